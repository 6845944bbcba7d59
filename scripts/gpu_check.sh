#!/usr/bin/env bash
# GPU check for fscan: the CUDA tests, then the GPU benchmark table, in under 5 minutes.
#
#   bash scripts/gpu_check.sh            # from anywhere; PYTHON=/path/to/python to choose one
#
# What it assumes of the machine (it checks each and says what is missing):
#   * a Python >= 3.10 with torch built for CUDA (torch.cuda.is_available()), and
#     Triton, which torch's CUDA wheels bring along. GPU machines usually have this
#     preinstalled; if not: `pip install torch` (CUDA wheels) first.
#   * optree and pytest: installed with `pip install --user` when missing (this
#     needs the network; on an offline machine install them beforehand).
# fscan itself is not installed: the repository root goes on PYTHONPATH, so the
# machine's site-packages stay as they were.
#
# Output goes to the terminal and to $OUT/gpu_check.log when $OUT is set (else
# ./gpu_check.log). Exit status: 0 when the tests pass and the table was made.
# GPU_CHECK_ALLOW_CPU=1 runs the script without a GPU (CUDA tests skipped, no
# table, no Triton needed): a check of the script itself.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LOG="${OUT:-$ROOT}/gpu_check.log"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
exec > >(tee "$LOG") 2>&1
start=$SECONDS

step() { printf '\n== %s (%ds)\n' "$1" "$((SECONDS - start))"; }
fail() { printf '\ngpu_check: %s\n' "$1"; exit 1; }

step "environment"
"$PY" - <<'PY' || fail "torch with CUDA and Triton are needed: install a CUDA build of torch (pip install torch; it brings Triton), or set PYTHON= to a Python that has one."
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
import os
if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" and not torch.cuda.is_available():
    print("no CUDA device: GPU_CHECK_ALLOW_CPU=1, checking the script only")
    sys.exit(0)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
import triton
print("triton", triton.__version__)
PY
for module in optree pytest; do
  if ! "$PY" -c "import $module" 2>/dev/null; then
    echo "installing $module (pip --user)"
    "$PY" -m pip install --user --quiet "$module" || fail "$module is missing and pip could not install it."
  fi
done
"$PY" -c "import fscan, optree; print('fscan', fscan.__version__, 'from', fscan.__file__, '| optree', optree.__version__)" \
  || fail "fscan does not import from $ROOT."
git -C "$ROOT" log -1 --format='commit %h %s' 2>/dev/null || true

step "CUDA tests (tests/test_cuda.py: real kernels, plus the dispatch tests)"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py
tests=$?

step "GPU benchmark (python -m fscan.bench.gpu)"
timeout 240 "$PY" -m fscan.bench.gpu
bench=$?

step "done: tests exit $tests, benchmark exit $bench, log in $LOG"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
