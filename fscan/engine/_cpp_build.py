"""Compile and load generated C++ through Inductor's C++ code cache.

Inductor brings a compiler driver, the ISA flags of this CPU, a disk cache (its
cache directory, ``TORCHINDUCTOR_CACHE_DIR``, shared across processes, with
file locks) and a fast binding that passes tensors as data pointers. Three
settings matter for a scan kernel, all appended after Inductor's flags so they
win:

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

Example:
    >>> compiler_problem() is None or isinstance(compiler_problem(), str)
    True
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Sequence
from typing import Any

from ._cpp_source import MVEC

__all__ = ["EXTRA_FLAGS", "compiler_problem", "load_kernel"]

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

    return ScanBindings


def load_kernel(source: str, argtypes: Sequence[str]) -> Callable[..., None]:
    """Compile ``source`` (or find it in the disk cache) and return its ``kernel`` entry.

    Raises whatever the compiler or loader raises; the caller turns that into a fallback.
    """
    bindings = _bindings()
    try:
        return bindings.load_pybinding(
            list(argtypes), source, extra_flags=EXTRA_FLAGS, needs_vec_isa=True
        )
    except TypeError:  # an Inductor without `needs_vec_isa`
        return bindings.load_pybinding(list(argtypes), source, extra_flags=EXTRA_FLAGS)
