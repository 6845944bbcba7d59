"""Inductor's Python wrapper calling a Python kernel of one of fscan's ops directly
(:func:`call_directly`): the twins that compiled graphs run (``fscan::kernel_scan_run``,
``fscan::kernel_scan_backward_run``) skip the dispatcher's trip to Python, which boxes
the arguments, unboxes them back and runs the autograd fallback (measured in
:mod:`fscan._engines.cpp.traced_kernel`'s doc)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["call_directly"]


def call_directly(op: Any, module: str, function: str) -> None:
    """Have Inductor's Python wrapper call ``module.function`` where it would call ``op``, a
    fallback of one of fscan's ops whose CPU kernel is that function: the same arguments
    and results, without the dispatcher's trip to Python (module doc). The function is
    looked up on its module at each call, as the op's kernel looks it up."""
    try:  # a private table of Inductor's: without it, the wrapper calls the op
        from torch._inductor.codegen.custom_extern_kernel_codegen import (
            CUSTOM_EXTERN_KERNEL_CODEGEN,
            CustomCodegen,
        )
    except ImportError:
        return
    from torch._inductor.virtualized import V

    package, _, name = module.rpartition(".")
    alias = f"fscan_{name}"

    def python(node: Any, writeline: Callable[[str], None]) -> None:
        wrapper = V.graph.wrapper_code
        wrapper.add_import_once(f"from {package} import {name} as {alias}")
        args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
        call = f"{alias}.{function}({args})"
        writeline(f"{wrapper.declare}{node.get_name()} = {call}{wrapper.ending}")

    # The name Inductor gives the fallback (ir.FallbackKernel.set_python_kernel_name).
    op_name = f"{op.__module__.replace('._ops.', '.ops.')}.{op.__name__}"
    CUSTOM_EXTERN_KERNEL_CODEGEN[op_name] = CustomCodegen(python=python)
