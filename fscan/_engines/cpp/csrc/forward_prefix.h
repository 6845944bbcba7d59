// The forward scan's third chain kind: one chain at a time, its steps in vectors of PV (8)
// consecutive steps, each vector scanned in registers by log steps (no transposes), then
// combined with the running value, broadcast. Placed by fscan._engines.cpp._cpp_source after
// forward_lanes.h and before forward_chains.h, whose chain_group sends chains here where
// PREFIX is set (see prefix_structs in _cpp_tiles.py: one float32 leaf, its running value
// float32, a combine with a vector form: torch.maximum / torch.minimum, exact in float32)
// and prefixable(x, y) holds (the steps dense in memory: T stride 1, in and out).
// Why: on AVX2 the tiles' 8 x 8 transposes alone cost 2.4-3.3x a copy; max over (4096,
// 256) dim 1 ran 3.4x a copy tiled (4.6 reversed), 1-D 5.0 (two passes: chunk totals for
// the tiles' 8 chains, then the scan); by prefix chains 1.7-2.1 and 1.4-2.1 (1 thread,
// scripts/roofline.py, load 5-9; its bare loop 1.1-1.2, with this NaN check 1.2-1.3); see
// docs/performance.md, "Floors". add, mul and the affine pair keep the tiles: their
// running values are double, and a double prefix (4 steps a vector) ran slower than them.
// Only associativity is used (the left operand is always the earlier steps), as the walk
// and the chunked chain path assume: torch.maximum's NaN (the first one sticks) and its ties
// (-0.0 against +0.0: the later step wins) come out bit for bit as the walk gives them.
// AVX2 code, also on AVX-512 CPUs (where the tiles hold 16 chains, FSCAN_TV): compiled out there
// before, max over (1048576,) ran 670 us by the tiles against 182 us by these chains in an AVX2
// build on the same AVX-512 EPYC (a copy 91-94 us, 1 thread, thread CPU time).
#if defined(__AVX2__)
static constexpr int PV = 8;  // steps in a vector: one __m256 of float32, whatever FSCAN_TV is
static constexpr bool PREFIX_ON = PREFIX != 0;
// combine(l, r) on 8 lanes: fscan_max / fscan_min (prelude.h). vmaxps gives l > r ? l : r
// (r where either is NaN, r on ties), vminps l < r ? l : r: fscan_max / fscan_min exactly
// but where l is NaN, which NANS keeps (a compare and a blend more: where neither operand
// can be NaN, they are left out, see prefix_chain).
template <bool NANS = true> static FSCAN_INLINE __m256 prefix_combine(__m256 l, __m256 r) {
  const __m256 m = PREFIX == 1 ? _mm256_max_ps(l, r) : _mm256_min_ps(l, r);
  return NANS ? _mm256_blendv_ps(m, l, _mm256_cmp_ps(l, l, _CMP_UNORD_Q)) : m;
}
// The inclusive scan of a vector's 8 steps (Hillis-Steele: at distance k each step takes
// combine(the step k earlier, itself)): k = 1, 2 inside each 128-bit half (in-lane
// shuffles), then the high half takes the low half's last step. UP: steps in ascending
// lanes; else in descending lanes (a reversed chain read from its lowest address). The
// steps with none k earlier are combined with themselves instead of blended back:
// fscan_max(a, a) is a, bit for bit (NaN and -0.0 too), so each level is a shuffle and a
// combine (blended back, max over (1048576,) ran 0.43 ns an element, 1 thread; so, 0.30,
// before the NaN check went to pairs of vectors).
template <bool UP, bool NANS = true> static FSCAN_INLINE __m256 prefix_vector(__m256 v) {
  v = prefix_combine<NANS>(_mm256_permute_ps(v, UP ? 0x90 : 0xf9), v);  // (0,0,1,2) / (1,2,3,3)
  v = prefix_combine<NANS>(_mm256_permute_ps(v, UP ? 0x44 : 0xee), v);  // (0,1,0,1) / (2,3,2,3)
  const __m256i h = UP ? _mm256_setr_epi32(0, 1, 2, 3, 3, 3, 3, 3) : _mm256_setr_epi32(4, 4, 4, 4, 4, 5, 6, 7);
  return prefix_combine<NANS>(_mm256_permutevar8x32_ps(v, h), v);
}
// The last step of a scanned vector in every lane.
template <bool UP> static FSCAN_INLINE __m256 prefix_last(__m256 v) {
  return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(UP ? 7 : 0));
}
// Lanes [lo, hi) set: the steps a vector holds at a chain's ends (maskload/maskstore touch
// no other element: a reversed chain's last vector starts below its lane).
static FSCAN_INLINE __m256i prefix_mask(int lo, int hi) {
  const __m256i i = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(hi), i), _mm256_cmpgt_epi32(i, _mm256_set1_epi32(lo - 1)));
}

// One chain: xb/yb the lane, len steps from t0, UP ascending (else descending) memory;
// carry (if has) its inclusive carry-in; hb (if head) the element its first step reads
// instead of x. WRITE: every output; else only the final value, into *last.
template <bool WRITE, bool UP>
static void prefix_chain(const In xb, const Out yb, const Par p, int64_t t0, int64_t len,
                         int64_t elem, const Vals& carry, bool has, Vals* last, const In hb,
                         bool head) {
  const float* xs = prefix_in(row(xb, t0));
  float* ys = prefix_out(row(yb, t0));
  (void)p; (void)elem;
  // Vector k holds steps [k, k + 8) (fewer: the chain's last, partial), at xs + k (UP) or
  // from xs - k - 7 (its steps in descending lanes).
  auto at = [&](int64_t k) { return UP ? k : -k - (PV - 1); };  // vector k's lowest address
  // The running value, from the carry-in or else the combine's identity (fscan_max(-inf,
  // v) is v, bit for bit, NaN and -0.0 too; fscan_min's: +inf), so that the first vector
  // is scanned as any other. Its own chain is one combine a vector: the next is
  // combine(c, the vector's own last step), not the combined vector's last (a permute more).
  const float id = (PREFIX == 1 ? -1 : 1) * std::numeric_limits<float>::infinity();
  __m256 c = _mm256_set1_ps(has ? prefix_get(carry) : id);
  auto step = [&](__m256 x, int64_t k, auto nans) {
    const __m256 v = prefix_vector<UP, decltype(nans)::value>(x);
    if (WRITE) _mm256_storeu_ps(ys + at(k), prefix_combine<decltype(nans)::value>(c, v));
    c = prefix_combine<decltype(nans)::value>(c, prefix_last<UP>(v));
  };
  // The head element (a carry-in's) replaces the first step: its lane.
  auto with_head = [&](__m256 x) {
    return _mm256_blend_ps(x, _mm256_set1_ps(prefix_get(load_t(hb, 0, t0))), UP ? 0x01 : 0x80);
  };
  // A NaN running value is every later output (fscan_max keeps a NaN left operand).
  auto stuck = [&] { const float f = _mm256_cvtss_f32(c); return f != f; };
  int64_t b = 0;
  if (head && len >= PV) {
    step(with_head(_mm256_loadu_ps(xs + at(0))), 0, std::true_type{});
    b = PV;
  }
  // Two vectors whose steps are not NaN (one compare of the two: the running value is not
  // NaN here) are scanned without the NaN blends: with a compare of each vector and the
  // carry, max over (4096, 256) dim 1 ran 1.58x a copy in scripts/roofline.py's loop,
  // 1.13x without any.
  if (!stuck())
    for (; b + 2 * PV <= len; b += 2 * PV) {
      const __m256 x0 = _mm256_loadu_ps(xs + at(b)), x1 = _mm256_loadu_ps(xs + at(b + PV));
      const __m256 nan = _mm256_cmp_ps(x0, x1, _CMP_UNORD_Q);
      if (_mm256_testz_ps(nan, nan)) {
        step(x0, b, std::false_type{});
        step(x1, b + PV, std::false_type{});
      } else {
        step(x0, b, std::true_type{});
        step(x1, b + PV, std::true_type{});
        if (stuck()) { b += 2 * PV; break; }
      }
    }
  if (stuck()) {  // the rest is c
    if (WRITE) {
      for (; b + PV <= len; b += PV) _mm256_storeu_ps(ys + at(b), c);
      if (b < len) _mm256_maskstore_ps(ys + at(b), UP ? prefix_mask(0, (int)(len - b)) : prefix_mask(PV - (int)(len - b), PV), c);
    }
    if (!WRITE) *last = prefix_put(_mm256_cvtss_f32(c));
    return;
  }
  if (b + PV <= len) {  // a last whole vector
    const __m256 x = _mm256_loadu_ps(xs + at(b));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_testz_ps(nan, nan)) step(x, b, std::false_type{});
    else step(x, b, std::true_type{});
    b += PV;
  }
  if (b < len) {  // the partial last vector (masked: no element beyond the chain is touched)
    const int n = (int)(len - b);
    const __m256i m = UP ? prefix_mask(0, n) : prefix_mask(PV - n, PV);
    __m256 x = _mm256_maskload_ps(xs + at(b), m);
    if (head && b == 0) x = with_head(x);
    const __m256 v = prefix_combine(c, prefix_vector<UP>(x));
    if (WRITE) _mm256_maskstore_ps(ys + at(b), m, v);
    alignas(32) float l[PV];
    _mm256_store_ps(l, v);
    c = _mm256_set1_ps(l[UP ? n - 1 : PV - n]);
  }
  if (!WRITE) *last = prefix_put(_mm256_cvtss_f32(c));
}
#else
static constexpr bool PREFIX_ON = false;
template <bool WRITE, bool UP>
static void prefix_chain(const In, const Out, const Par, int64_t, int64_t, int64_t, const Vals&,
                         bool, Vals*, const In, bool) {}
#endif

// ng chains by prefix_chain (see chain_group in forward_chains.h).
template <bool WRITE>
static void prefix_group(const In* xb, const Out* yb, const Par p, int ng, const int64_t* t0,
                         const int64_t* len, const int64_t* elem, int64_t tstep, const Vals* carry,
                         const bool* has, Vals* last, const In* hb, const bool* head) {
  if (tstep > 0)
    for (int g = 0; g < ng; ++g) prefix_chain<WRITE, true>(xb[g], yb[g], p, t0[g], len[g], elem[g], carry[g], has[g], last + g, hb[g], head[g]);
  else  // reversed chains read downwards: the group's from the last, so that memory is read in a descending stream
    for (int g = ng - 1; g >= 0; --g) prefix_chain<WRITE, false>(xb[g], yb[g], p, t0[g], len[g], elem[g], carry[g], has[g], last + g, hb[g], head[g]);
}
