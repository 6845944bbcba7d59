// The segmented scan's chain path (lanes laid out along T, or fewer than VEC_MIN side by
// side): each lane a chain walked along its steps, restarting where flagged, as the
// forward's chain_path (forward_chains.h) walks it without flags. fscan.engine._kernel_segmented
// places this after csrc/segmented.h (Flags, pick) and before its segmented().
// SEG_TILED (generated, per combine and leaf layout): SEG_TW chains go side by side, as the
// lanes of vector loops, TB steps at a time (a tile, gathered into SoA rows, the flags
// with them); else SEG_G chains (generated: 3, or 1 where the combine selects) are walked
// interleaved, but where SEG_TILE_ROWS (float32 leaves, no positions: cumsum, cumprod)
// and whole lanes read a 1-D mask, or each their own flags as adjacent bytes, tiled as the
// forward's (seg_row_tiles), and chunks of fewer lanes (a 1-D input) whose flags are
// adjacent bytes, each chunk a tiled chain (seg_transposed_chains). One chain walked alone
// (the reduce pass over one lane's chunks, the old split) ran 2-3x the forward's chain path; walked
// chains kept cummax's and logcumsumexp's combines scalar (7 and 36 ns an element).
// Its walked chains are csrc/segmented_walk.h, its tiled ones csrc/segmented_tiles.h,
// both placed before this file (the groups of chains and the path).

// Chains per group: SEG_TW where tiled, else SEG_G (generated: 3, or 1 for a combine that
// selects; see fscan._engines.cpp._kernel_segmented.chains_interleaved). SEG_GMAX: the
// larger, the size of a group's arrays.
static constexpr int SEG_GMAX = SEG_TW > SEG_G ? SEG_TW : SEG_G;

// ng chains written: a whole group of SEG_TW tiled (where `tiled`), or SEG_G at a time
// interleaved; fewer, one by one.
static void seg_chain_group(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                            bool rev, bool tiled, int ng, const int64_t* lane, const int64_t* s0,
                            const int64_t* s1, const Vals* const* carry, SegTile& tl) {
  if (tiled && ng == SEG_TW) {
    if (TILED && tileable(x, y)) {
      if (rev) seg_transposed_chains<false>(x, y, p, R, S, lane, s0, s1, carry, tl.t);
      else seg_transposed_chains<true>(x, y, p, R, S, lane, s0, s1, carry, tl.t);
    } else if (SEG_TILED) {  // (SEG_TILE_ROWS tiles only where tileable: not compiled there)
      seg_tile_chains(x, y, p, R, S, rev, lane, s0, s1, carry, tl);
    }
    return;
  }
  int g = 0;
  for (; g + SEG_G <= ng; g += SEG_G) seg_chains<SEG_G>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g);
  for (; g < ng; ++g) seg_chains<1>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g);
}

// The totals of ng chains (seg_totals): SEG_G at a time, the rest one by one.
static void seg_total_group(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                            bool rev, int ng, const int64_t* lane, const int64_t* s0,
                            const int64_t* s1, const Vals* const* carry, Vals* last,
                            uint8_t* seen) {
  int g = 0;
  for (; g + SEG_G <= ng; g += SEG_G)
    seg_totals<SEG_G>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g, last + g, seen + g);
  for (; g < ng; ++g)
    seg_totals<1>(x, y, p, R, S, rev, lane + g, s0 + g, s1 + g, carry + g, last + g, seen + g);
}

// The chain path, as chain_path (forward_chains.h): where lanes are fewer than a group per
// thread, each is split into C chunks (their totals, then the scan: the totals composed
// in order, except where a chunk restarts the lane: its total is then the carry on).
static void seg_chain_path(const In x, const Out y, const Par p, const Flags R, const Geo& S,
                           bool rev, int nt) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  auto chunks = [&](int64_t cg) {  // chunks per lane, for groups of cg chains
    if (lanes >= (int64_t)nt * cg) return (int64_t)1;
    const int64_t c = std::min<int64_t>(((int64_t)nt * cg + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
    return c >= cg ? c / cg * cg : c;
  };
  // Tiled: every group where SEG_TILED; else (SEG_TILE_ROWS: an arithmetic combine of
  // float32 leaves) where the tiles transpose in registers and every chain of a group
  // reads one row of flags at the same steps (a 1-D mask, whole lanes): 5 tiles in 6 then
  // scan without flags, as the forward's (cumsum over (4096, 256) dim 1, a restart every
  // 97 steps: see fscan._engines.cpp._kernel_segmented.chains_tiled).
  // Flags every lane reads alike (a 1-D mask, or a mask broadcast over the lanes, whose
  // stride over a dim of one need not be 0): a stride 0, or one lane, along each lane dim.
  const bool shared = (R.sa == 0 || S.outer <= S.nb) && (R.sb == 0 || S.nb == 1) && (R.si == 0 || inner == 1);
  bool tiled = SEG_TILED;
  if (!SEG_TILED && SEG_TILE_ROWS && TILED && tileable(x, y)) tiled = shared && chunks(SEG_TW) == 1;
  // Where the tiles transpose in registers and each chain's steps' flags are adjacent bytes:
  const bool step_bytes = (SEG_TILED || SEG_TILE_ROWS) && TILED && tileable(x, y) && R.st == 1;
  // whole lanes reading each their own flags (a mask of x's shape along its last dim): row
  // tiles too (seg_row_tiles, LANES);
  const bool lane_rows = step_bytes && !shared && chunks(SEG_TW) == 1;
  // lanes split into chunks (fewer lanes than a group of chains a thread: a 1-D input):
  // each chunk a chain of the transposed tiles (seg_transposed_chains), its flags read as
  // bits. Cumsum over (1048576,) against its inclusive call, walked (3 chunks interleaved)
  // -> tiled: a random mask 1.15-1.18x -> 1.02-1.07x, a restart every 97 steps 1.00-1.02x
  // -> 1.03-1.12x (see fscan._engines.cpp._kernel_segmented.chains_tiled).
  tiled |= lane_rows || (step_bytes && chunks(SEG_TW) > 1);
  const int64_t cg = tiled ? SEG_TW : SEG_G;
  int64_t C = chunks(cg);
  int64_t L = (T + C - 1) / C;
  // Chunks of one lane at power-of-two distances share cache sets: skew them.
  if (C > 1 && inner == 1) L = (L + 15) / 16 * 16 + 16;
  C = (T + L - 1) / L;
  const int64_t items = lanes * C, groups = (items + cg - 1) / cg;
  std::vector<Vals> tot(C > 1 ? items : 0);
  std::vector<uint8_t> seen(tot.size());
  // Tiled whole lanes reading a 1-D mask: each tile's restarts as bits, read once here
  // (each group reading its tiles' flags cost 5% of cumsum over (4096, 256) dim 1).
  std::vector<uint32_t> bits(tiled && C == 1 && shared ? (T + TB - 1) / TB : 0);
  for (int64_t s = 0; s < (bits.empty() ? 0 : T); ++s)
    bits[s / TB] |= (uint32_t)(step(R, rev ? T - 1 - s : s) != 0) << (s % TB);
  const uint32_t* const rows = bits.empty() ? nullptr : bits.data();
  const bool row_tiles = (rows != nullptr && TILED && tileable(x, y)) || lane_rows;
  fscan_team(nt, [&] {
    SegTiles tiles;
    SegTile tl(tiles);
    int64_t lane[SEG_GMAX], s0[SEG_GMAX], s1[SEG_GMAX];
    const Vals* carry[SEG_GMAX];
    auto describe = [&](int g, int64_t k, bool write) {
      const int64_t c = k % C;
      lane[g] = k / C;
      s0[g] = c * L;
      s1[g] = std::min(T, (c + 1) * L);
      carry[g] = write && c > 0 ? &tot[k - 1] : nullptr;
    };
    if (C > 1) {  // every chunk's total but each lane's last
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        int64_t ks[SEG_GMAX];
        Vals last[SEG_GMAX];
        uint8_t restarts[SEG_GMAX];
        int ng = 0;
        for (int64_t k = gi * cg; k < std::min(items, (gi + 1) * cg); ++k)
          if (k % C != C - 1) { ks[ng] = k; describe(ng++, k, false); }
        seg_total_group(x, y, p, R, S, rev, ng, lane, s0, s1, carry, last, restarts);
        for (int g = 0; g < ng; ++g) { tot[ks[g]] = last[g]; seen[ks[g]] = restarts[g]; }
      }
#pragma omp for schedule(static)
      for (int64_t ln = 0; ln < lanes; ++ln) {
        for (int64_t c = 1; c < C - 1; ++c) {
          const int64_t k = ln * C + c;
          if (seen[k]) continue;  // restarted in the chunk: its total is the carry on
          const Vals l = tot[k - 1], r = tot[k], v = combine(l, r, p, ln);
          if (!suspect(l, r, v)) {
            tot[k] = v;
            continue;
          }
          // Composing is not what the steps give (see suspect): walk the chunk.
          describe(0, k, false);
          carry[0] = &tot[k - 1];
          Vals walked;
          uint8_t again;
          seg_totals<1>(x, y, p, R, S, rev, lane, s0, s1, carry, &walked, &again);
          tot[k] = walked;
        }
      }
    }
    // Reversed, walked groups from the last: each chain walks its lane downwards, so the
    // lanes taken from the last make one descending stream through memory (from the first,
    // each lane's walk started a new one: cummax over (4096, 256) dim 1, a restart every 97
    // steps, walked reversed in 2.3 ms against 1.2 forward, the kernel's caches warm). Row
    // tiles go from the first in both directions, as the forward's tiles do: each group
    // asks the caches for the block above it (tile_ahead in seg_row_tiles), so taken from
    // the last, every block came from memory (cumsum over (4096, 256) dim 1 reversed with a
    // restart every 97 steps, outputs out of cache: 1004 us against 497 forward).
#pragma omp for schedule(static)
    for (int64_t gj = 0; gj < groups; ++gj) {
      const int64_t gi = rev && !row_tiles ? groups - 1 - gj : gj;
      const int ng = (int)std::min<int64_t>(cg, items - gi * cg);
      if (row_tiles && ng == SEG_TW) {  // whole lanes (C == 1): item gi * cg is lane gi * cg
        if (lane_rows) {
          if (rev) seg_row_tiles<false, true>(x, y, p, R, S, gi * cg, nullptr, tiles);
          else seg_row_tiles<true, true>(x, y, p, R, S, gi * cg, nullptr, tiles);
        } else {
          if (rev) seg_row_tiles<false, false>(x, y, p, R, S, gi * cg, rows, tiles);
          else seg_row_tiles<true, false>(x, y, p, R, S, gi * cg, rows, tiles);
        }
        continue;
      }
      for (int g = 0; g < ng; ++g) describe(g, gi * cg + g, true);
      seg_chain_group(x, y, p, R, S, rev, tiled, ng, lane, s0, s1, carry, tl);
    }
  });
}
