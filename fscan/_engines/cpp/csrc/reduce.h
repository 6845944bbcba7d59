// The reduce: each lane's total over its T steps, one element per lane, nothing else
// written (a read of the leaves). Lanes next to each other in memory are reduced in
// columns (vector loops along each row), others as chains (tiled where every leaf is
// float32 and the steps are dense, else G interleaved); where that
// leaves threads idle, or a lone chain waits on each combine's latency, a lane's steps
// are split into chunks whose totals are combined in scan order. The sum of one float32
// leaf (SUM_F32) is the exception to scan order: its blocks are summed in float32 and
// widened once (sum_rows on lanes, dense_sum on chains whose steps are dense), as a sum
// may be regrouped and reordered at the cost of rounding only.
// fscan.engine._cpp_source places this after the forward's generated part (Vals, In,
// Out, Par, Buf, Store, InRow, LANE_BLOCK, load_*/store_*/get_all/put_all, combine) and
// csrc/reduce_lanes.h (the lane path), and before the generated entry point, which calls
// reduce().

// NG chunks of chains interleaved: chunk g starts at xb[g] (its first step in scan order),
// runs len[g] steps tstep (+-1) apart from position t0[g], at element position elem[g].
// (GCC packs the NG float32 chains of add into two vectors of doubles: a carry-in
// chosen per chain at the start, `carry ? combine(carry[g], v) : v`, kept them scalar,
// 1.6x the time over (1048576,).)
template <int NG>
static FSCAN_INLINE void chain_totals(const In* xb, const Par p, const int64_t* t0, const int64_t* len,
                                      const int64_t* elem, int64_t tstep, Vals* out) {
  Vals acc[NG];
  int64_t common = len[0];
  for (int g = 1; g < NG; ++g) common = std::min(common, len[g]);
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) acc[g] = load_t(xb[g], 0, t0[g]);
  for (int64_t s = 1; s < common; ++s) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) acc[g] = combine(acc[g], load_t(xb[g], s * tstep, t0[g] + s * tstep), p, elem[g]);
  }
  for (int g = 0; g < NG; ++g) {
    for (int64_t s = common; s < len[g]; ++s) acc[g] = combine(acc[g], load_t(xb[g], s * tstep, t0[g] + s * tstep), p, elem[g]);
    out[g] = acc[g];
  }
}

// TW chains' totals side by side, as the lanes of vector loops (float32 leaves, steps
// dense: TILED and tileable), as the forward's chain path scans them (tile_chains in
// csrc/forward_chains.h, which a reduce kernel does not include): TB steps of each chain
// transposed in registers into a tile (InTile: WAYS blocks of TV chains), the chains'
// running values held in registers across the tile's steps, in scan order; nothing
// transposed back out. Walked one element at a time (chain_totals: G scalar chains
// interleaved), the affine pair over dim 1 of (4096, 256) read at 9.3-9.5x a read, tiled
// 3.3-3.8x (1.03-1.11 ms against 2.1-2.4; with the check in the loop, 1.46 ns an element
// against 1.02 watched); torch.maximum 635-680 us walked, 260-440 tiled (AVX2, 1 thread;
// perf: the transposes are most of what is left). A reduce kernel's tiles hold two
// blocks (WAYS = 2, reduce_source): a lone vector of chains waits on each combine's
// latency (16 dependent steps a tile).
#if defined(__GNUC__) && !defined(__clang__)
#define FSCAN_REDUCE_TILE __attribute__((noinline, optimize("no-tree-pre")))  // see tile_scan
#else
#define FSCAN_REDUCE_TILE __attribute__((noinline))
#endif
// Steps [K0, TB) of a whole tile (UP: ascending rows) from the running values in `from`
// into `to` (the same buffer, or another). Flushed (fscan_flush_f32) at the tile's last
// step only, as the forward's tile_scan. WATCH (a combine with a range check, RANGED):
// the checks left out, and the return value set where one would have changed a value;
// tile_totals then runs the tile again checked (see FscanWatch and lane_total_watched).
template <bool UP, int64_t K0, bool WATCH>
FSCAN_REDUCE_TILE static bool tile_total(const In x, const Par p, const int64_t* elem, const Buf from,
                                         const Buf to, const InTile& in) {
  FscanWatch outside;
#pragma GCC ivdep
  for (int g = 0; g < TV; ++g) {
    Vals a[WAYS];
    for (int w = 0; w < WAYS; ++w) a[w] = get_all(from, w * TV + g);
#pragma GCC unroll 16
    for (int64_t k = K0; k < TB; ++k) {
      const int64_t j = UP ? k : TB - 1 - k;
      for (int w = 0; w < WAYS; ++w) {
        const Vals v = load_i(tile_row(x, in, w * TB + j), g, 0);
        const int64_t e = elem[w * TV + g];
        a[w] = k == TB - 1 ? combine<true, WATCH>(a[w], v, p, e, outside) : combine<false, WATCH>(a[w], v, p, e, outside);
      }
    }
    for (int w = 0; w < WAYS; ++w) put_all(to, w * TV + g, a[w]);
  }
  return WATCH && fscan_watched(outside);
}
// Steps [K0, n) of a partial tile (n < TB), a row at a time (as tile_scan_part: a vector
// loop over the chains only where the steps inside it are a constant count).
template <bool UP, int64_t K0>
FSCAN_REDUCE_TILE static void tile_total_part(const In x, const Par p, const int64_t* elem, const Buf acc,
                                              const InTile& in, int64_t n) {
  for (int64_t k = K0; k < n; ++k) {
    const int64_t j = UP ? k : TB - 1 - k;
    for (int w = 0; w < WAYS; ++w) {
      const In xr = tile_row(x, in, w * TB + j);
#pragma GCC ivdep
#pragma GCC unroll 1
      for (int g = 0; g < TV; ++g)
        put_all(acc, w * TV + g, combine<false>(get_all(acc, w * TV + g), load_i(xr, g, 0), p, elem[w * TV + g]));
    }
  }
}

struct ReduceTiles {
  InTile in;
  Store acc{TW}, spare{RANGED ? TW : 0};
};

// The totals of TW chains (xb[g]: the lane's step 0; its steps t0[g] on, len[g] of them,
// in scan order) into out: the steps all chains have in tiles (the last one partial, its
// rows masked: fscan_tile_in), the rest walked a chain at a time.
template <bool UP>
static void tile_totals(const In* xb, const Par p, const int64_t* t0, const int64_t* len,
                        const int64_t* elem, Vals* out, ReduceTiles& tl) {
  Buf acc = tl.acc.buf(), spare = tl.spare.buf();
  int64_t common = len[0];
  for (int g = 1; g < TW; ++g) common = std::min(common, len[g]);
  const unsigned all = (1u << TB) - 1;
  int64_t lo[TW];  // each chain's step at the tile's lowest address
  // A whole tile's steps [K0, TB), range checks watched where the combine has them (the
  // affine pair over dim 1 of (4096, 256): see the measurements in docs/reduce.md).
  auto whole = [&](auto k0) {
    constexpr int64_t K0 = decltype(k0)::value;
    if constexpr (RANGED) {
      if (tile_total<UP, K0, true>(xb[0], p, elem, acc, spare, tl.in)) tile_total<UP, K0, false>(xb[0], p, elem, acc, acc, tl.in);
      else std::swap(acc, spare);
    } else {
      tile_total<UP, K0, false>(xb[0], p, elem, acc, acc, tl.in);
    }
  };
  for (int64_t s0 = 0; s0 < common; s0 += TB) {
    const int64_t n = std::min(TB, common - s0);
    const bool part = n < TB;
    // The rows a partial tile reads: the first n (UP), or the last n (a reversed chain's
    // steps descend from the tile's highest address).
    const unsigned m = !part ? all : (UP ? (1u << n) - 1 : all & ~((1u << (TB - n)) - 1));
    for (int g = 0; g < TW; ++g) lo[g] = UP ? t0[g] + s0 : t0[g] - s0 - (TB - 1);
    if (part) tile_in(xb, lo, tl.in, m);
    else tile_in(xb, lo, tl.in, all);
    if (s0 == 0) {
      for (int g = 0; g < TW; ++g)
        put_all(acc, g, load_i(tile_row(xb[0], tl.in, g / TV * TB + (UP ? 0 : TB - 1)), g % TV, 0));
      if (part) tile_total_part<UP, 1>(xb[0], p, elem, acc, tl.in, n);
      else whole(std::integral_constant<int64_t, 1>{});
    } else if (part) {
      tile_total_part<UP, 0>(xb[0], p, elem, acc, tl.in, n);
    } else {
      whole(std::integral_constant<int64_t, 0>{});
    }
  }
  const int64_t tstep = UP ? 1 : -1;
  for (int g = 0; g < TW; ++g) {  // common > 0: every chunk has a step
    Vals a = get_all(acc, g);
    const In xg = row(xb[g], t0[g]);
    for (int64_t s = common; s < len[g]; ++s) a = combine(a, load_t(xg, s * tstep, t0[g] + s * tstep), p, elem[g]);
    out[g] = a;
  }
}

// Chains per group: TW where they may be tiled, else G. (Walked float32 chains of add
// are packed by GCC into two vectors of doubles, each step waiting on the last add's
// latency; 2 G of them were not packed but gathered, 3x the time over (1048576,).)
static constexpr int CG = TILED ? TW : G;

static void reduce_chains(const In x, const Out z, const Par p, const Geo& S, bool rev, int nt) {
  if constexpr (SUM_F32) {
    if (x.x0.st == 1) return sum_chains(x, z, S, nt);
  }
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  // Not where a chain holds one float32 leaf widened to double (BLOCKED: add, mul): on
  // AVX2 (Zen) every element's widening (vcvtps2pd) costs about a torch.sum and the
  // transposes about as much again, and the tiles ran no faster than the walked chains
  // (add over dim 1 of (4096, 256): 350-475 us tiled, 333-480 walked; over (1048576,):
  // 280-390 tiled, 244-268 walked; alternating processes, load 6), with the running
  // values in registers as here and the steps' loads kept to their step.
  const bool tiles = TILED && !BLOCKED && tileable(x, z);
  const int cg = tiles ? CG : G;
  int64_t C = 1;  // chunks per lane
  if (lanes < (int64_t)nt * cg) C = std::min<int64_t>(((int64_t)nt * cg + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
  int64_t L = (T + C - 1) / C;
  // Tiled chunks of one lane a power of two apart share their lines' L1 sets: skew them
  // (as the forward's chain_path).
  if (tiles && C > 1 && inner == 1) L = (L + 15) / 16 * 16 + 16;
  C = (T + L - 1) / L;
  const int64_t tstep = rev ? -1 : 1, items = lanes * C, groups = (items + cg - 1) / cg;
  std::vector<Vals> tot(items);
  fscan_team(nt, [&] {
    std::unique_ptr<ReduceTiles> tl(tiles ? new ReduceTiles : nullptr);
    In xb[CG];
    int64_t t0[CG], len[CG], elem[CG];
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int ng = (int)std::min<int64_t>(cg, items - gi * cg);
      for (int g = 0; g < ng; ++g) {
        const int64_t k = gi * cg + g, lane = k / C, c = k % C, s = c * L;
        t0[g] = rev ? T - 1 - s : s;
        xb[g] = at(x, S, lane / inner, 0, lane % inner);
        len[g] = std::min(T, s + L) - s;
        elem[g] = lane;
      }
      Vals* out = &tot[gi * cg];
      if (tiles && ng == CG) {
        if (rev) tile_totals<false>(xb, p, t0, len, elem, out, *tl);
        else tile_totals<true>(xb, p, t0, len, elem, out, *tl);
        continue;
      }
      for (int g = 0; g < ng; ++g) xb[g] = row(xb[g], t0[g]);
      int g = 0;
      for (; g + G <= ng; g += G) chain_totals<G>(xb + g, p, t0 + g, len + g, elem + g, tstep, out + g);
      for (; g < ng; ++g) chain_totals<1>(xb + g, p, t0 + g, len + g, elem + g, tstep, out + g);
    }
#pragma omp for schedule(static)
    for (int64_t lane = 0; lane < lanes; ++lane) {
      Vals v = tot[lane * C];
      for (int64_t c = 1; c < C; ++c) {
        const Vals r = tot[lane * C + c], j = combine(v, r, p, lane);
        if (!suspect(v, r, j)) {
          v = j;
          continue;
        }
        // Composing the chunk is not what its steps give (see suspect): walk them from v.
        const int64_t s = c * L, t0 = rev ? T - 1 - s : s, len = std::min(T, s + L) - s;
        const In xb = row(at(x, S, lane / inner, 0, lane % inner), t0);
        for (int64_t k = 0; k < len; ++k) v = combine(v, load_t(xb, k * tstep, t0 + k * tstep), p, lane);
      }
      store_t(at(z, S, lane / inner, 0, lane % inner), 0, v);
    }
  });
}

static void reduce(const In x, const Out z, const Par p, const Geo& S, bool rev, int threads) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t total = S.outer * S.T * S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / PER_THREAD));
  if (S.inner >= VEC_MIN && !along(x)) reduce_lanes(x, z, p, S, rev, nt);
  else reduce_chains(x, z, p, S, rev, nt);
}
