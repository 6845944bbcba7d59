// The reduce kernel's sum of one float32 leaf held in double (SUM_F32, see
// float32_sum in _cpp_tiles.py): blocks summed in float32 and widened once, where reduce.h
// combines every element in double in scan order. A sum may be regrouped and reordered at
// the cost of rounding only; the bound that costs is stated at each loop, and
// tests/test_reduce_sum.py holds the kernel to it and to torch.sum's accuracy.
// fscan._engines.cpp._cpp_source places this after the forward's generated part and tuning.h,
// and before reduce_lanes.h and reduce.h, which call sum_rows (lanes) and sum_chains (chains).

// SUM_F32 (the sum of one float32 leaf held in double): rows t + j * dt (j < SUM_RB) of
// lanes [0, w) summed in float32, in scan order, and each lane's block sum widened once
// and added to its double running value. Widening every element kept block_rows above
// torch.sum (add over (4096, 256) dim 0: 87 us against 61; this loop alone 57 us, a
// float32 column sum 52-57, scripts/roofline/sum_loops.cpp). A block's float32 sum is
// within 15 float32 units of its elements' magnitudes, the rest is double: the total's
// error bound is 15u sum |x| + u |total|, and measured it stays under torch.sum's
// (float32 cascade) error, mean and max (tests/test_reduce_sum.py). A lane whose block
// sum is not finite (an overflow, or an inf or NaN read) keeps its running value and runs
// the block in double, element by element, as block_rows does: range and NaNs are the
// double loop's.
static constexpr int SUM_RB = 16;
template <typename I, typename B>
static FSCAN_INLINE void sum_rows(const I x0, int64_t dt, int64_t w, const B acc) {
  decltype(x0.x0.p) r[SUM_RB];
#pragma GCC unroll 16
  for (int j = 0; j < SUM_RB; ++j) r[j] = row(x0, (j + 1) * dt).x0.p;
  auto* a = acc.v0;
  int bad = 0;
  for (int64_t i = 0; i < w; ++i) {
    float v = r[0][i];
#pragma GCC unroll 16
    for (int j = 1; j < SUM_RB; ++j) v += r[j][i];
    const bool finite = v - v == 0.0f;
    a[i] = finite ? a[i] + static_cast<double>(v) : a[i];
    bad |= !finite;
  }
  if (!bad) return;
  for (int64_t i = 0; i < w; ++i) {
    float v = r[0][i];
    for (int j = 1; j < SUM_RB; ++j) v += r[j][i];
    if (v - v == 0.0f) continue;
    double d = a[i];
    for (int j = 0; j < SUM_RB; ++j) d += static_cast<double>(r[j][i]);
    a[i] = d;
  }
}
// SUM_F32 on chains whose steps are dense: the sum of n float32 elements from p up, in
// double. Float addition commutes, so the steps need not stay in order: blocks of DR rows
// of DL lanes (DL running float32 sums a block, each widened once into DL double
// accumulators; a lane not finite runs the block in double, as sum_rows), then whole rows
// of DL in double, the accumulators added pairwise and the last elements one by one.
// Walked as G interleaved chains (each element widened) these rows took 230 us over dim 1
// of (4096, 256) and 189 over (1048576,), torch.sum 49 and 46; this loop alone 55 and 47
// (scripts/roofline/sum_loops.cpp). Each block's float32 sum is within 7 float32 units of
// its magnitudes. The accumulators start at -0.0, which keeps a sum of zeros' sign.
static constexpr int DL = 32, DR = 8;
static FSCAN_INLINE double dense_sum(const float* p, int64_t n) {
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
    int bad = 0;
    for (int l = 0; l < DL; ++l) {
      const bool finite = v[l] - v[l] == 0.0f;
      acc[l] = finite ? acc[l] + static_cast<double>(v[l]) : acc[l];
      bad |= !finite;
    }
    if (!bad) continue;
    for (int l = 0; l < DL; ++l)
      if (!(v[l] - v[l] == 0.0f))
        for (int j = 0; j < DR; ++j) acc[l] += static_cast<double>(q[DL * j + l]);
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

// Every lane's sum by dense_sum (SUM_F32, a lane's steps dense). The order of the steps
// does not matter to a sum, so reversed lanes are summed as forward ones. A lane is split
// into chunks only where the lanes are fewer than the threads, and its chunks' sums are
// added in double. (A template, and x's type a parameter, so that it is compiled only for a
// kernel that has SUM_F32.)
template <bool SUM = SUM_F32, typename I>
static void sum_chains(const I x, const Out z, const Geo& S, int nt) {
  if constexpr (!SUM) return;
  else {
    const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
    const int64_t C = lanes >= nt ? 1 : std::min<int64_t>((nt + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
    const int64_t L = (T + C - 1) / C;
    std::vector<double> tot(C > 1 ? lanes * C : 0);
    auto put = [&](int64_t o, int64_t i, double v) {
      Vals w;
      w.v0 = v;
      store_t(at(z, S, o, 0, i), 0, w);
    };
    fscan_team(nt, [&] {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < lanes * C; ++k) {
        // (Integer divisions cost about as much as a short lane's sum: skipped where they are by 1.)
        const int64_t lane = C == 1 ? k : k / C, c = C == 1 ? 0 : k % C;
        const int64_t o = inner == 1 ? lane : lane / inner, i = inner == 1 ? 0 : lane % inner;
        const double v = dense_sum(at(x, S, o, 0, i).x0.p + c * L, std::min(T, (c + 1) * L) - c * L);
        if (C == 1) put(o, i, v);
        else tot[k] = v;
      }
      if (C == 1) return;
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < lanes; ++lane) {
        double v = tot[lane * C];
        for (int64_t c = 1; c < C; ++c) v += tot[lane * C + c];
        put(lane / inner, lane % inner, v);
      }
    });
  }
}
