// The segmented forward scan (reset=): lane by lane, y[t] = x[t] where the lane's flag at
// t is set, else combine(y[t - 1], x[t]), in one pass over the data. The flags are one
// more strided input R (uint8, the mask expanded to the leaves' shape: a 1-D mask is
// a row of flags shared by every lane, R.sa = R.sb = R.si = 0). Scanning (flag, value)
// pairs through the forward kernel instead cost 7-40x the scan without flags (a second
// leaf of another width, the flag written out, selects around the combine).
// fscan.engine._kernel_segmented places this after the forward's generated part (Vals,
// In, Out, Par, Buf, Store, InRow, OutRow, LANE_BLOCK, load_*/store_*/get*/put*,
// combine, suspect) and before the generated entry point, which calls segmented().

using Flags = Ptr<const uint8_t>;
// How a row's flags are read: ROW, one flag for every lane of the row (R.si == 0: a 1-D
// mask, or one broadcast over the lanes, as a (batch, T) mask over (batch, T, features));
// LANE, a flag per lane, read from adjacent bytes: the mask's own where its lanes are
// adjacent, else the row's flags gathered into `gathered` first (a third mode reading
// them through their stride in the loop doubled the lane path's instantiations: a
// segmented kernel took 8.2 s of CPU to build with it, against 5.3 without).
enum { ROW = 0, LANE = 1 };
// The lanes of a descending block (fscan_lanes) where a loop reads a flag per lane (LANE):
// a cache line of the flags' bytes. GCC vectorises a loop by its narrowest type, 64 bytes
// a vector with AVX-512, so LANE_BLOCK's 16 float32 lanes with a flag each ran scalar:
// fscan.cumsum reversed with a full reset= mask over (4096, 256) dim 0 took 0.66 ms against
// 0.23-0.29 forward, now 0.26-0.28; over (16384, 1024) 14.4 ms, now 9.4-10.0.
static constexpr int64_t FLAG_LANES = LANE_BLOCK > 64 ? LANE_BLOCK : 64;

// Row t's flags as LANE reads them: w adjacent bytes. Gathered in the order opposite to
// the one the row's loop reads them in (fscan_lanes: down, from the top block), so that
// the loop's first vector loads find their bytes stored long before, not in the store
// buffer (gathered ascending, reversed scans over (8, 1024, 256) dim 1 with every other
// lane of a wider mask ran 1.7-2x their forward ones). The bytes' address, not a Flags:
// a struct returned by value was stored field by field and read back as one vector load
// every row, which the store buffer cannot forward (perf: 13% of the cumsum's samples
// over (4096, 256) dim 0 with a mask of x's shape on the one instruction after it).
static FSCAN_INLINE const uint8_t* lane_flags(const Flags rc, int64_t t, int64_t w, bool down,
                                              uint8_t* gathered) {
  const Flags rr = row(rc, t);
  if (rr.si == 1) return rr.p;
  if (down) {
    for (int64_t i = w - 1; i >= 0; --i) gathered[i] = rr.p[i * rr.si];
  } else {
    for (int64_t i = 0; i < w; ++i) gathered[i] = rr.p[i * rr.si];
  }
  return gathered;
}

// fscan_lanes (blocks of B lanes, descending where down) for a row whose lanes each read
// a flag byte, each block's B flags widened to int32 first, in registers: lane(i, flag).
// Where seg_lane_run takes it (widen): see there. GCC vectorises a loop by its narrowest
// type, so a loop reading a byte a lane runs 64 lanes a vector and a reversed row goes
// down in 64-lane blocks, ascending inside; where a lane moves 16 bytes or more
// (WIDE_FLAGS, generated: float64; cummax's value and index, see
// fscan._engines.cpp._kernel_segmented.wide_flags) that zig-zag through the descending
// streams cost the reversed scan 1.5-2x its inclusive call. B flags widened to int32 make
// the block's loop run LANE_BLOCK lanes a vector, as the scan without flags does. Before,
// each row's flags were widened into a buffer by a loop of their own and read back: the
// bench's cummax over (1024, 8, 64) dim 1 reversed with a mask of x's shape 1.45-1.62x
// its inclusive call (265-305 us against 185-195), 1.06-1.14x this way (194-208 us);
// (4096, 256) dim 0 reversed 1.22-1.48x -> 1.02-1.04x, float64 cumsum (1024, 8, 64) dim 1
// 1.30-1.96x -> 1.14-1.18x (alternating processes). Rows of 64 lanes or more keep the
// bytes' loop forward (widened, float64 cumsum over (4096, 256) dim 0 went 1.11-1.14x ->
// 1.20-1.23x), and where a lane moves 8 bytes (float32 cumsum) in both directions
// (1.03-1.06x -> 1.17-1.20x).
template <int64_t B, typename F>
static FSCAN_INLINE void widened_lanes(int64_t w, bool down, const uint8_t* f, F&& lane) {
  auto block = [&](int64_t i0) {
    alignas(64) int32_t fb[B];
#pragma GCC unroll 64
    for (int64_t j = 0; j < B; ++j) fb[j] = f[i0 + j] != 0;
#pragma GCC ivdep
#pragma GCC unroll 1
    for (int64_t j = 0; j < B; ++j) lane(i0 + j, fb[j] != 0);
  };
  const int64_t whole = w - w % B;  // the lanes in whole blocks: [0, whole) up, [w - whole, w) down
  if (down) {
    for (int64_t hi = w; hi >= B; hi -= B) block(hi - B);
  } else {
    for (int64_t i0 = 0; i0 < whole; i0 += B) block(i0);
  }
  // The lanes left (fewer than B), their flags widened too: read as bytes, the loop ran
  // them scalar (rows of 24 lanes, 8 left: cummax over (4096, 8, 24) dim 1 reversed with a
  // mask of x's shape 3.2x its inclusive call); as int32, GCC's narrower epilogue vectors
  // take them.
  const int64_t a = down ? 0 : whole, n = w - whole;
  alignas(64) int32_t fb[B];
  for (int64_t j = 0; j < n; ++j) fb[j] = f[a + j] != 0;
#pragma GCC ivdep
  for (int64_t j = 0; j < n; ++j) lane(a + j, fb[j] != 0);
}

// A lane's running value l combined with its element u, or u where the lane restarts (f).
// A flagged lane takes its element: the combine's result (of anything, NaN included) is
// dropped, as torch.where drops it on the (flag, value) pairs. pick selects field by
// field: `flag ? u : c` on the structs went through memory (a select of addresses), 20 ns
// an element on the chain path. cummax's / cummin's pair (SEG_EXTREMUM) folds the restart
// into the combine's own select instead (u where flagged, NaN, or at or beyond l: one
// mask and a blend a field, not a second blend a field after the combine's): the bench's
// cummax over (4096, 256) dim 0 with a mask of x's shape, against the inclusive call,
// 1.20-1.38x -> 1.08-1.12x, reversed 1.29-1.33x -> 1.06-1.07x (2 alternating rounds).
template <typename V>
static FSCAN_INLINE V restarted(bool f, const V& l, const V& u, const Par& p, int64_t e) {
  if constexpr (SEG_EXTREMUM != 0) {
    (void)p; (void)e;
    const bool take = f | (u.v0 != u.v0) | (SEG_EXTREMUM > 0 ? u.v0 >= l.v0 : u.v0 <= l.v0);
    V o;
    o.v0 = take ? u.v0 : l.v0;
    o.v1 = take ? u.v1 : l.v1;
    return o;
  } else {
    return pick(f, u, combine<false>(l, u, p, e));
  }
}

// NARROW_ROWS rows of a column NW lanes wide (LANE_BLOCK or half of it) from the running
// values in left into acc, as narrow_rows in forward_lanes.h holds the inclusive scan's
// (WRITE, ALL: as there, and as seg_lane_run's), each lane's running value in a register
// across the rows; FLAGGED: restarting where flagged (ROW: a flag a row; LANE: a flag a
// lane, the rows' bytes adjacent, widened to int32 first so that the loop over lanes
// vectorises, as widened_lanes does). FIRST: the first row's elements start the running
// values (a chunk's first row without a carry; left unread). Without the blocks, a row
// at a time, cumsum over (4096, 16, 16) dim 1 with a mask of x's shape ran 1.45-1.60x its
// (blocked) inclusive call, 1.22-1.29x with them. Columns of 8 lanes and a split column's
// first chunk and totals (WRITE && !ALL only, before): cumsum over (8192, 16, 8) dim 1
// with such a mask 3.96-4.58x -> 1.64-1.90x, reversed 4.91x -> 1.69x; with a flag a row
// 1.61-1.89x -> 1.04-1.32x; cummax 6.5x -> 1.18x, logcumsumexp 2.82x -> 1.03x; over
// (131072, 8) dim 0 on 2 threads 4.8x -> 1.55x (medians of alternating processes; one
// step in 97 restarting).
template <int MODE, int64_t NW, bool WRITE, bool ALL, bool FIRST, bool FLAGGED>
static FSCAN_INLINE void seg_narrow_block(const In xr, const Out yr, const Par p, const Flags rc,
                                          int64_t e0, int64_t t, int64_t dt, const Buf left,
                                          const Buf acc) {
  constexpr int64_t FW = FLAGGED ? (MODE == LANE ? NW : 1) : 0;  // flags a row
  alignas(64) int32_t fb[NARROW_ROWS][FW > 0 ? FW : 1];
  for (int64_t r = 0; r < (FW > 0 ? NARROW_ROWS : 0); ++r) {
    const uint8_t* const f = row(rc, t + r * dt).p;
#pragma GCC unroll 64
    for (int64_t j = 0; j < FW; ++j) fb[r][j] = f[j] != 0;
  }
#pragma GCC ivdep
  for (int64_t i = 0; i < NW; ++i) {
    Vals a = FIRST ? load_i(xr, i, t) : get_as<ALL>(left, i);
    if (FIRST && WRITE) store_i(yr, i, a);
#pragma GCC unroll 16
    for (int64_t r = FIRST ? 1 : 0; r < NARROW_ROWS; ++r) {
      const Vals u = load_i(row(xr, r * dt), i, t + r * dt);
      if constexpr (FLAGGED) a = restarted(fb[r][MODE == LANE ? i : 0] != 0, a, u, p, e0 + i);
      else a = combine<false>(a, u, p, e0 + i);
      if (WRITE) store_i(row(yr, r * dt), i, a);
    }
    put_as<ALL>(acc, i, a);
  }
}

// A block of NARROW_ROWS rows (seg_narrow_block). ROW: the block's flags (a byte a row)
// read first, and a block without any (FIRST's row aside: unread) runs the inclusive
// scan's loop, neither widening its flags nor selecting a lane's element (cumsum over
// (8192, 16, 8) dim 1 with a flag a row, one step in 97 restarting: 1.42-1.43x ->
// 1.06-1.19x its inclusive call; (4096, 16, 16) 1.21-1.22x -> 1.05-1.16x; a runtime
// switch, alternating processes). LANE always selects: at that
// density a block of 16 lanes holds a flag 73% of the time, and the test (two words a row
// and a branch that mispredicts) cost more than it saved (1.30x -> 1.42x; 8 lanes, 52%
// holding one, 1.79x -> 1.75x; medians of 4 alternating processes). !WRITE: seen (NW
// bytes) marks the lanes restarting in the block, its first row included (see
// seg_lane_run). Not inlined: the half width's blocks inlined into seg_lane_run's row loop
// beside the full width's slowed those, whose code was unchanged (cumsum over (4096, 16,
// 16) dim 1 with a mask of x's shape: 1.18-1.33x its inclusive call with the half width's
// blocks out of line or absent, 1.34-1.44x with them inlined).
template <int MODE, int64_t NW, bool WRITE, bool ALL, bool FIRST>
__attribute__((noinline)) static void seg_narrow_rows(const In xr, const Out yr, const Par p,
                                                      const Flags rc, int64_t e0, int64_t t,
                                                      int64_t dt, const Buf left, const Buf acc,
                                                      uint8_t* seen) {
  static_assert(MODE == ROW || NW % 8 == 0, "LANE marks seen 8 bytes at a time");
  if constexpr (MODE == ROW) {
    uint8_t any = 0, marked = 0;
    for (int64_t r = 0; r < NARROW_ROWS; ++r) {
      const uint8_t f = row(rc, t + r * dt).p[0];
      if (!FIRST || r > 0) any |= f;
      marked |= f;
    }
    if (!WRITE && marked) std::memset(seen, 1, (size_t)NW);
    if (any) seg_narrow_block<MODE, NW, WRITE, ALL, FIRST, true>(xr, yr, p, rc, e0, t, dt, left, acc);
    else seg_narrow_block<MODE, NW, WRITE, ALL, FIRST, false>(xr, yr, p, rc, e0, t, dt, left, acc);
  } else {
    if constexpr (!WRITE) {
      for (int64_t r = 0; r < NARROW_ROWS; ++r) {
        const uint8_t* const f = row(rc, t + r * dt).p;
        for (int64_t j = 0; j < NW; j += 8) {
          uint64_t word, marked;
          std::memcpy(&word, f + j, sizeof word);
          std::memcpy(&marked, seen + j, sizeof marked);
          marked |= word;
          std::memcpy(seen + j, &marked, sizeof marked);
        }
      }
    }
    seg_narrow_block<MODE, NW, WRITE, ALL, FIRST, true>(xr, yr, p, rc, e0, t, dt, left, acc);
  }
}

// Steps [s0, s1) (in scan order) of lanes [i0, i0 + w) of outer index o, as lane_run in
// forward_lanes.h, restarting where flagged. carry (or nullptr) holds the inclusive result
// before s0. !WRITE: a chunk total in acc, and seen[i] set where lane i restarts in the
// chunk (its total then owes nothing to the chunks before). ALL with WRITE: the outputs
// written and the total kept, every leaf (a split column's first chunk, whose total no
// carry precedes: seen is not kept). gathered: W bytes (LANE with strided flags).
template <bool WRITE, bool GATHER, int MODE, bool ALL = !WRITE>
static void seg_lane_run(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                         int64_t o, int64_t i0, int64_t w, int64_t s0, int64_t s1, bool rev,
                         const Buf* carry, const Buf acc, uint8_t* seen, const InRow& rows,
                         const OutRow& orows, uint8_t* gathered) {
  const In xc = at(x, S, o, 0, i0);
  const Out yc = at(y, S, o, 0, i0);
  const Flags rc = shift(R, o, S.nb, 0, i0);
  const int64_t e0 = o * S.inner + i0, T = S.T, dt = rev ? -1 : 1;
  // Widened (see widened_lanes) going down over more than one block of LANE_BLOCK lanes
  // where a lane moves 16 bytes or more: forward, the bytes' loop ascends through the row
  // in one pass. (Rows of one 64-lane block of bytes, read ascending while the rows go
  // down, zig-zag too: cummax over (4096, 8, 64) dim 1 reversed with a mask of x's shape
  // 2410-2435 us unwidened, 1.85-2.05x the inclusive call.) And in either direction, any
  // dtype, where a row is narrower than the bytes' 64-lane vector: that loop never ran a
  // vector iteration there, all its lanes scalar (rows of 16 lanes: cummax over
  // (4096, 16, 16) dim 1 with a mask of x's shape 3.8-4.2x its inclusive call, float32
  // cumsum over (16384, 16) dim 0 reversed 3.4-3.6x), narrower than LANE_BLOCK included
  // (widened_lanes takes them as lanes left over: rows of 12 lanes, cumsum over (8192, 16,
  // 12) dim 1 with a mask of x's shape, 3.3x -> 2.2x its inclusive call, one run each).
  const bool widen = MODE == LANE && (w < FLAG_LANES || (WIDE_FLAGS && rev && w > LANE_BLOCK));
  if (!WRITE) std::memset(seen, 0, (size_t)w);
  In xs = row(xc, rev ? T - 1 - s0 : s0);
  Out ys = row(yc, rev ? T - 1 - s0 : s0);
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t t = rev ? T - 1 - s : s;
    if (s > s0) { xs = row(xs, dt); ys = row(ys, dt); }
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    const Out yr = GATHER ? buffered(ys, orows) : ys;
    const uint8_t* const rf = MODE == LANE ? lane_flags(rc, t, w, rev, gathered) : row(rc, t).p;
    const bool first = s == s0 && carry == nullptr;
    if (!GATHER && (w == LANE_BLOCK || w == LANE_BLOCK / 2) && (MODE == ROW || rc.si == 1) &&
        s + NARROW_ROWS <= s1) {  // NARROW_ROWS rows in registers
      constexpr int64_t HALF = LANE_BLOCK / 2;
      const Buf left = s == s0 && carry != nullptr ? *carry : acc;  // first: unread
      if (w == HALF) {
        if (first) seg_narrow_rows<MODE, HALF, WRITE, ALL, true>(xr, yr, p, rc, e0, t, dt, left, acc, seen);
        else seg_narrow_rows<MODE, HALF, WRITE, ALL, false>(xr, yr, p, rc, e0, t, dt, left, acc, seen);
      } else if (first) {
        seg_narrow_rows<MODE, LANE_BLOCK, WRITE, ALL, true>(xr, yr, p, rc, e0, t, dt, left, acc, seen);
      } else {
        seg_narrow_rows<MODE, LANE_BLOCK, WRITE, ALL, false>(xr, yr, p, rc, e0, t, dt, left, acc, seen);
      }
      s += NARROW_ROWS - 1;
      xs = row(xs, (NARROW_ROWS - 1) * dt);
      ys = row(ys, (NARROW_ROWS - 1) * dt);
      continue;  // its lanes' seen marked, nothing gathered
    } else if (MODE == ROW && (first || rf[0])) {  // the whole row restarts: a copy
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        const Vals v = load_i(xr, i, t);
        put_as<ALL>(acc, i, v);
        if (WRITE) store_i(yr, i, v);
      });
      if (!WRITE && rf[0]) std::memset(seen, 1, (size_t)w);
    } else if (MODE == ROW || !first) {
      // The row combined with the running values, flagged lanes taking their element (f:
      // the lane's flag, from the row's bytes or widened a block at a time: see widen).
      const Buf left = s == s0 ? *carry : acc;
      auto lane = [&](int64_t i, bool f) {
        const Vals u = load_i(xr, i, t);
        const Vals v = MODE != ROW ? restarted(f, get_as<ALL>(left, i), u, p, e0 + i)
                                   : combine<false>(get_as<ALL>(left, i), u, p, e0 + i);
        put_as<ALL>(acc, i, v);
        if (WRITE) store_i(yr, i, v);
      };
      if constexpr (MODE == ROW) {
        fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) { lane(i, false); });
      } else if (widen) {
        widened_lanes<LANE_BLOCK>(w, rev, rf, lane);
      } else {
        fscan_lanes<FLAG_LANES>(w, rev, [&](int64_t i) { lane(i, rf[i] != 0); });
      }
    } else {  // the chunk's first row, no carry: its elements, flagged or not
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        const Vals v = load_i(xr, i, t);
        put_as<ALL>(acc, i, v);
        if (WRITE) store_i(yr, i, v);
      });
    }
    if (MODE != ROW && !WRITE) {
      for (int64_t i = 0; i < w; ++i) seen[i] |= rf[i];
    }
    if (WRITE && GATHER) scatter(ys, orows, w, rev);
  }
}

template <bool WRITE, int MODE, bool ALL = !WRITE>
static FSCAN_INLINE void seg_lanes(bool dense, const In x, const Out y, const Par p, const Flags R,
                                   const Geo& S, int64_t o, int64_t i0, int64_t w, int64_t s0,
                                   int64_t s1, bool rev, const Buf* carry, const Buf acc,
                                   uint8_t* seen, const InRow& rows, const OutRow& orows,
                                   uint8_t* gathered) {
  if (dense) seg_lane_run<WRITE, false, MODE, ALL>(x, y, p, R, S, o, i0, w, s0, s1, rev, carry, acc, seen, rows, orows, gathered);
  else seg_lane_run<WRITE, true, MODE, ALL>(x, y, p, R, S, o, i0, w, s0, s1, rev, carry, acc, seen, rows, orows, gathered);
}

// lane_path (forward_lanes.h) with flags: columns of W lanes; where there are fewer columns
// than threads, each column's steps split into C chunks, whose totals are composed in
// scan order, except where a chunk restarts a lane (its total is then the carry on). As
// lane_path, a split column's first chunk is scanned (outputs written, total kept) while
// the other threads take the totals of chunks 1..C-2, then chunks 1..C-1 are scanned from
// their carries: C = threads + 1, one pass of each (every chunk's total first, C = 2 *
// threads, took as long on 2 threads as one thread's scan).
template <int MODE>
static void seg_lane_path(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                          bool rev, int nt) {
  const int64_t outer = S.outer, T = S.T, inner = S.inner;
  const Columns K = lane_columns(outer, T, inner, nt, 1, 1);
  const int64_t W = K.W, ntiles = K.ntiles, ncols = K.ncols, C = K.C, L = K.L;
  Store tot(C > 1 ? ncols * (C - 1) * W : 0);
  std::vector<uint8_t> seen(C > 1 ? ncols * (C - 1) * W : 0);
  const Buf tb = tot.buf();
  fscan_team(nt, [&] {
    Store scratch(W);
    const Buf acc = scratch.buf();
    const bool dense = unit(x) && unit(y);
    const InRow rows(dense ? 0 : W);
    const OutRow orows(dense ? 0 : W);
    std::vector<uint8_t> flags(MODE == LANE && R.si != 1 ? W : 0);
    uint8_t* const gathered = flags.data();
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < ncols * (C - 1); ++k) {
        const int64_t col = k / (C - 1), c = k % (C - 1);
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        const Buf total = offset(tb, k * W);
        if (c == 0) seg_lanes<true, MODE, true>(dense, x, y, p, R, S, o, i0, w, 0, L, rev, nullptr, total, nullptr, rows, orows, gathered);
        else seg_lanes<false, MODE>(dense, x, y, p, R, S, o, i0, w, c * L, (c + 1) * L, rev, nullptr, total, seen.data() + k * W, rows, orows, gathered);
      }
#pragma omp for schedule(static)
      for (int64_t col = 0; col < ncols; ++col) {
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        for (int64_t c = 1; c < C - 1; ++c) {
          const int64_t k = col * (C - 1) + c;
          const Buf prev = offset(tb, (k - 1) * W), cur = offset(tb, k * W);
          bool walk = false;
          for (int64_t i = 0; i < w; ++i) {
            if (seen[k * W + i]) continue;
            const Vals l = get_all(prev, i), r = get_all(cur, i), v = combine(l, r, p, o * inner + i0 + i);
            walk |= suspect(l, r, v);
            put_all(cur, i, v);
          }
          // Composing is not what the steps give (see suspect): walk the chunk.
          if (walk) seg_lanes<false, MODE>(dense, x, y, p, R, S, o, i0, w, c * L, (c + 1) * L, rev, &prev, cur, seen.data() + k * W, rows, orows, gathered);
        }
      }
    }
    // The chunks left: every chunk of a whole column, chunks 1..C-1 of a split one.
    const int64_t rest = C > 1 ? C - 1 : 1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < ncols * rest; ++n) {
      // Reversed, the columns go down too, as lane_path's (forward_lanes.h): where columns
      // are consecutive blocks of memory (a middle dim), ascending columns whose rows
      // descend zig-zagged through memory: (1024, 8, 64) dim 1 reversed ran 1.15-1.3x its
      // inclusive call (forward 0.94-1.05).
      const int64_t k = rev ? ncols * rest - 1 - n : n;
      const int64_t col = k / rest, c = C > 1 ? k % rest + 1 : 0;
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      const Buf carry = c > 0 ? offset(tb, (col * (C - 1) + c - 1) * W) : tb;
      const int64_t s1 = std::min(T, (c + 1) * L);
      seg_lanes<true, MODE>(dense, x, y, p, R, S, o, i0, w, c * L, s1, rev, c == 0 ? nullptr : &carry, acc, nullptr, rows, orows, gathered);
    }
  });
}

// The chain path (csrc/segmented_chains.h, placed after this file).
static void seg_chain_path(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                           bool rev, int nt);

static void segmented(const In x, const Out y, const Par p, const Flags R, const Geo& S, bool rev,
                      int threads) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t total = S.outer * S.T * S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / PER_THREAD));
  if (S.inner >= VEC_MIN && !along(x) && !along(y)) {
    if (R.si == 0) seg_lane_path<ROW>(x, y, p, R, S, rev, nt);
    else seg_lane_path<LANE>(x, y, p, R, S, rev, nt);
  } else {
    seg_chain_path(x, y, p, R, S, rev, nt);
  }
}
