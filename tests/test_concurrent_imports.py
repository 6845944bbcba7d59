"""Tracing fscan beside threads that import: Dynamo iterates the dicts it reads while it
traces, and a module added to ``sys.modules`` (or a pytree node registered) by another
thread meanwhile made the trace fail ("dictionary changed size during iteration"). Nothing
fscan traces reads ``sys.modules``, and fscan's own background thread (the C++ kernel's
warm-up and compiles) imports nothing a trace could be running beside."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch
from helpers import linear_recurrence

import fscan


def _churn(stop: threading.Event) -> None:
    """Add and remove modules in ``sys.modules``, as imports in another thread do."""
    i = 0
    while not stop.is_set():
        name = f"_fscan_test_module_{i % 64}"
        if sys.modules.pop(name, None) is None:
            sys.modules[name] = types.ModuleType(name)
        i += 1
        time.sleep(0)  # hand the GIL back after each change


def _traced_calls(x: torch.Tensor, w: torch.nn.Parameter) -> tuple[torch.Tensor, ...]:
    # The two front ends that look for DTensors: a plain leaf and a Parameter leaf (a
    # tensor subclass: the DTensor class is looked up), and a recurrence's number gate.
    # Any two-leaf combine does; this one's C++ kernels (float32, forward and backward)
    # are the suite's commonest, so the test builds none of its own.
    return (
        *fscan.associative_scan(linear_recurrence, (x, w), 0),
        fscan.linear_recurrence(0.5, x, 0),
    )


# Dynamo's clean-up of the globals it installs (CleanupManager, a weakref callback) raises
# an unraisable KeyError where those globals were cleared first (a doctest's, by the
# doctest runner): torch's, surfacing in whichever test runs at the next collection, and
# no part of what this test checks (the trace itself must not fail).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_trace_beside_a_thread_that_imports():
    x, w = torch.randn(9, 3), torch.nn.Parameter(torch.randn(9, 3))
    expected = _traced_calls(x, w)
    stop = threading.Event()
    thread = threading.Thread(target=_churn, args=(stop,), daemon=True)
    interval = sys.getswitchinterval()
    # Switch threads often (every 0.1 ms): the trace's loop over a dict meets the churn.
    sys.setswitchinterval(1e-4)
    thread.start()
    try:  # on the unfixed code, every trace failed
        torch._dynamo.reset()
        compiled = torch.compile(_traced_calls, backend="eager", fullgraph=True)
        for got, want in zip(compiled(x, w), expected):
            torch.testing.assert_close(got, want)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
        torch._dynamo.reset()


def test_the_background_warm_up_imports_nothing_a_trace_could_run_beside():
    """Once torch._dynamo is imported (the only way a trace can be running), the kernel's
    background warm-up imports nothing: the rest is imported by the scan that queues a
    compile. In a fresh process, where nothing else has imported Inductor yet."""
    script = textwrap.dedent(
        """
        import sys
        import torch._dynamo
        import fscan
        from fscan._engines.cpp import _kernel_builder
        before = set(sys.modules)
        _kernel_builder.warm_up()
        print(sorted(set(sys.modules) - before))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert run.stdout.strip() == "[]", run.stdout[:2000]
