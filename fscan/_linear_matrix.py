"""``fscan.linear_recurrence_matrix``: ``h_t = A_t @ h_{t-1} + B_t`` with matrix gates.

States are vectors ``(d,)`` or matrices ``(d, k)`` (the DeltaNet / linear-attention
state); gates ``A`` are ``(d, d)``, per step or shared. One recursion serves every
case: the odd/even scan of :mod:`fscan._engines.tree` (combine neighbouring pairs, scan
the pairs, fill in the rest), specialised to the affine maps ``h -> A h + B``::

    (A1, B1) then (A2, B2) = (A2 @ A1, A2 @ B1 + B2)

* A gate shared over time (``A`` of shape ``(d, d)``, or size 1 along ``dim``,
  e.g. ``(batch, 1, d, d)``) is never materialised per step: every element at
  recursion level ``l`` covers ``2**l`` steps and has the same gate ``A**(2**l)``,
  so a level costs one ``d x d`` product for its gate plus the batched
  ``A**(2**l) @ B`` products: O(n d^2 k) work instead of O(n d^3), and no
  ``(n, d, d)`` tensor in memory.
* Per-step gates compose pairwise as usual, O(n d^3) work.
* ``reset`` marks steps where ``h_{t-1}`` is dropped. Each element carries a flag
  (a reset somewhere in the steps it covers) and the combine *masks the earlier
  operand* where the later one is flagged, ``A2 @ where(f2, 0, B1) + B2``, instead
  of multiplying by a zero gate: ``0 * inf = nan`` never happens, in the forward or
  the backward pass, so NaN and inf propagate exactly as in the sequential loop.
* ``initial`` is carried into the recursion: at every level the first element
  is combined with it (one ``d x d`` by ``d x k`` product per level), rather than
  folded into a copy of ``B``.
* ``reverse`` flips the inputs along time, scans and flips back.
* Products of gates can leave the floats' range (``(2 I)**1024`` is inf, ``(0.1
  I)**512`` is 0) and meet a state the loop would carry (``inf * 0``, ``0 * inf``:
  NaN); the loop never forms them. Any non-finite state in the result is such a
  suspect, so there the result is walked step by step instead (the loop's cost, on
  inputs that are infinite, NaN or out of range anyway).
* While ``torch.compile`` or ``torch.export`` traces, the recursion (which unrolls
  per length) gives way to ``fscan.associative_scan`` in generic mode over
  ``(flag, A, B)`` triples, one length-polymorphic op.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._checks import check_dense, normalize_dim
from ._entry import scan_tree
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe
from ._recurrences.args import broadcasts_to
from ._recurrences.composed_gates import values_hidden
from ._route_log import logs_route

__all__ = ["linear_recurrence_matrix"]

_API = "fscan.linear_recurrence_matrix"
# Up to this many elements a level walks sequentially: the recursion's two
# batched calls per level buy nothing on a handful of steps.
_SEQUENTIAL_CUTOFF = 4


@logs_route(_API)
def linear_recurrence_matrix(
    A: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    matrix_state: bool = False,
) -> torch.Tensor:
    """All states of ``h_t = A_t @ h_{t-1} + b_t`` along ``dim`` (matrix-valued gates).

    Semantics (``h_{-1} = initial``, or 0)::

        for t in range(n):
            h[t] = (0 if reset[t] else A[t] @ h[t - 1]) + b[t]   # along `dim`

    Args:
        A (Tensor): gates ``(*batch_A, d, d)``; ``batch_A`` broadcasts to ``b``'s
            batch (right-aligned, as in torch). Size 1 along ``dim`` (or missing,
            e.g. a plain ``(d, d)``) shares one gate over time, never expanded per step.
        b (Tensor): inputs ``(*batch, d)``, or ``(*batch, d, k)`` with ``matrix_state``.
        dim (int): the time dimension, one of ``batch``; negative counts from the end.
        initial (Tensor or None, default None): the state before the first step,
            broadcastable to one step of ``b`` (``b`` with ``dim`` removed).
        reverse (bool, default False): run from the end, ``h_t = A_t @ h_{t+1} + b_t``.
        reset (bool Tensor or None, default None): where True, ``h_t = b_t``: a 1-D
            mask of length ``n``, or a mask with the batch's dimensions (``b``'s
            dimensions also work if the state's are size 1), broadcastable to it.
        matrix_state (bool, default False): states are ``(d, k)`` matrices.

    Returns:
        Tensor: ``h``, of ``b``'s shape and the promoted dtype; differentiable in
        ``A``, ``b`` and ``initial``, vmappable and compilable.

    Example:
        >>> import fscan, torch
        >>> rotate = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # one gate for every step
        >>> fscan.linear_recurrence_matrix(rotate, torch.tensor([[1.0, 0.0]]).expand(4, 2), 0)
        tensor([[1., 0.],
                [1., 1.],
                [0., 1.],
                [0., 0.]])
        >>> state = fscan.linear_recurrence_matrix(0.5 * torch.eye(3), torch.ones(6, 3, 2), 0,
        ...                                        matrix_state=True)
        >>> tuple(state.shape), state[-1, 0, 0].item()
        ((6, 3, 2), 1.96875)
    """
    A, b, initial, dim, flags = _check(A, b, dim, initial, reverse, reset, matrix_state)
    n = b.shape[dim]
    if n == 0:
        return b.clone()
    z = b if matrix_state else b.unsqueeze(-1)  # (*batch, d, k)
    batch = z.ndim - 2
    A = A.reshape((1,) * (batch + 2 - A.ndim) + tuple(A.shape)).movedim(dim, 0)
    shared = A.shape[0] == 1 and n > 1
    z = z.movedim(dim, 0)
    carry = None if initial is None else _as_state(initial, z, matrix_state)
    if flags is not None:
        flags = flags.movedim(dim, 0)
    if reverse:
        z = z.flip(0)
        A = A if shared else A.flip(0)
        flags = None if flags is None else flags.flip(0)
    if torch.compiler.is_compiling():  # one length-polymorphic graph: see _traced_scan
        h = _traced_scan(z, A, flags, carry)
    else:
        gates = A.squeeze(0) if shared else A
        maps = _Maps(z, gates, flags, carry, shared)
        h = _scan(maps)
        if not values_hidden(h) and not bool(torch.isfinite(h).all()):
            # A product of gates may have left the range and met a state (0 * inf, inf
            # * 0), where the loop never forms it: the loop's answer, step by step.
            h = _walk(maps)
    if reverse:
        h = h.flip(0)
    h = h.movedim(0, dim)
    return h if matrix_state else h.squeeze(-1)


class _Maps(NamedTuple):
    """The maps ``h -> gate_i @ h + z_i``, time first, and the state ``carry`` (or None:
    0) before them. ``gates`` is one gate for every element (``shared``) or one per
    element; ``flags[i]`` says element ``i`` drops what comes before it."""

    z: torch.Tensor
    gates: torch.Tensor
    flags: torch.Tensor | None
    carry: torch.Tensor | None
    shared: bool


def _scan(maps: _Maps) -> torch.Tensor:
    """All prefixes of the maps applied to their ``carry``, time first."""
    z, gates, flags, carry, shared = maps
    m = z.shape[0]
    if m <= _SEQUENTIAL_CUTOFF:
        return _walk(maps)
    p = m // 2
    left, right = slice(0, 2 * p, 2), slice(1, 2 * p, 2)
    f_right = None if flags is None else flags[right]
    g_left, g_right = (gates, gates) if shared else (gates[left], gates[right])
    # Step 1: compose neighbouring pairs, the later one masking the earlier where it resets.
    pair_z = _apply(g_right, _drop(z[left], f_right), shared) + z[right]
    pair_gates = gates @ gates if shared else g_right @ _drop(g_left, f_right)
    pair_flags = None if flags is None else flags[left] | f_right
    # Step 2: their prefixes are the states at the odd positions.
    odd = _scan(_Maps(pair_z, pair_gates, pair_flags, carry, shared))
    # Step 3: the even positions, each from the state just before it.
    f_even = None if flags is None else flags[2::2]
    g_even = gates if shared else gates[2::2]
    rest = _apply(g_even, _drop(odd[: (m - 1) // 2], f_even), shared) + z[2::2]
    first = z[:1]
    if carry is not None:
        g_first = gates if shared else gates[:1]
        f_first = None if flags is None else flags[:1]
        first = _apply(g_first, _drop(carry.unsqueeze(0), f_first), shared) + first
    even = torch.cat([first, rest])
    woven = torch.stack([even[:p], odd], 1).flatten(0, 1)
    return woven if m == 2 * p else torch.cat([woven, even[p:]])


def _traced_scan(
    z: torch.Tensor, A: torch.Tensor, flags: torch.Tensor | None, carry: torch.Tensor | None
) -> torch.Tensor:
    """The same maps through ``fscan.associative_scan`` in generic mode, for
    ``torch.compile`` and ``torch.export``: the recursion above unrolls per length,
    while the scan is one length-polymorphic op (``fscan._engines.traced``). The gates are
    expanded per step here (a view; the traced op materialises what it needs)."""
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


def _walk(maps: _Maps) -> torch.Tensor:
    """The sequential loop, for short levels."""
    z, gates, flags, carry, shared = maps
    states, h = [], carry
    for t in range(z.shape[0]):
        if h is None:
            h = z[t]
        else:
            gate = gates if shared else gates[t]
            h = _apply(gate, _drop(h, None if flags is None else flags[t]), shared, 0) + z[t]
        states.append(h)
    return torch.stack(states)


def _apply(gate: torch.Tensor, h: torch.Tensor, shared: bool, time: int = 1) -> torch.Tensor:
    """``gate @ h`` for states ``h`` (with ``time`` leading dimensions), as one einsum.

    ``torch.matmul`` would broadcast a shared ``(d, d)`` gate to every step (a
    ``(steps, d, d)`` copy, d times the states' size for vector states) before its
    batched product; einsum folds the steps into the product instead.
    """
    if shared and time:
        return torch.einsum("...ij,t...jk->t...ik", gate, h)
    return torch.einsum("...ij,...jk->...ik", gate, h)


def _drop(h: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """``h`` with zeros where ``flag`` is set: a where, not a product, so inf stays out."""
    return h if flag is None else torch.where(flag, 0, h)


def _as_state(initial: torch.Tensor, z: torch.Tensor, matrix_state: bool) -> torch.Tensor:
    """``initial`` as one step's ``(*batch, d, k)`` state (an expanded view)."""
    state = initial if matrix_state else initial.unsqueeze(-1)
    return state.expand(z.shape[1:])


# ---- argument checks --------------------------------------------------------------


def _check(
    A: Any,
    b: Any,
    dim: Any,
    initial: Any,
    reverse: Any,
    reset: Any,
    matrix_state: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.Tensor | None]:
    """Check every argument; return ``A``, ``b``, ``initial`` in one dtype, ``dim`` made
    non-negative, and ``reset`` as flags shaped to broadcast against ``(*batch, d, k)``."""
    for name, value in (("reverse", reverse), ("matrix_state", matrix_state)):
        if not isinstance(value, bool):
            raise ScanTypeError(
                f"{_API}: `{name}` must be a bool, got {type(value).__name__} {value!r}."
            )
    for name, t in (("A", A), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ScanTypeError(f"{_API}: `{name}` must be a torch.Tensor, got {describe(t)}.")
    if initial is not None and not isinstance(initial, torch.Tensor):
        raise ScanTypeError(
            f"{_API}: `initial` must be a torch.Tensor or None, got {describe(initial)}."
        )
    for name, t in (("A", A), ("b", b), ("initial", initial)):
        if t is not None:
            check_dense(_API, f"`{name}`", t)
    state = 2 if matrix_state else 1
    if b.ndim < state + 1:
        need = "(*batch, d, k)" if matrix_state else "(*batch, d)"
        raise ScanValueError(
            f"{_API}: `b` has shape {tuple(b.shape)}, expected {need} with a time dimension "
            "in batch."
        )
    dim = normalize_dim(_API, dim, b.ndim, lambda: "`b`")
    batch = b.shape[: b.ndim - state]
    if dim >= len(batch):
        raise ScanValueError(
            f"{_API}: `dim` {dim} is {'a' if matrix_state else 'the'} state dimension of `b` "
            f"(shape {tuple(b.shape)}), "
            f"expected a batch dimension, one of the first {len(batch)}."
        )
    for name, t in (("A", A), ("initial", initial)):
        if t is not None and t.device != b.device:
            raise ScanValueError(
                f"{_API}: `{name}` is on {t.device}, expected {b.device} like `b`."
            )
    d = b.shape[len(batch)]
    _check_gates(A, b, batch, d, matrix_state)
    if initial is not None:
        step = b.shape[:dim] + b.shape[dim + 1 :]
        if not broadcasts_to(initial.shape, step):
            raise ScanValueError(
                f"{_API}: `initial` of shape {tuple(initial.shape)} does not broadcast to one "
                f"step of `b`, shape {tuple(step)} (`b` with dim {dim} removed)."
            )
    flags = None if reset is None else _flags(reset, b, batch, dim, state)
    dtype = torch.promote_types(A.dtype, b.dtype)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    initial = None if initial is None else initial.to(dtype)
    return A.to(dtype), b.to(dtype), initial, dim, flags


def _check_gates(
    A: torch.Tensor, b: torch.Tensor, batch: torch.Size, d: int, matrix_state: bool
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
            f"{_API}: `A` of shape {tuple(A.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected {(*batch, d, d)}, or a shape broadcasting to it "
            f"(sizes 1 or leading dimensions left out, e.g. ({d}, {d}) shared){hint}."
        )


def _flags(reset: Any, b: torch.Tensor, batch: torch.Size, dim: int, state: int) -> torch.Tensor:
    """``reset`` as a bool tensor of ``len(batch) + 2`` dimensions, broadcastable to
    ``(*batch, d, k)``, the time dimension at ``dim``."""
    n = b.shape[dim]
    if not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool:
        raise ScanTypeError(
            f"{_API}: `reset` must be a bool tensor, got {describe(reset)}; "
            "build it with a comparison, e.g. `done > 0`."
        )
    check_dense(_API, "`reset`", reset)
    if reset.device != b.device:
        raise ScanValueError(
            f"{_API}: `reset` is on {reset.device}, expected {b.device} like `b`; "
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
            f"{_API}: `reset` of shape {tuple(reset.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected a 1-D mask of length {n}, or a mask of the batch "
            f"shape {tuple(batch)} with size {n} along dim {dim} and sizes 1 or the batch's "
            "elsewhere."
        )
    return mask.reshape((*mask.shape, 1, 1))
