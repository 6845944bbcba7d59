// The forward scan's entry: scan() sends a scan to the lane path (forward_lanes.h:
// columns of lanes, vector loops along each row) or the chain path (forward_chains.h:
// lanes walked one by one, or tiled), each splitting T into chunks when there are too
// few columns or chains for the threads. fscan._engines.cpp._cpp_source places the three
// files, lanes, chains and this one, after the generated part they are written against
// (Vals, In, Out, Par, Buf, Store, InRow, OutRow, Heads, LANE_BLOCK, load_*/store_*/get*/
// put*, combine, suspect) and before the generated entry point, which calls scan().

// The lane path wants lanes next to each other in memory (SIMD over them); where an
// input or output is laid out along T instead (a transpose: T stride below the inner
// stride), the chain path walks each lane along its contiguous steps.
static void scan(const In x, const Out y, const Par p, const Geo& S, bool rev, int threads,
                 const Heads& H) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t total = S.outer * S.T * S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / PER_THREAD));
  if (S.inner >= VEC_MIN && !along(x) && !along(y)) {
    lane_path(x, y, p, S, rev, nt, H);
  } else {
    chain_path(x, y, p, S, rev, nt, H);
  }
}
