// The reduce section's own floors (scripts/roofline.py --section reduce): a column total
// of a float32 (T, N) leaf as the reduce kernel reads it (csrc/reduce_lanes.h, block_rows):
// 8 rows by 4 lanes a block, the running values in registers between the rows of a block,
// in a row of scratch between blocks. Written with AVX2 intrinsics (the kernel's packing,
// not a guess at what a compiler makes of it): each 4 floats widened straight from memory
// (vcvtps2pd) into double, or kept in float32 for the cost of the widening.
#include <cstdint>
#include <vector>
#include <immintrin.h>
#include <pybind11/pybind11.h>

template <int RB, bool DOUBLE>
static void column_totals(const float* x, float* z, int64_t T, int64_t N) {
  std::vector<double> acc(N);
  std::vector<float> accf(N);
  for (int64_t i = 0; i < N; ++i) acc[i] = accf[i] = x[i];
  int64_t t = 1;
  for (; t + RB <= T; t += RB) {
    int64_t i = 0;
    for (; i + 4 <= N; i += 4) {
      if constexpr (DOUBLE) {
        __m256d v = _mm256_loadu_pd(&acc[i]);
        for (int j = 0; j < RB; ++j) v = _mm256_add_pd(v, _mm256_cvtps_pd(_mm_loadu_ps(x + (t + j) * N + i)));
        _mm256_storeu_pd(&acc[i], v);
      } else {
        __m128 v = _mm_loadu_ps(&accf[i]);
        for (int j = 0; j < RB; ++j) v = _mm_add_ps(v, _mm_loadu_ps(x + (t + j) * N + i));
        _mm_storeu_ps(&accf[i], v);
      }
    }
    for (; i < N; ++i)
      for (int j = 0; j < RB; ++j) {
        acc[i] += (double)x[(t + j) * N + i];
        accf[i] += x[(t + j) * N + i];
      }
  }
  for (; t < T; ++t)
    for (int64_t i = 0; i < N; ++i) {
      acc[i] += (double)x[t * N + i];
      accf[i] += x[t * N + i];
    }
  for (int64_t i = 0; i < N; ++i) z[i] = DOUBLE ? (float)acc[i] : accf[i];
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_blocks", [](bool dbl, int rows, uintptr_t x, uintptr_t z, int64_t T, int64_t N) {
    auto X = (const float*)x;
    auto Z = (float*)z;
    if (dbl && rows == 8) column_totals<8, true>(X, Z, T, N);
    else if (dbl) column_totals<4, true>(X, Z, T, N);
    else if (rows == 8) column_totals<8, false>(X, Z, T, N);
    else column_totals<4, false>(X, Z, T, N);
  });
}
