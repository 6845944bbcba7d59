"""The precompiled header of the kernels' system includes (``_cpp_pch``): GCC uses it
when it is valid (``-H`` prints ``!`` before a PCH it loads), ignores it when it is
invalid or stale, kernels build without it where it cannot be written, and a kernel
built with it has the same machine code and results as one built without it."""

from __future__ import annotations

import json
import operator
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import optree
import pytest
import torch

import fscan
from fscan._engines.cpp import _cpp_pch, cpu_kernel
from fscan._engines.cpp._cpp_build import EXTRA_FLAGS, _bindings, compiler_problem

needs_gcc = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def _state() -> _cpp_pch._Pch:
    state = _cpp_pch.pch_state(_bindings(), EXTRA_FLAGS)
    if state is None:
        pytest.skip("no PCH with this compiler (not GCC)")
    return state


@pytest.fixture(scope="module")
def pch(tmp_path_factory: pytest.TempPathFactory):
    """A cache directory of this module's, with its PCH built."""
    cache = tmp_path_factory.mktemp("pch_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        mp.setattr(_cpp_pch, "ENABLED", True)
        state = _state()
        _cpp_pch.wait()
        yield state


def _probe(state: _cpp_pch._Pch, header: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """A kernel-like source compiled (syntax only) with a kernel's exact command line,
    plus ``-Winvalid-pch -H``."""
    from torch._inductor.cpp_builder import CppBuilder

    source = tmp_path / "probe.cpp"
    source.write_text(f'#include "{header}"\nstatic double f(double x) {{ return std::exp(x); }}\n')
    command = CppBuilder(
        name=str(tmp_path / "probe"), sources=str(source), BuildOption=state.kernel_options
    ).get_command_line()
    args = [*shlex.split(command), "-fsyntax-only", "-Winvalid-pch", "-H"]
    return subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)


@needs_gcc
def test_used_when_valid(pch, tmp_path):
    assert pch.fresh and Path(pch.gch).is_file()
    done = _probe(pch, pch.header, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"! {pch.gch}" in done.stderr.splitlines()[0], done.stderr[:2000]
    assert "invalid" not in done.stderr


@needs_gcc
def test_include_line_names_the_header(pch, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(pch.directory).parents[1]))
    assert _cpp_pch.include_line(_bindings(), EXTRA_FLAGS) == f'#include "{pch.header}"\n'
    monkeypatch.setattr(_cpp_pch, "ENABLED", False)
    assert _cpp_pch.include_line(_bindings(), EXTRA_FLAGS) == ""


@needs_gcc
def test_built_from_the_second_kernel(tmp_path, monkeypatch):
    """The first kernel of a process gets the include line but starts no build (a
    process of one kernel would spend more on the .gch than it saves); the second does."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cpp_pch, "ENABLED", True)
    line = _cpp_pch.include_line(_bindings(), EXTRA_FLAGS)
    (state,) = [p for p in _cpp_pch._by_dir.values() if p.header in line]
    assert line and Path(state.header).is_file() and state.thread is None
    assert _cpp_pch.include_line(_bindings(), EXTRA_FLAGS) == line
    assert state.thread is not None
    _cpp_pch.wait()
    assert state.fresh and Path(state.gch).is_file()


@needs_gcc
def test_ignored_when_invalid(pch, tmp_path):
    """A damaged .gch: GCC warns (-Winvalid-pch) and parses the header instead."""
    header = tmp_path / _cpp_pch.HEADER
    shutil.copy(pch.header, header)
    Path(f"{header}.gch").write_bytes(b"gpch" + bytes(4096))
    done = _probe(pch, str(header), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{header}.gch" in done.stderr and not done.stderr.startswith("!")


@needs_gcc
def test_stale_is_rebuilt(pch, monkeypatch):
    """A header it was built from changed (its recorded mtime differs): the next process
    (here: a fresh record) builds it again."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(Path(pch.directory).parents[1]))
    deps = json.loads(Path(pch.deps).read_text())
    first = next(iter(deps))
    deps[first][0] -= 1
    Path(pch.deps).write_text(json.dumps(deps))
    monkeypatch.setattr(_cpp_pch, "_by_dir", {})
    # Beside it, another key's directory unused for a month and one used an hour ago:
    # the rebuild (a new .gch) removes the first only.
    unused, used = _sibling(pch, "unused", days=30), _sibling(pch, "used", days=1 / 24)
    line = _cpp_pch.include_line(_bindings(), EXTRA_FLAGS)  # a first kernel's request
    (again,) = _cpp_pch._by_dir.values()
    assert line == f'#include "{again.header}"\n'
    assert not again.fresh and again.thread is not None  # removed, being built again
    _cpp_pch.wait()
    assert again.fresh and not again.gave_up
    assert json.loads(Path(pch.deps).read_text())[first][0] == deps[first][0] + 1
    assert not unused.exists() and (used / _cpp_pch.HEADER).is_file()
    assert time.time() - (Path(pch.directory) / "last_used").stat().st_mtime < 600


def _sibling(pch: _cpp_pch._Pch, name: str, days: float, stamp: bool = True) -> Path:
    """A directory beside ``pch``'s, as another key's: a header, a .gch and (``stamp``)
    its last-used stamp, all ``days`` old."""
    other = Path(pch.directory).parent / name
    other.mkdir()
    files = [_cpp_pch.HEADER, _cpp_pch.HEADER + ".gch"] + ["last_used"] * stamp
    old = time.time() - days * 86400
    for f in files:
        (other / f).write_text("x")
        os.utime(other / f, (old, old))
    os.utime(other, (old, old))
    return other


def test_sweep_keeps_what_was_used_lately(tmp_path):
    """The sweep judges a sibling by its stamp, else its .gch, else the directory; keeps
    its own directory, recent siblings and files; removes what is older than STALE_DAYS."""
    own = _cpp_pch._Pch(str(tmp_path / "fscan_pch" / "own"), "own", "")
    Path(own.directory).mkdir(parents=True)
    days = _cpp_pch.STALE_DAYS
    old_stamp = _sibling(own, "old_stamp", days + 1)
    new_stamp_old_gch = _sibling(own, "new_stamp", days + 1)
    os.utime(new_stamp_old_gch / "last_used")
    old_gch = _sibling(own, "old_gch", days + 1, stamp=False)
    _sibling(own, "new_gch", days - 1, stamp=False)
    bare = Path(own.directory).parent / "bare"
    bare.mkdir()
    (Path(own.directory).parent / "a_file").write_text("x")
    removed = _cpp_pch._sweep(own, time.time())
    assert sorted(removed) == sorted(map(str, (old_stamp, old_gch)))
    left = sorted(p.name for p in Path(own.directory).parent.iterdir())
    assert left == ["a_file", "bare", "new_gch", "new_stamp", "own"]
    assert _cpp_pch._sweep(own, time.time() + (days + 1) * 86400) != []  # all age


def _kernel_scan(fn, x):
    """``x`` scanned along dim 0 by the C++ kernel (built on this call if new)."""
    leaves, spec = optree.tree_flatten(x)
    with fscan.config.override(cpu_kernel="eager"):
        got = cpu_kernel.kernel_scan("test", fn, spec, leaves, 0, False)
    assert got is not None, "the kernel did not serve"
    return got[0]


@needs_gcc
def test_unwritable_builds_without(tmp_path, monkeypatch):
    """The PCH directory cannot be made (a file in its place): no include line, and the
    kernel builds as without the PCH."""
    (tmp_path / "fscan_pch").write_text("not a directory")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cpp_pch, "ENABLED", True)
    monkeypatch.setattr(_bindings(), "cache", {})  # built here, not found in memory
    assert _cpp_pch.include_line(_bindings(), EXTRA_FLAGS) == ""
    fscan.clear_caches()
    x = torch.randn(300, 9, dtype=torch.float64)
    got = _kernel_scan(operator.add, x)
    fscan.clear_caches()
    assert list(tmp_path.rglob("*.main.so")), "no kernel was built"
    want = x.clone()
    for t in range(1, len(x)):
        want[t] = want[t - 1] + x[t]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _text(library: Path) -> list[str]:
    """The disassembled .text of ``library``, without its file name."""
    done = subprocess.run(
        ["objdump", "-d", "-j", ".text", str(library)], capture_output=True, text=True, check=True
    )
    return [line for line in done.stdout.splitlines() if str(library) not in line]


@needs_gcc
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump")
def test_same_machine_code_and_results(pch, monkeypatch):
    """The add kernel built with the PCH and without: the same .text, the same values."""
    cache = Path(pch.directory).parents[1]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setattr(_bindings(), "cache", {})  # built here, not found in memory
    x = torch.randn(513, 37)
    results, libraries = [], []
    for enabled in (True, False):
        monkeypatch.setattr(_cpp_pch, "ENABLED", enabled)
        fscan.clear_caches()
        before = set(cache.rglob("*.main.so"))
        results.append(_kernel_scan(operator.add, x))
        (built,) = set(cache.rglob("*.main.so")) - before
        libraries.append(built)
    fscan.clear_caches()
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], torch.cumsum(x.double(), 0).float())
    assert _text(libraries[0]) == _text(libraries[1])
