"""Test-session defaults.

Engine. The suite runs what users run: pointwise CPU scans go to the generated C++
kernel, in mode ``cpu_kernel="eager"`` (built on the first call and waited for, so
which engine answers never depends on timing; the default mode ``"on"`` switches
to the kernel when its background build finishes, and has tests of its own in
tests/test_cpu_kernel.py). ``FSCAN_CPU_KERNEL=off`` (or any mode) set in the
environment is respected: ``FSCAN_CPU_KERNEL=off python -m pytest`` is the
torch-engine-only run.

A test that needs fscan's torch engine whatever the session runs carries
``@pytest.mark.torch_engine`` (it then runs with ``cpu_kernel="off"``): checks
with zero tolerance between two runs that the kernel's rounding breaks
(gradcheck's reentrancy check, exact equality with torch's own ops), and tests of
the torch engine itself. The marker's reason belongs in a comment beside it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import settings

import fscan
from fscan._config import ENV_CPU_KERNEL

# The session's mode: the environment's when set, else "eager" (module doc).
SESSION_CPU_KERNEL = os.environ.get(ENV_CPU_KERNEL, "").strip().lower() or "eager"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "torch_engine: run on fscan's torch engine (cpu_kernel='off') whatever the session's "
        "mode; say why in a comment",
    )


@pytest.fixture(autouse=True, scope="session")
def _session_cpu_kernel():
    """The session's CPU kernel mode (module doc)."""
    with fscan.config.override(cpu_kernel=SESSION_CPU_KERNEL):
        yield


@pytest.fixture(autouse=True)
def _torch_engine_marker(request: pytest.FixtureRequest):
    """``@pytest.mark.torch_engine``: this test runs with ``cpu_kernel="off"``."""
    if request.node.get_closest_marker("torch_engine") is None:
        yield
        return
    with fscan.config.override(cpu_kernel="off"):
        yield


# Scheduling under pytest-xdist's --dist loadfile (the README's command): xdist hands out
# whole files, those with the most tests first, so a file of a few long tests came last and
# ran alone while the other workers sat idle (test_compile_inductor.py: 5 tests, about 2.5
# CPU-minutes of Inductor compiles, was the last file). These files start first instead,
# heaviest first (CPU seconds of a profile of the suite, December 2026); the rest keep
# xdist's order. A stale list only costs wall time, never a test.
HEAVY_FEW_TEST_FILES = (
    "tests/test_compile.py",  # 180 s, 45 tests
    "tests/test_compile_inductor.py",  # 160 s, 5 tests
    "tests/test_traced_adjoint.py",  # 110 s, 13 tests
    "tests/test_cpu_kernel_cache.py",  # 75 s, 8 tests
    "tests/test_traced_kernel.py",  # 75 s, 42 tests
    "tests/test_examples.py",  # 70 s, 9 tests
    "tests/test_log_linear.py",  # 60 s, 57 tests
    "tests/test_concurrent_imports.py",  # 40 s, 2 tests
    "tests/test_specials.py",  # 35 s, 8 tests
    "tests/test_kernel_pch.py",  # 30 s, 7 tests
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class HeavyFilesFirst(LoadFileScheduling):
        def _assign_work_unit(self, node):
            if not getattr(self, "_heavy_first", False):  # the queue is full by the first call
                self._heavy_first = True
                # xdist's internals (an OrderedDict of scopes): where another version has
                # none, its own order stands.
                queue = getattr(self, "workqueue", None)
                for scope in reversed(HEAVY_FEW_TEST_FILES):
                    if hasattr(queue, "move_to_end") and scope in queue:
                        queue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return HeavyFilesFirst(config, log)


# Every test draws its random tensors from a seed of its own: a failure reproduces
# from its name alone, and CI does not pass or fail by luck. FSCAN_TEST_SEED picks
# another family of seeds (and random hypothesis examples) to hunt for rare failures.
SEED = int(os.environ.get("FSCAN_TEST_SEED", "0"))
settings.register_profile("fscan", derandomize=SEED == 0, print_blob=True)
settings.load_profile("fscan")


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"fscan test seed: FSCAN_TEST_SEED={SEED}; CPU kernel mode: "
        f"{ENV_CPU_KERNEL}={SESSION_CPU_KERNEL}"
    )


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest) -> None:
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + SEED)


@pytest.fixture
def runs_of(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[object]]:
    """``runs_of(name, *modules, kept=...)``: the runs (each call's first argument) that
    the function ``name`` of ``modules`` serves, as they happen: one function, wrapped in
    each module that holds it (its first module's), a run kept where ``kept(out)``."""

    def record(name: str, *modules: Any, kept: Callable[[Any], bool] = lambda out: True):
        runs: list[object] = []
        original = getattr(modules[0], name)

        def counted(run: object, *args: Any, **kwargs: Any) -> Any:
            out = original(run, *args, **kwargs)
            if kept(out):
                runs.append(run)
            return out

        for module in modules:
            monkeypatch.setattr(module, name, counted)
        return runs

    return record


@pytest.fixture
def served_exclusive(runs_of: Callable[..., list[object]]) -> list[object]:
    """The exclusive runs the drop-ins' repeat route served, as they happen."""
    from fscan._routing import repeat_drop_ins

    return runs_of("run_exclusive", repeat_drop_ins)


@pytest.fixture
def fresh_eager_kernel():
    """fscan's caches cleared before and after a test, kernels built on their first call
    (``cpu_kernel="eager"``): the repeat-route tests count what a call stored and served."""
    fscan.clear_caches()
    with fscan.config.override(cpu_kernel="eager"):
        yield
    fscan.clear_caches()
