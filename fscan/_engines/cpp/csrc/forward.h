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
// The exclusive scan (the kernel's EXCLUSIVE_MODE), written in one pass: output step t
// is the running value before step t's input is combined, the carry-in at the first step
// in scan order. Its carry-in is the heads' FIRST element, shared by every lane (the start
// value: the drop-ins' identity; a position leaf starts at -1 there, in both directions),
// and is combined with the first step where fold (a true carry-in, not a replacement of
// that step as the inclusive scan's heads are), else only written there, the first step's
// input starting the running value (for an identity e with combine(e, x) == x exactly, the
// same values without the combine: logcumsumexp's -inf start took float32 subnormal assists
// in logaddexp, 1.10x the inclusive call over (1024, 8, 64) dim 1); it needs heads. (The
// exclusive drop-ins' repeat route used to run the inclusive scan with the input read one
// step behind the output, or n - 1 steps into shifted outputs and a strided fill of the
// first step: the latter a second pass over memory, the former no tiles on the chain path,
// where heads disable them.)
// EXCLUSIVE_MODE (generated: forward_source's exclusive) picks the instantiations: a kernel
// compiles either the exclusive paths or the inclusive ones, never both. Both made every
// one-leaf kernel's build twice as dear (float32 add: 6.7 CPU-s of g++, 3.6 with one), so
// the exclusive scan is a kernel variant of its own (an entry of its own: the slot key's
// last field), built only where an exclusive drop-in asks for it. (A runtime select between
// the two stores in the row loop built 25-30% faster but kept the lane add from
// vectorising: ~6x slower.)
// GATHER_MODE (generated: forward_source's gather) splits the kernel by layout: the
// gather variant is the lane path's GATHER instantiations alone (rows of other inner
// strides than 1, gathered and scattered), for the calls that need them and nothing else:
// the lane path's test below passes and some inner stride is not 1 (the Python side's
// gathers() decides, mirroring it); the ordinary kernel takes every other call, its lane
// path's rows all dense. The GATHER instantiations were a fifth to a quarter of every
// forward kernel's g++ time where few kernels ever read such a layout (hand builds, CPU-s
// with and without: float32 add 2.41 / 2.04, the affine pair 4.87 / 3.51, cummax 3.88 /
// 3.10), and the variant alone costs about a third of a whole kernel (add 0.89 of 3.27,
// the affine pair 1.99 of 5.84, cummax 1.37 of 4.51, under load). scan_as is a template
// so that if constexpr discards the paths the variant does not take: only in a template
// is a discarded branch guaranteed not to be instantiated.
template <bool GATHER>
static void scan_as(const In x, const Out y, const Par p, const Geo& S, bool rev, bool fold,
                    int nt, const Heads& H) {
  if constexpr (GATHER)
    lane_path<EXCLUSIVE_MODE>(x, y, p, S, rev, nt, H, fold);
  else if (S.inner >= VEC_MIN && !along(x) && !along(y))
    lane_path<EXCLUSIVE_MODE>(x, y, p, S, rev, nt, H, fold);
  else
    chain_path<EXCLUSIVE_MODE>(x, y, p, S, rev, nt, H, fold);
}

static void scan(const In x, const Out y, const Par p, const Geo& S, bool rev, bool fold,
                 int threads, const Heads& H) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t total = S.outer * S.T * S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / PER_THREAD));
  scan_as<GATHER_MODE>(x, y, p, S, rev, fold, nt, H);
}
