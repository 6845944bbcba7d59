// The segmented scan's chain path, its tiles: SEG_TW chains side by side, TB steps at a
// time, gathered into rows (seg_tile_chains: any leaf, any layout) or transposed in
// registers as the forward's tiles (seg_transposed_chains, seg_row_tiles: float32 leaves,
// steps dense; Tiles, tile_scan, tile_rows from chain_tiles.h). Placed by
// fscan._engines.cpp._kernel_segmented after segmented_walk.h (the steps after a tile are
// walked by seg_chains) and before segmented_chains.h.

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
// LANE_BITS, each chain's own as bits (bit j of bits[chain] for the tile's row j), as
// seg_row_tiles reads a mask of x's shape along its last dim.
enum { ROW_BITS = 1, LANE_FLAGS = 2, LANE_BITS = 3 };

// The TB steps (in scan order; UP: ascending rows) of a whole tile, the running values
// in registers, as tile_scan (chain_tiles.h: see there for why a function of its own).
template <bool UP, int FLAGS>
FSCAN_TILE_SCAN static void seg_tile_scan(const In x, const Out y, const Par p, const int64_t* elem,
                                        const Buf acc, SegTiles& tl, unsigned rows,
                                        const uint32_t* bits = nullptr) {
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
        // Row j's bit moved to the sign: a shift and a compare a step (as a test of bit j,
        // GCC built the constant 1 << j in a register and broadcast it, every step).
        else if (FLAGS == LANE_BITS) a[w] = pick((int32_t)(bits[w * TV + g] << (31 - j)) < 0, v, c);
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

// A whole tile's TB (16) flags of one chain, adjacent bytes from p, as bits: bit j for the
// byte at p + j (the tile's row j).
static FSCAN_INLINE uint32_t tile_flag_bits(const uint8_t* p) {
  static_assert(TB == 16, "one 16-byte load a chain");
#if defined(__SSE2__)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (uint32_t)_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_setzero_si128())) ^ 0xffffu;
#else
  uint32_t b = 0;
  for (int j = 0; j < TB; ++j) b |= (uint32_t)(p[j] != 0) << j;
  return b;
#endif
}

// SEG_TW whole lanes from lane0 on (steps [0, T), no carry), shaped as the forward's
// lane_tiles (forward_chains.h) with its tiles (chain_tiles.h): the lanes' bases stepped
// from lane0 (one division a group, not two a chain), every chain at the same step, so a
// tile's rows are each lane's base plus one offset. Their restarts: !LANES, one 1-D mask
// every lane reads, bit k of rows[k0 / TB] for step k0 + k (a blend on the row's bit,
// ROW_BITS); LANES, each lane's own, a mask of x's shape along its last dim (R.st == 1:
// a tile's 16 flags of a lane are 16 adjacent bytes, read as bits by one load, then a
// blend on each lane's bit, LANE_BITS). A tile without a restart is scanned by the
// forward's tile_scan. (Through seg_transposed_chains, each chain described apart, the
// group's set-up divided 2-3 times a chain (its item, its lane's (o, i)): with the tiles'
// row pointers rebuilt from the chains each tile, 9% of cumsum's segmented kernel over
// (4096, 256) dim 1, where the forward's chain_path spends 6%: see
// fscan._engines.cpp._kernel_segmented.chains_tiled.)
template <bool UP, bool LANES>
__attribute__((noinline)) static void seg_row_tiles(const In x, const Out y, const Par p, const Flags R,
                                                    const Geo& S, int64_t lane0, const uint32_t* rows,
                                                    SegTiles& tl) {
  In xb[SEG_TW];
  Out yb[SEG_TW];
  int64_t elem[SEG_TW];
  const uint8_t* rb[SEG_TW];  // LANES: each lane's flags at step 0
  const int64_t ahead = whole_lanes<SEG_TW>(x, y, S, lane0, xb, yb, elem);  // chain_tiles.h
  if constexpr (LANES) {
    int64_t o = lane0 / S.inner, i = lane0 - o * S.inner;
    for (int g = 0; g < SEG_TW; ++g) {
      rb[g] = shift(R, o, S.nb, 0, i).p;
      if (++i == S.inner) { i = 0; ++o; }
    }
  }
  const int64_t T = S.T;
  const Buf acc = tl.acc.buf();
  const unsigned first = UP ? 1u : 1u << (TB - 1);  // the tile's row of step 0
  for (int64_t k0 = 0; k0 < T; k0 += TB) {
    if (ahead) tile_ahead<true>(xb[0], yb[0], SEG_TW * T + k0 / TB * ahead * 16, ahead);
    const int64_t n = std::min(TB, T - k0);
    const bool part = n < TB;
    const unsigned all = (1u << TB) - 1, m = tile_rows<UP>(n);
    const int64_t low = UP ? k0 : T - 1 - k0 - (TB - 1);  // every chain's step at row 0
    int64_t lo[SEG_TW];
    for (int g = 0; g < SEG_TW; ++g) lo[g] = low;
    // LANES: a whole tile's flags as bits, each chain's stored apart, read before the
    // transposes: seg_tile_scan loads the 16 as one vector, which waited on the 16 stores
    // where they came just before it (no store forwards to a wider load; perf: an eighth
    // of seg_tile_scan's samples on the instruction after that load). Read first, the
    // transposes run while the stores drain: cumsum over (4096, 256) dim 1 with a mask of
    // x's shape, against the inclusive call, 1.19-1.22x -> 1.07-1.11x (p10 of 300 calls,
    // 2 alternating processes each; the 1-D mask's chunks, seg_transposed_chains,
    // 1.04-1.18x -> 0.95x forward, 1.08-1.16x -> 1.05-1.09x reversed).
    alignas(64) uint32_t bits[SEG_TW];
    uint32_t any = 0;
    if (LANES && !part) {
      for (int g = 0; g < SEG_TW; ++g) {
        bits[g] = tile_flag_bits(rb[g] + low) | (k0 == 0 ? first : 0u);
        any |= bits[g];
      }
    }
    if (part) tile_in(xb, lo, tl.in, m);
    else tile_in(xb, lo, tl.in, all);
    if (part) {
      // The first step restarts too: each chain's element (acc, not yet set, is dropped).
      if constexpr (LANES) {
        for (int g = 0; g < SEG_TW; ++g) {
          int32_t* f = tl.flag + (g / TV * TB) * TV + g % TV;
          for (int64_t k = 0; k < n; ++k) {
            const int64_t s = k0 + k;
            f[(UP ? k : TB - 1 - k) * TV] = s == 0 || rb[g][UP ? s : T - 1 - s] != 0;
          }
        }
      } else {
        seg_row_flags<UP>(tl, rows[k0 / TB] | (k0 == 0 ? 1u : 0u), n);
      }
      seg_tile_scan_part<UP>(x, y, p, elem, acc, tl, n);
    } else if constexpr (LANES) {
      if (any != 0) seg_tile_scan<UP, LANE_BITS>(x, y, p, elem, acc, tl, 0, bits);
      else tile_scan<true, UP, 0, false>(x, y, p, elem, acc, tl);
    } else {
      const unsigned r = rows[k0 / TB] | (k0 == 0 ? 1u : 0u);
      if (r != 0) seg_tile_scan<UP, ROW_BITS>(x, y, p, elem, acc, tl, r);
      else tile_scan<true, UP, 0, false>(x, y, p, elem, acc, tl);
    }
    if (part) tile_out(yb, lo, tl.out, m);
    else tile_out(yb, lo, tl.out, all);
  }
}

// SEG_TW chains, each its own flags (any mask layout) or carry: TB steps a tile, each
// chain's flags gathered into the tile's rows (LANE_FLAGS). Where the mask's steps are
// adjacent bytes (R.st == 1: a mask of x's shape along its last dim, a 1-D mask's chunks),
// a whole tile's flags are read 16 bytes a chain, as bits, blended on each chain's bit
// (LANE_BITS, as seg_row_tiles; spread into the rows first, cumsum over (1048576,) with a
// random restart about every 100 steps ran 4-5% slower), and a tile without a restart is
// scanned by the forward's tile_scan; else gathered a byte at a
// time (a byte load, a compare and a scattered store an element: 38% of the path outside
// the tile scan, perf on cumsum). A function of its own:
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
  const bool dense = R.st == 1;  // each chain's flags adjacent bytes, in step order
  for (int64_t k0 = 0; k0 < common; k0 += TB) {
    const int64_t n = std::min(TB, common - k0);
    const bool part = n < TB;
    const unsigned all = (1u << TB) - 1, m = tile_rows<UP>(n);
    int64_t lo[SEG_TW];  // each chain's step at the tile's lowest address
    for (int g = 0; g < SEG_TW; ++g) lo[g] = UP ? c[g].t0 + k0 : c[g].t0 - k0 - (TB - 1);
    const unsigned first = UP ? 1u : 1u << (TB - 1);  // the tile's row of its first step
    // A whole tile's flags as bits (dense: LANE_BITS), read before the transposes (see
    // seg_row_tiles).
    alignas(64) uint32_t bits[SEG_TW];
    uint32_t any = 0;
    if (dense && !part) {
      for (int g = 0; g < SEG_TW; ++g) {
        bits[g] = tile_flag_bits(c[g].r.p + (lo[g] - c[g].t0));
        if (k0 == 0 && carry[g] == nullptr) bits[g] |= first;
        any |= bits[g];
      }
    }
    if (part) tile_in(xb, lo, tl.in, m);
    else tile_in(xb, lo, tl.in, all);
    // Each chain's first step: from its carry (the running value), else its element (a
    // restart there). So the scans start at step 0 in every tile: the instantiations
    // from step 1 (a third of the tile scans' build) are not needed.
    for (int g = 0; k0 == 0 && g < SEG_TW; ++g)
      if (carry[g] != nullptr) put_all(acc, g, *carry[g]);
    if (dense && !part) {  // blended on each chain's bit (LANE_BITS)
      if (any != 0) seg_tile_scan<UP, LANE_BITS>(x, y, p, lane, acc, tl, 0, bits);
      else tile_scan<true, UP, 0, false>(x, y, p, lane, acc, tl);
    } else {
      for (int g = 0; g < SEG_TW; ++g) {
        int32_t* f = fl + (g / TV * TB) * TV + g % TV;
        for (int64_t k = 0; k < n; ++k) f[(UP ? k : TB - 1 - k) * TV] = step(c[g].r, (k0 + k) * dt) != 0;
        if (k0 == 0 && carry[g] == nullptr) f[(UP ? 0 : TB - 1) * TV] = 1;
      }
      if (part) seg_tile_scan_part<UP>(x, y, p, lane, acc, tl, n);
      else seg_tile_scan<UP, LANE_FLAGS>(x, y, p, lane, acc, tl, 0);
    }
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
