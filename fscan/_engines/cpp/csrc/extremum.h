// cummax's and cummin's walk of their (value, index) pairs (EXTREMUM in the forward kernel,
// SEG_EXTREMUM in the segmented one: the combine recognised as torch's, see
// fscan._engines.cpp._cpp_tiles.extremum), a step at a time (extremum_step) or, where a
// float32 chain is dense, 16 steps a vector (extremum_blocks). Placed by
// fscan._engines.cpp._cpp_source before forward_chains.h and by _kernel_segmented before
// segmented_walk.h, after the generated part (Vals, In, Out, row).

// One step of cummax's (EXT 1) or cummin's (EXT -1) (value, index) pair (SEG_EXTREMUM:
// the combine recognised as torch's, see fscan._engines.cpp._kernel_segmented.extremum):
// a the running pair, u the step's element, `restart` its flag. No branch on the data:
// one ordered compare selects the index (cmovbe) and the value is a max/min instruction
// (vmaxss: the running value where it is greater, else the element, ties included, as
// torch's `>=`); a restart is a branch (mispredicted once a segment), and a NaN on
// either side (unordered) one of its own: the element where it is NaN, else the running
// NaN stays. The combine's own selects compiled to a branch, mispredicted at each new
// maximum (~5 a segment of 97 random steps): 1.4-1.6 ns an element, ~1.0 so ((1048576,),
// a restart every 97 steps). Without any restart, where that branch almost never
// mispredicts, 0.90 -> 1.05-1.15. (The restart as the running value set to the identity,
// -inf / +inf, and the compare after it: 1.2 ns an element at a restart every step,
// against 0.9 so and 0.7 before.)
template <int EXT, typename V>
static FSCAN_INLINE void extremum_step(V& a, const V& u, bool restart) {
  using Value = decltype(a.v0);  // the value leaf's compute type
  if (__builtin_expect(restart, 0)) {
    a = u;
    return;
  }
  if constexpr (std::is_floating_point_v<Value>) {
    if (__builtin_expect(__builtin_isunordered(a.v0, u.v0), 0)) {
      if (u.v0 != u.v0) a = u;
      return;
    }
  }
  const bool keep = EXT > 0 ? a.v0 > u.v0 : a.v0 < u.v0;
  if constexpr (std::is_floating_point_v<Value>) {
    a.v1 = keep ? a.v1 : u.v1;
  } else {
    // As a mask: `keep ? a.v1 : u.v1` became a branch beside the value's vpmaxsd.
    a.v1 ^= (a.v1 ^ u.v1) & -(int64_t)!keep;
  }
  a.v0 = keep ? a.v0 : u.v0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Each lane's highest set bit (the lane holding fewer than 24 bits), -127 where none: the
// exponent of the lane converted to float (AVX-512CD's vplzcntd is not among the flags).
static FSCAN_INLINE __m512i fscan_top_bit(__m512i v) {
  const __m512i e = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(v)), 23);
  return _mm512_sub_epi32(e, _mm512_set1_epi32(127));
}

// extremum_blocks' loop (below) on the chain's raw pointers (xp, vp, ip, rp at its step
// 0), a function per direction (REV). Inlined into seg_chains with the direction a
// runtime test, GCC kept two branches a block on it and rebuilt three constants every
// block (broadcasts from general registers). Each block is scanned in address order in
// both directions: reversed, each lane takes from the lanes above it (not the vector
// permuted at the load and at the three stores, and the flags' bytes at their load).
// A block without a restart (5 in 6 with a restart every 97 steps) runs the inclusive
// scan's code: its flags' 16 bytes tested as two words in general registers, and the
// windows' masks made only where one is set (tested as a mask register moved out, the
// reversed loop ran 1.15x its inclusive scan with no flag set at all, forward 1.03x).
// Standalone copies of this loop (g++ -O3 -march=native as Inductor builds it, (1048576,),
// 1 thread, thread CPU time, medians of 300), inclusive / a restart every 97 steps / at
// random steps (1 in 100): before, inlined, forward 518 / 594 / 598 us, reversed 585 /
// 696 / 697; now 521 / 560 / 551, reversed 529 / 552 / 552. The drop-ins, the bench's
// rows (2 alternating rounds, 1 thread): cummax over (1048576,) inclusive 570-581 us ->
// 552-590, reversed 729-748 -> 592-594, `reset=` 670-688 -> 593-633 (1.17-1.18x the
// inclusive call -> 1.06-1.07x), reversed 787-804 -> 609-626 (1.07-1.09x -> 1.03-1.06x);
// over (4096, 256) dim 1 inclusive 737-768 -> 645-660, reversed 864-880 -> 676-680.
template <int EXT, bool FLAGS, bool REV, typename V>
__attribute__((noinline)) static int64_t extremum_run(const float* const xp, float* const vp,
                                                      int64_t* const ip, const uint8_t* const rp,
                                                      const int64_t base, const int64_t n, V& acc) {
  constexpr int64_t dt = REV ? -1 : 1;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Lane i's bits of the lanes before it in scan order, itself included: at or below it
  // (forward), at or above it (REV).
  const __m512i upto = REV ? _mm512_sllv_epi32(_mm512_set1_epi32(0xffff), lane)
                           : _mm512_sub_epi32(_mm512_sllv_epi32(_mm512_set1_epi32(2), lane), _mm512_set1_epi32(1));
  const __m512i last_f = _mm512_set1_epi32(REV ? 0 : 15), last_q = _mm512_set1_epi64(REV ? 0 : 7);
  const __m128i ones = _mm_set1_epi8(-1);
  const __m512i fill = _mm512_castps_si512(_mm512_set1_ps(EXT > 0 ? -INFINITY : INFINITY));
  auto ext_in = [](__m512 a, __mmask16 m, __m512 b) {
    return EXT > 0 ? _mm512_mask_max_ps(a, m, a, b) : _mm512_mask_min_ps(a, m, a, b);
  };
  // Lane i's value s lanes before it in scan order (lane i - s forward, i + s REV), the
  // identity where that is outside the block.
  auto before = [&](__m512 v, auto s) {
    const __m512i u = _mm512_castps_si512(v);
    return _mm512_castsi512_ps(REV ? _mm512_alignr_epi32(fill, u, decltype(s)::value)
                                   : _mm512_alignr_epi32(u, fill, 16 - decltype(s)::value));
  };
  // The flags of the lanes s before each lane or fewer, OR-ed in: w | w << s (REV >> s).
  auto widen = [](uint32_t w, int s) { return REV ? w | (w >> s) : (w | (w << s)) & 0xffffu; };
  __m512 cv = _mm512_set1_ps(acc.v0);
  __m512i ci = _mm512_set1_epi64(acc.v1);
  bool nan_carry = acc.v0 != acc.v0;
  // The block's first element in each array, stepped a block at a time (indexed from
  // the chain's start, the reversed loop kept some of its pointers in vector registers,
  // moved out every block).
  const int64_t first = REV ? -16 : 1, blocks = (n - 1) / 16;
  const float* xq = xp + first;
  float* vq = vp + first;
  int64_t* iq = ip + first;
  const uint8_t* rq = rp + first;
  __m512i at = _mm512_set1_epi64(base + first);  // lane 0's position, in every lane
  const __m512i step_at = _mm512_set1_epi64(16 * dt);
  for (int64_t b = 0; b < blocks; ++b, xq += 16 * dt, vq += 16 * dt, iq += 16 * dt, rq += 16 * dt,
               at = _mm512_add_epi64(at, step_at)) {
    const __m512 xv = _mm512_loadu_ps(xq);
    uint64_t any = 0;  // the block's 16 flags' bytes OR-ed, as two words
    if (FLAGS) {
      uint64_t f0, f1;
      std::memcpy(&f0, rq, 8);
      std::memcpy(&f1, rq + 8, 8);
      any = f0 | f1;
    }
    if (__builtin_expect(_mm512_cmp_ps_mask(xv, xv, _CMP_UNORD_Q) != 0 || nan_carry, 0)) {
      // A step at a time, in scan order (lanes 15 down to 0 reversed).
      acc.v0 = _mm512_cvtss_f32(cv);
      acc.v1 = _mm_cvtsi128_si64(_mm512_castsi512_si128(ci));
      const int64_t pos = _mm_cvtsi128_si64(_mm512_castsi512_si128(at));  // lane 0's
      for (int m0 = 0; m0 < 16; ++m0) {
        const int m = REV ? 15 - m0 : m0;
        V u;
        u.v0 = xq[m];
        u.v1 = pos + m;
        extremum_step<EXT>(acc, u, FLAGS && rq[m] != 0);
        vq[m] = acc.v0;
        iq[m] = acc.v1;
      }
      cv = _mm512_set1_ps(acc.v0);
      ci = _mm512_set1_epi64(acc.v1);
      nan_carry = acc.v0 != acc.v0;
      continue;
    }
    // The block's scan given its flags W: called with 0 (a constant: no masks) where the
    // block has no restart, so that path is the inclusive scan's own code.
    auto scan = [&](const uint32_t W) __attribute__((always_inline)) {
      const uint32_t w1 = W, w2 = widen(w1, 1), w4 = widen(w2, 2), w8 = widen(w4, 4);
      const __mmask16 reach = (__mmask16)~widen(w8, 8);  // the lanes no flag parts from the carry
      __m512 v = xv;
      v = ext_in(v, (__mmask16)~w1, before(v, std::integral_constant<int, 1>{}));
      v = ext_in(v, (__mmask16)~w2, before(v, std::integral_constant<int, 2>{}));
      v = ext_in(v, (__mmask16)~w4, before(v, std::integral_constant<int, 4>{}));
      v = ext_in(v, (__mmask16)~w8, before(v, std::integral_constant<int, 8>{}));
      const __mmask16 records = _mm512_cmp_ps_mask(xv, v, _CMP_EQ_OQ);
      // Each lane's latest record in scan order: the highest at or below it, REV the lowest
      // at or above it (isolated as y & -y first).
      __m512i own = _mm512_and_si512(_mm512_set1_epi32(records), upto);
      if (REV) own = _mm512_and_si512(own, _mm512_sub_epi32(_mm512_setzero_si512(), own));
      const __m512i r = fscan_top_bit(own);
      const __mmask16 carried = EXT > 0 ? _mm512_mask_cmp_ps_mask(reach, v, cv, _CMP_LT_OQ)
                                        : _mm512_mask_cmp_ps_mask(reach, v, cv, _CMP_GT_OQ);
      const __m512 val = _mm512_mask_mov_ps(_mm512_permutexvar_ps(r, xv), carried, cv);
      __m512i i0 = _mm512_add_epi64(at, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(r)));
      __m512i i1 = _mm512_add_epi64(at, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(r, 1)));
      i0 = _mm512_mask_mov_epi64(i0, (__mmask8)carried, ci);
      i1 = _mm512_mask_mov_epi64(i1, (__mmask8)(carried >> 8), ci);
      _mm512_storeu_ps(vq, val);
      _mm512_storeu_si512(iq, i0);
      _mm512_storeu_si512(iq + 8, i1);
      cv = _mm512_permutexvar_ps(last_f, val);
      ci = _mm512_permutexvar_epi64(last_q, REV ? i0 : i1);
    };
    if (any == 0) scan(0);
    else scan(_mm_test_epi8_mask(_mm_loadu_si128((const __m128i*)rq), ones));
  }
  acc.v0 = _mm512_cvtss_f32(cv);
  acc.v1 = _mm_cvtsi128_si64(_mm512_castsi512_si128(ci));
  return 1 + 16 * blocks;
}
#endif

// Steps [1, n) of a chain whose step s reads x at s * dt (dt = rev ? -1 : 1), its position
// t0 + s * dt (plus x.pos0), writes y at s * dt and, where FLAGS, restarts where rp[s * dt]
// is set; acc holds the running pair after step 0 and is left after the last step done.
// Where the value leaf is float32 and the input, both outputs and the flags are one element
// apart along the walk (either direction): 16 steps a vector (AVX-512), each block scanned
// on its own in registers, then the carry put in. Per block, in scan order:
//  - v, the block's segmented extremum: four shifted max/min steps (log-step), each lane
//    taking from lanes no flag separates it from (masks made from the flags' bits);
//  - each lane's index: the last lane at or before it equal to its v (a record: the later
//    of ties, as torch's >= / <=), found as the highest set bit of the records' mask at or
//    below it (reversed, the lowest at or above it: the lanes in address order); its value is that lane's element (so a zero's sign is the element's, not the
//    max instruction's);
//  - the carry (the running pair before the block) where no flag precedes the lane and
//    the carry is strictly beyond v (ties go to the block's later element).
// A block with a NaN (or after one, the carry NaN) is walked a step at a time. The walk a
// step at a time is latency- and branch-bound (a new maximum ~5 times a segment of 97
// random steps); this one by its ~50 instructions a block. Standalone copies (g++ -O3,
// the kernel's AVX-512 flags, a restart every 97 steps, 1 thread, thread CPU time): (32768,)
// in cache 18 us forward, 21-23 reversed (then with its lanes reversed at the loads and
// stores), against the step walk's 27 and an inclusive branchy walk's 21-23; (1048576,)
// 577 and 652-665 against 860-900 and 681-686 (the loop as it is now: see extremum_run).
// Returns the first step not written (>= 1).
template <int EXT, bool FLAGS, typename I, typename O, typename V>
static int64_t extremum_blocks(const I& x, const O& y, const uint8_t* rp, int64_t rst, int64_t t0,
                               int64_t n, bool rev, V& acc) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if constexpr (EXT != 0 && std::is_same_v<decltype(x.x0), Ptr<const float>> &&
                std::is_same_v<decltype(y.y0), Ptr<float>> &&
                std::is_same_v<decltype(y.y1), Ptr<int64_t>>) {
    if (n < 17 || x.x0.st != 1 || y.y0.st != 1 || y.y1.st != 1 || (FLAGS && rst != 1)) return 1;
    const int64_t base = t0 + x.pos0;
    // Through a copy: the caller's running pair, its address not taken, stays in
    // registers for the steps it walks after the blocks (passed itself, it lived on the
    // stack there, a store and a load each step).
    V a = acc;
    const int64_t k = rev ? extremum_run<EXT, FLAGS, true>(x.x0.p, y.y0.p, y.y1.p, rp, base, n, a)
                          : extremum_run<EXT, FLAGS, false>(x.x0.p, y.y0.p, y.y1.p, rp, base, n, a);
    acc = a;
    return k;
  }
#endif
  (void)x; (void)y; (void)rp; (void)rst; (void)t0; (void)n; (void)rev; (void)acc;
  return 1;
}
