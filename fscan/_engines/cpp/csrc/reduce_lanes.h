// The reduce's lane path (reduce_lanes): lanes next to each other in memory, reduced in
// columns by vector loops along each row, a column's steps split into chunks where there
// are fewer columns than threads. fscan.engine._cpp_source places this after the
// forward's generated part and csrc/reduce_sum.h, and before csrc/reduce.h (the chains
// and reduce() itself).

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
// (RANGED) runs a block watched (see FscanWatch) and again checked from acc where a
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
