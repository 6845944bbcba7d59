// The forward scan's chain path: lanes walked one by one along their steps (G interleaved,
// or TW side by side as tiles transposed in registers), T split into chunks where lanes are
// fewer than the threads need. Placed by fscan._engines.cpp._cpp_source after
// forward_lanes.h and before forward.h (see there for the names it is written against).

// NG chains interleaved: chain g is the lane whose start (t = 0) is xb[g]/yb[g]; it runs
// len[g] steps from position t0[g], tstep (+-1) apart, at element position elem[g];
// carry[g] (if has[g]) is its inclusive carry-in.
// WRITE: store every output; else only the final values, into last[g].
// head[g]: the chain's first step reads hb[g] (a carry-in's head element) instead of x.
// EXCL: output step t is the running value before step t is combined; step 0's is carry[g]
// whether or not has[g] (chain_path gives the first chunk of a lane the exclusive scan's
// start value there, has[g] where it is folded in).
template <int NG, bool WRITE, bool EXCL = false>
static FSCAN_INLINE void chains(const In* xb, const Out* yb, const Par p, const int64_t* t0,
                                const int64_t* len, const int64_t* elem, int64_t tstep,
                                const Vals* carry, const bool* has, Vals* last,
                                const In* hb, const bool* head) {
  constexpr int64_t X = WRITE && EXCL;  // steps walked: each chain's len - X (see walk)
  Vals acc[NG];
  In xp[NG];  // each chain's inputs and outputs at its first step
  Out yp[NG];
  int64_t common = len[0] - X;
  for (int g = 1; g < NG; ++g) common = std::min(common, len[g] - X);
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    xp[g] = row(xb[g], t0[g]);
    yp[g] = row(yb[g], t0[g]);
    const Vals v = head[g] ? load_t(hb[g], 0, t0[g]) : load_t(xp[g], 0, t0[g]);
    if (X) store_t(yp[g], 0, carry[g]);
    acc[g] = has[g] ? combine(carry[g], v, p, elem[g]) : v;
    if (WRITE) {
      if (!X) store_t(yp[g], 0, acc[g]);
      else if (len[g] > 1) store_t(yp[g], tstep, acc[g]);
    }
  }
  // X: step s's result is stored as output s + 1 as soon as it is computed (as the
  // inclusive walk stores it), and the last step's input is never combined: nothing reads
  // it. (Stored as output s before step s was combined, the old and the new running value
  // were live at once: cummax's (value, index) pair over 8 chains spilled more (57 moves in
  // the loop against the inclusive walk's 42), and reversed over (4096, 256) dim 1 ran
  // 1.2-1.27x the inclusive call, (1048576,) 1.12-1.19x.)
  auto walk = [&](int g, int64_t s) {
    acc[g] = combine(acc[g], load_t(xp[g], s * tstep, t0[g] + s * tstep), p, elem[g]);
    if (WRITE) store_t(yp[g], (s + X) * tstep, acc[g]);
  };
  // cummax's / cummin's lone chain (EXTREMUM): 16 steps a vector where it is dense float32
  // (extremum_blocks, extremum.h), the rest a step at a time. X: step s's result is output
  // s + 1, so the blocks write through the outputs shifted a step (formed only where the
  // chain has a step to walk: a one-step reversed chain's shift would point before it).
  if constexpr (NG == 1 && WRITE && EXTREMUM != 0) {
    const int64_t n = len[0] - X;
    const int64_t done = n <= 1 ? 1 : extremum_blocks<EXTREMUM, false>(xp[0], row(yp[0], X * tstep), nullptr, 0,
                                                                        t0[0], n, tstep < 0, acc[0]);
    for (int64_t s = done; s < n; ++s) walk(0, s);
    return;
  }
  // Lanes a multiple of 4 KiB apart (T a power of two, inner 1) walked in step put every
  // chain's current lines in one L1 set: (64, 16384) over the last dim ran 17 ns an
  // element against 1.5 for T = 16400. So on long chains, chain g walks SKEW * g steps
  // ahead (whole cache lines of float32), alone first. From 512 steps: with the skew only
  // from 8192, int64 add over (64, 4096) dim 1 took 1220 us forward (192 reversed) and
  // float64 over (256, 1024) 1415 (163), against 177 and 133 skewed (1 thread).
  const int64_t skew = NG > 1 && common >= 4 * SKEW * NG ? SKEW : 0;
  int64_t at[NG];  // each chain's next step
  for (int g = 0; g < NG; ++g) {
    at[g] = 1;
    for (; at[g] < 1 + skew * g; ++at[g]) walk(g, at[g]);
  }
  const int64_t n = common - 1 - skew * (NG - 1);  // steps every chain still has
  for (int64_t s = 0; s < n; ++s) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) walk(g, at[g] + s);
  }
  for (int g = 0; g < NG; ++g) {
    for (int64_t s = at[g] + std::max<int64_t>(n, 0); s < len[g] - X; ++s) walk(g, s);
    if (!WRITE) last[g] = acc[g];
  }
}

// TW chains side by side in tiles transposed in registers (Tiles, tile_scan, tile_scan_part,
// tile_rows: chain_tiles.h, shared with the segmented kernel).

// The steps [s0, s0 + n) (n <= TB) of a tile's chains: transposed in, scanned from acc (or,
// at s0 = 0, from the carry-in, if any), transposed out. A partial tile (n < TB) reads and
// writes its n steps only (masked: see fscan_tile_in).
template <bool WRITE, bool UP, bool EXCL>
static FSCAN_INLINE void tile_step(const In* xb, const Out* yb, const Par p, const int64_t* t0,
                                   const int64_t* elem, const Vals* carry, const bool* has,
                                   int64_t s0, int64_t n, Tiles& tl) {
  const Buf acc = tl.acc.buf();
  const bool part = n < TB;
  const unsigned all = (1u << TB) - 1, m = tile_rows<UP>(n);
  int64_t* const lo = tl.lo;  // each chain's step at the tile's lowest address
  for (int g = 0; g < TW; ++g) lo[g] = UP ? t0[g] + s0 : t0[g] - s0 - (TB - 1);
  if (part) tile_in(xb, lo, tl.in, m);
  else tile_in(xb, lo, tl.in, all);
  if (s0 == 0) {  // the first step: from the carry-in, if any
    for (int g = 0; g < TW; ++g) {
      const int64_t j = g / TV * TB + (UP ? 0 : TB - 1);
      const Vals v = load_i(tile_row(xb[0], tl.in, j), g % TV, t0[g]);
      if (WRITE && EXCL) store_i(tile_row(yb[0], tl.out, j), g % TV, carry[g]);
      put_all(acc, g, has[g] ? combine(carry[g], v, p, elem[g]) : v);
      if (WRITE && !EXCL) store_i(tile_row(yb[0], tl.out, j), g % TV, get_all(acc, g));
    }
    if (part) tile_scan_part<WRITE, UP, 1, EXCL>(xb[0], yb[0], p, elem, acc, tl, n);
    else tile_scan<WRITE, UP, 1, EXCL>(xb[0], yb[0], p, elem, acc, tl);
  } else if (part) {
    tile_scan_part<WRITE, UP, 0, EXCL>(xb[0], yb[0], p, elem, acc, tl, n);
  } else {
    tile_scan<WRITE, UP, 0, EXCL>(xb[0], yb[0], p, elem, acc, tl);
  }
  if (!WRITE) return;
  if (part) tile_out(yb, lo, tl.out, m);
  else tile_out(yb, lo, tl.out, all);
}

template <bool WRITE, bool UP, bool EXCL>
static void tile_chains(const In* xb, const Out* yb, const Par p, const int64_t* t0,
                        const int64_t* len, const int64_t* elem, const Vals* carry,
                        const bool* has, Vals* last, const In* hb, const bool* head, Tiles& tl) {
  const Buf acc = tl.acc.buf();
  int64_t common = len[0];
  for (int g = 1; g < TW; ++g) common = std::min(common, len[g]);
  // The steps every chain has, in tiles, the last one partial where TB does not divide
  // them: walking those steps a chain at a time ran (4096, 255) dim 1 1.6x slower than
  // (4096, 256) (the exclusive drop-ins' repeat route then scanned n - 1 steps).
  int64_t low[TW];  // each chain's lowest tiled step
  for (int g = 0; g < TW; ++g) low[g] = UP ? t0[g] : t0[g] - common + 1;
  const int64_t ahead = len[0] == common ? ahead_lines(xb, low, common) : 0;
  for (int64_t s0 = 0; s0 < common; s0 += TB) {
    if (ahead) tile_ahead<WRITE>(xb[0], yb[0], low[0] + TW * common + s0 / TB * ahead * 16, ahead);
    tile_step<WRITE, UP, EXCL>(xb, yb, p, t0, elem, carry, has, s0, std::min(TB, common - s0), tl);
  }
  // Chains longer than the shortest walk their remaining steps, a chain at a time
  // (interleaving G of them here ran slower: add over (4096, 5) dim 1, 2.4 ns an element,
  // one by one 1.7; the affine pair 9.6, 2.8).
  const int64_t tstep = UP ? 1 : -1;
  for (int g = 0; g < TW; ++g) {
    if (common == 0) {
      chains<1, WRITE, EXCL>(xb + g, yb + g, p, t0 + g, len + g, elem + g, tstep, carry + g, has + g, last + g, hb + g, head + g);
      continue;
    }
    const Vals a = get_all(acc, g);
    const int64_t t1 = t0[g] + common * tstep, n1 = len[g] - common;
    const bool yes = true, no = false;
    if (n1 > 0) chains<1, WRITE, EXCL>(xb + g, yb + g, p, &t1, &n1, elem + g, tstep, &a, &yes, last + g, hb + g, &no);
    else if (!WRITE) last[g] = a;
  }
}

// TW whole lanes from lane0 on (steps [0, T), no head element), tiled as tile_chains does,
// but shaped as the segmented kernel's seg_row_tiles (segmented_tiles.h): the lanes' bases
// stepped from lane0 (one division a group), every chain at the same step, a function of
// its own. Through chain_group, each chain described apart in the team's loop (its item,
// its lane's (o, i) and addresses, its head), short chains paid for the set-up: add over
// (16384, 16) dim 1 took 225 us and over (1024, 8, 64) dim 2 264, against 160 and 232 so
// (1 thread, alternating processes). The price: tile_step inlined twice more, a fifth more
// g++ time for a one-leaf kernel (mul 2.3 -> 2.8-3.1 CPU-s); tile_step out of line instead
// ran add over (4096, 256) dim 1 1.5x slower.
// EXCL: every lane's carry is start (the exclusive scan's start value, combined with the
// first step where fold), as chain_path gives a lane's first chunk.
template <bool UP, bool EXCL>
__attribute__((noinline)) static void lane_tiles(const In x, const Out y, const Par p, const Geo& S,
                                                 int64_t lane0, const Vals& start, bool fold,
                                                 Tiles& tl) {
  In xb[TW];
  Out yb[TW];
  int64_t t0[TW], elem[TW];
  Vals carry[TW];
  bool has[TW];
  const int64_t T = S.T;
  const int64_t ahead = whole_lanes<TW>(x, y, S, lane0, xb, yb, elem);  // chain_tiles.h
  for (int g = 0; g < TW; ++g) {
    t0[g] = UP ? 0 : T - 1;
    carry[g] = start;
    has[g] = EXCL && fold;
  }
  for (int64_t s0 = 0; s0 < T; s0 += TB) {
    if (ahead) tile_ahead<true>(xb[0], yb[0], TW * T + s0 / TB * ahead * 16, ahead);
    tile_step<true, UP, EXCL>(xb, yb, p, t0, elem, carry, has, s0, std::min(TB, T - s0), tl);
  }
}

// Chains per group: TW where they may be tiled, else G.
static constexpr int CG = TILED ? TW : G;

// ng chains: tiled, or G at a time interleaved, or (fewer than a group) one by one.
template <bool WRITE, bool EXCL = false>
static void chain_group(const In* xb, const Out* yb, const Par p, int ng, const int64_t* t0,
                        const int64_t* len, const int64_t* elem, int64_t tstep, const Vals* carry,
                        const bool* has, Vals* last, const In* hb, const bool* head, Tiles& tl) {
  // A chain at a time, by prefix scans (forward_prefix.h), which have no exclusive mode
  // (constexpr: the exclusive variant compiles none).
  if constexpr (!EXCL) {
    if (PREFIX_ON && prefixable(xb[0], yb[0])) {
      prefix_group<WRITE>(xb, yb, p, ng, t0, len, elem, tstep, carry, has, last, hb, head);
      return;
    }
  }
  // Chains of WALK_FROM steps or more (position leaves: see chain_path) one at a time.
  const bool lone = len[0] >= WALK_FROM && steps_dense(xb[0]) && steps_dense(yb[0]);
  if (ng == CG && !lone) {
    bool heads = false;
    for (int g = 0; g < ng; ++g) heads |= head[g];
    // Tiled where every chain's steps are dense, where a tensor whose steps are not holds
    // the group's chains side by side (tile_rows_fit: rows copied, not transposed), and
    // for an expensive combine in any layout (TILE_ANY: elements gathered into the tile
    // where neither holds). A transposed input scanned into torch's contiguous outputs
    // is the second: walked, logcumsumexp over (256, 4096).t() dim 0 took 11.1-11.7 ms,
    // 4.7x the same scan of contiguous memory; x[:, ::2] dim 1 the third.
    if (TILED && !heads && (tileable(xb[0], yb[0]) || TILE_ANY || tile_rows_fit(xb, yb, t0))) {
      if (tstep > 0) tile_chains<WRITE, true, EXCL>(xb, yb, p, t0, len, elem, carry, has, last, hb, head, tl);
      else tile_chains<WRITE, false, EXCL>(xb, yb, p, t0, len, elem, carry, has, last, hb, head, tl);
      return;
    }
    for (int h = 0; h < ng; h += G)
      chains<G, WRITE, EXCL>(xb + h, yb + h, p, t0 + h, len + h, elem + h, tstep, carry + h, has + h,
                       last + h, hb + h, head + h);
    return;
  }
  // Reversed chains read downwards: the group's from the last (one descending stream).
  for (int k = 0; k < ng; ++k) {
    const int g = tstep > 0 ? k : ng - 1 - k;
    chains<1, WRITE, EXCL>(xb + g, yb + g, p, t0 + g, len + g, elem + g, tstep, carry + g, has + g,
                           last + g, hb + g, head + g);
  }
}

// EXCL: the exclusive scan (see scan in forward.h): its start value (the heads' first
// element, position -1) is every lane's first chunk's carry (has where fold), so that
// chunk may be tiled.
template <bool EXCL>
static void chain_path(const In x, const Out y, const Par p, const Geo& S, bool rev, int nt,
                       const Heads& H, bool fold = true) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  int64_t C = 1;  // chunks per lane
  // Prefix chains (forward_prefix.h) go one at a time: chunked only for the threads; so do
  // chains of WALK_FROM steps or more (generated: cummax/cummin's position leaves, whose
  // chains walked one at a time in memory order beat the tiles from 128 steps: see
  // _cpp_source.WALK_FROM), walked by chain_group, where each is one stream through memory
  // (steps_dense, in and out: a transposed input scanned into torch's contiguous outputs
  // is not, its outputs a row apart, and its lone walk took 6.5x the time of the same scan
  // into outputs laid out as the input).
  const bool lone = T >= WALK_FROM && steps_dense(x) && steps_dense(y);
  const int64_t cg = (!EXCL && PREFIX_ON && prefixable(x, y)) || lone ? 1 : CG;
  // ... and only from 3 threads: chunked, a chain is read twice (the chunks' totals, then
  // the scan), so on 2 threads the longer thread's path is a whole pass again, plus the
  // team and both threads sharing memory bandwidth: max over (1048576,) float32 took
  // 401-423 us on 2 threads against 220-229 us on one (quiet machine, wall-clock medians).
  if (cg == 1 && lanes < nt && nt < 3) nt = 1;
  if (lanes < (int64_t)nt * cg) {
    C = std::min<int64_t>(((int64_t)nt * cg + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
    if (C >= cg) C = C / cg * cg;
  }
  int64_t L = (T + C - 1) / C;
  // Interleaved chunks of one lane at power-of-two distances share cache sets: skew them.
  if (C > 1 && inner == 1) L = (L + 15) / 16 * 16 + 16;
  C = (T + L - 1) / L;
  const int64_t tstep = rev ? -1 : 1;
  const int64_t items = lanes * C, groups = (items + CG - 1) / CG;
  // Item k: chunk c of lane (o, i), k = lane * C + c. A pass steps from one item to the
  // next by increments (a division or two per chain, which GCC keeps even where C or
  // inner is 1, cost 18% on 64-step chains).
  struct Item { int64_t lane, c, o, i; };
  auto item = [&](int64_t k) {
    const int64_t lane = k / C, o = lane / inner;
    return Item{lane, k - lane * C, o, lane - o * inner};
  };
  auto next = [&](Item& it) {
    if (++it.c < C) return;
    it.c = 0;
    ++it.lane;
    if (++it.i == inner) { it.i = 0; ++it.o; }
  };
  auto describe = [&](const Item& it, In& xb, Out& yb, int64_t& t0, int64_t& len, int64_t& elem,
                      In& hb, bool& head) {
    const int64_t s = it.c * L;
    t0 = rev ? T - 1 - s : s;
    xb = at(x, S, it.o, 0, it.i);
    yb = at(y, S, it.o, 0, it.i);
    len = std::min(T, s + L) - s;
    elem = it.lane;
    head = !EXCL && H.any && it.c == 0;  // the scan's first step: from the carry-in's head element
    if (head) hb = head_at(x, H, it.lane);
  };
  std::vector<Vals> tot(C > 1 ? items : 0);
  Vals start{};  // EXCL: the first chunk's carry
  if (EXCL && H.any) start = load_t(head_at(x, H, 0), 0, -1);
  // Groups of TW whole lanes that chain_group would tile (no heads: the exclusive scan's
  // are its start value): lane_tiles.
  const bool whole = TILED && C == 1 && cg == CG && (EXCL || !H.any) && tileable(x, y);
  // Chunks' totals by chunk_totals where no chunk reads a head element (the exclusive
  // scan's start value, the drop-ins' identity, is a carry: folded into its lane's first
  // chunk's total where fold, as the tiles fold it).
  const bool summed = CHUNK_TOTALS != TOTAL_NONE && (EXCL || !H.any) && steps_dense(x);
  fscan_team(nt, [&] {
    Tiles tl;
    In xb[CG], hb[CG];
    Out yb[CG];
    int64_t t0[CG], len[CG], elem[CG];
    Vals carry[CG];
    bool has[CG], head[CG];
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int ng = (int)std::min<int64_t>(CG, items - gi * CG);
        Item it = item(gi * CG);
        for (int g = 0; g < ng; ++g, next(it)) {
          describe(it, xb[g], yb[g], t0[g], len[g], elem[g], hb[g], head[g]);
          has[g] = EXCL && it.c == 0 && fold;
          if (EXCL && it.c == 0) carry[g] = start;
        }
        Vals* const last = tot.data() + gi * CG;
        bool walk = !summed;
        if (summed) {
          chunk_totals(xb, t0, len, ng, tstep, last);
          for (int g = 0; g < ng; ++g) {
            if (!has[g]) continue;
            const Vals v = combine(carry[g], last[g], p, elem[g]);
            walk |= suspect(carry[g], last[g], v);  // not what the steps give: walk the group
            last[g] = v;
          }
        }
        if (walk) chain_group<false>(xb, yb, p, ng, t0, len, elem, tstep, carry, has, last, hb, head, tl);
      }
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < lanes; ++lane)
        for (int64_t c = 1; c < C - 1; ++c) {
          const int64_t k = lane * C + c;
          const Vals v = combine(tot[k - 1], tot[k], p, lane);
          if (!suspect(tot[k - 1], tot[k], v)) {
            tot[k] = v;
            continue;
          }
          // Composing the chunk is not what its steps give (see suspect): walk them.
          describe(item(k), xb[0], yb[0], t0[0], len[0], elem[0], hb[0], head[0]);
          has[0] = true;
          carry[0] = tot[k - 1];
          chain_group<false>(xb, yb, p, 1, t0, len, elem, tstep, carry, has, &tot[k], hb, head, tl);
        }
    }
#pragma omp for schedule(static)
    for (int64_t gj = 0; gj < groups; ++gj) {
      // Reversed lone chains read memory downwards: their groups from the last too.
      const int64_t gi = rev && cg == 1 ? groups - 1 - gj : gj;
      const int ng = (int)std::min<int64_t>(CG, items - gi * CG);
      if (whole && ng == CG) {
        if (rev) lane_tiles<false, EXCL>(x, y, p, S, gi * CG, start, fold, tl);
        else lane_tiles<true, EXCL>(x, y, p, S, gi * CG, start, fold, tl);
        continue;
      }
      Item it = item(gi * CG);
      for (int g = 0; g < ng; ++g, next(it)) {
        describe(it, xb[g], yb[g], t0[g], len[g], elem[g], hb[g], head[g]);
        has[g] = it.c != 0 || (EXCL && fold);
        if (it.c != 0) carry[g] = tot[gi * CG + g - 1];
        else if (EXCL) carry[g] = start;
      }
      chain_group<true, EXCL>(xb, yb, p, ng, t0, len, elem, tstep, carry, has, nullptr, hb, head, tl);
    }
  });
}
