// The kernels' tuning constants, shared by the forward and the backward scans.
static constexpr int64_t TILE = 1024;         // lanes per column of the lane path
static constexpr int64_t VEC_MIN = 8;         // inner sizes below this take the chain path
static constexpr int64_t MIN_CHUNK = 2048;    // steps per chunk, at least, when T is split
static constexpr int64_t PER_THREAD = 16384;  // elements per thread, at least
static constexpr int G = 8;                   // chains interleaved on the chain path
static constexpr int64_t SKEW = 16;           // steps between interleaved chains, when long
static constexpr int TW = 16;                 // chains side by side in a tile of the chain path
static constexpr int64_t TB = 16;             // steps per tile of the chain path
