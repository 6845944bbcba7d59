// The kernels' tuning constants, shared by the forward and the backward scans.
static constexpr int64_t TILE = 1024;         // lanes per column of the lane path
static constexpr int64_t VEC_MIN = 8;         // inner sizes below this take the chain path
static constexpr int64_t MIN_CHUNK = 2048;    // steps per chunk, at least, when T is split
static constexpr int64_t PER_THREAD = 16384;  // elements per thread, at least
static constexpr int G = 8;                   // chains interleaved on the chain path
static constexpr int64_t SKEW = 16;           // steps between interleaved chains, when long
static constexpr int TV = FSCAN_TV;           // chains per vector in a tile of the chain path (prelude.h)
static constexpr int64_t TB = 16;             // steps per tile of the chain path
static constexpr int64_t NARROW_ROWS = 8;     // rows a block of a column one LANE_BLOCK wide

// The lane paths' columns: up to TILE lanes each, never narrowed for the threads. Where
// there are fewer columns than threads (a 2-D scan over dim 0: one column), each column's
// T steps split into C chunks of L instead (per chunks per idle thread and extra more; at least
// LANE_CHUNK elements and MIN_STEPS steps each), so that every thread writes whole rows of
// its own. Narrowed columns shared every row between the threads, and a thread writing one
// half of a row while another wrote the other half made 2 threads slower than one: add over
// (1024, 512) dim 0, 1 thread 43 us; halves of each row on 2 threads 51-196 us; halves of
// the rows (steps [0, T/2) and [T/2, T)) 21 us (a standalone loop of the same arithmetic).
// T > 0.
static constexpr int64_t LANE_CHUNK = 16384;  // elements per chunk of a lane path column, at least
static constexpr int64_t MIN_STEPS = 64;      // steps per chunk of a lane path column, at least
struct Columns { int64_t W, ntiles, ncols, C, L; };
static inline Columns lane_columns(int64_t outer, int64_t T, int64_t inner, int nt, int64_t per,
                                   int64_t extra = 0) {
  const int64_t W = std::min<int64_t>(inner, TILE);
  const int64_t ntiles = (inner + W - 1) / W, ncols = outer * ntiles;
  int64_t C = 1;
  if (ncols < nt) {
    const int64_t steps = std::max<int64_t>(MIN_STEPS, (LANE_CHUNK + W - 1) / W);
    C = std::min<int64_t>((nt + ncols - 1) / ncols * per + extra, std::max<int64_t>(1, T / steps));
  }
  const int64_t L = (T + C - 1) / C;
  return Columns{W, ntiles, ncols, (T + L - 1) / L, L};
}
