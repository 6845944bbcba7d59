"""Every traced route in one graph under Inductor, against eager: outputs and float64 gradients.

Too slow to compile for the test suite (2-10 minutes on 2 cores per mode), which runs its
parts apart: other_routes under aot_eager (tests/test_compile.py), core_routes under
Inductor (tests/test_compile_inductor.py).

    PYTHONPATH=. python scripts/inductor_every_route.py static    # or: dynamic
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import compile_routes as routes  # the tests' route functions and helpers
from test_compile_inductor import TWO_THREADS


def main(mode: str) -> int:
    warnings.simplefilter("ignore")  # Inductor's own deprecation warnings
    dynamic = mode == "dynamic"
    lengths = (11, 21) if dynamic else (11,)
    start, failures = time.perf_counter(), 0
    with torch._inductor.config.patch(TWO_THREADS):
        compiled = torch.compile(routes.every_route, dynamic=dynamic, fullgraph=True)
        for n in lengths:
            args = routes.route_inputs(n)
            want = routes.outputs_and_gradients(routes.every_route, args)
            try:
                routes.assert_trees_close(routes.outputs_and_gradients(compiled, args), want)
                print(f"{mode} n={n}: outputs and gradients match eager", flush=True)
            except AssertionError as err:
                failures += 1
                print(f"{mode} n={n}: MISMATCH {str(err)[:500]}", flush=True)
    print(f"{time.perf_counter() - start:.0f} s")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "static"))
