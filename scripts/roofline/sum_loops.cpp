// The float32 sum's loops in the reduce kernel (csrc/reduce.h, SUM_F32), standalone, next
// to the floors they are held to: a float32 column sum (what torch.sum's vector loop does)
// and, along a lane, a float32 sum of dense steps. Build and run, one thread:
//   g++ -O3 -march=native -fno-trapping-math -fno-math-errno -fwrapv -ffp-contract=off \
//       scripts/roofline/sum_loops.cpp -o /tmp/sum_loops && taskset -c 1 /tmp/sum_loops
// Medians of 301 runs, microseconds. The loops are the kernel's, written out for one leaf.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

// The lane path (sum_rows): blocks of RB rows summed in float32, widened once a block.
template <int RB>
__attribute__((noinline)) void column_blocks(const float* x, int64_t T, int64_t w, double* a) {
  for (int64_t i = 0; i < w; ++i) a[i] = x[i];
  for (int64_t t = 1; t + RB <= T; t += RB) {
    int bad = 0;
    for (int64_t i = 0; i < w; ++i) {
      float v = x[t * w + i];
#pragma GCC unroll 16
      for (int j = 1; j < RB; ++j) v += x[(t + j) * w + i];
      const bool finite = v - v == 0.0f;
      a[i] = finite ? a[i] + static_cast<double>(v) : a[i];
      bad |= !finite;
    }
    if (bad) std::abort();  // (the kernel reruns those lanes in double; random data has none)
  }
}

// The floor: float32 running values, row by row.
__attribute__((noinline)) void column_float32(const float* x, int64_t T, int64_t w, float* a) {
  for (int64_t i = 0; i < w; ++i) a[i] = x[i];
  for (int64_t t = 1; t < T; ++t)
    for (int64_t i = 0; i < w; ++i) a[i] += x[t * w + i];
}

// The chain path (dense_sum): DR rows of DL lanes of a lane's dense steps a block.
template <int DL, int DR>
__attribute__((noinline)) double dense_sum(const float* p, int64_t n) {
  double acc[DL];
  for (int l = 0; l < DL; ++l) acc[l] = -0.0;
  int64_t k = 0;
  for (; k + DL * DR <= n; k += DL * DR) {
    const float* q = p + k;
    float v[DL];
    for (int l = 0; l < DL; ++l) v[l] = q[l];
#pragma GCC unroll 8
    for (int j = 1; j < DR; ++j)
      for (int l = 0; l < DL; ++l) v[l] += q[DL * j + l];
    for (int l = 0; l < DL; ++l) acc[l] += static_cast<double>(v[l]);
  }
  for (; k + DL <= n; k += DL)
    for (int l = 0; l < DL; ++l) acc[l] += static_cast<double>(p[k + l]);
#pragma GCC unroll 8
  for (int h = DL / 2; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) acc[l] += acc[l + h];
  double total = acc[0];
  for (; k < n; ++k) total += static_cast<double>(p[k]);
  return total;
}

template <class F>
static double median_us(F f) {
  std::vector<double> v;
  for (int k = 0; k < 301; ++k) {
    const auto s = std::chrono::steady_clock::now();
    f();
    v.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2] * 1e6;
}

volatile double sink;

int main() {
  const int64_t T = 4096, W = 256;
  std::vector<float> x(T * W);
  for (auto& v : x) v = (std::rand() % 1000) / 1000.0f;
  std::vector<double> a(W);
  std::vector<float> af(W);
  printf("(4096, 256) dim 0, blocks of 8 rows   %7.1f\n", median_us([&] { column_blocks<8>(x.data(), T, W, a.data()); }));
  printf("(4096, 256) dim 0, blocks of 16 rows  %7.1f\n", median_us([&] { column_blocks<16>(x.data(), T, W, a.data()); }));
  printf("(4096, 256) dim 0, float32 row by row %7.1f\n", median_us([&] { column_float32(x.data(), T, W, af.data()); }));
  printf("(1048576,), 32 lanes x 8 rows         %7.1f\n", median_us([&] { sink = dense_sum<32, 8>(x.data(), T * W); }));
  printf("(1048576,), 16 lanes x 16 rows        %7.1f\n", median_us([&] { sink = dense_sum<16, 16>(x.data(), T * W); }));
  printf("(4096, 256) dim 1, 32 lanes x 8 rows  %7.1f\n", median_us([&] {
    for (int64_t r = 0; r < T; ++r) sink = dense_sum<32, 8>(x.data() + W * r, W);
  }));
  printf("(4096, 256) dim 1, 16 lanes x 16 rows %7.1f\n", median_us([&] {
    for (int64_t r = 0; r < T; ++r) sink = dense_sum<16, 16>(x.data() + W * r, W);
  }));
}
