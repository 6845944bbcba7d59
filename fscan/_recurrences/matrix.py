"""The matrix recurrence's entry (``fscan.linear_recurrence_matrix``): checks, shaping.

:func:`run_linear_recurrence_matrix` checks the arguments, lays the maps out time
first (flipped for ``reverse``) and hands them to the router
(:func:`fscan._routing.recurrence.route_matrix`), with :func:`traced_matrix_scan`,
the maps through the internal entry for ``torch.compile`` and ``torch.export``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._checks import check_dense, normalize_dim
from .._engines.matrix_tree import MatrixMaps
from .._entry import scan_tree
from .._errors import ScanTypeError, ScanValueError
from .._exclusive import Shift, Steps, check_exclusive, exclusive
from .._pytree import describe
from .._routing.recurrence import route_matrix
from .args import RecurrenceCall, broadcasts_to, check_initial_fits

__all__ = ["check_matrix_args", "run_linear_recurrence_matrix", "traced_matrix_scan"]


def run_linear_recurrence_matrix(call: RecurrenceCall, exclusive: Any = False) -> torch.Tensor:
    """``fscan.linear_recurrence_matrix``, its arguments checked here. ``exclusive``: the
    states entering each step (``initial`` or 0 at the first, 0 at the resets): the
    shift of :func:`fscan._exclusive.exclusive` on the maps laid out time first."""
    A, b, initial, dim, flags = check_matrix_args(call)
    if exclusive is not False:
        check_exclusive(call.api, exclusive)
    reverse, matrix_state = call.reverse, call.matrix_state
    z = b if matrix_state else b.unsqueeze(-1)  # (*batch, d, k)
    batch = z.ndim - 2
    A = A.reshape((1,) * (batch + 2 - A.ndim) + tuple(A.shape)).movedim(dim, 0)
    z = z.movedim(dim, 0)
    carry = None if initial is None else _as_state(initial, z, matrix_state)
    if flags is not None:
        flags = flags.movedim(dim, 0)
    if reverse:  # time first and in scan order from here on
        z = z.flip(0)
        A = A if A.shape[0] == 1 else A.flip(0)
        flags = None if flags is None else flags.flip(0)
    if exclusive:
        h = _exclusive_states(z, A, flags, carry, (A, b, initial))
    else:
        h = _states(z, A, flags, carry)
    if reverse:
        h = h.flip(0)
    h = h.movedim(0, dim)
    return h if matrix_state else h.squeeze(-1)


def _states(
    z: torch.Tensor, A: torch.Tensor, flags: torch.Tensor | None, carry: torch.Tensor | None
) -> torch.Tensor:
    """The states of the maps ``(A, z)`` laid out time first, in scan order."""
    shared = A.shape[0] == 1 and z.shape[0] > 1
    gates = A.squeeze(0) if shared else A
    return route_matrix(MatrixMaps(z, gates, flags, carry, shared), traced_matrix_scan)


def _exclusive_states(
    z: torch.Tensor,
    A: torch.Tensor,
    flags: torch.Tensor | None,
    carry: torch.Tensor | None,
    inputs: tuple,
) -> torch.Tensor:
    """The states entering each step of :func:`_states`' maps, 0 at the resets."""
    shift = Shift(0, z.shape[0], False)

    def inclusive(steps: Steps, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        part = None if flags is None else steps.mask(flags)
        return [_states(steps(z), steps(A), part, carry)]

    start = 0.0 if carry is None else carry
    outputs = [(z.shape, z.dtype)]
    return exclusive(shift, inclusive, outputs, z.device, [start], inputs, flags, [0.0])[0]


def traced_matrix_scan(maps: MatrixMaps) -> torch.Tensor:
    """The maps scanned through the internal entry in generic mode, for
    ``torch.compile`` and ``torch.export``: the tree's recursion unrolls per length,
    while the scan is one length-polymorphic op (``fscan._engines.traced``). The gates are
    expanded per step here (a view; the traced op materialises what it needs)."""
    z, A, flags, carry, _ = maps
    steps = z.shape[:-2]
    A = A.expand(*steps, *A.shape[-2:])
    if flags is None:
        flags = torch.zeros((*steps, 1, 1), dtype=torch.bool, device=z.device)
    flags = flags.expand(*steps, 1, 1)
    initial = None
    if carry is not None:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape[1:])
        initial = (torch.zeros_like(flags[0]), eye, carry)
    return scan_tree(_compose, (flags, A, z), 0, False, "generic", initial=initial)[2]


def _compose(x: tuple, y: tuple) -> tuple:
    """``(f1, A1, B1) then (f2, A2, B2)``, the earlier map dropped where ``f2`` resets."""
    (f1, A1, B1), (f2, A2, B2) = x, y
    return f1 | f2, A2 @ torch.where(f2, 0, A1), A2 @ torch.where(f2, 0, B1) + B2


def _as_state(initial: torch.Tensor, z: torch.Tensor, matrix_state: bool) -> torch.Tensor:
    """``initial`` as one step's ``(*batch, d, k)`` state (an expanded view)."""
    state = initial if matrix_state else initial.unsqueeze(-1)
    return state.expand(z.shape[1:])


# ---- argument checks --------------------------------------------------------------


def check_matrix_args(
    call: RecurrenceCall,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """Check every argument; return ``A``, ``b``, ``initial`` in one dtype, ``dim`` made
    non-negative, and ``reset`` as flags shaped to broadcast against ``(*batch, d, k)``."""
    api, A, b, dim, initial, reverse, reset, _, matrix_state = call
    for name, value in (("reverse", reverse), ("matrix_state", matrix_state)):
        if not isinstance(value, bool):
            raise ScanTypeError(
                f"{api}: `{name}` must be a bool, got {type(value).__name__} {value!r}."
            )
    for name, t in (("A", A), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ScanTypeError(f"{api}: `{name}` must be a torch.Tensor, got {describe(t)}.")
    if initial is not None and not isinstance(initial, torch.Tensor):
        raise ScanTypeError(
            f"{api}: `initial` must be a torch.Tensor or None, got {describe(initial)}."
        )
    for name, t in (("A", A), ("b", b), ("initial", initial)):
        if t is not None:
            check_dense(api, f"`{name}`", t)
    state = 2 if matrix_state else 1
    if b.ndim < state + 1:
        need = "(*batch, d, k)" if matrix_state else "(*batch, d)"
        raise ScanValueError(
            f"{api}: `b` has shape {tuple(b.shape)}, expected {need} with a time dimension "
            "in batch."
        )
    dim = normalize_dim(api, dim, b.ndim, lambda: "`b`")
    batch = b.shape[: b.ndim - state]
    if dim >= len(batch):
        raise ScanValueError(
            f"{api}: `dim` {dim} is {'a' if matrix_state else 'the'} state dimension of `b` "
            f"(shape {tuple(b.shape)}), "
            f"expected a batch dimension, one of the first {len(batch)}."
        )
    for name, t in (("A", A), ("initial", initial)):
        if t is not None and t.device != b.device:
            raise ScanValueError(f"{api}: `{name}` is on {t.device}, expected {b.device} like `b`.")
    d = b.shape[len(batch)]
    _check_gates(api, A, b, batch, d, matrix_state)
    check_initial_fits(api, initial, b, dim)
    flags = None if reset is None else _flags(api, reset, b, batch, dim, state)
    dtype = torch.promote_types(A.dtype, b.dtype)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    initial = None if initial is None else initial.to(dtype)
    return A.to(dtype), b.to(dtype), initial, dim, flags


def _check_gates(
    api: str, A: torch.Tensor, b: torch.Tensor, batch: torch.Size, d: int, matrix_state: bool
) -> None:
    fits = (
        2 <= A.ndim <= len(batch) + 2
        and A.shape[-2:] == (d, d)
        and broadcasts_to(A.shape[:-2], batch)
    )
    if not fits:
        hint = (
            "" if matrix_state or A.ndim != b.ndim else "; for (d, k) states pass matrix_state=True"
        )
        raise ScanValueError(
            f"{api}: `A` of shape {tuple(A.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected {(*batch, d, d)}, or a shape broadcasting to it "
            f"(sizes 1 or leading dimensions left out, e.g. ({d}, {d}) shared){hint}."
        )


def _flags(
    api: str, reset: Any, b: torch.Tensor, batch: torch.Size, dim: int, state: int
) -> torch.Tensor:
    """``reset`` as a bool tensor of ``len(batch) + 2`` dimensions, broadcastable to
    ``(*batch, d, k)``, the time dimension at ``dim``."""
    n = b.shape[dim]
    if not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool:
        raise ScanTypeError(
            f"{api}: `reset` must be a bool tensor, got {describe(reset)}; "
            "build it with a comparison, e.g. `done > 0`."
        )
    check_dense(api, "`reset`", reset)
    if reset.device != b.device:
        raise ScanValueError(
            f"{api}: `reset` is on {reset.device}, expected {b.device} like `b`; "
            "move it with .to()."
        )
    if reset.ndim == 1 and reset.shape[0] == n:
        return reset.reshape([n if i == dim else 1 for i in range(len(batch) + 2)])
    mask = reset
    if mask.ndim == b.ndim and all(s == 1 for s in mask.shape[len(batch) :]):
        mask = mask.reshape(mask.shape[: len(batch)])  # b's dimensions, state sizes 1
    fits = (
        mask.ndim == len(batch)
        and all(r in (1, s) for r, s in zip(mask.shape, batch))
        and mask.shape[dim] == n
    )
    if not fits:
        raise ScanValueError(
            f"{api}: `reset` of shape {tuple(reset.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected a 1-D mask of length {n}, or a mask of the batch "
            f"shape {tuple(batch)} with size {n} along dim {dim} and sizes 1 or the batch's "
            "elsewhere."
        )
    return mask.reshape((*mask.shape, 1, 1))
