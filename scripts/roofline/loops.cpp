// Standalone loops for scripts/roofline.py: the floors under fscan's C++ kernel rows.
//
// Each loop does the least work a row of the speed bars needs, written the way the kernel
// writes it (same compiler flags, same helpers: csrc/prelude.h and csrc/logaddexp.h are
// included, not copied), so that the distance from a loop to a copy is what the hardware
// charges for that work, and the distance from fscan's row to the loop is the kernel's own.
// Every loop takes raw float32 pointers (row-major, dense) and writes into memory the
// caller preallocated: no allocation, no page faults inside the timing.
#include <pybind11/pybind11.h>

#include "prelude.h"
#include "logaddexp.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

enum Op { ADD = 0, MUL = 1, MAX = 2, AFFINE = 3, LAE = 4 };
// Running values: float32, double (as the kernel holds a rounding float32 combine), or
// double with the float32 range check the generated code applies to every product it
// reuses (fscan_range_f32; _cpp_codegen drops it where the value is only stored, so it
// survives in the affine pair's b-update only).
enum Acc { F32 = 0, F64 = 1, F64_RANGE = 2 };

constexpr int leaves(int op) { return op == AFFINE ? 2 : 1; }

template <typename A> constexpr A identity0(int op) {
  return op == ADD ? A(0) : (op == MAX || op == LAE) ? -std::numeric_limits<A>::infinity() : A(1);
}

// (l0, l1) <- (l0, l1) o (r0, r1), as the generated combine computes it.
template <int OP, typename A, bool RANGE>
static FSCAN_INLINE void comb(A& l0, A& l1, A r0, A r1) {
  if constexpr (OP == ADD) {
    l0 = l0 + r0;
  } else if constexpr (OP == MUL) {
    l0 = l0 * r0;
  } else if constexpr (OP == MAX) {
    l0 = fscan_max(l0, r0);
  } else if constexpr (OP == AFFINE) {
    A v2 = r0 * l1;
    if constexpr (RANGE) v2 = fscan_range_f32(v2);
    l1 = v2 + r1;
    l0 = l0 * r0;
  } else {
    if constexpr (sizeof(A) == 8) l0 = fscan_logaddexp_f32(l0, r0);
    else l0 = fscan_logaddexp(l0, r0);
  }
}

// The lane path's loop (csrc/forward_lanes.h, lane_run): rows [t0, t1) of (T, N), a vector
// loop along each row, the running values in acc (L1) between rows. fresh: row t0 starts
// them (else acc holds the carry). !WRITE: totals only (the reduce's loop, and a split
// column's middle chunks).
template <int OP, typename A, bool RANGE, bool WRITE>
static void lane_rows(const float* __restrict x0, const float* __restrict x1, float* __restrict y0,
                      float* __restrict y1, int64_t N, int64_t t0, int64_t t1, A* __restrict a0,
                      A* __restrict a1, bool fresh) {
  constexpr bool two = leaves(OP) == 2;
  int64_t t = t0;
  if (fresh && t < t1) {
#pragma GCC ivdep
    for (int64_t i = 0; i < N; ++i) {
      a0[i] = (A)x0[t * N + i];
      if constexpr (two) a1[i] = (A)x1[t * N + i];
      if constexpr (WRITE) {
        y0[t * N + i] = x0[t * N + i];
        if constexpr (two) y1[t * N + i] = x1[t * N + i];
      }
    }
    ++t;
  }
  for (; t < t1; ++t) {
    const float* xr0 = x0 + t * N;
    const float* xr1 = two ? x1 + t * N : nullptr;
    float* yr0 = WRITE ? y0 + t * N : nullptr;
    float* yr1 = WRITE && two ? y1 + t * N : nullptr;
#pragma GCC ivdep
    for (int64_t i = 0; i < N; ++i) {
      A l0 = a0[i], l1 = two ? a1[i] : A(0);
      comb<OP, A, RANGE>(l0, l1, (A)xr0[i], two ? (A)xr1[i] : A(0));
      a0[i] = l0;
      if constexpr (two) a1[i] = l1;
      if constexpr (WRITE) {
        yr0[i] = (float)l0;
        if constexpr (two) yr1[i] = (float)l1;
      }
    }
  }
}

template <int OP, typename A, bool RANGE>
static void lane_scan_t(uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t T, int64_t N,
                        bool write) {
  std::vector<A> a0(N), a1(N);
  auto X0 = (const float*)x0, X1 = (const float*)x1;
  auto Y0 = (float*)y0, Y1 = (float*)y1;
  if (write) lane_rows<OP, A, RANGE, true>(X0, X1, Y0, Y1, N, 0, T, a0.data(), a1.data(), true);
  else lane_rows<OP, A, RANGE, false>(X0, X1, Y0, Y1, N, 0, T, a0.data(), a1.data(), true);
  // The totals (write=False: the reduce) land in y's first row, as a reduce's output would.
  if (!write)
    for (int64_t i = 0; i < N; ++i) {
      Y0[i] = (float)a0[i];
      if (leaves(OP) == 2) Y1[i] = (float)a1[i];
    }
}

// Two threads on one column of T rows. halves: each thread scans its half from scratch
// (not a scan of the whole, only the ideal time: one thread's / 2). Else as lane_path
// splits it: C = 3 chunks; thread 0 scans chunk 0 (writing) while thread 1 totals
// chunk 1; the totals compose; then each scans one of chunks 1, 2 from its carry.
template <int OP, typename A, bool RANGE>
static void lane_two_t(uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t T, int64_t N,
                       bool halves) {
  auto X0 = (const float*)x0, X1 = (const float*)x1;
  auto Y0 = (float*)y0, Y1 = (float*)y1;
  std::vector<A> tot(4 * N);  // chunk c's total: leaf 0 at 2cN, leaf 1 at (2c+1)N
  if (halves) {
    const int64_t H = T / 2;
#pragma omp parallel for num_threads(2) schedule(static)
    for (int k = 0; k < 2; ++k)
      lane_rows<OP, A, RANGE, true>(X0, X1, Y0, Y1, N, k * H, k ? T : H, &tot[2 * k * N],
                                    &tot[(2 * k + 1) * N], true);
    return;
  }
  const int64_t L = (T + 2) / 3;
#pragma omp parallel num_threads(2)
  {
    std::vector<A> acc(2 * N);
#pragma omp for schedule(static)
    for (int k = 0; k < 2; ++k) {
      if (k == 0) lane_rows<OP, A, RANGE, true>(X0, X1, Y0, Y1, N, 0, L, &tot[0], &tot[N], true);
      else lane_rows<OP, A, RANGE, false>(X0, X1, Y0, Y1, N, L, 2 * L, &tot[2 * N], &tot[3 * N], true);
    }
#pragma omp single
    for (int64_t i = 0; i < N; ++i) {  // chunk 2's carry: total 0 o total 1
      A l0 = tot[i], l1 = tot[N + i];
      comb<OP, A, RANGE>(l0, l1, tot[2 * N + i], tot[3 * N + i]);
      tot[2 * N + i] = l0;
      tot[3 * N + i] = l1;
    }
#pragma omp for schedule(static)
    for (int c = 1; c < 3; ++c) {
      std::copy(&tot[2 * (c - 1) * N], &tot[2 * (c - 1) * N] + 2 * N, acc.begin());
      lane_rows<OP, A, RANGE, true>(X0, X1, Y0, Y1, N, c * L, std::min<int64_t>(T, (c + 1) * L),
                                    acc.data(), acc.data() + N, false);
    }
  }
}


// The chain path's work without its bookkeeping: N chains of L steps (the rows of a dense
// (N, L), N a multiple of CW and L of 16), CW chains side by side in blocks of FSCAN_TV;
// 16 steps of each block transposed in registers into a tile by the kernel's own
// fscan_tile_in (csrc/prelude.h: one 16 x 16 transpose on AVX-512, two 8 x 8 on AVX2), the
// tiles scanned, the outputs transposed back by fscan_tile_out. The scan as the kernel's
// tile_scan writes it: a block's chains are the vector loop, the 16 steps unrolled inside
// it, each chain's running value in a register across them, the CW / FSCAN_TV blocks
// independent for the core to overlap. MODE 0: the transposes alone (tile in, tile out, no
// scan); 1: the scan, from carry (N values per leaf) or from the identity; 2: totals only
// (no outputs) into tot.
constexpr int CW = 32;
constexpr int NB = CW / FSCAN_TV;
template <int OP, typename A, bool RANGE, int MODE>
static void chain_rows(const float* x0, const float* x1, float* y0, float* y1, int64_t N, int64_t L,
                       const A* carry, A* tot) {
#if FSCAN_TILES
  constexpr int NL = leaves(OP);
  constexpr bool two = NL == 2;
  alignas(64) float tin[NL][NB][16][FSCAN_TV];
  alignas(64) float tout[NL][NB][16][FSCAN_TV];
  alignas(64) A acc[NL][NB][FSCAN_TV];
  const float* xs[2] = {x0, x1};
  float* ys[2] = {y0, y1};
  for (int64_t g = 0; g + CW <= N; g += CW) {
    for (int b = 0; b < NB; ++b)
      for (int j = 0; j < FSCAN_TV; ++j) {
        const int64_t c = g + b * FSCAN_TV + j;
        acc[0][b][j] = carry ? carry[c] : identity0<A>(OP);
        if constexpr (two) acc[NL - 1][b][j] = carry ? carry[N + c] : A(0);
      }
    for (int64_t s = 0; s < L; s += 16) {
      for (int f = 0; f < NL; ++f)
        for (int b = 0; b < NB; ++b) {
          const float* src[FSCAN_TV];
          for (int j = 0; j < FSCAN_TV; ++j) src[j] = xs[f] + (g + b * FSCAN_TV + j) * L + s;
          fscan_tile_in(src, &tin[f][b][0][0], 0xffffu);
        }
      if constexpr (MODE == 0) {
        std::memcpy(tout, tin, sizeof(tin));
      } else {
        for (int b = 0; b < NB; ++b) {
#pragma GCC ivdep
          for (int j = 0; j < FSCAN_TV; ++j) {
            A l0 = acc[0][b][j], l1 = two ? acc[NL - 1][b][j] : A(0);
#pragma GCC unroll 16
            for (int k = 0; k < 16; ++k) {
              comb<OP, A, RANGE>(l0, l1, (A)tin[0][b][k][j], two ? (A)tin[NL - 1][b][k][j] : A(0));
              if constexpr (MODE == 1) {
                tout[0][b][k][j] = (float)l0;
                if constexpr (two) tout[NL - 1][b][k][j] = (float)l1;
              }
            }
            acc[0][b][j] = l0;
            if constexpr (two) acc[NL - 1][b][j] = l1;
          }
        }
      }
      if constexpr (MODE != 2)
        for (int f = 0; f < NL; ++f)
          for (int b = 0; b < NB; ++b) {
            float* dst[FSCAN_TV];
            for (int j = 0; j < FSCAN_TV; ++j) dst[j] = ys[f] + (g + b * FSCAN_TV + j) * L + s;
            fscan_tile_out(&tout[f][b][0][0], dst, 0xffffu);
          }
    }
    if constexpr (MODE == 2)
      for (int b = 0; b < NB; ++b)
        for (int j = 0; j < FSCAN_TV; ++j) {
          const int64_t c = g + b * FSCAN_TV + j;
          tot[c] = acc[0][b][j];
          if constexpr (two) tot[N + c] = acc[NL - 1][b][j];
        }
  }
#endif
}

#ifdef __AVX2__
// An add scan along contiguous steps without transposes: each vector of 8 steps is
// prefix-summed in registers (log2(8) shifts and adds, across the two 128-bit halves), then
// the row's running total added; the running total's own chain is one add per vector (the
// vector's total is broadcast off that chain), and R rows are interleaved to overlap those
// chains. DOUBLE: the 8 steps widened to two vectors of 4 doubles, prefixed and carried in
// double (fscan's float32 accumulation), rounded back on the store.
static FSCAN_INLINE __m256 prefix8(__m256 v) {
  v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_si256(_mm256_castps_si256(v), 4)));
  v = _mm256_add_ps(v, _mm256_castsi256_ps(_mm256_slli_si256(_mm256_castps_si256(v), 8)));
  const __m256 low_total = _mm256_permute_ps(v, 0xFF);  // each half's last, in its half
  return _mm256_add_ps(v, _mm256_permute2f128_ps(low_total, low_total, 0x08));  // lo: 0, hi: lo's
}
static FSCAN_INLINE __m256d prefix4(__m256d v) {
  v = _mm256_add_pd(v, _mm256_blend_pd(_mm256_permute4x64_pd(v, 0x90), _mm256_setzero_pd(), 0x1));
  return _mm256_add_pd(v, _mm256_permute2f128_pd(v, v, 0x08));
}
template <bool DOUBLE, int R>
static void prefix_rows(const float* x, float* y, int64_t rows, int64_t L, const double* carry) {
  for (int64_t g = 0; g < rows; g += R) {
    __m256 cf[R];
    __m256d cd[R];
    for (int r = 0; r < R; ++r) {
      const double c = carry ? carry[g + r] : 0.0;
      cf[r] = _mm256_set1_ps((float)c);
      cd[r] = _mm256_set1_pd(c);
    }
    for (int64_t s = 0; s < L; s += 8) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 v = _mm256_loadu_ps(x + (g + r) * L + s);
        if constexpr (DOUBLE) {
          const __m256d lo = prefix4(_mm256_cvtps_pd(_mm256_castps256_ps128(v)));
          const __m256d hi = prefix4(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
          const __m256d lo_out = _mm256_add_pd(lo, cd[r]);
          const __m256d lo_total = _mm256_permute4x64_pd(lo, 0xFF);
          const __m256d hi_out = _mm256_add_pd(hi, _mm256_add_pd(cd[r], lo_total));
          cd[r] = _mm256_add_pd(cd[r], _mm256_add_pd(lo_total, _mm256_permute4x64_pd(hi, 0xFF)));
          _mm256_storeu_ps(y + (g + r) * L + s,
                           _mm256_set_m128(_mm256_cvtpd_ps(hi_out), _mm256_cvtpd_ps(lo_out)));
        } else {
          const __m256 p = prefix8(v);
          _mm256_storeu_ps(y + (g + r) * L + s, _mm256_add_ps(p, cf[r]));
          const __m256 last = _mm256_permute_ps(_mm256_permute2f128_ps(p, p, 0x11), 0xFF);
          cf[r] = _mm256_add_ps(cf[r], last);
        }
      }
    }
  }
}
#endif

// A max scan along contiguous steps, a row at a time (as the kernel's prefix chains,
// csrc/forward_prefix.h): each vector of 8 steps scanned in registers (k = 1, 2 by in-lane
// shuffles, then the low half's last into the high half; steps with none k earlier are
// maxed with themselves, which leaves them as they are), then maxed with the running
// value, whose own chain is one max a vector. CHECKED: torch.maximum's NaN rule as the
// kernel keeps it, a compare of each pair of vectors for NaN (never found here: the loop
// is the kernel's NaN-free path); else bare vmaxps (no NaN rule). L: a multiple of 16.
static FSCAN_INLINE void prefix_max8(const float* x, float* y, __m256& c) {
  const __m256i h = _mm256_setr_epi32(0, 1, 2, 3, 3, 3, 3, 3), last = _mm256_set1_epi32(7);
  __m256 v = _mm256_loadu_ps(x);
  v = _mm256_max_ps(_mm256_permute_ps(v, 0x90), v);
  v = _mm256_max_ps(_mm256_permute_ps(v, 0x44), v);
  v = _mm256_max_ps(_mm256_permutevar8x32_ps(v, h), v);
  _mm256_storeu_ps(y, _mm256_max_ps(c, v));
  c = _mm256_max_ps(c, _mm256_permutevar8x32_ps(v, last));
}
template <bool CHECKED>
static void prefix_max_rows(const float* x, float* y, int64_t rows, int64_t L) {
  for (int64_t g = 0; g < rows; ++g) {
    const float* xr = x + g * L;
    float* yr = y + g * L;
    __m256 c = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t s = 0; s < L; s += 16) {
      if (CHECKED) {
        const __m256 nan = _mm256_cmp_ps(_mm256_loadu_ps(xr + s), _mm256_loadu_ps(xr + s + 8), _CMP_UNORD_Q);
        if (!_mm256_testz_ps(nan, nan)) __builtin_trap();
      }
      prefix_max8(xr + s, yr + s, c);
      prefix_max8(xr + s + 8, yr + s + 8, c);
    }
  }
}

// rows x L (rows a multiple of 4, L of 8), each row scanned (mode 1), or one row of
// rows * L steps cut into `rows` segments (mode 2): their totals first (a read: sums of 4
// partial vectors in double), their carries in order, then the prefix pass from them.
template <bool DOUBLE>
static void prefix_scan_t(uintptr_t x0, uintptr_t y0, int64_t rows, int64_t L, int mode) {
#ifdef __AVX2__
  auto X = (const float*)x0;
  auto Y = (float*)y0;
  if (mode == 1) return prefix_rows<DOUBLE, 4>(X, Y, rows, L, nullptr);
  std::vector<double> carry(rows);
  double run = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    const float* xr = X + r * L;
    for (int64_t s = 0; s < L; s += 16) {
      const __m256 a = _mm256_loadu_ps(xr + s), b = _mm256_loadu_ps(xr + s + 8);
      acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
      acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
      acc[2] = _mm256_add_pd(acc[2], _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
      acc[3] = _mm256_add_pd(acc[3], _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
    }
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(_mm256_add_pd(acc[0], acc[1]), _mm256_add_pd(acc[2], acc[3])));
    carry[r] = run;
    run += t[0] + t[1] + t[2] + t[3];
  }
  prefix_rows<DOUBLE, 4>(X, Y, rows, L, carry.data());
#endif
}

// A dim scanned as chains: (N, L) last dim (pass 1: mode 0 or 1), or one long row cut into
// N chains of L steps (passes 2: totals of every chain, their carries composed in order,
// then the scan from the carries), as a 1-D scan on the chain path does.
template <int OP, typename A, bool RANGE>
static void chain_scan_t(uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t N, int64_t L,
                         int mode) {
  auto X0 = (const float*)x0, X1 = (const float*)x1;
  auto Y0 = (float*)y0, Y1 = (float*)y1;
  if (mode == 0) return chain_rows<OP, A, RANGE, 0>(X0, X1, Y0, Y1, N, L, nullptr, nullptr);
  if (mode == 1) return chain_rows<OP, A, RANGE, 1>(X0, X1, Y0, Y1, N, L, nullptr, nullptr);
  std::vector<A> tot(2 * N), carry(2 * N);
  chain_rows<OP, A, RANGE, 2>(X0, X1, Y0, Y1, N, L, nullptr, tot.data());
  A l0 = identity0<A>(OP), l1 = A(0);
  for (int64_t c = 0; c < N; ++c) {
    carry[c] = l0;
    carry[N + c] = l1;
    comb<OP, A, RANGE>(l0, l1, tot[c], tot[N + c]);
  }
  chain_rows<OP, A, RANGE, 1>(X0, X1, Y0, Y1, N, L, carry.data(), nullptr);
}

// The segmented lane loop (csrc/segmented.h, seg_lane_run with a flag per lane): as
// lane_rows, each lane restarting at its element where its flag byte is set (a mask of
// x's shape, f), one leaf. flags=false: the same loop without them (the inclusive scan).
template <int OP, typename A, bool FLAGS>
static void seg_lane_rows(const float* __restrict x, const uint8_t* __restrict f, float* __restrict y,
                          int64_t T, int64_t N, A* __restrict a) {
#pragma GCC ivdep
  for (int64_t i = 0; i < N; ++i) {
    a[i] = (A)x[i];
    y[i] = x[i];
  }
  for (int64_t t = 1; t < T; ++t) {
    const float* xr = x + t * N;
    const uint8_t* fr = f + t * N;
    float* yr = y + t * N;
#pragma GCC ivdep
    for (int64_t i = 0; i < N; ++i) {
      A l = a[i], no_second_leaf = A(0);
      const A u = (A)xr[i];
      comb<OP, A, false>(l, no_second_leaf, u, A(0));
      if constexpr (FLAGS) l = fr[i] != 0 ? u : l;
      a[i] = l;
      yr[i] = (float)l;
    }
  }
}
// op: ADD or MUL (cumsum's and cumprod's rows), double running values.
static void seg_lane_scan(int op, bool flags, uintptr_t x, uintptr_t f, uintptr_t y, int64_t T, int64_t N) {
  if (op != ADD && op != MUL) throw std::invalid_argument("seg_lane_scan: op must be ADD or MUL");
  std::vector<double> a(N);
  auto X = (const float*)x;
  auto F = (const uint8_t*)f;
  auto Y = (float*)y;
  if (op == MUL) {
    if (flags) seg_lane_rows<MUL, double, true>(X, F, Y, T, N, a.data());
    else seg_lane_rows<MUL, double, false>(X, F, Y, T, N, a.data());
  } else {
    if (flags) seg_lane_rows<ADD, double, true>(X, F, Y, T, N, a.data());
    else seg_lane_rows<ADD, double, false>(X, F, Y, T, N, a.data());
  }
}
// The memory a segmented row moves and nothing else: x and its flags read, y written
// (y = x where flagged, else -x).
static void select_loop(uintptr_t dst, uintptr_t src, uintptr_t flags, int64_t n) {
  auto d = (float*)dst;
  auto s = (const float*)src;
  auto f = (const uint8_t*)flags;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) d[i] = f[i] != 0 ? s[i] : -s[i];
}

static void copy_loop(uintptr_t dst, uintptr_t src, int64_t n) {
  auto d = (float*)dst;
  auto s = (const float*)src;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) d[i] = s[i];
}

// One fscan_log1p_exp, or one whole float32 logaddexp, per element.
static void log1p_exp_loop(uintptr_t dst, uintptr_t src, int64_t n) {
  auto d = (float*)dst;
  auto s = (const float*)src;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) d[i] = fscan_log1p_exp(-std::fabs(s[i]));
}
static void logaddexp_loop(uintptr_t dst, uintptr_t a, uintptr_t b, int64_t n) {
  auto d = (float*)dst;
  auto x = (const float*)a, y = (const float*)b;
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) d[i] = fscan_logaddexp(x[i], y[i]);
}

// Run-time (op, acc) to the template instance.
template <template <int, typename, bool> class F, typename... Args>
static void dispatch(int op, int acc, Args... args) {
#define FSCAN_ROOF_CASE(O)                                             \
  case O:                                                              \
    if (acc == F32) return F<O, float, false>::run(args...);           \
    if (acc == F64) return F<O, double, false>::run(args...);          \
    return F<O, double, true>::run(args...);
  switch (op) {
    FSCAN_ROOF_CASE(ADD)
    FSCAN_ROOF_CASE(MUL)
    FSCAN_ROOF_CASE(MAX)
    FSCAN_ROOF_CASE(AFFINE)
    FSCAN_ROOF_CASE(LAE)
  }
#undef FSCAN_ROOF_CASE
}
template <int O, typename A, bool R> struct LaneScan {
  static void run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int64_t T, int64_t N, bool w) {
    lane_scan_t<O, A, R>(a, b, c, d, T, N, w);
  }
};
template <int O, typename A, bool R> struct LaneTwo {
  static void run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int64_t T, int64_t N, bool h) {
    lane_two_t<O, A, R>(a, b, c, d, T, N, h);
  }
};
template <int O, typename A, bool R> struct ChainScan {
  static void run(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, int64_t N, int64_t L, int m) {
    chain_scan_t<O, A, R>(a, b, c, d, N, L, m);
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("lane_scan", [](int op, int acc, uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t T,
                        int64_t N, bool write) {
    py::gil_scoped_release nogil;
    dispatch<LaneScan>(op, acc, x0, x1, y0, y1, T, N, write);
  });
  m.def("lane_two", [](int op, int acc, uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t T,
                       int64_t N, bool halves) {
    py::gil_scoped_release nogil;
    dispatch<LaneTwo>(op, acc, x0, x1, y0, y1, T, N, halves);
  });
  m.def("chain_scan", [](int op, int acc, uintptr_t x0, uintptr_t x1, uintptr_t y0, uintptr_t y1, int64_t N,
                         int64_t L, int mode) {
    py::gil_scoped_release nogil;
    dispatch<ChainScan>(op, acc, x0, x1, y0, y1, N, L, mode);
  });
  m.def("prefix_add", [](bool dbl, uintptr_t x0, uintptr_t y0, int64_t rows, int64_t L, int mode) {
    py::gil_scoped_release nogil;
    if (dbl) prefix_scan_t<true>(x0, y0, rows, L, mode);
    else prefix_scan_t<false>(x0, y0, rows, L, mode);
  });
  m.def("prefix_max", [](bool checked, uintptr_t x0, uintptr_t y0, int64_t rows, int64_t L) {
    py::gil_scoped_release nogil;
#ifdef __AVX2__
    if (checked) prefix_max_rows<true>((const float*)x0, (float*)y0, rows, L);
    else prefix_max_rows<false>((const float*)x0, (float*)y0, rows, L);
#endif
  });
  m.def("seg_lane_scan", [](int op, bool flags, uintptr_t x, uintptr_t f, uintptr_t y, int64_t T, int64_t N) {
    py::gil_scoped_release nogil;
    seg_lane_scan(op, flags, x, f, y, T, N);
  });
  m.def("select", &select_loop);
  m.def("copy", &copy_loop);
  m.def("log1p_exp", &log1p_exp_loop);
  m.def("logaddexp", &logaddexp_loop);
#if FSCAN_TILES
  m.attr("tiles") = FSCAN_TV == 16 ? "the kernel's (prelude.h): 16 x 16, AVX-512" : "the kernel's (prelude.h): two 8 x 8, AVX2";
#else
  m.attr("tiles") = "none (no AVX2): the chain loops do nothing";
#endif
}
