"""A precompiled header (GCC's PCH) of the system headers every kernel includes.

Every kernel starts with the same system includes (``csrc/prelude.h`` up to its
``FSCAN_PCH_END`` line: ``<immintrin.h>``, ``<cmath>``, ``<algorithm>``, ...) and ends
with Inductor's binding's (``<Python.h>``, ...); parsing them is about a third of a
kernel build's CPU (1 s of 3). So they are compiled once per Inductor cache directory
(``TORCHINDUCTOR_CACHE_DIR``: it follows it and is removed with it) into
``fscan_pch/<key>/scan_std.h.gch``, and a kernel's source starts with
``#include "<that dir>/scan_std.h"``: GCC then loads the ``.gch`` instead of parsing
the headers, and where the ``.gch`` is missing or invalid it parses the header
silently, so the kernel's text, and its machine code, are the same either way (and so
is its cache key: a kernel built before the ``.gch`` was ready is found again after).

``key`` hashes everything GCC's PCH validity depends on: the compiler's path and
version, Inductor's exact command line for a kernel (its flags plus ``EXTRA_FLAGS``),
the header's text; the headers it pulled in are recorded (path, mtime, size: from
``-MD``) and checked once per process, so an updated system header rebuilds it.

Each key has a directory of its own, so a new fscan, torch or compiler (a new key) leaves
the old one behind: a process stamps the directory it uses (``last_used``, once per
process), and a process that builds a new ``.gch`` removes the sibling directories no
process stamped for :data:`STALE_DAYS` days (another venv sharing the cache dir keeps
its own fresh by using it; a process that still held a removed one sees its include fail
and builds without it, as above).

The ``.gch`` (about 90 MB, 3-4 s of CPU) is built in a thread of its own beside the
second kernel build of a process that wants it (which goes on without it: no call
waits for it; a process that ends meanwhile waits for it at exit; a process that
builds one kernel, as the tests that each use a fresh cache dir, builds none), under a
file lock taken without waiting (xdist workers: one builds, the others compile without
it meanwhile), written to a temporary name and renamed into place; a failed build is
not tried again in that process (kernels parse the header). No include line at all
where the compiler is not GCC (clang's PCH is another format), in fbcode's
relative-path builds, where the directory cannot be written, or in a process where a
kernel failed to build with it and built without it: the kernel's source is then
exactly what it was without this module.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Any

from ._cpp_source import csrc

__all__ = ["ENABLED", "HEADER", "STALE_DAYS", "disable", "include_line", "pch_state", "wait"]

ENABLED = True  # False: kernels are built without a PCH (measurements, tests)
HEADER = "scan_std.h"
_END = "// FSCAN_PCH_END"
_FORMAT = 1  # bump when the layout of the directory changes
_STAMP = "last_used"  # touched once per process that uses the directory
STALE_DAYS = 14  # a sibling directory unused this long is removed by a new build

logger = logging.getLogger("fscan")


class _Pch:
    """One PCH directory of this process: its header, what builds its ``.gch``, and
    whether the ``.gch`` was checked fresh, is being built, or failed."""

    def __init__(self, directory: str, key: str, command: str) -> None:
        self.directory = directory
        self.key = key
        self.header = os.path.join(directory, HEADER)
        self.gch = self.header + ".gch"
        self.deps = self.header + ".deps.json"
        self.command = command  # builds <header>.<pid>.tmp.gch
        self.kernel_options: Any = None  # Inductor's build options of a kernel (tests)
        self.fresh = False
        self.failed = False  # no include line: the header cannot be written, or a kernel failed
        self.gave_up = False  # the .gch failed to build: kernels parse the header
        self.thread: threading.Thread | None = None
        self.requests = 0  # kernels of this process that asked for it


_by_dir: dict[str, _Pch] = {}
_lock = threading.Lock()


def header_text(bindings: Any) -> str:
    """The precompiled header: the prelude's system includes, then the binding's (the
    leading preprocessor lines of Inductor's ``suffix_template``), in the order a
    kernel's source has them.

    Example:
        >>> from fscan._engines.cpp._cpp_build import _bindings
        >>> "#include <Python.h>" in header_text(_bindings())
        True
    """
    prelude = csrc("prelude.h")
    includes = prelude[: prelude.index(_END)] if _END in prelude else ""
    binding = []
    for line in bindings.suffix_template.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            binding.append(stripped)
        elif stripped and not stripped.startswith("//"):
            break
    return includes + "\n".join(binding) + "\n"


def include_line(bindings: Any, extra_flags: Sequence[str]) -> str:
    """``#include "<dir>/scan_std.h"`` (with its newline) to start a kernel's source, or
    "" where there is no PCH (module doc); starts building the ``.gch`` if it is
    missing or stale. Never raises."""
    if not ENABLED:
        return ""
    try:
        pch = _prepare(bindings, extra_flags, eager=False)
    except Exception as err:  # the kernel is built as without this module
        logger.debug("fscan: no precompiled header: %s: %s", type(err).__name__, err)
        return ""
    if pch is None or pch.failed:
        return ""
    return f'#include "{pch.header}"\n'


def disable(line: str) -> None:
    """A kernel failed to build with ``line`` and built without it: no PCH for this
    directory in this process."""
    with _lock:
        for pch in _by_dir.values():
            if line == f'#include "{pch.header}"\n':
                pch.failed = True


def pch_state(bindings: Any, extra_flags: Sequence[str]) -> _Pch | None:
    """This process's PCH record for the current cache directory (tests, measurements)."""
    return _prepare(bindings, extra_flags, eager=True)


def wait(timeout: float | None = None) -> None:
    """Wait for this process's ``.gch`` builds (tests, measurements)."""
    with _lock:
        threads = [p.thread for p in _by_dir.values() if p.thread is not None]
    for thread in threads:
        thread.join(timeout)


def _prepare(bindings: Any, extra_flags: Sequence[str], eager: bool) -> _Pch | None:
    """This process's record of the PCH for the current cache dir, its header written;
    the build of its ``.gch`` started if missing or stale, from the second kernel of this
    process that asks (a process that builds one kernel would spend more on it than
    it saves), or at once if ``eager``."""
    from torch._inductor import config, cpp_builder
    from torch._inductor.codecache import get_compiler_version_info
    from torch._inductor.cpu_vec_isa import invalid_vec_isa
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if config.is_fbcode() or not cpp_builder.is_gcc():
        return None
    # The options load_pybinding gives Inductor's CppBuilder for a kernel (load_async).
    options = dict(
        bindings.cpp_compile_command_flags,
        device_type="cpu",
        extra_flags=tuple(extra_flags),
        use_relative_path=False,
        vec_isa=invalid_vec_isa,  # as the kernels: no ISA flags (see fscan._engines.cpp._cpp_build)
    )
    kernel_options = cpp_builder.CppTorchDeviceOptions(
        compile_only=False, min_optimize=False, **options
    )
    kernel_command = cpp_builder.CppBuilder(
        name="o", sources="i", BuildOption=kernel_options
    ).get_command_line()
    compiler = kernel_options.get_compiler()
    where = shutil.which(compiler)
    if where is None:
        return None
    text = header_text(bindings)
    identity = [_FORMAT, os.path.realpath(where), get_compiler_version_info(compiler)]
    identity += [kernel_command, text]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    directory = os.path.join(os.path.abspath(cache_dir()), "fscan_pch", key)
    if any(c in directory for c in '"\\\n'):  # not writable in an #include "..."
        return None
    with _lock:
        pch = _by_dir.get(directory)
        if pch is None:
            header = os.path.join(directory, HEADER)
            builder = cpp_builder.CppBuilder(
                name=f"{header}.{os.getpid()}.tmp",
                sources=header,
                BuildOption=cpp_builder.CppTorchDeviceOptions(
                    precompiling=True,
                    # the same, less the libraries (-lmvec): g++ would link the header
                    **dict(options, extra_flags=[f for f in extra_flags if f[:2] != "-l"]),
                ),
            )
            pch = _by_dir[directory] = _Pch(directory, key, builder.get_command_line())
            pch.kernel_options = kernel_options
            if not _write_header(pch, text):
                pch.failed = True
        building = pch.thread is not None and pch.thread.is_alive()
        if pch.failed or pch.fresh or pch.gave_up or building:
            return pch
        if _is_fresh(pch):
            _mark_fresh(pch)
            return pch
        if os.path.exists(pch.gch):  # stale: no kernel may use it; build it again now
            with contextlib.suppress(OSError):
                os.remove(pch.gch)
            eager = True
        pch.requests += 1
        if pch.requests < 2 and not eager:
            return pch
        # Not a daemon (a thread's default is its creator's: fscan's compile thread is
        # one): a process that exits meanwhile waits for the .gch (seconds, once per
        # cache dir) instead of leaving g++ to write a temporary file no one renames.
        pch.thread = threading.Thread(target=_build, args=(pch,), name="fscan-pch", daemon=False)
        pch.thread.start()
    return pch


def _write_header(pch: _Pch, text: str) -> bool:
    """Write the header (atomically) unless it is there already; False if it cannot be."""
    try:
        with open(pch.header, encoding="utf-8") as f:
            if f.read() == text:
                return True
    except OSError:
        pass
    tmp = f"{pch.header}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(pch.directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, pch.header)
        return True
    except OSError as err:  # a read-only cache: kernels are built without a PCH
        logger.debug("fscan: no precompiled header (%s)", err)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return False


def _is_fresh(pch: _Pch) -> bool:
    """Whether the ``.gch`` exists and every header it was built from is as recorded."""
    if not os.path.exists(pch.gch):
        return False
    try:
        with open(pch.deps, encoding="utf-8") as f:
            recorded = json.load(f)
        for path, (mtime, size) in recorded.items():
            st = os.stat(path)
            if (st.st_mtime_ns, st.st_size) != (mtime, size):
                return False
    except (OSError, ValueError, TypeError):
        return False
    return True


def _build(pch: _Pch) -> None:
    """Build the ``.gch`` (module doc), unless another process is building it; on a
    failure, kernels parse the header (this process tries no more)."""
    try:
        from filelock import Timeout
        from torch._inductor.codecache import get_lock_dir
        from torch.utils._filelock import FileLock

        lock = FileLock(os.path.join(get_lock_dir(), f"fscan_pch_{pch.key}.lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:  # another process builds it: kernels go without it meanwhile
            return
        try:
            _build_locked(pch)
        finally:
            lock.release()
    except Exception as err:
        pch.gave_up = True
        logger.debug("fscan: building the precompiled header failed: %s", err)


def _mark_fresh(pch: _Pch) -> None:
    """The ``.gch`` is fresh: this process uses it from now on; stamp its directory."""
    pch.fresh = True
    stamp = os.path.join(pch.directory, _STAMP)
    with contextlib.suppress(OSError):
        with open(stamp, "a", encoding="utf-8"):
            pass
        os.utime(stamp)


def _sweep(pch: _Pch, now: float) -> list[str]:
    """Remove the directories beside ``pch``'s that no process stamped for
    :data:`STALE_DAYS` days (their ``last_used``, else their ``.gch``, else the
    directory's own time); the removed paths."""
    parent = os.path.dirname(pch.directory)
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        other = os.path.join(parent, name)
        if other == pch.directory or not os.path.isdir(other):
            continue
        for mark in (_STAMP, HEADER + ".gch", ""):
            try:
                used = os.stat(os.path.join(other, mark) if mark else other).st_mtime
                break
            except OSError:
                continue
        else:
            continue
        if now - used > STALE_DAYS * 86400:
            shutil.rmtree(other, ignore_errors=True)
            removed.append(other)
    if removed:
        logger.debug("fscan: removed unused precompiled headers: %s", removed)
    return removed


def _build_locked(pch: _Pch) -> None:
    if _is_fresh(pch):
        _mark_fresh(pch)
        return
    for stale in glob.glob(os.path.join(glob.escape(pch.directory), "*.tmp*")):
        with contextlib.suppress(OSError):
            os.remove(stale)  # left by a process killed mid-build (this one holds the lock)
    with contextlib.suppress(FileNotFoundError):
        os.remove(pch.gch)  # stale: no kernel may use it any more
    tmp_gch = f"{pch.header}.{os.getpid()}.tmp.gch"
    tmp_deps = f"{pch.header}.{os.getpid()}.tmp.d"
    try:
        command = [*shlex.split(pch.command), "-MD", "-MF", tmp_deps]
        done = subprocess.run(command, cwd=pch.directory, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        with open(tmp_deps, encoding="utf-8") as f:
            deps = f.read().split(":", 1)[1].replace("\\\n", " ").split()
        recorded = {}
        for dep in deps:
            path = os.path.abspath(os.path.join(pch.directory, dep))
            with contextlib.suppress(OSError):
                st = os.stat(path)
                recorded[path] = [st.st_mtime_ns, st.st_size]
        tmp_json = f"{pch.deps}.{os.getpid()}.tmp"
        with open(tmp_json, "w", encoding="utf-8") as f:
            json.dump(recorded, f)
        os.replace(tmp_json, pch.deps)
        os.replace(tmp_gch, pch.gch)
        _mark_fresh(pch)
        _sweep(pch, time.time())
    finally:
        for tmp in (tmp_gch, tmp_deps):
            with contextlib.suppress(OSError):
                os.remove(tmp)
