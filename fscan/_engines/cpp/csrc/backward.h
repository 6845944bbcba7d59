// The backward scan: one reverse pass per lane through the traced VJP of combine, on
// columns of lanes (lane_bwd) or on chains split into chunks (chain_bwd).
// fscan.engine._cpp_source places this after the generated part it is written against
// (the forward's structs, Lam, Grad, Bar, LamBuf, LamStore, PLam, PBar, NF, vjp and the
// lam_* helpers) and before the generated entry point, which calls backward().
// A dead cotangent (lam_dead(u): an output without one that no output with one reads,
// see fscan's translate_vjp) is the constant 0 in Lam: never loaded or stored, and the
// transfer maps below skip its unit column (computed, it would only meet a zero carry).

// Lanes [i0, i0 + w) of outer index o, steps [a, z) backwards in scan order: the
// cotangent entering the chunk's top step is g's plus in[i] (what the chunk above passes
// down; none for the top chunk). The params' cotangents of these lanes (element positions
// e0..) sum into q, which this column owns, or, for a chunk of a split column, into
// pt[i]. With down (a > 0: the top chunk of a split column, see backward()), what the
// chunk passes below its first step goes to down[i], as lane_transfer's out has it.
// Rows of x, y and g with other inner strides than 1 are gathered.
// Step s (in scan order) of T: its position along the scan dim.
static FSCAN_INLINE int64_t pos(int64_t s, int64_t T, bool rev) { return rev ? T - 1 - s : s; }

struct BwdRows { InRow x, y; GradRow g; explicit BwdRows(int64_t n) : x(n), y(n), g(n) {} };

template <bool GATHER>
static void lane_bwd(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                     const Geo& S, int64_t o, int64_t i0, int64_t w, int64_t a, int64_t z, bool rev,
                     const Lam* in, PLam* pt, Lam* down, const LamBuf lam, const BwdRows& rows) {
  const In xc = at(x, S, o, 0, i0), yc = at(y, S, o, 0, i0);
  const Grad gc = at(g, S, o, 0, i0);
  const Bar bc = at(b, S, o, 0, i0);
  const int64_t T = S.T, e0 = o * S.inner + i0;
  const Grad gtop = GATHER ? gather(row(gc, pos(z - 1, T, rev)), rows.g, w, false) : row(gc, pos(z - 1, T, rev));
#pragma GCC ivdep
  for (int64_t i = 0; i < w; ++i) {
    put_lam(lam, i, in ? lam_add(load_g_i(gtop, i), in[i]) : load_g_i(gtop, i));
    if (pt) pt[i] = plam_zero(); else zero_pbar(q, e0 + i);
  }
  // Step s: its VJP, the gradient of x at s stored; DOWN (the last step, with down): what
  // it passes below kept as such, else added to g one row below (for the step below).
  auto step = [&](int64_t s, auto pass_down) {
    constexpr bool DOWN = decltype(pass_down)::value;
    const int64_t tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    const In xr = GATHER ? gather(row(xc, tc), rows.x, w, !rev) : row(xc, tc);
    const In yr = GATHER ? gather(row(yc, tp), rows.y, w, !rev) : row(yc, tp);
    const Grad gr = DOWN ? gc : GATHER ? gather(row(gc, tp), rows.g, w, !rev) : row(gc, tp);
    const Bar br = row(bc, tc);
    fscan_lanes<LANE_BLOCK>(w, !rev, [&](int64_t i) {  // !rev: walking memory backwards
      Lam lb, rb;
      PLam pb;
      vjp(load_i(yr, i, tp), load_i(xr, i, tc), get_lam(lam, i), p, e0 + i, lb, rb, pb);
      store_bar_i(br, i, rb);
      if (DOWN) down[i] = lb; else put_lam(lam, i, lam_add(load_g_i(gr, i), lb));
      if (pt) pt[i] = plam_add(pt[i], pb); else add_pbar(q, e0 + i, pb);
    });
  };
  // The last step (s = a) of a chunk with a > 0 reads g one row below it too, unless it
  // passes down: what it passes down is not kept otherwise (the transfer pass found it).
  const int64_t last = down ? a + 1 : std::max<int64_t>(a, 1);
  for (int64_t s = z - 1; s >= last; --s) step(s, std::false_type{});
  if (down) step(a, std::true_type{});
  if (a > 0) return;
  const Bar bfirst = row(bc, pos(0, T, rev));
#pragma GCC ivdep
  for (int64_t i = 0; i < w; ++i) store_bar_i(bfirst, i, get_lam(lam, i));
}

// A split column's chunk [a, z), a > 0, as a linear map of what enters its top step
// (see the chains below): out[i], what it passes down from a zero entry, and M[i * NF + u],
// what it passes down per unit cotangent u entering (NF extra VJPs a step, no stores).
// lam holds (1 + NF) * w running cotangents.
template <bool GATHER>
static void lane_transfer(const In x, const In y, const Grad g, const Par p, const Geo& S,
                          int64_t o, int64_t i0, int64_t w, int64_t a, int64_t z, bool rev,
                          Lam* out, Lam* M, const LamBuf lam, const BwdRows& rows) {
  const In xc = at(x, S, o, 0, i0), yc = at(y, S, o, 0, i0);
  const Grad gc = at(g, S, o, 0, i0);
  const int64_t T = S.T, e0 = o * S.inner + i0;
  const Grad gtop = GATHER ? gather(row(gc, pos(z - 1, T, rev)), rows.g, w, false) : row(gc, pos(z - 1, T, rev));
  for (int64_t i = 0; i < w; ++i) {
    put_lam(lam, i, load_g_i(gtop, i));
    for (int u = 0; u < NF; ++u) if (!lam_dead(u)) put_lam(lam, (1 + u) * w + i, lam_unit(u));
  }
  for (int64_t s = z - 1; s >= a; --s) {
    const int64_t tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    const In xr = GATHER ? gather(row(xc, tc), rows.x, w, !rev) : row(xc, tc);
    const In yr = GATHER ? gather(row(yc, tp), rows.y, w, !rev) : row(yc, tp);
    const Grad gr = GATHER ? gather(row(gc, tp), rows.g, w, !rev) : row(gc, tp);
    fscan_lanes<LANE_BLOCK>(w, !rev, [&](int64_t i) {
      const Vals l = load_i(yr, i, tp), v = load_i(xr, i, tc);
      Lam lb, rb;
      PLam pb;
      vjp(l, v, get_lam(lam, i), p, e0 + i, lb, rb, pb);
      put_lam(lam, i, s > a ? lam_add(load_g_i(gr, i), lb) : lb);
      for (int u = 0; u < NF; ++u) {
        if (lam_dead(u)) continue;
        vjp(l, v, get_lam(lam, (1 + u) * w + i), p, e0 + i, lb, rb, pb);
        put_lam(lam, (1 + u) * w + i, lb);
      }
    });
  }
  for (int64_t i = 0; i < w; ++i) {
    out[i] = get_lam(lam, i);
    for (int u = 0; u < NF; ++u) if (!lam_dead(u)) M[i * NF + u] = get_lam(lam, (1 + u) * w + i);
  }
}

// --- Chains: few lanes (1-D, or a scan over the last dim), or lanes laid out along T (a
// transpose), G interleaved per thread, each lane in C chunks of steps. The adjoint
// recurrence lam[s-1] = g[s-1] + A_s^T lam[s] is linear, so a chunk [a, z) maps the lam
// its top step receives from above (in) to what its bottom step passes down
// (out = M in + o). With C > 1, pass 1: o and M (M's columns: the VJP of unit
// cotangents, NF extra VJPs a step, no stores); pass 2: each lane's chunk carries, top
// down. Pass 3: each chunk (again) from its true carry, storing the gradients; then the
// params' per-chunk sums are added in chunk order.

struct Chunk { In x, y; Grad g; Bar b; int64_t e, a, z; };  // a lane's start, position, steps [a, z)

template <int NG>
static FSCAN_INLINE void transfer(const Par p, const Chunk* k, int64_t T, bool rev, Lam* out, Lam* M) {
  Lam lam[NG], U[NG][NF];
  int64_t n[NG], common = INT64_MAX;
  for (int c = 0; c < NG; ++c) {
    lam[c] = load_g_t(k[c].g, pos(k[c].z - 1, T, rev));
    for (int u = 0; u < NF; ++u) U[c][u] = lam_unit(u);
    n[c] = k[c].z - std::max<int64_t>(k[c].a, 1);
    common = std::min(common, n[c]);
    out[c] = lam_zero();
  }
  auto one = [&](int c, int64_t r) {
    const int64_t s = k[c].z - 1 - r, tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    const Vals l = load_t(k[c].y, tp, tp), v = load_t(k[c].x, tc, tc);
    Lam lb, rb; PLam pb;
    vjp(l, v, lam[c], p, k[c].e, lb, rb, pb);
    for (int u = 0; u < NF; ++u) if (!lam_dead(u)) { Lam ub, urb; PLam upb; vjp(l, v, U[c][u], p, k[c].e, ub, urb, upb); U[c][u] = ub; }
    if (s > k[c].a) lam[c] = lam_add(load_g_t(k[c].g, tp), lb); else out[c] = lb;
  };
  for (int64_t r = 0; r < common; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NG; ++c) one(c, r);
  }
  for (int c = 0; c < NG; ++c) {
    for (int64_t r = common; r < n[c]; ++r) one(c, r);
    for (int u = 0; u < NF; ++u) if (!lam_dead(u)) M[c * NF + u] = U[c][u];
  }
}

template <int NG>
static FSCAN_INLINE void finish(const Par p, const Chunk* k, int64_t T, bool rev, const Lam* in,
                                PLam* ptot) {
  Lam lam[NG]; PLam pacc[NG];
  int64_t n[NG], common = INT64_MAX;
  for (int c = 0; c < NG; ++c) {
    lam[c] = lam_add(load_g_t(k[c].g, pos(k[c].z - 1, T, rev)), in[c]);
    pacc[c] = plam_zero();
    n[c] = k[c].z - std::max<int64_t>(k[c].a, 1);
    common = std::min(common, n[c]);
  }
  auto one = [&](int c, int64_t r) {
    const int64_t s = k[c].z - 1 - r, tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    Lam lb, rb; PLam pb;
    vjp(load_t(k[c].y, tp, tp), load_t(k[c].x, tc, tc), lam[c], p, k[c].e, lb, rb, pb);
    store_bar_t(k[c].b, tc, rb);
    pacc[c] = plam_add(pacc[c], pb);
    if (s > k[c].a) lam[c] = lam_add(load_g_t(k[c].g, tp), lb);
  };
  for (int64_t r = 0; r < common; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NG; ++c) one(c, r);
  }
  for (int c = 0; c < NG; ++c) {
    for (int64_t r = common; r < n[c]; ++r) one(c, r);
    if (k[c].a == 0) store_bar_t(k[c].b, pos(0, T, rev), lam[c]);
    ptot[c] = pacc[c];
  }
}

// What a chunk passes below its first step, walked from `in` (what the chunk above passes
// down): the exact answer where composing its transfer matrix is not (see lam_suspect),
// e.g. a product of gates that underflowed to 0 against an infinite cotangent.
static Lam walk_down(const Par p, const Chunk& k, int64_t T, bool rev, const Lam& in) {
  Lam lam = lam_add(load_g_t(k.g, pos(k.z - 1, T, rev)), in), out = lam_zero();
  for (int64_t s = k.z - 1; s >= std::max<int64_t>(k.a, 1); --s) {
    const int64_t tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    Lam lb, rb; PLam pb;
    vjp(load_t(k.y, tp, tp), load_t(k.x, tc, tc), lam, p, k.e, lb, rb, pb);
    if (s > k.a) lam = lam_add(load_g_t(k.g, tp), lb); else out = lb;
  }
  return out;
}

// Chunks per lane: 1 with lanes enough for the threads (and the interleave).
static int64_t chunks_per_lane(int64_t lanes, int64_t T, int nt) {
  if (lanes >= (int64_t)nt * G) return 1;
  int64_t C = std::min<int64_t>(((int64_t)nt * G + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
  if (C >= G) C = C / G * G;
  return C;
}

static void chain_bwd(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                      const Geo& S, bool rev, int nt, int64_t C) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  const int64_t L = (T + C - 1) / C;
  C = (T + L - 1) / L;
  const int64_t items = lanes * C, groups = (items + G - 1) / G;
  auto describe = [&](int64_t item) {
    const int64_t lane = item / C, c = item % C, o = lane / inner, i = lane % inner;
    return Chunk{at(x, S, o, 0, i), at(y, S, o, 0, i), at(g, S, o, 0, i), at(b, S, o, 0, i),
                 lane, c * L, std::min(T, (c + 1) * L)};
  };
  std::vector<Lam> outs(C > 1 ? items : 0), ins(items, lam_zero()), M(C > 1 ? items * NF : 0);
  std::vector<PLam> ptot(items);
  fscan_team(nt, [&] {
    Chunk k[G];
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int ng = (int)std::min<int64_t>(G, items - gi * G);
        for (int c = 0; c < ng; ++c) k[c] = describe(gi * G + c);
        if (ng == G) transfer<G>(p, k, T, rev, &outs[gi * G], &M[gi * G * NF]);
        else for (int c = 0; c < ng; ++c) transfer<1>(p, k + c, T, rev, &outs[gi * G + c], &M[(gi * G + c) * NF]);
      }
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < lanes; ++lane) {
        Lam carry = lam_zero();  // what the chunk above passes down
        for (int64_t c = C - 1; c >= 0; --c) {
          const int64_t item = lane * C + c;
          ins[item] = carry;
          Lam next = outs[item];
          for (int u = 0; u < NF; ++u) if (!lam_dead(u)) next = lam_axpy(next, M[item * NF + u], carry, u);
          if (c > 0 && lam_suspect(outs[item], carry, next)) next = walk_down(p, describe(item), T, rev, carry);
          carry = next;
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int ng = (int)std::min<int64_t>(G, items - gi * G);
      for (int c = 0; c < ng; ++c) k[c] = describe(gi * G + c);
      if (ng == G) finish<G>(p, k, T, rev, &ins[gi * G], &ptot[gi * G]);
      else for (int c = 0; c < ng; ++c) finish<1>(p, k + c, T, rev, &ins[gi * G + c], &ptot[gi * G + c]);
    }
#pragma omp for schedule(static)
    for (int64_t lane = 0; lane < lanes; ++lane) {
      zero_pbar(q, lane);
      for (int64_t c = 0; c < C; ++c) add_pbar(q, lane, ptot[lane * C + c]);
    }
  });
}

static void backward(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                     const Geo& S, bool rev, int threads) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t outer = S.outer, inner = S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, outer * S.T * inner / PER_THREAD));
  // As the forward: chains for few inner lanes or inputs laid out along T.
  if (inner < VEC_MIN || along(x) || along(y) || along(g)) {
    chain_bwd(x, y, g, b, q, p, S, rev, nt, chunks_per_lane(outer * inner, S.T, nt));
    return;
  }
  // Columns of up to TILE lanes; too few columns for the threads: each column split into
  // C chunks of steps (see lane_columns), composed through their transfer maps (see the
  // chains above). As the forward's lane_path, the top chunk (the last steps in scan
  // order: nothing enters it from above) is scanned, its gradients stored and what it
  // passes down kept, while the other threads find the transfer maps of chunks 1..C-2;
  // then chunks 0..C-2 are scanned from their carries. With C = threads + 1, one pass of
  // each: finding every chunk's map first (C = 2 * threads), as before, took as long on
  // 2 threads as one thread's scan.
  // The chunks are not equal where one carried cotangent (live == 1: linear_recurrence's
  // backward, add) makes the maps cost about twice the scan: the top chunk is then twice as
  // long as each of the others (span below), so that the first pass's scan and maps end
  // together and the second pass's chunks are equal. Measured (quiet, 2 threads, the
  // backward alone, wall, float32, dim 0): linear_recurrence's backward 1.83-1.86 -> 1.50-1.52 ms
  // (4096, 256), 9.6-10.2 -> 6.8-7.3 ms (16384, 256); add the same within noise. The
  // affine pair with both cotangents (live == 2) keeps equal chunks: its top chunk 3 times
  // as long (1 + live VJPs a step) took 1.32-1.36 -> 1.57-1.77 ms at (4096, 256), so its
  // maps cost no more than its scan (they store nothing).
  const int64_t T = S.T;
  const Columns K = lane_columns(outer, T, inner, nt, 1, 1);
  const int64_t W = K.W, ntiles = K.ntiles, ncols = K.ncols, C = K.C;
  int live = 0;
  for (int u = 0; u < NF; ++u) live += !lam_dead(u);
  // Chunk c < C - 1: steps [c * L, (c + 1) * L); the top chunk C - 1: [(C - 1) * L, T).
  const int64_t top = live == 1 ? 2 : 1;  // the top chunk's length in the others'
  const int64_t L = C > 1 ? std::max<int64_t>(1, T / (C - 1 + top)) : T;
  auto span = [&](int64_t c, int64_t& a, int64_t& z) { a = c * L; z = c == C - 1 ? T : std::min(T, a + L); };
  const bool dense = unit(x) && unit(y) && unit(g);
  const int64_t slots = C > 1 ? ncols * C * W : 0;  // per (column, chunk, lane)
  std::vector<Lam> outs(slots), ins(slots, lam_zero()), M(slots * NF);
  std::vector<PLam> pt(slots);
  auto place = [&](int64_t col, int64_t& o, int64_t& i0, int64_t& w) {
    o = col / ntiles; i0 = (col % ntiles) * W; w = std::min(W, inner - i0);
  };
  fscan_team(nt, [&] {
    LamStore store(C > 1 ? W * (1 + NF) : W);
    const BwdRows rows(dense ? 0 : W);
    int64_t o, i0, w;
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < ncols * (C - 1); ++k) {
        // j = 0: the top chunk C - 1, scanned; j > 0: chunk j's transfer map.
        const int64_t col = k / (C - 1), j = k % (C - 1), c = j == 0 ? C - 1 : j;
        const int64_t base = (col * C + c) * W;
        int64_t a, z;
        span(c, a, z);
        place(col, o, i0, w);
        if (j == 0) {
          Lam* down = &ins[(col * C + C - 2) * W];  // what enters chunk C - 2
          if (dense) lane_bwd<false>(x, y, g, b, q, p, S, o, i0, w, a, z, rev, nullptr, &pt[base], down, store.buf(), rows);
          else lane_bwd<true>(x, y, g, b, q, p, S, o, i0, w, a, z, rev, nullptr, &pt[base], down, store.buf(), rows);
        } else if (dense) {
          lane_transfer<false>(x, y, g, p, S, o, i0, w, a, z, rev, &outs[base], &M[base * NF], store.buf(), rows);
        } else {
          lane_transfer<true>(x, y, g, p, S, o, i0, w, a, z, rev, &outs[base], &M[base * NF], store.buf(), rows);
        }
      }
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < ncols * W; ++lane) {
        const int64_t col = lane / W, i = lane % W;
        place(col, o, i0, w);
        if (i >= w) continue;
        Lam carry = ins[(col * C + C - 2) * W + i];  // what the top chunk passes down
        for (int64_t c = C - 2; c >= 1; --c) {
          const int64_t slot = (col * C + c) * W + i;
          Lam next = outs[slot];
          for (int u = 0; u < NF; ++u) if (!lam_dead(u)) next = lam_axpy(next, M[slot * NF + u], carry, u);
          if (lam_suspect(outs[slot], carry, next)) {
            int64_t a, z;
            span(c, a, z);
            const Chunk k{at(x, S, o, 0, i0 + i), at(y, S, o, 0, i0 + i), at(g, S, o, 0, i0 + i),
                          at(b, S, o, 0, i0 + i), o * inner + i0 + i, a, z};
            next = walk_down(p, k, T, rev, carry);
          }
          carry = next;
          ins[slot - W] = carry;  // what enters chunk c - 1
        }
      }
    }
    // The chunks left: every chunk of a whole column, chunks 0..C-2 of a split one.
    const int64_t rest = C > 1 ? C - 1 : 1;
#pragma omp for schedule(static)
    for (int64_t k = 0; k < ncols * rest; ++k) {
      const int64_t col = k / rest, c = k % rest, base = (col * C + c) * W;
      place(col, o, i0, w);
      int64_t a, z;
      span(c, a, z);
      const Lam* in = C > 1 ? &ins[base] : nullptr;
      PLam* sums = C > 1 ? &pt[base] : nullptr;
      if (dense) lane_bwd<false>(x, y, g, b, q, p, S, o, i0, w, a, z, rev, in, sums, nullptr, store.buf(), rows);
      else lane_bwd<true>(x, y, g, b, q, p, S, o, i0, w, a, z, rev, in, sums, nullptr, store.buf(), rows);
    }
    if (C > 1) {  // the params' sums of a split column, in chunk order
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < ncols * W; ++lane) {
        const int64_t col = lane / W, i = lane % W;
        place(col, o, i0, w);
        if (i >= w) continue;
        zero_pbar(q, o * inner + i0 + i);
        for (int64_t c = 0; c < C; ++c) add_pbar(q, o * inner + i0 + i, pt[(col * C + c) * W + i]);
      }
    }
  });
}
