// The start of every kernel: includes, the ops as torch computes them, and the strided
// pointers (Ptr), lane loops and float rounding helpers the kernels are written with.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>
#include <omp.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>  // the tiles' intrinsics below (AVX2, AVX-512): here to be precompiled
#endif
// FSCAN_PCH_END: the lines above are system includes only, precompiled once per cache dir
// with Inductor's binding's includes (_cpp_pch.py); fscan's own code starts below.

#define FSCAN_INLINE __attribute__((always_inline)) inline

// body() on a team of nt threads (its `omp for` loops shared between them), or where nt
// is 1 on the calling thread alone, no team: GOMP_parallel costs 1.3-2 us of CPU a call
// even for a team of one (futex calls), most of a (64,) add's 1.6-2.3 us kernel call;
// outside a parallel region the loops' `omp for` run serially, as OpenMP specifies.
// (Inside one, an orphaned `omp for` would share its loop with the enclosing team: a
// team of its own then, as before.)
template <typename F> static FSCAN_INLINE void fscan_team(int nt, F&& body) {
  if (nt > 1 || omp_in_parallel()) {
#pragma omp parallel num_threads(nt)
    body();
  } else {
    body();
  }
}

// The chain path's tiles (forward_chains.h): TB = 16 steps of FSCAN_TV float32 chains,
// transposed in registers. AVX-512: 16 chains, one 16 x 16 transpose; AVX2: 8 chains, two
// 8 x 8 transposes (steps 0-7, then 8-15); elsewhere chains are walked, not tiled.
#ifdef __AVX512F__
#include <immintrin.h>
#define FSCAN_TILES true
#define FSCAN_TV 16
static FSCAN_INLINE void fscan_transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) { t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)); r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d)); r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4q + m]: rows 4q..4q+3 of columns 4b + m, b the 128-bit block.
  for (int q = 0; q < 4; q += 2)
    for (int m = 0; m < 4; ++m) {
      t[4 * q + m] = _mm512_shuffle_f32x4(r[4 * q + m], r[4 * q + 4 + m], 0x88);
      t[4 * q + 4 + m] = _mm512_shuffle_f32x4(r[4 * q + m], r[4 * q + 4 + m], 0xdd);
    }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_f32x4(t[m], t[8 + m], 0xdd);
    r[4 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(t[4 + m], t[12 + m], 0xdd);
  }
}
// dst[j * 16 + g] = src[g][j]; and back: dst[g][j] = src[j * 16 + g]. Only the rows j
// whose bit is set in m are read (the others come in as 0) or written: a tile of fewer
// steps than 16 (the chain path's last partial tile) reads and writes no element beyond
// its chains' steps (masked lanes do not fault). A whole tile (m all ones, a constant
// where it is called) keeps its plain loads and stores.
static FSCAN_INLINE void fscan_tile_in(const float* const* src, float* dst, unsigned m) {
  __m512 r[16];
  if (m == 0xffffu)
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i]);
  else
    for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps((__mmask16)m, src[i]);
  fscan_transpose16(r);
  for (int i = 0; i < 16; ++i) _mm512_store_ps(dst + 16 * i, r[i]);
}
static FSCAN_INLINE void fscan_tile_out(const float* src, float* const* dst, unsigned m) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(src + 16 * i);
  fscan_transpose16(r);
  if (m == 0xffffu)
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst[i], r[i]);
  else
    for (int i = 0; i < 16; ++i) _mm512_mask_storeu_ps(dst[i], (__mmask16)m, r[i]);
}
// An 8 x 8 block of int64: r[i] (row i) becomes column i (24 shuffles: pairs of rows
// unpacked, then 128-bit lanes picked twice).
static FSCAN_INLINE void fscan_transpose8x64(__m512i* r) {
  __m512i t[8], u[8];
  for (int i = 0; i < 8; i += 2) { t[i] = _mm512_unpacklo_epi64(r[i], r[i + 1]); t[i + 1] = _mm512_unpackhi_epi64(r[i], r[i + 1]); }
  // u[h + c] (h = 0, 4): column c in 128-bit lanes 0 and 2, column c + 4 in 1 and 3, of rows h..h+3.
  for (int h = 0; h < 8; h += 4)
    for (int c = 0; c < 2; ++c) {
      u[h + c] = _mm512_shuffle_i64x2(t[h + c], t[h + c + 2], 0x88);
      u[h + c + 2] = _mm512_shuffle_i64x2(t[h + c], t[h + c + 2], 0xdd);
    }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i64x2(u[c], u[c + 4], 0x88);
    r[c + 4] = _mm512_shuffle_i64x2(u[c], u[c + 4], 0xdd);
  }
}
// fscan_tile_out for an int64 leaf (cummax/cummin's indices): dst[g][j] = src[j * 16 + g]
// for the rows j set in m, as four 8 x 8 blocks (chains 8c.., steps 8h..).
static FSCAN_INLINE void fscan_tile_out_i64(const int64_t* src, int64_t* const* dst, unsigned m) {
  for (int h = 0; h < 2; ++h) {
    const __mmask8 mh = (__mmask8)((m >> (8 * h)) & 0xffu);
    if (mh == 0) continue;
    for (int c = 0; c < 2; ++c) {
      __m512i r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm512_load_si512(src + 16 * (8 * h + i) + 8 * c);
      fscan_transpose8x64(r);
      if (mh == 0xffu)
        for (int i = 0; i < 8; ++i) _mm512_storeu_si512(dst[8 * c + i] + 8 * h, r[i]);
      else
        for (int i = 0; i < 8; ++i) _mm512_mask_storeu_epi64(dst[8 * c + i] + 8 * h, mh, r[i]);
    }
  }
}
#elif defined(__AVX2__)
#include <immintrin.h>
#define FSCAN_TILES true
#define FSCAN_TV 8
// r[i] (row i) becomes column i: unpack pairs of rows, shuffle pairs of pairs, then swap
// 128-bit halves (24 shuffles per 64 elements).
static FSCAN_INLINE void fscan_transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) { t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); }
  // u[4q + c]: columns c (low half) and c + 4 (high half) of rows 4q..4q+3.
  for (int q = 0; q < 8; q += 4) {
    u[q] = _mm256_shuffle_ps(t[q], t[q + 2], 0x44);
    u[q + 1] = _mm256_shuffle_ps(t[q], t[q + 2], 0xee);
    u[q + 2] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0x44);
    u[q + 3] = _mm256_shuffle_ps(t[q + 1], t[q + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}
// The lanes of 8 steps whose bits are set in m (bit i: step i), as a vector mask.
static FSCAN_INLINE __m256i fscan_mask8(unsigned m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bits), bits);
}
// As the AVX-512 pair below, for 8 chains of 16 steps: dst[j * 8 + g] = src[g][j], in two
// halves of 8 steps. Masked loads and stores (vmaskmovps) touch no element whose bit is
// clear, so a partial tile reads and writes only its chains' steps; a half with no step
// set is skipped, its rows left as they were (never read: see tile_step).
static FSCAN_INLINE void fscan_tile_in(const float* const* src, float* dst, unsigned m) {
  for (int h = 0; h < 2; ++h) {
    const unsigned mh = (m >> (8 * h)) & 0xffu;
    if (mh == 0) continue;
    __m256 r[8];
    if (mh == 0xffu)
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src[i] + 8 * h);
    else {
      const __m256i k = fscan_mask8(mh);
      for (int i = 0; i < 8; ++i) r[i] = _mm256_maskload_ps(src[i] + 8 * h, k);
    }
    fscan_transpose8(r);
    for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + 8 * (8 * h + i), r[i]);
  }
}
static FSCAN_INLINE void fscan_tile_out(const float* src, float* const* dst, unsigned m) {
  for (int h = 0; h < 2; ++h) {
    const unsigned mh = (m >> (8 * h)) & 0xffu;
    if (mh == 0) continue;
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(src + 8 * (8 * h + i));
    fscan_transpose8(r);
    if (mh == 0xffu)
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst[i] + 8 * h, r[i]);
    else {
      const __m256i k = fscan_mask8(mh);
      for (int i = 0; i < 8; ++i) _mm256_maskstore_ps(dst[i] + 8 * h, k, r[i]);
    }
  }
}
// fscan_tile_out for an int64 leaf: dst[g][j] = src[j * 8 + g] for the rows j set in m,
// as 4 x 4 blocks (chains 4c.., steps 4q..): pairs of rows unpacked, 128-bit halves swapped.
static FSCAN_INLINE void fscan_tile_out_i64(const int64_t* src, int64_t* const* dst, unsigned m) {
  const __m256i bits = _mm256_setr_epi64x(1, 2, 4, 8);
  for (int q = 0; q < 4; ++q) {
    const unsigned mq = (m >> (4 * q)) & 0xfu;
    if (mq == 0) continue;
    const __m256i k = _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(mq), bits), bits);
    for (int c = 0; c < 2; ++c) {
      __m256i r[4], t[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(src + 8 * (4 * q + i) + 4 * c));
      t[0] = _mm256_unpacklo_epi64(r[0], r[1]); t[1] = _mm256_unpackhi_epi64(r[0], r[1]);
      t[2] = _mm256_unpacklo_epi64(r[2], r[3]); t[3] = _mm256_unpackhi_epi64(r[2], r[3]);
      r[0] = _mm256_permute2x128_si256(t[0], t[2], 0x20); r[2] = _mm256_permute2x128_si256(t[0], t[2], 0x31);
      r[1] = _mm256_permute2x128_si256(t[1], t[3], 0x20); r[3] = _mm256_permute2x128_si256(t[1], t[3], 0x31);
      for (int i = 0; i < 4; ++i) {
        long long* d = reinterpret_cast<long long*>(dst[4 * c + i] + 4 * q);
        if (mq == 0xfu) _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), r[i]);
        else _mm256_maskstore_epi64(d, k, r[i]);
      }
    }
  }
}
#else
#define FSCAN_TILES false
#define FSCAN_TV 16
static FSCAN_INLINE void fscan_tile_in(const float* const*, float*, unsigned) {}
static FSCAN_INLINE void fscan_tile_out(const float*, float* const*, unsigned) {}
static FSCAN_INLINE void fscan_tile_out_i64(const int64_t*, int64_t* const*, unsigned) {}
#endif
// A tile's rows where its chains' steps are not dense: copied in and out, not transposed,
// where the chains lie side by side (row j at src + j * st, TV adjacent elements: a
// transposed input scanned into torch's contiguous outputs, or the reverse; see
// tile_rows_fit), else gathered an element at a time (chain g's step at row 0 at
// src[g]). Rows outside m are read as 0 and not written, as fscan_tile_in and
// fscan_tile_out do.
template <int TV_, int TB_, typename T>
static FSCAN_INLINE void fscan_rows_in(const T* src, int64_t st, T* dst, unsigned m) {
  for (int j = 0; j < TB_; ++j) {
    if ((m >> j) & 1u) {
#pragma GCC unroll 16
      for (int g = 0; g < TV_; ++g) dst[j * TV_ + g] = src[j * st + g];
    } else {
#pragma GCC unroll 16
      for (int g = 0; g < TV_; ++g) dst[j * TV_ + g] = T(0);
    }
  }
}
template <int TV_, int TB_, typename T>
static FSCAN_INLINE void fscan_rows_out(const T* src, T* dst, int64_t st, unsigned m) {
  for (int j = 0; j < TB_; ++j) {
    if (!((m >> j) & 1u)) continue;
#pragma GCC unroll 16
    for (int g = 0; g < TV_; ++g) dst[j * st + g] = src[j * TV_ + g];
  }
}
template <int TV_, typename P>
static FSCAN_INLINE bool fscan_side_by_side(P* const* p) {
  bool side = true;
  for (int g = 1; g < TV_; ++g) side &= p[g] == p[0] + g;
  return side;
}
template <int TV_, int TB_, typename T>
__attribute__((noinline)) static void fscan_gather_in(const T* const* src, int64_t st, T* dst, unsigned m) {
  for (int j = 0; j < TB_; ++j)
    for (int g = 0; g < TV_; ++g) dst[j * TV_ + g] = (m >> j) & 1u ? src[g][j * st] : T(0);
}
template <int TV_, int TB_, typename T>
__attribute__((noinline)) static void fscan_scatter_out(const T* src, T* const* dst, int64_t st, unsigned m) {
  for (int j = 0; j < TB_; ++j) {
    if (!((m >> j) & 1u)) continue;
    for (int g = 0; g < TV_; ++g) dst[g][j * st] = src[j * TV_ + g];
  }
}

// The ops below as torch computes them (tests/test_cpu_kernel_ops.py checks each against
// eager torch on every dtype, special values included).
// torch.maximum/minimum: NaN wins from either side.
template <typename T> static FSCAN_INLINE T fscan_max(T a, T b) { if (a != a) return a; return a > b ? a : b; }
template <typename T> static FSCAN_INLINE T fscan_min(T a, T b) { if (a != a) return a; return a < b ? a : b; }
// torch.fmax/fmin: NaN loses; integers compare as themselves (std::fmax would go through
// double, which rounds int64 beyond 2**53).
template <typename T> static FSCAN_INLINE T fscan_fmax(T a, T b) { return fscan_max(a, b); }
template <typename T> static FSCAN_INLINE T fscan_fmin(T a, T b) { return fscan_min(a, b); }
static FSCAN_INLINE float fscan_fmax(float a, float b) { return std::fmax(a, b); }
static FSCAN_INLINE double fscan_fmax(double a, double b) { return std::fmax(a, b); }
static FSCAN_INLINE float fscan_fmin(float a, float b) { return std::fmin(a, b); }
static FSCAN_INLINE double fscan_fmin(double a, double b) { return std::fmin(a, b); }
// torch.clamp's bounds: x where it ties (clamp(-0.0, 0) is -0.0), NaN from x or the bound.
template <typename T> static FSCAN_INLINE T fscan_clamp_lo(T x, T lo) { if (lo != lo) return lo; return x < lo ? lo : x; }
template <typename T> static FSCAN_INLINE T fscan_clamp_hi(T x, T hi) { if (hi != hi) return hi; return x > hi ? hi : x; }
template <typename T> static FSCAN_INLINE T fscan_relu(T a) { return a < T(0) ? T(0) : a; }  // relu(-0.0) is -0.0
// torch.sign: 0 for NaN and for -0.0.
template <typename T> static FSCAN_INLINE T fscan_sign(T a) { return (T)((T(0) < a) - (a < T(0))); }
template <typename T> static FSCAN_INLINE T fscan_abs(T a) { return a < T(0) ? -a : a; }
// torch's integer pow: products that wrap; a negative exponent gives 1 / a truncated.
template <typename T> static FSCAN_INLINE T fscan_powi(T a, T b) {
  if (b < T(0)) return a == T(1) ? T(1) : (a == T(-1) ? ((-b) % 2 ? T(-1) : T(1)) : T(0));
  T r = 1;
  while (b) { if (b & 1) r = (T)(r * a); b = (T)(b / 2); a = (T)(a * a); }
  return r;
}
static FSCAN_INLINE bool fscan_abs(bool a) { return a; }
static FSCAN_INLINE float fscan_abs(float a) { return std::fabs(a); }
static FSCAN_INLINE double fscan_abs(double a) { return std::fabs(a); }
// f(i) for the lanes i in [0, w), vectorised. The lane paths walk rows of lanes; where
// they walk the rows backwards in memory (reverse scans, the backward pass), the lanes of
// a row go in descending blocks of B too (a cache line of the narrowest leaf, at least
// 16 lanes), so that memory is read in a descending stream: ascending rows read
// backwards ran 3x slower than forwards (the hardware prefetcher follows each row up,
// into the row already read); this way, 1.1x (float32: blocks of 16, 32 or 64 lanes
// alike; 128 lanes 2.3x again). Every whole block is a loop of exactly B lanes, one
// vector iteration: a block of a trip count known only at run time got its own vector
// set-up (peeling checks, the combine's constants broadcast again) every 16 lanes, which
// cost as much as the block's work (1 thread, float32, reversed over (4096, 256) dim 0:
// add 1.8x a copy, now 1.1x; the affine pair 3.6x, now 1.9x). `unroll 1`: GCC unrolled
// the 16 iterations before vectorising and left add's scalar (4.6x a copy).
template <int64_t B, typename F> static FSCAN_INLINE void fscan_lanes(int64_t w, bool down, F&& f) {
  if (!down) {
#pragma GCC ivdep
    for (int64_t i = 0; i < w; ++i) f(i);
    return;
  }
  int64_t hi = w;
  for (; hi >= B; hi -= B) {
#pragma GCC ivdep
#pragma GCC unroll 1
    for (int64_t j = 0; j < B; ++j) f(hi - B + j);
  }
#pragma GCC ivdep
  for (int64_t i = 0; i < hi; ++i) f(i);
}
// A leaf in memory: its data and the strides (in elements) of the (outer, T, inner) view,
// outer split in two dims (o / nb, o % nb) so that a permuted (B, C, T) view of (B, T, C)
// data needs no copy. Inputs come with their own strides (views: transposes, step slices,
// stride-0 broadcasts); outputs too (fresh and dense, or a caller's views of its memory).
template <typename P> struct Ptr { P* p; int64_t sa, sb, st, si; };
// Where a lane (o, i) is at step t.
template <typename P> static FSCAN_INLINE Ptr<P> shift(Ptr<P> q, int64_t o, int64_t nb, int64_t t, int64_t i) {
  q.p += (nb == 1 ? o * q.sa : (o / nb) * q.sa + (o % nb) * q.sb) + t * q.st + i * q.si; return q; }
template <typename P> static FSCAN_INLINE Ptr<P> row(Ptr<P> q, int64_t t) { q.p += t * q.st; return q; }
// Lane i of a row (U: unit inner stride, the contiguous case, kept a plain vector load);
// step t of a lane.
template <bool U, typename P> static FSCAN_INLINE P& lane(const Ptr<P>& q, int64_t i) { return q.p[U ? i : i * q.si]; }
template <typename P> static FSCAN_INLINE P& step(const Ptr<P>& q, int64_t t) { return q.p[t * q.st]; }
template <typename P> static FSCAN_INLINE Ptr<P> dense(P* p, int64_t nb, int64_t T, int64_t inner) {
  return Ptr<P>{p, nb * T * inner, T * inner, inner, 1}; }
template <typename P> static FSCAN_INLINE int64_t mag(const Ptr<P>& q, bool t) { const int64_t s = t ? q.st : q.si; return s < 0 ? -s : s; }
// The shape of the scan: outer lanes (in two dims of nb inner ones), T steps, inner lanes.
struct Geo { int64_t outer, nb, T, inner; };
// bfloat16 stored as its bits; rounding to nearest even as torch does.
static FSCAN_INLINE float fscan_bf16_load(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
static FSCAN_INLINE uint16_t fscan_bf16_store(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
// float16 stored as its bits, converted as c10::Half converts (fp16_ieee_to_fp32_value and
// fp16_ieee_from_fp32_value: rounding to nearest even, NaN as 0x7E00 with its sign), in
// integer and float operations the loop vectoriser packs: GCC 12 converts _Float16 one
// element at a time (vcvtph2ps on a scalar), which kept every float16 loop scalar (cumsum
// over (4096, 256) dim 0: 790 us against bfloat16's 167).
// A float32's bits and back (also logaddexp.h's exp scaling).
static FSCAN_INLINE float fscan_bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static FSCAN_INLINE uint32_t fscan_f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static FSCAN_INLINE float fscan_f16_load(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = fscan_bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f;
  const float denormalized = fscan_bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? fscan_f32_bits(denormalized) : fscan_f32_bits(normalized);
  return fscan_bits_f32(sign | bits);
}
static FSCAN_INLINE uint16_t fscan_f16_store(float f) {
  const uint32_t w = fscan_f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  float base = (std::fabs(f) * 0x1p112f) * 0x1p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = fscan_bits_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = fscan_f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
// The same conversions for a walk a step at a time (load_t, store_t): one instruction each
// where the target has F16C (AVX-512F implies it; with plain AVX2 GCC calls libgcc), the
// bit arithmetic above costing more there than it saves (cumsum reversed over (4096, 256)
// dim 1, a chain walk: 1114 us -> 3713 with it).
static FSCAN_INLINE float fscan_f16_walk(uint16_t h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
// (A NaN keeps its payload here, quieted, as torch's vectorised conversions keep it; the
// bit arithmetic gives c10's scalar 0x7E00.)
static FSCAN_INLINE uint16_t fscan_f16_put(float x) { const _Float16 f = (_Float16)x; uint16_t h; std::memcpy(&h, &f, 2); return h; }
// A value rounded to a narrower float type and held in the wider one: what an eager op of
// that dtype returns (the translator rounds what discrete ops read: comparisons, floor...).
static FSCAN_INLINE double fscan_round_f32(double x) { return (double)(float)x; }
static FSCAN_INLINE float fscan_round_f16(float x) { return fscan_f16_load(fscan_f16_store(x)); }
static FSCAN_INLINE float fscan_round_bf16(float x) { return fscan_bf16_load(fscan_bf16_store(x)); }
// A value brought into a narrower float type's range, its precision kept: +-inf where
// rounding to that type overflows (from its largest finite value plus half an ulp, a
// tie that rounds to even: inf), +-0 where it underflows (to half its least subnormal).
template <typename T> static FSCAN_INLINE T fscan_range(T x, T over, T under) {
  const T m = std::fabs(x);
  return m >= over ? std::copysign(std::numeric_limits<T>::infinity(), x) : (m <= under ? std::copysign(T(0), x) : x);
}
// A float32 running value held in double, flushed to 0 below double's normal range
// (2**-1022, which rounds to float32 0): a product of float32 gates above 0.5 runs on
// into double's subnormals and stays at the least one (2**-1074 times a gate rounds back
// up to it), and every later step paid the CPU's slow path for subnormal operands,
// about 50x. Above 2**-1022 the value is kept as computed, beyond float32's range
// too, as torch.cumprod/cumsum accumulate float32 in double; only a value that had
// sunk below 2**-1022 and grew back past 2**-150 (by factors over 2**872) would differ.
static FSCAN_INLINE double fscan_flush_f32(double x) { return std::fabs(x) < 0x1p-1022 ? std::copysign(0.0, x) : x; }
// float32's range as a value held in double: from FSCAN_F32_OVER it rounds to inf, up to
// FSCAN_F32_UNDER to zero (fscan_range_f32, and the watch's bounds in fscan_watched).
static constexpr double FSCAN_F32_OVER = 0x1.ffffffp127, FSCAN_F32_UNDER = 0x1p-150;
static FSCAN_INLINE double fscan_range_f32(double x) { return fscan_range(x, FSCAN_F32_OVER, FSCAN_F32_UNDER); }
static FSCAN_INLINE float fscan_range_f16(float x) { return fscan_range(x, 65520.0f, 0x1p-25f); }
static FSCAN_INLINE float fscan_range_bf16(float x) { return fscan_range(x, 0x1.ffp127f, 0x1p-134f); }
// The range check as the generated combine calls it: WATCH false, the check itself;
// WATCH true, x as it is and the watch told of it (FscanWatch). A loop over a block of
// lanes runs the watched combine and runs the block again with the check where
// fscan_watched says a check would have changed a value: bit for bit the checked values,
// since the check changes nothing it would not flag (NaN is kept by both). Exact zeros
// are not flagged: the check keeps them as they are (copysign(0, x) is x), and a block
// whose product is 0 (a gate of 0, a reset written as a zero gate) would run twice.
template <typename T> static FSCAN_INLINE bool fscan_outside(T x, T over, T under) {
  const T m = std::fabs(x);
  return (m >= over) | ((m <= under) & (m != T(0)));
}
// What a watched loop knows of the checks it left out. A float32 value held in double
// (fscan_range_f32, the common case: the affine pair's reused product) is watched as
// its bits shifted left by one (the sign dropped: ordered as |x| is, NaN above inf):
// the greatest (hi) and the least less one (lo: 0 wraps to the top, so exact zeros never
// count), an unsigned max and min a value, which the loop vectoriser keeps as vector
// reductions. fscan_outside's compares and their OR a value made the watched loop's
// checks cost as much as its combine (the affine pair's reduce over (4096, 256) dim 0,
// AVX-512: 385-400 us a call against 300 this way and 285 unchecked). float16 and
// bfloat16 values held in float are flagged by fscan_outside (flag).
struct FscanWatch { uint64_t lo = ~uint64_t(0), hi = 0; int64_t flag = 0; };
static FSCAN_INLINE uint64_t fscan_magnitude_bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b << 1;
}
static FSCAN_INLINE bool fscan_watched(const FscanWatch& w) {
  const uint64_t over = fscan_magnitude_bits(FSCAN_F32_OVER), under = fscan_magnitude_bits(FSCAN_F32_UNDER);
  return (w.flag != 0) | (w.hi >= over) | (w.lo <= under - 1);
}
// Where a combine is called without a watch (WATCH false: never written).
static FscanWatch fscan_unwatched;
template <bool WATCH> static FSCAN_INLINE double fscan_range_f32(double x, FscanWatch& w) {
  if constexpr (WATCH) {
    const uint64_t b = fscan_magnitude_bits(x);
    w.hi = b > w.hi ? b : w.hi;
    w.lo = b - 1 < w.lo ? b - 1 : w.lo;
    return x;
  } else {
    return fscan_range_f32(x);
  }
}
template <bool WATCH> static FSCAN_INLINE float fscan_range_f16(float x, FscanWatch& w) {
  if constexpr (WATCH) { w.flag |= fscan_outside(x, 65520.0f, 0x1p-25f); return x; }
  else return fscan_range_f16(x);
}
template <bool WATCH> static FSCAN_INLINE float fscan_range_bf16(float x, FscanWatch& w) {
  if constexpr (WATCH) { w.flag |= fscan_outside(x, 0x1.ffp127f, 0x1p-134f); return x; }
  else return fscan_range_bf16(x);
}
