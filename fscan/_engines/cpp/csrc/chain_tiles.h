// The chain path's tiles, shared by the forward scan (forward_chains.h: tile_chains) and
// the segmented one (segmented_tiles.h: seg_row_tiles, seg_transposed_chains): TW chains'
// TB steps transposed in registers into a tile, scanned, transposed out. Placed by
// fscan._engines.cpp._cpp_source and fscan._engines.cpp._kernel_segmented after the tile
// types (fscan._engines.cpp._cpp_tiles) and the combine, before the chain paths.

// TW chains side by side, as the lanes of vector loops (float32 leaves, steps dense,
// AVX-512 or AVX2: TILED and tileable): TB steps of each chain are transposed in registers
// into a tile (InTile: WAYS blocks of TV chains, a row of each per step), the steps are
// scanned (tile_scan), and the outputs transposed back out. Walking chains one element
// at a time kept the combine scalar: the affine pair over (4096, 256) dim 1 ran 4.6 ns
// an element walked (9 reversed), 1.1 tiled; add 0.42 -> 0.29. The steps after the last
// whole tile make a partial tile (masked); the steps of chains longer than the shortest
// are walked.
// Where the time goes (add, (4096, 256) dim 1, 1 thread), measured by scripts/roofline.py
// (standalone loops): on AVX-512 0.24 ns an element in all (a copy 0.065), the scan
// without the transposes 0.10 (its double accumulation included), the transposes alone
// 0.14; on AVX2 the transposes alone are 2.7-3.3x a copy and accumulating in double costs
// about as much again (an add by prefix sums inside each vector, no transposes: 1.8-1.9x
// a copy in float32, 4.0-4.5x in double). So a chain scan of float32 stays near 4x a
// copy, where the lane path, needing no transpose, runs at 1.1-2x.
// lo[g]: chain g's step at the tile's lowest address (row 0), so that row j is step
// lo[g] + j: the position a position leaf (cummax/cummin's indices) takes there.
struct Tiles {
  InTile in;
  OutTile out;
  Store acc{TW};
  int64_t lo[TW] = {};
};

// Steps [K0, TB) (in scan order; UP: ascending rows) of a tile's TW chains, each chain's
// running value held in a register across them: the loop over TV chains is the vector
// loop, the steps unrolled inside it, the WAYS blocks interleaved in each step (an
// expensive combine's latency is hidden behind the other block's: see tile_ways). (The running values stored to acc after every row, and
// loaded back for the next, waited on the store for each row: 0.45 ns an element for add
// over (4096, 256) dim 1.) Flushed (see fscan_flush_f32) at the tile's last step only:
// at every step the flush cost the affine pair 10-17% over (4096, 256) dim 1; never, a
// product sunk into double's subnormals stayed there and cost 25% over (1048576,).
// A function of its own without GCC's partial redundancy elimination: in the unrolled
// steps, PRE carried a NaN check of one step's result into the next (torch.maximum's
// `a != a`) as a select of booleans, which GCC 12 cannot vectorise; the loop then ran
// scalar, 1.05 ns an element for max over (4096, 256) dim 1 (0.31 vectorised).
#if defined(__GNUC__) && !defined(__clang__)
#define FSCAN_TILE_SCAN __attribute__((noinline, optimize("no-tree-pre")))
#else
#define FSCAN_TILE_SCAN __attribute__((noinline))  // GCC's optimize attribute: GCC only
#endif
template <bool WRITE, bool UP, int64_t K0, bool EXCL>
FSCAN_TILE_SCAN static void tile_scan(const In x, const Out y, const Par p, const int64_t* elem, const Buf acc, Tiles& tl) {
#pragma GCC ivdep
  for (int g = 0; g < TV; ++g) {
    Vals a[WAYS];
    for (int w = 0; w < WAYS; ++w) a[w] = get_all(acc, w * TV + g);
#pragma GCC unroll 16
    for (int64_t k = K0; k < TB; ++k) {
      const int64_t j = UP ? k : TB - 1 - k;
      for (int w = 0; w < WAYS; ++w) {
        const Vals v = load_i(tile_row(x, tl.in, w * TB + j), g, tl.lo[w * TV + g] + j);
        const int64_t e = elem[w * TV + g];
        if (WRITE && EXCL) store_i(tile_row(y, tl.out, w * TB + j), g, a[w]);
        a[w] = k == TB - 1 ? combine<true>(a[w], v, p, e) : combine<false>(a[w], v, p, e);
        if (WRITE && !EXCL) store_i(tile_row(y, tl.out, w * TB + j), g, a[w]);
      }
    }
    for (int w = 0; w < WAYS; ++w) put_all(acc, w * TV + g, a[w]);
  }
}

// Steps [K0, n) of a partial tile (n < TB), a row at a time, each a vector loop over the
// tile's chains, their running values in acc: GCC vectorises the loop over chains only
// where the steps inside it are a constant count (with n steps inside, it ran scalar). Not
// unrolled: GCC unrolled a cheap combine's 16 chains (add) before vectorising, into scalars.
template <bool WRITE, bool UP, int64_t K0, bool EXCL>
FSCAN_TILE_SCAN static void tile_scan_part(const In x, const Out y, const Par p, const int64_t* elem, const Buf acc, Tiles& tl, int64_t n) {
  for (int64_t k = K0; k < n; ++k) {
    const int64_t j = UP ? k : TB - 1 - k;
    for (int w = 0; w < WAYS; ++w) {
      const In xr = tile_row(x, tl.in, w * TB + j);
      const Out yr = tile_row(y, tl.out, w * TB + j);
#pragma GCC ivdep
#pragma GCC unroll 1
      for (int g = 0; g < TV; ++g) {
        const Vals l = get_all(acc, w * TV + g);
        const Vals v = combine<false>(l, load_i(xr, g, tl.lo[w * TV + g] + j), p, elem[w * TV + g]);
        put_all(acc, w * TV + g, v);
        if (WRITE) store_i(yr, g, EXCL ? l : v);
      }
    }
  }
}

// The rows of a tile of n steps (n <= TB) that tile_in reads and tile_out writes (its
// mask m): every row of a whole tile; of a partial one the first n (UP), or the last n (a
// reversed chain's steps descend from the tile's highest address). (A whole tile passes
// the constant all-rows mask itself, so that its loads and stores stay plain.)
template <bool UP>
static FSCAN_INLINE unsigned tile_rows(int64_t n) {
  const unsigned all = (1u << TB) - 1;
  return n >= TB ? all : (UP ? (1u << n) - 1 : all & ~((1u << (TB - n)) - 1));
}

// The next group's memory, asked of the caches while this group runs. Read from memory
// (the caches evicted first), TW chains side by side in tiles ran at 3.1-3.6x a copy
// from memory where the lane path and the prefix chains run at 1.1x (add over the last
// dim of (4096, 256): 1180-1340 us against a cold copy's 340-410; scripts/spread.py
// --cold): one line of each of 16 chains a tile step is 16 strided streams, which the
// hardware fetches late. Where a group's chains lie side by side in memory (a dense last
// dim: rows; a lane's chunks, ascending), the next group's block follows this one, and
// each tile step asks for its share of it in address order (one stream, into L2), so
// that the block is in cache when its group starts. Measured against the tree before it
// (4 alternating processes each, 1 thread, thread CPU, AVX-512), new / old medians: from
// memory 0.72-0.79 on the (4096, 256) last-dim rows (add, mul, the affine pair, both
// directions), 0.58 on (1024, 8, 64), the segmented cumsum's row tiles 0.72-0.75; in
// cache 0.59-0.86, (1024, 8, 64) 0.74, segmented 0.55 (in cache the old code often ran
// at its from-memory speed: the L3 taken by other guests, docs/performance.md); 1-D
// (chunks of one lane) 0.87-1.08. Prefetching each chain's own line 4 tiles ahead instead
// gained 0.91-1.03 from memory.
// Lines to ask for each tile step, or 0 where the chains are not side by side (low[g]:
// chain g's lowest step in the tiles, steps: the tiled steps of every chain).
static FSCAN_INLINE int64_t ahead_lines(const In* xb, const int64_t* low, int64_t steps) {
  if constexpr (!TILED) return 0;
  const float* const first = tile_base(xb[0]) + low[0];
  for (int g = 1; g < TW; ++g)
    if (tile_base(xb[g]) + low[g] != first + g * steps) return 0;
  const int64_t tiles = (steps + TB - 1) / TB;
  return (TW * steps / 16 + tiles - 1) / tiles;
}

// N whole lanes from lane0 on (lane = o * inner + i): each one's base (its step 0) in x and
// y, and its element index, the lanes' (o, i) stepped from lane0's (one division a group,
// not two a lane: see lane_tiles in forward_chains.h, seg_row_tiles in segmented_tiles.h).
// Returns ahead_lines for them (every chain's lowest tiled step: 0).
template <int N>
static FSCAN_INLINE int64_t whole_lanes(const In x, const Out y, const Geo& S, int64_t lane0,
                                        In* xb, Out* yb, int64_t* elem) {
  int64_t o = lane0 / S.inner, i = lane0 - o * S.inner;
  for (int g = 0; g < N; ++g) {
    xb[g] = at(x, S, o, 0, i);
    yb[g] = at(y, S, o, 0, i);
    elem[g] = lane0 + g;
    if (++i == S.inner) { i = 0; ++o; }
  }
  const int64_t low[N] = {};
  return ahead_lines(xb, low, S.T);
}
