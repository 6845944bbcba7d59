// The forward scan's lane path: columns of lanes next to each other in memory, a vector
// loop along each row, T split into chunks where columns are fewer than the threads.
// Placed by fscan._engines.cpp._cpp_source before forward_chains.h and forward.h, after
// the generated part it is written against (see forward.h).

// Steps [s0, s1) (in scan order) of lanes [i0, i0 + w) of outer index o. The running
// values live in acc (w entries); carry (or nullptr) holds the inclusive result before s0.
// GATHER: inputs of other inner strides than 1 are gathered, a row at a time, into rows
// (a separate instantiation: dense inputs keep the loop they had before strides existed;
// the gather's pointer select in the same loop cost seg 1.45x), compiled only in the
// kernel's gather variant (GATHER_MODE, see scan in forward.h).
// Outputs of other inner strides than 1 are written, a row at a time, into orows and
// scattered from there (GATHER only: the dense instantiation has unit outputs too).
// H: a carry-in (if H.any): step 0 (in scan order) reads the head element instead of x;
// EXCL: the heads' first element, every lane's output at step 0, combined with that step
// where fold, else that step's input the running value after it (see scan).
// EXCL (with WRITE): output step t is the running value before step t's input is combined.
// !WRITE: a chunk total, kept with every leaf in acc (and carry), since the carries
// composed from it read its leaves as a right operand (see get_all). ALL with WRITE: the
// outputs written and the total kept (the first chunk of a split column, see lane_path).
// The running values go through acc (in L1) every row, not registers across rows as
// tile_scan holds them: lanes the vector loop and 4 or 8 rows unrolled inside it ran
// slower (1 thread, float32, (4096, 256) dim 0, the kernel into preallocated memory
// against a copy: add 1.13x a row at a time, 1.54x 4 rows, 1.40x 8; the affine pair
// 1.94x, 2.40x, 3.06x; also in L2, (256, 256): affine 2.0x against 3.0x). Each vector
// then carries a chain of dependent combines (the pair's multiply, float32 range check
// and add, about 15 cycles a row) with two vectors in flight, where a row at a time
// overlaps the whole row's lanes; rows in halves interleaved (four in flight) still
// ran 2.15x, and the rows' pointers spilled.
// NARROW_ROWS rows of a column exactly NW lanes wide (LANE_BLOCK, inner 16, or half that:
// inner 8 went 553-557 -> 279 us for cumsum over (131072, 8) dim 0, the affine pair
// 1179-1195 -> 977-988, alternating processes), each
// lane's running value held in a register across them: the vector loop over the lanes
// outside, the rows unrolled inside, as tile_scan holds its chains (chain_tiles.h). A row
// at a time through acc (lane_run's loop), such a column is one or two vectors a row,
// each waiting on the row before through acc's store and load: fscan.cumsum over (65536,
// 16) dim 0 took 304 us, 218 so (a copy 114); the affine pair 1128 -> 814, cumprod 615 ->
// 223, cummax 833 -> 657, logcumsumexp 3346 -> 2988; over (4096, 16, 16) dim 1 (columns
// of 16 rows: one block, the rest a row at a time) 0.88-0.90x (1 thread, medians of 300
// calls in turns in one process). Wider columns keep the row at a time: there each row's
// vectors overlap one another (rows unrolled inside the lane loop ran wider columns
// slower, see lane_run). left: the running values before the first row; into acc.
// FIRST: the first row starts the running values (no carry: left unread; EXCL: its
// outputs, the start value, written by lane_run), so that a
// column of 16 rows is two blocks, not one and 7 rows a row at a time (against that, in
// turns in one process: cumsum over (4096, 16, 16) dim 1 445 -> 244 us, reversed 0.83-0.86x,
// the affine pair 0.90-0.92x; columns of 8 rows, (1024, 8, 16) dim 1, 86 -> 39 us).
// (NARROW_ROWS: tuning.h; the segmented kernel's seg_narrow_rows does the same.)
template <int64_t NW, bool WRITE, bool ALL, bool EXCL, bool FIRST>
static FSCAN_INLINE void narrow_rows(const In xr, const Out yr, const Par p, int64_t e0, int64_t t,
                                     int64_t dt, const Buf left, const Buf acc) {
#pragma GCC ivdep
  for (int64_t i = 0; i < NW; ++i) {
    Vals a = FIRST ? load_i(xr, i, t) : get_as<ALL>(left, i);
    if (FIRST && WRITE && !EXCL) store_i(yr, i, a);  // EXCL: the start value, written
#pragma GCC unroll 16
    for (int64_t r = FIRST ? 1 : 0; r < NARROW_ROWS; ++r) {
      const Vals v = combine<false>(a, load_i(row(xr, r * dt), i, t + r * dt), p, e0 + i);
      if (WRITE) store_i(row(yr, r * dt), i, EXCL ? a : v);
      a = v;
    }
    put_as<ALL>(acc, i, a);
  }
}

template <bool WRITE, bool GATHER, bool ALL = !WRITE, bool EXCL = false>
static void lane_run(const In x, const Out y, const Par p, const Geo& S, int64_t o, int64_t i0,
                     int64_t w, int64_t s0, int64_t s1, bool rev, const Buf* carry, const Buf acc,
                     const InRow& rows, const OutRow& orows, const Heads& H, bool fold = true) {
  const In xc = at(x, S, o, 0, i0);
  const Out yc = at(y, S, o, 0, i0);
  const int64_t e0 = o * S.inner + i0, T = S.T, dt = rev ? -1 : 1;
  int64_t sb = s0;  // the first step read from x
  if (EXCL && s0 == 0 && H.any && fold) {  // the start value (position -1), folded in
    const Vals h = load_t(head_at(x, H, 0), 0, -1);
    fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { put_as<ALL>(acc, i, h); });
    carry = &acc;
  } else if (EXCL && s0 == 0 && H.any) {
    // The start value written at step 0; step 0's input then starts the running values
    // as the loop's head row (EXCL: its outputs left as written here), so that a column's
    // first NARROW_ROWS rows form a block. (Read here, step 0 left 15 rows of a 16-row
    // column to the loop: one block and 7 rows a row at a time, cumprod's exclusive call
    // over (4096, 16, 16) dim 1 1.59-1.80x the inclusive call, 0.94-0.95x now.)
    const Vals h = load_t(head_at(x, H, 0), 0, -1);
    const int64_t t = rev ? T - 1 : 0;
    const Out yr = GATHER ? buffered(row(yc, t), orows) : row(yc, t);
    if (WRITE) fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { store_i(yr, i, h); });
    if (WRITE && GATHER) scatter(row(yc, t), orows, w, rev);
  } else if (s0 == 0 && H.any && s1 > 0) {  // peeled: the loop below stays as it was
    const int64_t t = rev ? T - 1 : 0;
    const In hr = head_at(x, H, e0);
    const Out yr = GATHER ? buffered(row(yc, t), orows) : row(yc, t);
    fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
      const Vals v = load_i(hr, i, t);
      put_as<ALL>(acc, i, v);
      if (WRITE) store_i(yr, i, v);
    });
    if (WRITE && GATHER) scatter(row(yc, t), orows, w, rev);
    carry = &acc;
    sb = 1;
  }
  if (sb >= s1) return;
  // EXCL: the scan's last step (in scan order) is written, not combined: nothing reads its
  // result (the inclusive scan's n combines, where the shifted n - 1 step scan this mode
  // replaced computed n - 1: logcumsumexp over (1024, 8, 64) dim 1 ran 1.17x the inclusive
  // call combining it).
  const int64_t last = EXCL && WRITE && !ALL && s1 == T ? T - 1 : -1;
  // The rows' pointers step along (recomputing them from t cost 10% on 8-step columns).
  In xs = row(xc, rev ? T - 1 - sb : sb);
  Out ys = row(yc, rev ? T - 1 - sb : sb);
  for (int64_t s = sb; s < s1; ++s) {
    const int64_t t = rev ? T - 1 - s : s;
    if (s > sb) { xs = row(xs, dt); ys = row(ys, dt); }
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    const Out yr = GATHER ? buffered(ys, orows) : ys;
    // The row starts the running values (EXCL: its outputs, the start value, written).
    const bool head = s == sb && carry == nullptr;
    // NARROW_ROWS rows in registers. EXCL: the last row too where it ends a block, its
    // result unread (a column of 16 rows is then two blocks, not one block and 7 rows: the
    // exclusive cumsum over (8192, 16, 8) dim 1 ran 1.35-1.44x the inclusive call).
    if (!GATHER && (w == LANE_BLOCK || w == LANE_BLOCK / 2) && s + NARROW_ROWS <= s1) {
      const Buf left = s == sb && carry != nullptr ? *carry : acc;  // head: unread
      if (w == LANE_BLOCK / 2) {
        if (head) narrow_rows<LANE_BLOCK / 2, WRITE, ALL, EXCL, true>(xr, yr, p, e0, t, dt, left, acc);
        else narrow_rows<LANE_BLOCK / 2, WRITE, ALL, EXCL, false>(xr, yr, p, e0, t, dt, left, acc);
      } else if (head) {
        narrow_rows<LANE_BLOCK, WRITE, ALL, EXCL, true>(xr, yr, p, e0, t, dt, left, acc);
      } else {
        narrow_rows<LANE_BLOCK, WRITE, ALL, EXCL, false>(xr, yr, p, e0, t, dt, left, acc);
      }
      s += NARROW_ROWS - 1;
      xs = row(xs, (NARROW_ROWS - 1) * dt);
      ys = row(ys, (NARROW_ROWS - 1) * dt);
    } else if (head) {
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        const Vals v = load_i(xr, i, t);
        put_as<ALL>(acc, i, v);
        if (WRITE && !EXCL) store_i(yr, i, v);
      });
    } else if (EXCL && s == last) {
      const Buf left = s == sb ? *carry : acc;
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { store_i(yr, i, get_as<ALL>(left, i)); });
    } else {
      const Buf left = s == sb ? *carry : acc;
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        // Not flushed: subnormal products cost nothing measurable in these vector loops
        // (the affine pair, (4096, 256) dim 0, half its steps subnormal: 1.7x a copy
        // either way), and the flush cost 30%.
        const Vals l = get_as<ALL>(left, i);
        const Vals v = combine<false>(l, load_i(xr, i, t), p, e0 + i);
        put_as<ALL>(acc, i, v);
        if (WRITE) store_i(yr, i, EXCL ? l : v);
      });
    }
    if (WRITE && GATHER && !(EXCL && head)) scatter(ys, orows, w, rev);
  }
}

template <bool EXCL>
static void lane_path(const In x, const Out y, const Par p, const Geo& S, bool rev, int nt,
                      const Heads& H, bool fold = true) {
  const int64_t outer = S.outer, T = S.T, inner = S.inner;
  // A split column's first chunk is scanned (outputs written, total kept) while the
  // threads take the totals of its next chunks; then the rest are scanned from their
  // carries. C - 1 chunks a column per pass: with C = threads + 1, one pass of each on
  // 2 threads takes 2/3 of one thread's scan (taking every chunk's total first, as
  // before, took as long as one thread, the total costing as much as the scan).
  const Columns K = lane_columns(outer, T, inner, nt, 1, 1);
  const int64_t W = K.W, ntiles = K.ntiles, ncols = K.ncols, C = K.C, L = K.L;
  // Totals of chunks 0..C-2 of every column, W lanes each, then their inclusive scan.
  Store tot(C > 1 ? ncols * (C - 1) * W : 0);
  const Buf tb = tot.buf();
  fscan_team(nt, [&] {
    Store scratch(W);
    const Buf acc = scratch.buf();
    // One kind of row per kernel (see scan in forward.h): the ordinary kernel's calls are
    // all dense, the gather variant's all gather (a unit member passes through gather and
    // scatter untouched), so each compiles one set of lane_run instantiations.
    const InRow rows(GATHER_MODE ? W : 0);
    const OutRow orows(GATHER_MODE ? W : 0);
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < ncols * (C - 1); ++k) {
        const int64_t col = k / (C - 1), c = k % (C - 1);
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        const Buf total = offset(tb, k * W);
        if (c == 0) lane_run<true, GATHER_MODE, true, EXCL>(x, y, p, S, o, i0, w, 0, L, rev, nullptr, total, rows, orows, H, fold);
        else lane_run<false, GATHER_MODE>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, nullptr, total, rows, orows, H);
      }
#pragma omp for schedule(static)
      for (int64_t col = 0; col < ncols; ++col) {
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        for (int64_t c = 1; c < C - 1; ++c) {
          const Buf prev = offset(tb, (col * (C - 1) + c - 1) * W), cur = offset(tb, (col * (C - 1) + c) * W);
          bool walk = false;
          for (int64_t i = 0; i < w; ++i) {
            const Vals l = get_all(prev, i), r = get_all(cur, i), v = combine(l, r, p, o * inner + i0 + i);
            walk |= suspect(l, r, v);
            put_all(cur, i, v);
          }
          // Composing the chunk is not what its steps give (see suspect): walk them.
          if (walk) lane_run<false, GATHER_MODE>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, &prev, cur, rows, orows, H);
        }
      }
    }
    // The chunks left: every chunk of a whole column, chunks 1..C-1 of a split one.
    const int64_t rest = C > 1 ? C - 1 : 1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < ncols * rest; ++n) {
      // Reversed, the columns go down too: a column's rows do, and where columns are
      // consecutive blocks of memory (a middle dim) ascending columns zig-zagged.
      const int64_t j = rev ? ncols * rest - 1 - n : n;
      const int64_t col = j / rest, c = C > 1 ? j % rest + 1 : 0;
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      const Buf carry = c > 0 ? offset(tb, (col * (C - 1) + c - 1) * W) : tb;
      const int64_t s1 = std::min(T, (c + 1) * L);
      lane_run<true, GATHER_MODE, false, EXCL>(x, y, p, S, o, i0, w, c * L, s1, rev, c == 0 ? nullptr : &carry, acc, rows, orows, H, fold);
    }
  });
}
