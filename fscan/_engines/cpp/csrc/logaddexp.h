// torch.logaddexp, branch-free, so that the loops it sits in (the lane path's rows, the
// chain path's tiles) vectorise: libm's expf and log1pf are calls with branches inside,
// which kept every loop around them scalar ("control flow in loop"), 19 ns an element.
//
// As torch computes it: max(a, b) + log1p(exp(-|a - b|)), and a itself where a == b is
// infinite; NaN from either side gives NaN; +inf beside anything else gives +inf. Every
// select has a variable on both sides, or comes last: a constant on one side (d = 0
// where a == b, say) let GCC thread a path per side through the math after it, and
// evaluate the math twice a vector (one division and polynomial per path).
//
// fscan_log1p_exp(d) = log1p(exp(d)) for d <= 0 in float32 arithmetic: exp by range
// reduction (d = k log 2 + r, |r| <= log(2) / 2, cephes' polynomial for exp(r), 2**k
// applied in two exact halves so that subnormal results round once); then log1p(e) for
// e in [0, 1] as fdlibm's log1pf writes it around the atanh series, but without its
// reduction. Against log1p(exp(d)) in double over every float32 d in [-110, 0] (-0, and d
// giving subnormal results, included): at most 1.87 ulps of the float32 result, 0.75
// where it is subnormal (tests/test_logaddexp_kernel.py checks 2 ulps over a sweep, and
// torch's special values); torch's own float32 logaddexp (SLEEF's u10 expf and log1pf)
// is within 4 ulps of it (tests/test_cpu_kernel_ops.py).
// fscan_exp_le0(d) = exp(d) for d <= 0, the first half of fscan_log1p_exp (also the terms
// of a chunk's logsumexp: chunk_totals in chunk_totals.h).
static FSCAN_INLINE float fscan_exp_le0(float d) {
  // exp(d): below -105 it rounds to 0 (-inf lands there, and NaN: the callers select).
  const float x = d > -105.0f ? d : -105.0f;
  const float shifted = x * 0x1.715476p+0f + 0x1.8p23f;  // k = nearest(x / log 2), in the low bits
  const float k = shifted - 0x1.8p23f;
  const int32_t ki = (int32_t)(fscan_f32_bits(shifted) - 0x4b400000u);
  const float r = std::fma(k, -0x1.62e4p-1f, x) - k * 0x1.7f7d1cp-20f;  // log 2 in two parts
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const int32_t k1 = ki >> 1, k2 = ki - k1;  // k in [-152, 0]: both halves are normal scales
  return p * fscan_bits_f32((uint32_t)(k1 + 127) << 23) * fscan_bits_f32((uint32_t)(k2 + 127) << 23);
}
static FSCAN_INLINE float fscan_log1p_exp(float d) {
  const float e = fscan_exp_le0(d);
  // log1p(e), e in [0, 1]: log1p(e) = e - (e*e/2 - s (e*e/2 + R(s*s))), s = e / (2 + e)
  // <= 1/3 and R the atanh series to s**14 (its tail below 2**-29 of the result).
  // Without a reduction to |s| <= 0.2 (e >= 1/2: log(2) + log1p((e - 1) / 2)): two more
  // terms of the series cost less than the select, 20% less time than with it.
  const float s = e / (2.0f + e), z = s * s;
  float R = 1.3333333333e-1f;  // 2/15, then 2/13 .. 2/3
  R = std::fma(R, z, 1.5384615385e-1f);
  R = std::fma(R, z, 1.8181818182e-1f);
  R = std::fma(R, z, 2.2222222222e-1f);
  R = std::fma(R, z, 2.8571428571e-1f);
  R = std::fma(R, z, 4.0000000000e-1f);
  R = std::fma(R, z, 6.6666666667e-1f) * z;
  const float half_square = 0.5f * e * e;
  return e - (half_square - s * (half_square + R));
}
// d = -|a - b| is NaN exactly where the answer is a + b: a or b NaN, or a == b infinite.
// Half types compute in float, float64 in double (libmvec's exp and log1p, where GCC
// vectorises them, else libm's); float32 held in double (a running value:
// fscan._engines.cpp._cpp_codegen) keeps the maximum and the sum in double, exp and
// log1p in float32 on the difference rounded to float, as eager float32 runs them, so
// that a long scan accumulates in double as torch.logcumsumexp does.
static FSCAN_INLINE float fscan_logaddexp(float a, float b) {
  const float d = -std::fabs(a - b);
  const float r = (a > b ? a : b) + fscan_log1p_exp(d);
  return d == d ? r : a + b;
}
static FSCAN_INLINE double fscan_logaddexp(double a, double b) {
  const double d = -std::fabs(a - b);
  const double r = (a > b ? a : b) + std::log1p(std::exp(d));
  return d == d ? r : a + b;
}
static FSCAN_INLINE double fscan_logaddexp_f32(double a, double b) {
  const double d = -std::fabs(a - b);
  const double r = (a > b ? a : b) + static_cast<double>(fscan_log1p_exp(static_cast<float>(d)));
  return d == d ? r : a + b;
}
