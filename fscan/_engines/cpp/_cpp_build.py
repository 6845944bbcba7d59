"""Compile and load generated C++ through Inductor's C++ code cache.

Inductor brings a compiler driver with ``-march=native`` (its ``cpp.march``
setting, ``TORCHINDUCTOR_CPP_MARCH``), a disk cache (its cache directory,
``TORCHINDUCTOR_CACHE_DIR``, shared across processes, with file locks) and a fast
binding that passes tensors as data pointers. Not its vector ISA
(``needs_vec_isa=False``): picking one compiles a probe of ATen's vector headers per
ISA into each new cache directory and loads each in a child Python once per process
(1.0 s of every process's first kernel, 11.6 s in a fresh cache directory: Inductor's
three AVX and three BF16 probes before fscan's first build could start), and its
flags (``-mavx512f ...``, ``-DCPU_CAPABILITY_AVX512``) add nothing to
``-march=native``: the affine pair's forward kernel disassembles to the same
instructions with and without them. The kernels' intrinsics follow the compiler's
own ``__AVX512F__`` / ``__AVX2__``. Three settings matter for a scan kernel, all
appended after Inductor's flags so they win:

* ``-ftree-loop-vectorize``: Inductor passes ``-fno-tree-loop-vectorize`` (it
  vectorises by hand), which in GCC also disables ``#pragma omp simd`` loops;
* ``-fno-trapping-math``: Inductor's ``-fno-unsafe-math-optimizations`` turns
  trapping math on, which stops GCC from if-converting selects (``torch.where``);
* ``-fno-math-errno`` (and ``-lmvec``): vector math calls (glibc's libmvec).

``-fwrapv`` makes signed integer overflow wrap, as torch's integer ops do, and
``-ffp-contract=off`` keeps ``a * b + c`` two roundings and ``-fsigned-zeros``
undoes Inductor's ``-fno-signed-zeros``, as in torch eager.
Inductor's precompiled ``cpp_prefix.h`` (ATen's vector headers) is not used:
it is not needed, is slower to build and clashes with names here. The binding
releases the GIL while the kernel runs.

A kernel's source starts with the ``#include`` of the precompiled system headers
(:mod:`._cpp_pch`: a third of a build's CPU was parsing them); a kernel that fails to
build with it is built once without it (then, if that works, no PCH in this process).

A cached library is verified before it is loaded. Inductor links straight into
its cache path and loads whatever file is there: a linker killed mid-write or a
full disk leaves a truncated library, and mapping one kills the process (SIGBUS
inside dlopen). So fscan keeps a manifest beside each library it loads
(``<library>.fscan``: its size and SHA-256, written atomically once a build of
this process loaded), and loads a library only if it matches its manifest, or if
this very load built it and its ELF headers and segments lie within the file.
Anything else (no manifest, a mismatch, a truncated or corrupted file, a library
of an older fscan) is removed under Inductor's lock for its key and built again,
once; a second failure is the caller's fallback (the torch engine). The manifest
lives beside the library, not in fscan's own directory, so it follows
``TORCHINDUCTOR_CACHE_DIR`` and is removed with the cache; hashing a library costs
about a millisecond per load, once per process.

Example:
    >>> compiler_problem() is None or isinstance(compiler_problem(), str)
    True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _cpp_pch
from ._cpp_mvec import MVEC

__all__ = ["EXTRA_FLAGS", "MANIFEST_SUFFIX", "compiler_problem", "load_kernel"]

EXTRA_FLAGS = (
    "-ftree-loop-vectorize",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-fwrapv",
    "-ffp-contract=off",
    "-fsigned-zeros",
) + (("-lmvec",) if MVEC else ())


@functools.cache
def compiler_problem() -> str | None:
    """Why no kernel can be built here (no Inductor C++ cache, no compiler), or None."""
    try:
        from torch._inductor import cpp_builder
        from torch._inductor.codecache import CppPythonBindingsCodeCache  # noqa: F401
    except Exception as err:  # an old or stripped torch: the torch engine serves
        return f"Inductor's C++ code cache is unavailable ({type(err).__name__}: {err})"
    try:
        compiler = cpp_builder.get_cpp_compiler()
    except Exception as err:
        return f"no C++ compiler found ({type(err).__name__}: {err})"
    if shutil.which(compiler) is None:
        return f"the C++ compiler {compiler!r} is not installed"
    return None


@functools.cache
def _bindings() -> Any:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    class ScanBindings(CppPythonBindingsCodeCache):
        """Inductor's Python bindings, minus its precompiled header, with the GIL released."""

        cache: dict[str, Any] = {}  # noqa: RUF012  (Inductor's own layout: a class dict)
        # The arguments are parsed with the GIL held, then the kernel runs without it.
        call_entry_function = (
            "[](auto... a) {{ Py_BEGIN_ALLOW_THREADS kernel(a...); Py_END_ALLOW_THREADS }}({}); "
            "Py_RETURN_NONE;"
        )

        @classmethod
        def _get_uncompiled_header(cls, device: str) -> str | None:
            return None

        @classmethod
        def _load_library_inner(cls, path: str, key: str) -> Any:
            if f"{key}.{cls.entry_function}" not in sys.modules:  # else mapped already
                _verify(path, key)
            return super()._load_library_inner(path, key)

    return ScanBindings


MANIFEST_SUFFIX = ".fscan"  # the manifest of a cached library: <library>.fscan

# When this thread's current load_kernel began (ns): a library written since was built
# by it (the build takes far longer than the file system's clock granularity).
_loading = threading.local()


class _Rebuild(Exception):
    """A cached library failed verification and was removed: load again to rebuild it."""


def _verify(path: str, key: str) -> None:
    """Return if the library at ``path`` may be loaded (module doc); else remove it and
    its manifest under Inductor's lock for ``key`` and raise :class:`_Rebuild`."""
    from torch._inductor.codecache import LOCK_TIMEOUT, get_lock_dir
    from torch.utils._filelock import FileLock

    manifest = path + MANIFEST_SUFFIX
    with FileLock(os.path.join(get_lock_dir(), key + ".lock"), timeout=LOCK_TIMEOUT):
        found = _inspect(path)
        since = getattr(_loading, "since", None)
        if found is not None:
            size, digest, complete = found
            if _read_manifest(manifest) == {"size": size, "sha256": digest}:
                return
            if complete and since is not None and os.stat(path).st_mtime_ns >= since:
                _write_manifest(manifest, size, digest)  # built by this load
                return
        for stale in (path, manifest):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
    raise _Rebuild(f"the cached kernel {path} did not match its manifest: removed")


def _inspect(path: str) -> tuple[int, str, bool] | None:
    """The size, SHA-256 and completeness of the file at ``path`` (None if unreadable)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return len(data), hashlib.sha256(data).hexdigest(), _complete_elf(data)


def _complete_elf(data: bytes) -> bool:
    """Whether an ELF file's header tables and loaded segments lie within ``data`` (a
    truncated library's do not); True for other formats (the loader rejects garbage).

    Example:
        >>> _complete_elf(b"not ELF"), _complete_elf(b"\\x7fELF" + bytes(10))
        (True, False)
    """
    if data[:4] != b"\x7fELF":
        return True
    if len(data) < 52 or data[4] not in (1, 2) or data[5] not in (1, 2):
        return False
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    header = order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH")
    if len(data) < 16 + struct.calcsize(header):
        return False
    fields = struct.unpack_from(header, data, 16)
    phoff, shoff, phentsize, phnum, shentsize, shnum = fields[4], fields[5], *fields[8:12]
    size = len(data)
    if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        return False
    # A segment's file extent: p_offset and p_filesz (p_type, p_flags first when 64-bit).
    segment = order + ("IIQQQQ" if wide else "IIIII")
    for k in range(phnum):
        values = struct.unpack_from(segment, data, phoff + k * phentsize)
        offset, filesz = (values[2], values[5]) if wide else (values[1], values[4])
        if offset + filesz > size:
            return False
    return True


def _read_manifest(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _write_manifest(path: str, size: int, digest: str) -> None:
    # Atomically (a rename): a reader sees the old manifest, or none, or the new one.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"size": size, "sha256": digest}, f)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: the library is loaded, just not recorded
        with contextlib.suppress(OSError):
            os.remove(tmp)


def load_kernel(source: str, argtypes: Sequence[str]) -> Callable[..., None]:
    """Compile ``source`` (or find it, verified, in the disk cache: module doc) and
    return its ``kernel`` entry.

    Raises whatever the compiler or loader raises; the caller turns that into a fallback.
    """
    for attempt in (0, 1):
        _loading.since = time.time_ns()
        try:
            return _load(source, argtypes)
        except _Rebuild:
            if attempt:
                raise
        finally:
            _loading.since = None
    raise AssertionError("unreachable")


def _load(source: str, argtypes: Sequence[str]) -> Callable[..., None]:
    bindings = _bindings()
    line = _cpp_pch.include_line(bindings, EXTRA_FLAGS)
    if not line:
        return _load_pybinding(bindings, source, argtypes)
    try:
        return _load_pybinding(bindings, line + source, argtypes)
    except _Rebuild:
        raise
    except Exception:
        # Built without the precompiled header: if that works, the PCH was at fault (a
        # corrupt .gch GCC refused): none in this process. Else the kernel's own error.
        kernel = _load_pybinding(bindings, source, argtypes)
        _cpp_pch.disable(line)
        return kernel


def _load_pybinding(bindings: Any, source: str, argtypes: Sequence[str]) -> Callable[..., None]:
    try:
        return bindings.load_pybinding(
            list(argtypes), source, extra_flags=EXTRA_FLAGS, needs_vec_isa=False
        )
    except TypeError:  # an Inductor without `needs_vec_isa`
        return bindings.load_pybinding(list(argtypes), source, extra_flags=EXTRA_FLAGS)
