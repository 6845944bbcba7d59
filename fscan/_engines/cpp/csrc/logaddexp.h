// torch.logaddexp, branch-free, so that the loops it sits in (the lane path's rows, the
// chain path's tiles) vectorise: libm's expf and log1pf are calls with branches inside,
// which kept every loop around them scalar ("control flow in loop"), 19 ns an element.
//
// As torch computes it: max(a, b) + log1p(exp(-|a - b|)), and a itself where a == b is
// infinite (here: d = 0 where a == b, and -inf + log(2) is -inf, +inf + log(2) is +inf);
// NaN from either side gives NaN (d is NaN); +inf beside anything else gives +inf.
//
// fscan_log1p_exp(d) = log1p(exp(d)) for d <= 0 in float32 arithmetic: exp by range
// reduction (d = k log 2 + r, |r| <= log(2) / 2, cephes' polynomial for exp(r), 2**k
// applied in two exact halves so that subnormal results round once); then log1p(e) for
// e in [0, 1] by fdlibm's reduction (e >= 1/2: log(2) + log1p((e - 1) / 2), both steps
// exact), s = f / (2 + f) and log1p(f) = f - (f*f/2 - s (f*f/2 + R(s*s))), R the atanh
// series. Against log1p(exp(d)) in double over every float32 d in [-110, 0] (special
// values too: -inf, -0, NaN, d giving subnormal results): at most 1.64 ulps of the float32
// result, 0.75 where it is subnormal (tests/test_logaddexp_kernel.py checks 2 ulps and the special values); torch's
// own float32 logaddexp (SLEEF's u10 expf and log1pf) is within 4 ulps of it.
static FSCAN_INLINE float fscan_bits_float(int32_t i) { float f; std::memcpy(&f, &i, 4); return f; }
static FSCAN_INLINE int32_t fscan_float_bits(float f) { int32_t i; std::memcpy(&i, &f, 4); return i; }
static FSCAN_INLINE float fscan_log1p_exp(float d) {
  // exp(d): below -105 it rounds to 0 (and -inf lands there; NaN stays NaN).
  const float x = d < -105.0f ? -105.0f : d;
  const float shifted = x * 0x1.715476p+0f + 0x1.8p23f;  // k = nearest(x / log 2), in the low bits
  const float k = shifted - 0x1.8p23f;
  const int32_t ki = fscan_float_bits(shifted) - 0x4b400000;
  const float r = std::fma(k, -0x1.62e4p-1f, x) - k * 0x1.7f7d1cp-20f;  // log 2 in two parts
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  const int32_t k1 = ki >> 1, k2 = ki - k1;  // k in [-152, 0]: both halves are normal scales
  const float e = p * fscan_bits_float((k1 + 127) << 23) * fscan_bits_float((k2 + 127) << 23);
  // log1p(e), e in [0, 1]: f = e, or (e - 1) / 2 (exact: e >= 1/2) with log(2) added.
  const bool up = e >= 0.5f;
  const float f = up ? (e - 1.0f) * 0.5f : e;
  const float s = f / (2.0f + f), z = s * s;
  float R = 1.8181818182e-1f;  // 2/11 .. 2/3: |s| <= 0.2, the series' tail below 2**-31
  // relative to the result (a fiftieth of an ulp)
  R = std::fma(R, z, 2.2222222222e-1f);
  R = std::fma(R, z, 2.8571428571e-1f);
  R = std::fma(R, z, 4.0000000000e-1f);
  R = std::fma(R, z, 6.6666666667e-1f) * z;
  const float half_square = 0.5f * f * f;
  const float lo = up ? 0x1.7f7d1cp-20f : 0.0f, hi = up ? 0x1.62e4p-1f : 0.0f;
  return hi - ((half_square - std::fma(s, half_square + R, lo)) - f);
}
// Half types compute in float, float64 in double (libmvec's exp and log1p, where GCC
// vectorises them, else libm's).
static FSCAN_INLINE float fscan_logaddexp(float a, float b) {
  const float m = a > b ? a : b;
  const float d = a == b ? 0.0f : -std::fabs(a - b);
  return m + fscan_log1p_exp(d);
}
static FSCAN_INLINE double fscan_logaddexp(double a, double b) {
  const double m = a > b ? a : b;
  const double d = a == b ? 0.0 : -std::fabs(a - b);
  return m + std::log1p(std::exp(d));
}
// float32 held in double (a running value; fscan._engines.cpp._cpp_codegen): the
// maximum and the sum in double, exp and log1p in float32 on the difference rounded to
// float, as eager float32 runs them, so that a long scan accumulates in double as
// torch.logcumsumexp does.
static FSCAN_INLINE double fscan_logaddexp_f32(double a, double b) {
  const double m = a > b ? a : b;
  const double d = a == b ? 0.0 : -std::fabs(a - b);
  return m + static_cast<double>(fscan_log1p_exp(static_cast<float>(d)));
}
