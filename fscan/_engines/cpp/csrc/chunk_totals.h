// The forward's chunk totals without the tiles (chunk_totals, called by chain_path in
// forward_chains.h for the chunks of a chunked lane). Placed by fscan._engines.cpp.
// _cpp_source after the generated part (CHUNK_TOTALS, Vals) and logaddexp.h
// (fscan_exp_le0), before forward_chains.h.

// The totals of a chunked lane's chunks (its steps dense), where the tiles transposed
// each chunk in and scanned it without writes for its last value (31% of a 1-D add's
// samples): CHUNK_TOTALS (generated, see fscan._engines.cpp._cpp_tiles.chunk_totals),
// TOTAL_SUM, the sum of one float32 leaf held in double, summed in double by a vector
// loop (32 running sums, added pairwise at the end); TOTAL_LOGSUMEXP, logaddexp of one
// float32 leaf held in double, as m + log(sum exp(x - m)) over the chunk's maximum m (a
// vector loop for m, one for the sum in double of the float32 exps: one exp an element,
// where the scan takes an exp and a log1p). Only the rounding differs from the steps'
// (in double, far below the float32 outputs' unit: tests/test_cpu_kernel.py,
// test_float32_sum_accumulates_in_double, and the logcumsumexp tests' float64 oracle);
// the special values are the steps' (NaN anywhere gives NaN, +inf +inf, all -inf -inf),
// and a sum runs from -0.0, as the scan's first step keeps a sum of zeros' sign. Every
// step is widened: float32 blocks as the reduce sums them (reduce_sum.h: dense_sum)
// would bound a total by the blocks' float32 rounding, which the scan's double
// accumulation is there to avoid. (x's and the values' types template parameters, so
// that only a kernel with CHUNK_TOTALS compiles it.)
enum { TOTAL_NONE = 0, TOTAL_SUM = 1, TOTAL_LOGSUMEXP = 2 };
static constexpr int TOTAL_LANES = 32;  // running sums (maxima) of the vector loops

// Pairwise, the running sums' total.
static FSCAN_INLINE double lanes_total(double* acc) {
#pragma GCC unroll 8
  for (int h = TOTAL_LANES / 2; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
  return acc[0];
}

static FSCAN_INLINE double chunk_sum(const float* p, int64_t n) {
  double acc[TOTAL_LANES];
  for (int l = 0; l < TOTAL_LANES; ++l) acc[l] = -0.0;
  int64_t k = 0;
  for (; k + TOTAL_LANES <= n; k += TOTAL_LANES)
#pragma GCC unroll 32
    for (int l = 0; l < TOTAL_LANES; ++l) acc[l] += static_cast<double>(p[k + l]);
  double total = lanes_total(acc);
  for (; k < n; ++k) total += static_cast<double>(p[k]);
  return total;
}

static FSCAN_INLINE double chunk_logsumexp(const float* p, int64_t n) {
  float top[TOTAL_LANES];
  int nan = 0;
  for (int l = 0; l < TOTAL_LANES; ++l) top[l] = -INFINITY;
  int64_t k = 0;
  for (; k + TOTAL_LANES <= n; k += TOTAL_LANES)
    for (int l = 0; l < TOTAL_LANES; ++l) {
      const float v = p[k + l];
      top[l] = v > top[l] ? v : top[l];
      nan |= v != v;
    }
  float m = -INFINITY;
  for (int l = 0; l < TOTAL_LANES; ++l) m = top[l] > m ? top[l] : m;
  for (; k < n; ++k) {
    m = p[k] > m ? p[k] : m;
    nan |= p[k] != p[k];
  }
  if (nan) return NAN;
  if (!(m - m == 0.0f)) return static_cast<double>(m);  // +inf anywhere, or every step -inf
  double acc[TOTAL_LANES];
  for (int l = 0; l < TOTAL_LANES; ++l) acc[l] = 0.0;
  for (k = 0; k + TOTAL_LANES <= n; k += TOTAL_LANES)
    for (int l = 0; l < TOTAL_LANES; ++l) acc[l] += static_cast<double>(fscan_exp_le0(p[k + l] - m));
  double total = lanes_total(acc);
  for (; k < n; ++k) total += static_cast<double>(fscan_exp_le0(p[k] - m));
  return static_cast<double>(m) + std::log(total);
}

template <int KIND = CHUNK_TOTALS, typename I, typename V>
static void chunk_totals(const I* xb, const int64_t* t0, const int64_t* len, int ng, int64_t tstep, V* last) {
  if constexpr (KIND != TOTAL_NONE) {
    for (int g = 0; g < ng; ++g) {
      const float* const p = xb[g].x0.p + (tstep > 0 ? t0[g] : t0[g] - len[g] + 1);
      if constexpr (KIND == TOTAL_SUM)  // (a sum kernel does not compile the exps)
        last[g].v0 = chunk_sum(p, len[g]);
      else
        last[g].v0 = chunk_logsumexp(p, len[g]);
    }
  }
}
