"""The C++ kernel's disk cache: a damaged cached library is rebuilt, never loaded.

Inductor loads whatever file is at a kernel's cache path; a truncated library (a
linker killed mid-write, a full disk) killed the process with SIGBUS inside dlopen.
Each case below builds a kernel in a cache directory of its own, damages the library
(or its manifest) on disk, and loads it again in a fresh process: it must exit 0,
give the torch engine's results on the kernel, and have rebuilt the library.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fscan
from fscan._engines.cpp._cpp_build import MANIFEST_SUFFIX, _complete_elf, compiler_problem

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

# Scans with the kernel (built on the first call) and with the torch engine; prints
# whether the kernel served and whether the two agree.
CHILD = """
import json, optree, torch, fscan
from fscan._engines.cpp import cpu_kernel
x = torch.arange(1.0, 2001.0, dtype=torch.float64).reshape(200, 10)
fn = lambda a, b: a + b
leaves, spec = optree.tree_flatten(x)
with fscan.config.override(cpu_kernel="eager"):
    got = cpu_kernel.kernel_scan("test", fn, spec, leaves, 0, False)
with fscan.config.override(cpu_kernel="off"):
    want = fscan.associative_scan(fn, x, 0)
served = got is not None
print(json.dumps({"served": served, "equal": served and torch.equal(got[0], want)}))
"""


def _child(cache: Path) -> dict[str, bool]:
    """Run CHILD in a fresh process on ``cache``: exit 0 (no SIGBUS), its report."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(fscan.__file__).parents[1]), *sys.path])
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _library(cache: Path) -> Path:
    """The kernel's library (Inductor's own probe of the vector ISA is another .so)."""
    (found,) = cache.rglob("*.main.so")
    return found


def _truncate(lib: Path, manifest: Path) -> None:
    lib.write_bytes(lib.read_bytes()[: lib.stat().st_size // 3])


def _truncate_without_manifest(lib: Path, manifest: Path) -> None:
    _truncate(lib, manifest)
    manifest.unlink()


def _corrupt(lib: Path, manifest: Path) -> None:  # same size, bytes flipped mid-file
    data = bytearray(lib.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    lib.write_bytes(bytes(data))


def _empty(lib: Path, manifest: Path) -> None:
    lib.write_bytes(b"")


def _garbage_manifest(lib: Path, manifest: Path) -> None:
    manifest.write_text("{not json")


def _no_manifest(lib: Path, manifest: Path) -> None:  # intact, but nothing vouches for it
    manifest.unlink()


DAMAGES = {
    "truncated": _truncate,
    "truncated, manifest gone": _truncate_without_manifest,
    "corrupted": _corrupt,
    "empty": _empty,
    "manifest garbage": _garbage_manifest,
    "manifest gone": _no_manifest,
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache directory holding one built kernel, and that library's bytes."""
    cache = tmp_path_factory.mktemp("inductor_cache")
    assert _child(cache) == {"served": True, "equal": True}
    lib = _library(cache)
    return cache, lib.read_bytes()


def _restore(cache: Path, good: bytes) -> tuple[Path, Path]:
    """The built library back in place, with its manifest; both paths."""
    lib = _library(cache)
    lib.write_bytes(good)
    manifest = Path(f"{lib}{MANIFEST_SUFFIX}")
    digest = hashlib.sha256(good).hexdigest()
    manifest.write_text(json.dumps({"size": len(good), "sha256": digest}))
    return lib, manifest


OLD = 10**18  # ns: a file from 2001, written by no load of the child


@needs_compiler
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_cached_kernel_is_rebuilt_in_a_fresh_process(damage, built):
    cache, good = built
    lib, manifest = _restore(cache, good)
    DAMAGES[damage](lib, manifest)
    os.utime(lib, ns=(OLD, OLD))
    assert _child(cache) == {"served": True, "equal": True}
    assert lib.stat().st_mtime_ns != OLD  # rebuilt (the same bytes, where only the
    rebuilt = lib.read_bytes()  # manifest was damaged: the build is deterministic)
    assert _complete_elf(rebuilt)
    recorded = json.loads(manifest.read_text())
    assert recorded == {"size": len(rebuilt), "sha256": hashlib.sha256(rebuilt).hexdigest()}


@needs_compiler
def test_an_intact_cached_kernel_is_loaded_not_rebuilt(built):
    cache, good = built
    lib, _ = _restore(cache, good)
    os.utime(lib, ns=(OLD, OLD))  # an old file: only its manifest vouches for it
    assert _child(cache) == {"served": True, "equal": True}
    assert lib.stat().st_mtime_ns == OLD and lib.read_bytes() == good


@needs_compiler
def test_truncated_libraries_are_incomplete_elf(built):
    _, good = built
    assert _complete_elf(good)
    for size in (64, 1000, len(good) // 2, len(good) - 1):
        assert not _complete_elf(good[:size]), size
