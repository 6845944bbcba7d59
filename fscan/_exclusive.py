"""Exclusive scans: the ``exclusive=`` option of every door, as one shift of the inclusive scan.

The exclusive output at step ``t`` is the carry *into* step ``t``: the inclusive output
one step earlier in scan order (``t - 1``; ``t + 1`` with ``reverse=True``), ``n`` steps
like the input. At the first step in scan order, and at every step where ``reset=``
starts a segment, it is the door's start value: ``initial`` for
``fscan.associative_scan``; the initial state for the recurrences (zero, ``-inf`` in log
space, by default; zero at a reset, which restarts from zero); the op's identity for
the drop-ins.

No door has an exclusive engine: :func:`exclusive` runs the door's inclusive scan on
the first ``n - 1`` steps in scan order (narrowed views of its inputs, no copy) and
places the results one step later, where

* nothing is recorded (eager, no gradient wanted, no ``torch.func`` transform): the
  results are written straight into the last ``n - 1`` steps of fresh outputs (a
  narrowed view: the C++ kernel and the recurrences' walks write there in place, an
  engine that returns new memory is copied there), the start value fills the first
  step, and with ``reset=`` one in-place masked fill puts the start value at the
  segments' starts: no pass over the data beyond the inclusive scan's;
* autograd or a ``torch.func`` transform watching: one ``cat`` of the start value and
  the results, and one ``torch.where`` for the resets: differentiable ops, no write
  into memory a transform batches, and the last step's input never enters the scan
  (an inf or NaN there reaches no gradient);
* ``torch.compile``/``torch.export`` tracing: the inclusive scan of all ``n`` steps (the
  last in scan order zeroed, its output dropped), rolled one step and the start value
  selected by position. A slice of length ``n - 1`` would make the trace guard on it
  (``n - 1 != 1``: ``torch.export`` refuses a dynamic length from 2).

:func:`exclusive_scan` is ``fscan.associative_scan``'s form of it (a pytree, ``initial``
required); the drop-ins' router and the recurrences' entries call :func:`exclusive`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Number
from typing import Any, NamedTuple, NoReturn

import torch

from ._call import ScanCall
from ._carry import check_initial
from ._context import under_transform
from ._errors import ScanTypeError, ScanValueError, UnsupportedScanError
from ._knowledge.store import reach
from ._memory import advise_huge_pages
from ._pytree import flatten, unflatten
from ._segmented import check_reset

__all__ = [
    "Shift",
    "Steps",
    "check_exclusive",
    "exclusive",
    "exclusive_scan",
    "refuse_sharded_exclusive",
]

# A start value: a number, or a tensor of one element's shape (the output without `dim`)
# or one broadcasting to it.
Start = Number | torch.Tensor
# The door's inclusive scan of the steps of its inputs that `Steps` gives, into `outs`
# (one view per output) where it can, else into new memory: one tensor per output.
Inclusive = Callable[["Steps", "list[torch.Tensor] | None"], Sequence[torch.Tensor]]


def check_exclusive(
    api: str, exclusive: Any, initial: Any = None, needs_initial: bool = False
) -> None:
    """``exclusive`` is a bool; with ``needs_initial`` (a scan with no identity to start
    from), True only with an ``initial``."""
    if not isinstance(exclusive, bool):
        raise ScanTypeError(
            f"{api}: `exclusive` must be a bool, got {type(exclusive).__name__} {exclusive!r}."
        )
    if exclusive and needs_initial and initial is None:
        raise ScanValueError(
            f"{api}: exclusive=True needs `initial`: the output at the first step is the "
            "carry into it, and fscan cannot know the identity of `combine_fn`; pass "
            "initial= (e.g. initial=0.0 for a sum, 1.0 for a product)."
        )


def refuse_sharded_exclusive(api: str) -> NoReturn:
    """Raise the error for ``exclusive=True`` on DTensor inputs (sharded across ranks)."""
    raise UnsupportedScanError(
        f"{api}: exclusive=True does not take DTensor inputs (sharded across ranks); "
        "pass the local shards (`x.to_local()`) to fscan.distributed.associative_scan "
        "or fscan.distributed.linear_recurrence with exclusive=True and the mesh "
        "dimension's group (group=(mesh, mesh_dim))."
    )


class Shift(NamedTuple):
    """An exclusive scan of ``n`` steps along ``dim``, in the order ``reverse`` says."""

    dim: int
    n: int
    reverse: bool

    def later(self, y: torch.Tensor) -> torch.Tensor:
        """``y``'s last ``n - 1`` steps in scan order: where the inclusive results go."""
        return y.narrow(self.dim, 0 if self.reverse else 1, self.n - 1)

    def first(self, y: torch.Tensor) -> torch.Tensor:
        """``y``'s first step in scan order (size 1 along ``dim``)."""
        return y.narrow(self.dim, self.n - 1 if self.reverse else 0, 1)

    def mask(self, reset: torch.Tensor, ndim: int) -> torch.Tensor:
        """A ``reset=`` mask viewed to broadcast against an output of ``ndim`` dimensions."""
        if reset.ndim == 1 and ndim != 1:
            return reset.reshape([self.n if i == self.dim else 1 for i in range(ndim)])
        return reset

    def at(self, last: bool, ndim: int, device: torch.device) -> torch.Tensor:
        """Where the first (``last``: the last) step in scan order is, as a bool mask of
        ``ndim`` dimensions: positions, not a slice (no length ``n - 1`` to guard on)."""
        n = self.n
        index = 0 if self.reverse == last else n - 1
        at = torch.arange(n, device=device) == index
        return at.reshape([n if i == self.dim else 1 for i in range(ndim)])


class Steps(NamedTuple):
    """The steps of a door's inputs its inclusive scan reads: the first ``n - 1`` in scan
    order (``narrow``, views); or all ``n`` (the traced form, with the last step in scan
    order zeroed: its output is dropped, and zeros keep an inf or NaN there out of the
    gradients). A size 1 along ``dim`` (a gate shared over time) is read as it is."""

    shift: Shift
    narrow: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dim, n, reverse = self.shift
        if x.shape[dim] == 1 and (n != 1 or not self.narrow):
            return x
        if self.narrow:
            return x.narrow(dim, 1 if reverse else 0, n - 1)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return torch.where(self.shift.at(True, x.ndim, x.device), zero, x)

    def mask(self, reset: torch.Tensor) -> torch.Tensor:
        """A ``reset=`` mask (1-D, or with ``dim``) for the steps read."""
        if not self.narrow:
            return reset
        dim, n, reverse = self.shift
        return reset.narrow(0 if reset.ndim == 1 else dim, 1 if reverse else 0, n - 1)


def recorded(inputs: Sequence[Any]) -> bool:
    """Whether autograd or a ``torch.func`` transform watches a call on ``inputs`` (then
    :func:`exclusive` writes into no preallocated memory)."""
    if under_transform():
        return True
    if torch.is_grad_enabled():
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def exclusive(
    shift: Shift,
    inclusive: Inclusive,
    outputs: Sequence[tuple[torch.Size, torch.dtype]],
    device: torch.device,
    starts: Sequence[Start],
    inputs: Sequence[Any],
    reset: torch.Tensor | None = None,
    reset_starts: Sequence[Start] | None = None,
    into: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """The exclusive scan (module doc) from the door's ``inclusive`` scan.

    ``outputs``: each output's shape (``n`` steps) and dtype, on ``device``; ``starts``:
    each output's start value at the first step; ``reset_starts`` (default ``starts``)
    where ``reset`` (the door's mask, 1-D or with ``dim``, checked) is True. ``inputs``:
    the tensors whose ``requires_grad`` decides whether autograd records (module doc).
    ``into``: the outputs' memory where nothing records (a drop-in's checked ``out=``,
    contiguous, sharing memory with no input), else fresh tensors.

    Example:
        >>> x = torch.tensor([1.0, 2.0, 3.0])
        >>> run = lambda steps, outs: [torch.cumsum(steps(x), 0)]
        >>> exclusive(Shift(0, 3, False), run, [(x.shape, x.dtype)], x.device, [0], [x])
        [tensor([0., 1., 3.])]
    """
    if shift.n == 0:  # nothing to shift: the inclusive scan's empty results
        return list(inclusive(Steps(shift, False), None))
    tracing = torch.compiler.is_compiling()
    if tracing or recorded(inputs):
        found = inclusive(Steps(shift, not tracing), None)
        place = _rolled if tracing else _joined
        outs = [place(shift, f, s) for f, s in zip(found, starts)]
        if reset is not None:
            resets = starts if reset_starts is None else reset_starts
            for i, (o, s) in enumerate(zip(outs, resets)):
                start = s.unsqueeze(shift.dim) if isinstance(s, torch.Tensor) else s
                outs[i] = torch.where(shift.mask(reset, o.ndim), start, o)
        return outs
    return _written(shift, inclusive, outputs, device, starts, reset, reset_starts, into)


def _written(
    shift: Shift,
    inclusive: Inclusive,
    outputs: Sequence[tuple[torch.Size, torch.dtype]],
    device: torch.device,
    starts: Sequence[Start],
    reset: torch.Tensor | None,
    reset_starts: Sequence[Start] | None,
    into: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """:func:`exclusive` where nothing records: into the later steps of fresh outputs (or
    of ``into``)."""
    dim = shift.dim
    if into is not None:
        outs = list(into)
    else:  # huge pages where large, as the kernel's own fresh outputs (see fscan._memory)
        outs = [advise_huge_pages(torch.empty(s, dtype=d, device=device)) for s, d in outputs]
    views = [shift.later(o) for o in outs]
    found = inclusive(Steps(shift, True), views)
    for o, view, f, s in zip(outs, views, found, starts):
        if f is not view:  # an engine that wrote new memory
            view.copy_(f)
        head = shift.first(o)
        head.copy_(s.unsqueeze(dim)) if isinstance(s, torch.Tensor) else head.fill_(s)
    if reset is not None:
        _fill_resets(shift, outs, reset, starts if reset_starts is None else reset_starts)
    return outs


def _fill_resets(
    shift: Shift, outs: list[torch.Tensor], reset: torch.Tensor, starts: Sequence[Start]
) -> None:
    """The start values written where ``reset`` is True. A mask of one flag per step is
    turned into the steps' indices and only those steps are written (``index_fill_``:
    0.06-0.3x a copy of the output at 1-30% resets, (4096, 256) float32, one thread,
    where ``masked_fill_`` with the broadcast mask read and wrote all of it, 2.6-3x);
    per-row masks fill through the mask."""
    dim = shift.dim
    steps = reset.reshape(-1).nonzero().squeeze(1) if reset.numel() == shift.n else None
    for o, s in zip(outs, starts):
        if steps is None:
            mask = shift.mask(reset, o.ndim)
            if isinstance(s, torch.Tensor):
                torch.where(mask, s.unsqueeze(dim).to(o.dtype), o, out=o)
            else:
                o.masked_fill_(mask, s)
        elif isinstance(s, torch.Tensor):
            shape = (*o.shape[:dim], len(steps), *o.shape[dim + 1 :])
            o.index_copy_(dim, steps, s.unsqueeze(dim).to(o.dtype).expand(shape))
        else:
            o.index_fill_(dim, steps, s)


def _joined(shift: Shift, found: torch.Tensor, start: Start) -> torch.Tensor:
    """The start value's step and ``found`` (the later ``n - 1`` steps), in scan order."""
    dim = shift.dim
    shape = (*found.shape[:dim], 1, *found.shape[dim + 1 :])
    if isinstance(start, torch.Tensor):
        head = start.unsqueeze(dim).to(found.dtype).expand(shape)
    else:
        head = torch.full(shape, start, dtype=found.dtype, device=found.device)
    return torch.cat([found, head] if shift.reverse else [head, found], dim)


def _rolled(shift: Shift, found: torch.Tensor, start: Start) -> torch.Tensor:
    """``found`` (all ``n`` steps) one step later in scan order, the start value first:
    the traced form (a roll and a select: no slice of length ``n - 1``, which
    ``torch.export`` would guard on)."""
    dim = shift.dim
    rolled = torch.roll(found, -1 if shift.reverse else 1, dim)
    if isinstance(start, torch.Tensor):
        start = start.unsqueeze(dim).to(found.dtype)
    return torch.where(shift.at(False, found.ndim, found.device), start, rolled)


def exclusive_scan(run: Callable[..., Any], call: ScanCall) -> Any:
    """``fscan.associative_scan`` with ``exclusive=True`` (``call.initial`` given): the
    scan of the first ``n - 1`` steps with ``initial`` folded in, one step later, and
    ``initial`` at the first step and at the resets. ``run`` is the internal entry
    (:func:`fscan._entry.run_scan`, passed in: it imports this module), called with the
    narrowed call and the views to write into (None: new memory).

    Example:
        >>> import fscan
        >>> fscan.associative_scan(torch.add, torch.ones(3), 0, exclusive=True, initial=10.0)
        tensor([10., 11., 12.])
    """
    api, _, xs, spec, leaves, dim, reverse = call[:7]
    reset = call.reset
    starts = check_initial(api, call.initial, xs, leaves, spec, dim)
    if reset is not None:
        check_reset(api, reset, xs, leaves, dim)
    shift = Shift(dim, leaves[0].shape[dim], reverse)

    def inclusive(steps: Steps, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        narrowed = [steps(x) for x in leaves]
        options = {"xs": unflatten(spec, narrowed), "leaves": narrowed, "exclusive": False}
        if reset is not None:
            options["reset"] = steps.mask(reset)
        return flatten(run(call._replace(**options), outs))[0]

    outputs = [(x.shape, x.dtype) for x in leaves]
    inputs = [*leaves, *starts, *reach(call.combine_fn).tensors]
    device = leaves[0].device
    outs = exclusive(shift, inclusive, outputs, device, starts, inputs, reset)
    return unflatten(spec, outs)
