// The kernels' tuning constants, shared by the forward and the backward scans.
static constexpr int64_t TILE = 1024;         // lanes per column of the lane path
static constexpr int64_t VEC_MIN = 8;         // inner sizes below this take the chain path
static constexpr int64_t MIN_CHUNK = 2048;    // steps per chunk, at least, when T is split
static constexpr int64_t PER_THREAD = 16384;  // elements per thread, at least
static constexpr int G = 8;                   // chains interleaved on the chain path
static constexpr int64_t SKEW = 16;           // steps between interleaved chains, when long
static constexpr int TV = 16;                 // chains per vector in a tile of the chain path
static constexpr int64_t TB = 16;             // steps per tile of the chain path

// The lane paths' columns: up to TILE lanes each, narrowed (in multiples of 16) while
// there are fewer columns than threads; where that still leaves threads idle (a narrow
// inner dim), each column's T steps split into C chunks of L (per: chunks per idle
// thread, at least MIN_CHUNK steps each). T > 0.
struct Columns { int64_t W, ntiles, ncols, C, L; };
static inline Columns lane_columns(int64_t outer, int64_t T, int64_t inner, int nt, int64_t per) {
  int64_t W = std::min<int64_t>(inner, TILE);
  while (W > 16 && outer * ((inner + W - 1) / W) < nt) W = (W / 2 + 15) / 16 * 16;
  const int64_t ntiles = (inner + W - 1) / W, ncols = outer * ntiles;
  int64_t C = 1;
  if (ncols < nt) C = std::min<int64_t>((nt + ncols - 1) / ncols * per, std::max<int64_t>(1, T / MIN_CHUNK));
  const int64_t L = (T + C - 1) / C;
  return Columns{W, ntiles, ncols, (T + L - 1) / L, L};
}
