// The segmented scan's chain path, its walked chains: SegChain (where a chain starts) and
// seg_chains / seg_totals, chains walked a step at a time, NG interleaved. Placed by
// fscan._engines.cpp._kernel_segmented after csrc/segmented.h (Flags, pick), then
// segmented_tiles.h (the tiled chains, which walk the steps after their tiles here) and
// segmented_chains.h (the groups and the path, which pick between the two).

// Where chain g (steps [s0, s1) of lane `lane`, in scan order) starts: its input, output
// and flags at step s0, and that step's t; step s0 + k is then k * dt further on.
struct SegChain { In x; Out y; Flags r; int64_t t0; };
static FSCAN_INLINE SegChain seg_chain(const In x, const Out y, const Flags R, const Geo& S,
                                       bool rev, int64_t lane, int64_t s0) {
  const int64_t o = lane / S.inner, i = lane % S.inner, t0 = rev ? S.T - 1 - s0 : s0;
  return SegChain{row(at(x, S, o, 0, i), t0), row(at(y, S, o, 0, i), t0),
                  row(shift(R, o, S.nb, 0, i), t0), t0};
}

// Chains walked one step at a time, NG side by side (their combines overlap: one chain
// waits on each combine's latency), writing every output. Chain g is steps [s0[g], s1[g])
// of lane lane[g] (o * inner + i); carry[g] (or nullptr) its inclusive carry-in.
template <int NG>
static void seg_chains(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                       bool rev, const int64_t* lane, const int64_t* s0, const int64_t* s1,
                       const Vals* const* carry) {
  const int64_t dt = rev ? -1 : 1;
  SegChain c[NG];
  Vals acc[NG];
  int64_t common = s1[0] - s0[0];
  for (int g = 0; g < NG; ++g) {
    c[g] = seg_chain(x, y, R, S, rev, lane[g], s0[g]);
    common = std::min(common, s1[g] - s0[g]);
  }
  // The first step of each chain apart: in the loop, acc stays in registers (a select
  // between *carry and acc there kept it in memory, a store and a load every step).
  for (int g = 0; g < NG; ++g) {
    if (s1[g] <= s0[g]) continue;
    const Vals u = load_t(c[g].x, 0, c[g].t0);
    acc[g] = carry[g] == nullptr ? u : pick(step(c[g].r, 0) != 0, u, combine(*carry[g], u, p, lane[g]));
    store_t(c[g].y, 0, acc[g]);
  }
  auto walk = [&](int g, int64_t k) {
    const int64_t d = k * dt;
    const Vals u = load_t(c[g].x, d, c[g].t0 + d);
    if constexpr (SEG_EXTREMUM != 0) {
      extremum_step<SEG_EXTREMUM>(acc[g], u, step(c[g].r, d) != 0);
    } else if constexpr (SEG_G == 1) {
      // A combine that selects (positions: cummax/cummin's pairs, before SEG_EXTREMUM)
      // compiles to a branch, and so did the pick after it: the flag tested first, the
      // combine only where it is clear. With the pick, GCC copied the running pair
      // between two registers and back every step (vmovaps, mov on the carried value):
      // 1.87 ns an element against 1.62 so, (1048576,) a restart every 97 steps, the
      // kernel alone, warm outputs.
      if (step(c[g].r, d) != 0) acc[g] = u;
      else acc[g] = combine(acc[g], u, p, lane[g]);
    } else {
      acc[g] = pick(step(c[g].r, d) != 0, u, combine(acc[g], u, p, lane[g]));
    }
    store_t(c[g].y, d, acc[g]);
  };
  // (Chains reading one row of flags (a 1-D mask) at the same steps could share each
  // step's flag: one read and one branch for the group. Tried with 8 chains: no faster,
  // cumsum/cumprod over (4096, 256) dim 1 with a restart every 97 steps.)
  // (A chain alone walked segment by segment, the next flag found first by a pass over
  // the flags, then the steps up to it without flag or pick: no faster for cummax over
  // (1048576,) or (4096, 256) dim 1 with a restart every 97 steps, 1.5-2x the inclusive
  // either way. What costs there is the combine's branch: a restart every 97 steps
  // makes ~5 new maxima per segment, each a mispredicted branch; torch.cummax over the
  // same segments as lanes of their own, (10810, 97) dim 1, ran 1.2x torch.cummax over
  // (1048576,). A branchless select standalone (vcmpss/vblendvps on the carried pair) ran
  // one chain at 2.1 ns an element, as the branch: latency-bound; it would pay only with
  // chains interleaved, which needs the combine generated as blends.)
  // (Branchless cummax, tried on AVX2 in standalone copies of this kernel ((1048576,),
  // a restart every 97 steps, 1 thread, thread CPU time, loaded machine; the walk
  // above 1.8-2.0 ns an element, a branchy inclusive loop as torch's 0.8-1.0): the
  // combine and pick as masks in general registers, 1/2/4/8 chains interleaved:
  // 5.0/3.7/3.8/4.6 ns (the float <-> integer moves); 8 chains' running pairs side by
  // side in memory, each step's combine one loop over the chains: GCC vectorises it
  // only under `GCC unroll 1` + `ivdep` (unrolled first, its SLP pass gave up; `omp
  // simd` put the combine's Vals temporaries in simd arrays it could not store), 3.5 ns
  // (8 scalar loads and stores a step around the blends); by hand, 8 steps of one dense
  // chain a vector, a log-step scan of (flag, value, step) in the vector and then the
  // carry, indices widened to int64 at the store: 1.55-1.6 ns, no faster with 2 or 4
  // chains interleaved (throughput-bound: ~70 instructions a vector), nor as int32
  // keys with each lane's winner from a table of the steps that take (1.65). None
  // reaches the inclusive call: it mispredicts almost never, where a restart every 97
  // steps makes ~5 new maxima a segment.)
  // (Register-transposed tiles of (value, step) pairs, 8 chunks of a 1-D input as the
  // lanes of AVX2 vectors: 8x8 tiles of values and of flags (bytes widened) transposed
  // in, a compare and two blends a step (the flag or-ed into the take mask, the first NaN
  // kept by an ordered compare of the running value), values and int32 steps transposed
  // out and widened, then each chunk's head fixed up from the chunk before until its
  // first restart or until unchanged. Standalone (g++ -O3 -march=native, (1048768,), a
  // restart every 97 steps, thread CPU time, load 7): 1.30-1.61 ns an element, against
  // 0.84-0.94 for an inclusive branchy walk and 0.65-0.99 for the same traffic copied
  // (values and flags read, values and int64 indices written): the four transposes (1.5
  // shuffles an element) cost more than the mispredictions they remove. Not taken on.)
  // (cummax/cummin now walk without those branches (extremum_step): one chain,
  // ~1.0 ns an element there. 2, 4 or 8 chunks of the lane interleaved on top (the
  // select's latency overlapped, each chunk's head fixed up after) gained nothing in a
  // standalone loop (1.07-1.6 ns, 8 needing the chunks skewed off 4 KiB apart): one
  // chain is bound by its instructions a step (two stores among them), not by latency.)
  int64_t from = 1;  // the first step walked below: cummax's / cummin's dense float32
  if constexpr (NG == 1 && SEG_EXTREMUM != 0)  // chain goes 16 steps a vector first
    from = extremum_blocks<SEG_EXTREMUM, true>(c[0].x, c[0].y, c[0].r.p, c[0].r.st, c[0].t0, s1[0] - s0[0], rev, acc[0]);
  for (int64_t k = from; k < common; ++k) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) walk(g, k);
  }
  for (int g = 0; g < NG; ++g)
    for (int64_t k = std::max<int64_t>(common, 1); k < s1[g] - s0[g]; ++k) walk(g, k);
}

// The totals of NG chains (as seg_chains) into last[g], and seen[g]: whether the chain
// restarts in its steps. A chain that restarts owes nothing to the steps before its last
// flag, so only the steps from there are combined, and none of them with the flags'
// selects: with restarts every 97 steps, a pass over the flags (from the chain's end
// back to its last flag) and under 97 steps a chain, where walking every step with the
// selects cost as much as the scan's second pass.
template <int NG>
static void seg_totals(const In x, const Out y, const Par p, const Flags R, const Geo& S, bool rev,
                       const int64_t* lane, const int64_t* s0, const int64_t* s1,
                       const Vals* const* carry, Vals* last, uint8_t* seen) {
  const int64_t dt = rev ? -1 : 1;
  SegChain c[NG];
  Vals acc[NG];
  int64_t from[NG], common = INT64_MAX;
  for (int g = 0; g < NG; ++g) {
    c[g] = seg_chain(x, y, R, S, rev, lane[g], s0[g]);
    int64_t k = s1[g] - s0[g] - 1;  // the last flagged step, or the first
    while (k > 0 && step(c[g].r, k * dt) == 0) --k;
    seen[g] = step(c[g].r, k * dt) != 0;
    from[g] = k;
    common = std::min(common, s1[g] - s0[g] - k);
  }
  for (int g = 0; g < NG; ++g) {
    const int64_t d = from[g] * dt;
    const Vals u = load_t(c[g].x, d, c[g].t0 + d);
    acc[g] = seen[g] || carry[g] == nullptr ? u : combine(*carry[g], u, p, lane[g]);
  }
  auto walk = [&](int g, int64_t k) {
    const int64_t d = (from[g] + k) * dt;
    acc[g] = combine(acc[g], load_t(c[g].x, d, c[g].t0 + d), p, lane[g]);
  };
  for (int64_t k = 1; k < common; ++k) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) walk(g, k);
  }
  for (int g = 0; g < NG; ++g) {
    for (int64_t k = std::max<int64_t>(common, 1); k < s1[g] - s0[g] - from[g]; ++k) walk(g, k);
    last[g] = acc[g];
  }
}
