// The segmented scan's chain path (lanes laid out along T, or fewer than VEC_MIN side by
// side): each lane a chain walked along its steps, restarting where flagged, as the
// forward's chain_path (forward_chains.h) walks it without flags. fscan.engine._kernel_segmented
// places this after csrc/segmented.h (Flags, pick) and before its segmented().
// SEG_TILED (generated, per combine and leaf layout): SEG_TW chains go side by side, as the
// lanes of vector loops, TB steps at a time (a tile, gathered into SoA rows, the flags
// with them); else SEG_G chains (generated: 3, or 1 where the combine selects) are walked
// interleaved, but where SEG_TILE_ROWS (float32 leaves, no positions: cumsum, cumprod)
// and whole lanes read a 1-D mask, tiled as the forward's. One chain walked alone (the reduce
// pass over one lane's chunks, the old split) ran 2-3x the forward's chain path; walked
// chains kept cummax's and logcumsumexp's combines scalar (7 and 36 ns an element).

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

// Chains side by side in a tile: the generated TW (TV * WAYS, see
// fscan._engines.cpp._cpp_tiles) where the tiles transpose in registers, else 16.
static constexpr int SEG_TW = TILED ? TW : 16;

// A tile's scratch: TB steps of SEG_TW chains, a row of SEG_TW per step (every leaf, in the
// compute types), their flags, and the SEG_TW running values. The flags are 32-bit: bytes
// made GCC choose 64 lanes a vector for the row loops, more than their SEG_TW iterations,
// and leave them scalar.
struct SegTiles;
struct SegTile {
  Store rows{TB * SEG_TW};
  Store acc{SEG_TW};
  alignas(64) int32_t flag[TB * SEG_TW];
  SegTiles& t;  // the transposing tiles' scratch (seg_transposed_chains)
  explicit SegTile(SegTiles& tiles) : t(tiles) {}
};

// SEG_TW chains as seg_chains<SEG_TW>, tiled: each tile's steps gathered into rows (scalar loads
// through the strides: any leaf, any layout, positions included), scanned a row at a time
// by vector loops over the chains (the flag picks the element, as on the lane path), and
// written back. The steps after the last whole tile, and chains longer than the
// shortest, are walked on from the tile's values.
static void seg_tile_chains(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                            bool rev, const int64_t* lane, const int64_t* s0, const int64_t* s1,
                            const Vals* const* carry, SegTile& tl) {
  const int64_t dt = rev ? -1 : 1;
  SegChain c[SEG_TW];
  int64_t common = s1[0] - s0[0];
  for (int g = 0; g < SEG_TW; ++g) {
    c[g] = seg_chain(x, y, R, S, rev, lane[g], s0[g]);
    common = std::min(common, s1[g] - s0[g]);
  }
  const Buf rows = tl.rows.buf(), acc = tl.acc.buf();
  int32_t* const fl = tl.flag;
  int64_t k0 = 0;  // steps done in every chain
  for (; k0 + TB <= common; k0 += TB) {
    for (int g = 0; g < SEG_TW; ++g)
      for (int64_t j = 0; j < TB; ++j) {
        const int64_t d = (k0 + j) * dt;
        put_all(rows, j * SEG_TW + g, load_t(c[g].x, d, c[g].t0 + d));
        fl[j * SEG_TW + g] = step(c[g].r, d) != 0;
      }
    int64_t j = 0;
    if (k0 == 0) {  // each chain's first step: from its carry, or its element
      for (int g = 0; g < SEG_TW; ++g) {
        const Vals u = get_all(rows, g);
        const Vals v = carry[g] == nullptr ? u : pick(fl[g] != 0, u, combine(*carry[g], u, p, lane[g]));
        put_all(acc, g, v);
        put_all(rows, g, v);
      }
      j = 1;
    }
    for (; j < TB; ++j) {
      const Buf r = offset(rows, j * SEG_TW);
      const int32_t* f = fl + j * SEG_TW;
#pragma GCC unroll 1
#pragma GCC ivdep
      for (int g = 0; g < SEG_TW; ++g) {
        const Vals u = get_all(r, g);
        const Vals v = pick(f[g] != 0, u, combine<false>(get_all(acc, g), u, p, lane[g]));
        put_all(acc, g, v);
        put_all(r, g, v);
      }
    }
    for (int g = 0; g < SEG_TW; ++g)
      for (int64_t jj = 0; jj < TB; ++jj) store_t(c[g].y, (k0 + jj) * dt, get_all(rows, jj * SEG_TW + g));
  }
  for (int g = 0; g < SEG_TW; ++g) {  // the rest of each chain, walked
    const Vals a = get_all(acc, g);
    const int64_t from = s0[g] + k0;
    const Vals* in = k0 == 0 ? carry[g] : &a;
    if (from < s1[g]) seg_chains<1>(x, y, p, R, S, rev, lane + g, &from, s1 + g, &in);
  }
}

// SEG_TW chains as seg_tile_chains, where the tiles transpose in registers (float32
// leaves, steps dense: TILED and tileable), as the forward's tile_chains
// (forward_chains.h): TB steps of each chain transposed into a tile (tile_in), scanned with
// each chain's running value in a register across the tile's steps, transposed out. The
// flags are one more input per step, gathered (bytes, any layout) into 32-bit rows of the
// tile's layout. The steps after the last whole tile make a partial tile (masked). Against
// the gathering tile above, logcumsumexp over (4096, 256) dim 1 with a restart every 97
// steps: see fscan._engines.cpp._kernel_segmented.chains_tiled.
// The tiles (Tiles, tile_scan, tile_rows) are the forward's (chain_tiles.h), the flags
// beside them: a tile without a restart is scanned by the forward's own tile_scan.
struct SegTiles : Tiles {
  alignas(64) int32_t flag[TB * TW];  // (w * TB + j) * TV + g: as the tile's rows
};

// How a tile's restarts are read where it has some (else the forward's tile_scan, without
// the flags' loads, widenings and blends: cumsum over (4096, 256) dim 1, 260 instructions
// a tile of 8 chains with them, 154 without): ROW_BITS, restarts shared by every chain (a
// 1-D mask): bit k of `rows` for step k, a blend of a broadcast mask; LANE_FLAGS, each
// chain's own, from the tile's flags (tl.flag).
enum { ROW_BITS = 1, LANE_FLAGS = 2 };

// The TB steps (in scan order; UP: ascending rows) of a whole tile, the running values
// in registers, as tile_scan (chain_tiles.h: see there for why a function of its own).
template <bool UP, int FLAGS>
FSCAN_TILE_SCAN static void seg_tile_scan(const In x, const Out y, const Par p, const int64_t* elem,
                                        const Buf acc, SegTiles& tl, unsigned rows) {
  const int32_t* const fl = tl.flag;
#pragma GCC ivdep
  for (int g = 0; g < TV; ++g) {
    Vals a[WAYS];
#pragma GCC unroll 4
    for (int w = 0; w < WAYS; ++w) a[w] = get_all(acc, w * TV + g);
#pragma GCC unroll 16
    for (int64_t k = 0; k < TB; ++k) {
      const int64_t j = UP ? k : TB - 1 - k;
#pragma GCC unroll 4
      for (int w = 0; w < WAYS; ++w) {
        const Vals v = load_i(tile_row(x, tl.in, w * TB + j), g, 0);
        const int64_t e = elem[w * TV + g];
        const Vals c = k == TB - 1 ? combine<true>(a[w], v, p, e) : combine<false>(a[w], v, p, e);
        if (FLAGS == ROW_BITS) a[w] = pick(((rows >> k) & 1u) != 0, v, c);
        else a[w] = pick(fl[(w * TB + j) * TV + g] != 0, v, c);
        store_i(tile_row(y, tl.out, w * TB + j), g, a[w]);
      }
    }
#pragma GCC unroll 4
    for (int w = 0; w < WAYS; ++w) put_all(acc, w * TV + g, a[w]);
  }
}

// The n steps of a partial tile (n < TB), a row at a time (see tile_scan_part).
template <bool UP>
FSCAN_TILE_SCAN static void seg_tile_scan_part(const In x, const Out y, const Par p, const int64_t* elem,
                                             const Buf acc, SegTiles& tl, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t j = UP ? k : TB - 1 - k;
    for (int w = 0; w < WAYS; ++w) {
      const In xr = tile_row(x, tl.in, w * TB + j);
      const Out yr = tile_row(y, tl.out, w * TB + j);
      const int32_t* f = tl.flag + (w * TB + j) * TV;
#pragma GCC ivdep
#pragma GCC unroll 1
      for (int g = 0; g < TV; ++g) {
        const Vals u = load_i(xr, g, 0);
        const Vals v = pick(f[g] != 0, u, combine<false>(get_all(acc, w * TV + g), u, p, elem[w * TV + g]));
        put_all(acc, w * TV + g, v);
        store_i(yr, g, v);
      }
    }
  }
}

// A partial tile's restarts, bit k for step k, as the flags seg_tile_scan_part reads.
template <bool UP>
static FSCAN_INLINE void seg_row_flags(SegTiles& tl, unsigned r, int64_t n) {
  for (int64_t k = 0; k < n; ++k)
    for (int w = 0; w < WAYS; ++w)
      for (int g = 0; g < TV; ++g) tl.flag[(w * TB + (UP ? k : TB - 1 - k)) * TV + g] = (r >> k) & 1u;
}

// SEG_TW whole lanes from lane0 on (steps [0, T), no carry) that read one 1-D mask, its
// restarts bit k of rows[k0 / TB] for step k0 + k: shaped as the forward's tile_chains
// (forward_chains.h), with its tiles (chain_tiles.h). The lanes' bases are stepped from lane0 (one division a group, not
// two a chain), and every chain is at the same step, so a tile's rows are each lane's
// base plus one offset. A tile without a restart is scanned by the forward's tile_scan,
// one with some by a blend on the row's bit (ROW_BITS). (Through
// seg_transposed_chains, each chain described apart, the group's set-up divided 2-3
// times a chain (its item, its lane's (o, i)): with the tiles' row pointers rebuilt from
// the chains each tile, 9% of cumsum's segmented kernel over (4096, 256) dim 1, where
// the forward's chain_path spends 6%: see fscan._engines.cpp._kernel_segmented.chains_tiled.)
template <bool UP>
__attribute__((noinline)) static void seg_row_tiles(const In x, const Out y, const Par p, const Geo& S,
                                                    int64_t lane0, const uint32_t* rows, SegTiles& tl) {
  In xb[SEG_TW];
  Out yb[SEG_TW];
  int64_t elem[SEG_TW];
  int64_t o = lane0 / S.inner, i = lane0 - o * S.inner;
  for (int g = 0; g < SEG_TW; ++g) {
    xb[g] = at(x, S, o, 0, i);
    yb[g] = at(y, S, o, 0, i);
    elem[g] = lane0 + g;
    if (++i == S.inner) { i = 0; ++o; }
  }
  const int64_t T = S.T;
  const Buf acc = tl.acc.buf();
  const int64_t low[SEG_TW] = {};  // every chain from its step 0 (whole lanes)
  const int64_t ahead = ahead_lines(xb, low, T);  // the next group's rows (chain_tiles.h)
  for (int64_t k0 = 0; k0 < T; k0 += TB) {
    if (ahead) tile_ahead<true>(xb[0], yb[0], SEG_TW * T + k0 / TB * ahead * 16, ahead);
    const int64_t n = std::min(TB, T - k0);
    const bool part = n < TB;
    const unsigned all = (1u << TB) - 1, m = tile_rows<UP>(n);
    int64_t lo[SEG_TW];  // each chain's step at the tile's lowest address: one for all
    for (int g = 0; g < SEG_TW; ++g) lo[g] = UP ? k0 : T - 1 - k0 - (TB - 1);
    if (part) tile_in(xb, lo, tl.in, m);
    else tile_in(xb, lo, tl.in, all);
    // The first step restarts too: each chain's element (acc, not yet set, is dropped).
    const unsigned r = rows[k0 / TB] | (k0 == 0 ? 1u : 0u);
    if (part) {
      seg_row_flags<UP>(tl, r, n);
      seg_tile_scan_part<UP>(x, y, p, elem, acc, tl, n);
    } else if (r != 0) {
      seg_tile_scan<UP, ROW_BITS>(x, y, p, elem, acc, tl, r);
    } else {
      tile_scan<true, UP, 0, false>(x, y, p, elem, acc, tl);
    }
    if (part) tile_out(yb, lo, tl.out, m);
    else tile_out(yb, lo, tl.out, all);
  }
}

// SEG_TW chains, each its own flags (any mask layout) or carry: TB steps a tile, each
// chain's flags gathered into the tile's rows (LANE_FLAGS). A function of its own:
// inlined into seg_chain_path, GCC spilled the transposes' registers (328 vector stores
// to the stack there against 64 in the forward's chain_path) and the tiles ran 1.67x the
// forward's, 1.34x so (cumsum over (4096, 256) dim 1, the kernel alone).
template <bool UP>
__attribute__((noinline)) static void seg_transposed_chains(
    const In x, const Out y, const Par p, const Flags R, const Geo& S, const int64_t* lane,
    const int64_t* s0, const int64_t* s1, const Vals* const* carry, SegTiles& tl) {
  constexpr bool rev = !UP;
  const int64_t dt = UP ? 1 : -1;
  SegChain c[SEG_TW];
  In xb[SEG_TW];
  Out yb[SEG_TW];
  int64_t common = s1[0] - s0[0];
  for (int g = 0; g < SEG_TW; ++g) {
    c[g] = seg_chain(x, y, R, S, rev, lane[g], s0[g]);
    const int64_t o = lane[g] / S.inner, i = lane[g] % S.inner;
    xb[g] = at(x, S, o, 0, i);
    yb[g] = at(y, S, o, 0, i);
    common = std::min(common, s1[g] - s0[g]);
  }
  const Buf acc = tl.acc.buf();
  int32_t* const fl = tl.flag;
  for (int64_t k0 = 0; k0 < common; k0 += TB) {
    const int64_t n = std::min(TB, common - k0);
    const bool part = n < TB;
    const unsigned all = (1u << TB) - 1, m = tile_rows<UP>(n);
    int64_t lo[SEG_TW];  // each chain's step at the tile's lowest address
    for (int g = 0; g < SEG_TW; ++g) lo[g] = UP ? c[g].t0 + k0 : c[g].t0 - k0 - (TB - 1);
    if (part) tile_in(xb, lo, tl.in, m);
    else tile_in(xb, lo, tl.in, all);
    for (int g = 0; g < SEG_TW; ++g) {
      int32_t* f = fl + (g / TV * TB) * TV + g % TV;
      for (int64_t k = 0; k < n; ++k) f[(UP ? k : TB - 1 - k) * TV] = step(c[g].r, (k0 + k) * dt) != 0;
    }
    // Each chain's first step: from its carry (the running value), else its element (a
    // restart there). So the scans start at step 0 in every tile: the instantiations
    // from step 1 (a third of the tile scans' build) are not needed.
    for (int g = 0; k0 == 0 && g < SEG_TW; ++g) {
      if (carry[g] != nullptr) put_all(acc, g, *carry[g]);
      else fl[(g / TV * TB + (UP ? 0 : TB - 1)) * TV + g % TV] = 1;
    }
    if (part) seg_tile_scan_part<UP>(x, y, p, lane, acc, tl, n);
    else seg_tile_scan<UP, LANE_FLAGS>(x, y, p, lane, acc, tl, 0);
    if (part) tile_out(yb, lo, tl.out, m);
    else tile_out(yb, lo, tl.out, all);
  }
  for (int g = 0; g < SEG_TW; ++g) {  // chains longer than the shortest: walked on
    const Vals a = get_all(acc, g);
    const int64_t from = s0[g] + common;
    const Vals* in = common == 0 ? carry[g] : &a;
    if (from < s1[g]) seg_chains<1>(x, y, p, R, S, rev, lane + g, &from, s1 + g, &in);
  }
}

// Chains per group: SEG_TW where tiled, else SEG_G (generated: 3, or 1 for a combine that
// selects; see fscan._engines.cpp._kernel_segmented.chains_interleaved). SEG_GMAX: the
// larger, the size of a group's arrays.
static constexpr int SEG_GMAX = SEG_TW > SEG_G ? SEG_TW : SEG_G;

// ng chains written: a whole group of SEG_TW tiled (where `tiled`), or SEG_G at a time
// interleaved; fewer, one by one.
static void seg_chain_group(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                            bool rev, bool tiled, int ng, const int64_t* lane, const int64_t* s0,
                            const int64_t* s1, const Vals* const* carry, SegTile& tl) {
  if (tiled && ng == SEG_TW) {
    if (TILED && tileable(x, y)) {
      if (rev) seg_transposed_chains<false>(x, y, p, R, S, lane, s0, s1, carry, tl.t);
      else seg_transposed_chains<true>(x, y, p, R, S, lane, s0, s1, carry, tl.t);
    } else if (SEG_TILED) {  // (SEG_TILE_ROWS tiles only where tileable: not compiled there)
      seg_tile_chains(x, y, p, R, S, rev, lane, s0, s1, carry, tl);
    }
    return;
  }
  int g = 0;
  for (; g + SEG_G <= ng; g += SEG_G) seg_chains<SEG_G>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g);
  for (; g < ng; ++g) seg_chains<1>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g);
}

// The totals of ng chains (seg_totals): SEG_G at a time, the rest one by one.
static void seg_total_group(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                            bool rev, int ng, const int64_t* lane, const int64_t* s0,
                            const int64_t* s1, const Vals* const* carry, Vals* last,
                            uint8_t* seen) {
  int g = 0;
  for (; g + SEG_G <= ng; g += SEG_G)
    seg_totals<SEG_G>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g, last + g, seen + g);
  for (; g < ng; ++g)
    seg_totals<1>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g, last + g, seen + g);
}

// The chain path, as chain_path (forward_chains.h): where lanes are fewer than a group per
// thread, each is split into C chunks (their totals, then the scan: the totals composed
// in order, except where a chunk restarts the lane: its total is then the carry on).
static void seg_chain_path(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                           bool rev, int nt) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  auto chunks = [&](int64_t cg) {  // chunks per lane, for groups of cg chains
    if (lanes >= (int64_t)nt * cg) return (int64_t)1;
    const int64_t c = std::min<int64_t>(((int64_t)nt * cg + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
    return c >= cg ? c / cg * cg : c;
  };
  // Tiled: every group where SEG_TILED; else (SEG_TILE_ROWS: an arithmetic combine of
  // float32 leaves) where the tiles transpose in registers and every chain of a group
  // reads one row of flags at the same steps (a 1-D mask, whole lanes): 5 tiles in 6 then
  // scan without flags, as the forward's (cumsum over (4096, 256) dim 1, a restart every
  // 97 steps: see fscan._engines.cpp._kernel_segmented.chains_tiled).
  // Flags every lane reads alike (a 1-D mask, or a mask broadcast over the lanes, whose
  // stride over a dim of one need not be 0): a stride 0, or one lane, along each lane dim.
  const bool shared = (R.sa == 0 || S.outer <= S.nb) && (R.sb == 0 || S.nb == 1) && (R.si == 0 || inner == 1);
  bool tiled = SEG_TILED;
  if (!SEG_TILED && SEG_TILE_ROWS && TILED && tileable(x, y)) tiled = shared && chunks(SEG_TW) == 1;
  const int64_t cg = tiled ? SEG_TW : SEG_G;
  int64_t C = chunks(cg);
  int64_t L = (T + C - 1) / C;
  // Chunks of one lane at power-of-two distances share cache sets: skew them.
  if (C > 1 && inner == 1) L = (L + 15) / 16 * 16 + 16;
  C = (T + L - 1) / L;
  const int64_t items = lanes * C, groups = (items + cg - 1) / cg;
  std::vector<Vals> tot(C > 1 ? items : 0);
  std::vector<uint8_t> seen(tot.size());
  // Tiled whole lanes reading a 1-D mask: each tile's restarts as bits, read once here
  // (each group reading its tiles' flags cost 5% of cumsum over (4096, 256) dim 1).
  std::vector<uint32_t> bits(tiled && C == 1 && shared ? (T + TB - 1) / TB : 0);
  for (int64_t s = 0; s < (bits.empty() ? 0 : T); ++s)
    bits[s / TB] |= (uint32_t)(step(R, rev ? T - 1 - s : s) != 0) << (s % TB);
  const uint32_t* const rows = bits.empty() ? nullptr : bits.data();
  const bool row_tiles = rows != nullptr && TILED && tileable(x, y);
  fscan_team(nt, [&] {
    SegTiles tiles;
    SegTile tl(tiles);
    int64_t lane[SEG_GMAX], s0[SEG_GMAX], s1[SEG_GMAX];
    const Vals* carry[SEG_GMAX];
    auto describe = [&](int g, int64_t k, bool write) {
      const int64_t c = k % C;
      lane[g] = k / C;
      s0[g] = c * L;
      s1[g] = std::min(T, (c + 1) * L);
      carry[g] = write && c > 0 ? &tot[k - 1] : nullptr;
    };
    if (C > 1) {  // every chunk's total but each lane's last
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        int64_t ks[SEG_GMAX];
        Vals last[SEG_GMAX];
        uint8_t restarts[SEG_GMAX];
        int ng = 0;
        for (int64_t k = gi * cg; k < std::min(items, (gi + 1) * cg); ++k)
          if (k % C != C - 1) { ks[ng] = k; describe(ng++, k, false); }
        seg_total_group(x, y, p, R, S, rev, ng, lane, s0, s1, carry, last, restarts);
        for (int g = 0; g < ng; ++g) { tot[ks[g]] = last[g]; seen[ks[g]] = restarts[g]; }
      }
#pragma omp for schedule(static)
      for (int64_t ln = 0; ln < lanes; ++ln) {
        for (int64_t c = 1; c < C - 1; ++c) {
          const int64_t k = ln * C + c;
          if (seen[k]) continue;  // restarted in the chunk: its total is the carry on
          const Vals l = tot[k - 1], r = tot[k], v = combine(l, r, p, ln);
          if (!suspect(l, r, v)) {
            tot[k] = v;
            continue;
          }
          // Composing is not what the steps give (see suspect): walk the chunk.
          describe(0, k, false);
          carry[0] = &tot[k - 1];
          Vals walked;
          uint8_t again;
          seg_totals<1>(x, y, p, R, S, rev, lane, s0, s1, carry, &walked, &again);
          tot[k] = walked;
        }
      }
    }
    // Reversed, walked groups from the last: each chain walks its lane downwards, so the
    // lanes taken from the last make one descending stream through memory (from the first,
    // each lane's walk started a new one: cummax over (4096, 256) dim 1, a restart every 97
    // steps, walked reversed in 2.3 ms against 1.2 forward, the kernel's caches warm). Row
    // tiles go from the first in both directions, as the forward's tiles do: each group
    // asks the caches for the block above it (tile_ahead in seg_row_tiles), so taken from
    // the last, every block came from memory (cumsum over (4096, 256) dim 1 reversed with a
    // restart every 97 steps, outputs out of cache: 1004 us against 497 forward).
#pragma omp for schedule(static)
    for (int64_t gj = 0; gj < groups; ++gj) {
      const int64_t gi = rev && !row_tiles ? groups - 1 - gj : gj;
      const int ng = (int)std::min<int64_t>(cg, items - gi * cg);
      if (row_tiles && ng == SEG_TW) {  // whole lanes (C == 1): item gi * cg is lane gi * cg
        if (rev) seg_row_tiles<false>(x, y, p, S, gi * cg, rows, tiles);
        else seg_row_tiles<true>(x, y, p, S, gi * cg, rows, tiles);
        continue;
      }
      for (int g = 0; g < ng; ++g) describe(g, gi * cg + g, true);
      seg_chain_group(x, y, p, R, S, rev, tiled, ng, lane, s0, s1, carry, tl);
    }
  });
}
