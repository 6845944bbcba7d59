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
// Out, Par, Buf, Store, InRow, LANE_BLOCK, load_*/store_*/get_all/put_all, combine)
// and before the generated entry point, which calls reduce().

// The total of steps [s0, s1) (in scan order, s1 > s0) of lanes [i0, i0 + w) of outer
// index o, into acc (w entries, every leaf). Where a lane holds one float32 leaf widened
// to double (BLOCKED: add, mul; add takes sum_rows first), dense rows are read RB at a
// time by block_rows: LB lanes' running values stay in registers across the RB combines
// (in scan order, so the total is the row-by-row one) and acc is read and written once
// per RB rows; row by row,
// acc's load and store around every combine bounded the loop (add over (4096, 256) dim 0:
// 1.4x torch.sum). Wider lanes go row by row, or (a range-checked combine: the affine pair)
// in blocks of rows_total: block_rows with two leaves stayed scalar (GCC packed neither
// leaf: the affine pair over (4096, 256) dim 0 took 1.4-2.9 ms with N = 1-8 against 0.45 ms
// row by row). Strided rows are gathered one at a time.
static constexpr int64_t RB = 8;
// Lanes a block: one vector of the running values (4 doubles with AVX2).
static constexpr int64_t LB = 4;
// Whether block_rows takes the dense rows: one float32 leaf read into a double running
// value (add, mul: the widening made the loop vectorizer's code slow, see block_rows).
// Elsewhere row by row, as the forward's lane path, which the loop vectorizer takes at
// full width: block_rows leaves a combine with branches (fscan_max) scalar, and so did
// RB rows a pass of the row loop (max over (4096, 256) dim 0: 575-600 us both ways,
// 127 us row by row, a float32 column sum 100-130 us).
static constexpr bool BLOCKED = sizeof(Vals) == 8 && std::is_same_v<decltype(Vals::v0), double> &&
                                std::is_same_v<decltype(std::declval<In>().x0.p), const float*>;
// Rows t + j * dt (j < N: row(x0, (j + 1) * dt)) of lanes [0, w) combined into the running
// values in acc. A block of LB lanes is written out as LB scalar chains that GCC's
// straight-line (SLP) vectorizer packs into one vector a leaf, its loads converted straight
// from memory (vcvtps2pd ymm, m128). The asm hides the block index from the loop
// vectorizer: left to it, it took the whole loop at 8 lanes (float32's width), loaded 8
// floats and split each load into two halves to widen, and spilled rows' pointers (add
// over (4096, 256) dim 0, AVX2, the kernel alone: 150 us as fscan_lanes at RB = 4 with
// the rows in an array; 122 us as an omp simd loop at 8; 93-100 us this way; a float32
// column sum 85-93 us; blocks of 8 lanes 138 us: not packed). A combine with a range check
// (RANGED) runs a block watched (see fscan_range_f32) and again checked from acc where a
// check would have changed a value: bit for bit the checked loop's totals.
template <int N>
static FSCAN_INLINE void block_rows(const In x0, int64_t dt, int64_t t, const Par p, int64_t e0, int64_t w,
                                    const Buf acc) {
  int64_t i = 0;
  for (; i + LB <= w; i += LB) {
    Vals v[LB];
    FscanWatch outside;
#pragma GCC unroll 8
    for (int k = 0; k < LB; ++k) v[k] = get_all(acc, i + k);
#pragma GCC unroll 8
    for (int j = 0; j < N; ++j) {
      const In xj = row(x0, (j + 1) * dt);
#pragma GCC unroll 8
      for (int k = 0; k < LB; ++k) v[k] = combine<false, RANGED>(v[k], load_i(xj, i + k, t + j * dt), p, e0 + i + k, outside);
    }
    if (RANGED && fscan_watched(outside)) {
#pragma GCC unroll 8
      for (int k = 0; k < LB; ++k) v[k] = get_all(acc, i + k);
      for (int j = 0; j < N; ++j) {
        const In xj = row(x0, (j + 1) * dt);
        for (int k = 0; k < LB; ++k) v[k] = combine<false>(v[k], load_i(xj, i + k, t + j * dt), p, e0 + i + k);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < LB; ++k) put_all(acc, i + k, v[k]);
    asm("" : "+r"(i));
  }
  for (; i < w; ++i) {
    Vals v = get_all(acc, i);
    for (int j = 0; j < N; ++j) v = combine<false>(v, load_i(row(x0, (j + 1) * dt), i, t + j * dt), p, e0 + i);
    put_all(acc, i, v);
  }
}
// With a carry (the total of the steps before s0), the total of steps [0, s1) instead:
// the chunk join walks a chunk that way where composing totals is not what its steps give.
template <bool GATHER>
static void lane_total(const In x, const Par p, const Geo& S, int64_t o, int64_t i0, int64_t w,
                       int64_t s0, int64_t s1, bool rev, const Buf acc, const InRow& rows,
                       const Buf* carry = nullptr) {
  const In xc = at(x, S, o, 0, i0);
  const int64_t e0 = o * S.inner + i0, T = S.T, dt = rev ? -1 : 1;
  In xs = row(xc, rev ? T - 1 - s0 : s0);
  {
    const int64_t t = rev ? T - 1 - s0 : s0;
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    if (carry) {
      const Buf left = *carry;
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        put_all(acc, i, combine<false>(get_all(left, i), load_i(xr, i, t), p, e0 + i));
      });
    } else {
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { put_all(acc, i, load_i(xr, i, t)); });
    }
  }
  int64_t s = s0 + 1;
  if (!GATHER && BLOCKED) {
    if constexpr (SUM_F32) {
      for (; s + SUM_RB <= s1; s += SUM_RB) {
        sum_rows(xs, dt, w, acc);
        xs = row(xs, SUM_RB * dt);
      }
    }
    for (; s + RB <= s1; s += RB) {
      block_rows<RB>(xs, dt, rev ? T - 1 - s : s, p, e0, w, acc);
      xs = row(xs, RB * dt);
    }
  }
  // Not flushed (combine<false>), as on the forward's lane path: subnormal products cost
  // nothing measurable in vector loops, and the flush's selects do (the affine pair,
  // (4096, 256) dim 0: 1.4x the time).
  for (; s < s1; ++s) {
    const int64_t t = rev ? T - 1 - s : s;
    xs = row(xs, dt);
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
      put_all(acc, i, combine<false>(get_all(acc, i), load_i(xr, i, t), p, e0 + i));
    });
  }
}

// Rows t + j * dt (j < N; x1: row t) of lanes [0, w) combined into the running values in
// `from`, written to `to`: a vector loop along the lanes, each lane's values held in
// registers across the N rows. WATCH (see FscanWatch): the range checks left out, and
// whether one would have changed a value returned.
template <int N, bool WATCH>
static FSCAN_INLINE bool rows_total(const In x1, int64_t dt, int64_t t, const Par p, int64_t e0, int64_t w,
                                    const Buf from, const Buf to) {
  FscanWatch watch;
#pragma GCC ivdep
  for (int64_t i = 0; i < w; ++i) {
    Vals v = get_all(from, i);
#pragma GCC unroll 16
    for (int j = 0; j < N; ++j) v = combine<false, WATCH>(v, load_i(row(x1, j * dt), i, t + j * dt), p, e0 + i, watch);
    put_all(to, i, v);
  }
  return WATCH && fscan_watched(watch);
}
// Dense rows a block of rows_total (the affine pair: 16 lanes a pass of the vector loop,
// AVX-512; 8 rows spilled, 300 us over (4096, 256) dim 0 with 4 rows, 390-460 with 8).
static constexpr int WB = 4;

// lane_total for a combine that range-checks a value held wider than its dtype (RANGED:
// the affine pair's product, float32 in double). Dense rows go WB at a time, watched
// (rows_total: the checks left out, FscanWatch), and a block runs again checked only
// where the watch says a check would have changed a value: bit for bit the checked loop's
// totals. A block's running values go from one buffer to the other (L1), as the block may
// have to run again from the first. Neither half alone gained (the affine pair over
// (4096, 256) dim 0, AVX-512, one process, standalone: a row at a time with the compares
// of fscan_outside watched 400 us, blocks of 4 rows with them 385, a row at a time with
// FscanWatch 437 against 445 (a noisier run), both 300; with the check in the loop it was
// 3.4x a read, AVX2). Strided rows are gathered a row at a time.
template <bool GATHER>
static void lane_total_watched(const In x, const Par p, const Geo& S, int64_t o, int64_t i0, int64_t w,
                               int64_t s0, int64_t s1, bool rev, const Buf acc, const Buf spare,
                               const InRow& rows) {
  const In xc = at(x, S, o, 0, i0);
  const int64_t e0 = o * S.inner + i0, T = S.T, dt = rev ? -1 : 1;
  In xs = row(xc, rev ? T - 1 - s0 : s0);
  {
    const int64_t t = rev ? T - 1 - s0 : s0;
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { put_all(acc, i, load_i(xr, i, t)); });
  }
  Buf cur = acc, next = spare;
  bool moved = false;  // the totals are in spare
  int64_t s = s0 + 1;
  if constexpr (!GATHER) {
    for (; s + WB <= s1; s += WB) {
      const int64_t t = rev ? T - 1 - s : s;
      const In x1 = row(xs, dt);
      if (rows_total<WB, true>(x1, dt, t, p, e0, w, cur, next)) rows_total<WB, false>(x1, dt, t, p, e0, w, cur, next);
      xs = row(xs, WB * dt);
      std::swap(cur, next);
      moved = !moved;
    }
  }
  for (; s < s1; ++s) {
    const int64_t t = rev ? T - 1 - s : s;
    xs = row(xs, dt);
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    if (rows_total<1, true>(xr, dt, t, p, e0, w, cur, next)) rows_total<1, false>(xr, dt, t, p, e0, w, cur, next);
    std::swap(cur, next);
    moved = !moved;
  }
  if (moved) fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { put_all(acc, i, get_all(cur, i)); });
}

static void reduce_lanes(const In x, const Out z, const Par p, const Geo& S, bool rev, int nt) {
  const int64_t outer = S.outer, T = S.T, inner = S.inner;
  const Columns K = lane_columns(outer, T, inner, nt, 1);
  const int64_t W = K.W, ntiles = K.ntiles, ncols = K.ncols, C = K.C, L = K.L;
  Store tot(ncols * C * W);  // every chunk's total, W lanes each
  const Buf tb = tot.buf();
  const bool dense = unit(x);
  fscan_team(nt, [&] {
    const InRow rows(dense ? 0 : W);
    Store spare_store(RANGED ? W : 0);
    const Buf spare = spare_store.buf();
#pragma omp for schedule(static)
    for (int64_t k = 0; k < ncols * C; ++k) {
      const int64_t col = k / C, c = k % C;
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      const int64_t s1 = std::min(T, (c + 1) * L);
      const Buf acc = offset(tb, k * W);
      if constexpr (RANGED) {
        if (dense) lane_total_watched<false>(x, p, S, o, i0, w, c * L, s1, rev, acc, spare, rows);
        else lane_total_watched<true>(x, p, S, o, i0, w, c * L, s1, rev, acc, spare, rows);
      } else {
        if (dense) lane_total<false>(x, p, S, o, i0, w, c * L, s1, rev, acc, rows);
        else lane_total<true>(x, p, S, o, i0, w, c * L, s1, rev, acc, rows);
      }
    }
#pragma omp for schedule(static)
    for (int64_t col = 0; col < ncols; ++col) {
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      // Chunk c's slot takes the total of chunks 0..c. Composing is exact only up to the
      // floats' range (a gate product underflowed to 0 meeting an inf carry: 0 * inf): where
      // a lane's join is suspect (csrc/reduce.cpp.in), the chunk is walked from the carry,
      // as the forward's chunk join does (csrc/forward_lanes.h).
      for (int64_t c = 1; c < C; ++c) {
        const Buf prev = offset(tb, (col * C + c - 1) * W), cur = offset(tb, (col * C + c) * W);
        bool walk = false;
        for (int64_t i = 0; i < w; ++i) {
          const Vals l = get_all(prev, i), r = get_all(cur, i), v = combine(l, r, p, o * inner + i0 + i);
          walk |= suspect(l, r, v);
          put_all(cur, i, v);
        }
        const int64_t s1 = std::min(T, (c + 1) * L);
        if (walk && dense) lane_total<false>(x, p, S, o, i0, w, c * L, s1, rev, cur, rows, &prev);
        else if (walk) lane_total<true>(x, p, S, o, i0, w, c * L, s1, rev, cur, rows, &prev);
      }
      const Buf last = offset(tb, (col * C + C - 1) * W);
      const Out zr = at(z, S, o, 0, i0);
      for (int64_t i = 0; i < w; ++i) store_i(zr, i, get_all(last, i));
    }
  });
}

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
// tile_totals then runs the tile again checked (see fscan_range_f32 and lane_total_watched).
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
