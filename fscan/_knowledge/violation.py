"""What a failed associativity check reports: the worst of the differences between the
two groupings (:func:`worst_violation`), and the message that names the leaf, the index,
the two values and the elements combined (:func:`violation_message`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from optree import PyTreeSpec

__all__ = ["ROUNDOFF_HINT", "Failure", "Violation", "violation_message", "worst_violation"]


ROUNDOFF_HINT = (
    " If the difference is only float roundoff, check with "
    "fscan.check_associative(..., rtol=...) and a larger rtol."
)


@dataclass
class Violation:
    trial: int
    index: tuple[int, ...]
    lhs: Any
    rhs: Any
    diff: float
    tol: float
    exact: bool


@dataclass
class Failure:
    leaf: int  # the index of the first failing leaf
    worst: Violation
    starts: torch.Tensor  # the draw (3 x trials): where the runs a, b, c start
    lengths: torch.Tensor  # and how many elements each combines


def worst_violation(
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    involved: Sequence[torch.Tensor],
    rtol: float | None,
    atol: float | None,
) -> Violation | None:
    """The entry where the two groupings differ most beyond the tolerance, if any."""
    trials = lhs.shape[0]
    if lhs.numel() == 0:
        return None
    inexact = lhs.dtype.is_floating_point or lhs.dtype.is_complex
    if rtol is None:
        rtol = torch.finfo(lhs.dtype).eps ** (1 / 3) if inexact else 0.0
    atol = 0.0 if atol is None else atol
    wide = torch.complex128 if lhs.dtype.is_complex else torch.float64
    left, right = lhs.to(wide).reshape(trials, -1), rhs.to(wide).reshape(trials, -1)
    finite = torch.isfinite(left) & torch.isfinite(right)
    diff = torch.where(finite, (left - right).abs(), 0.0)
    values = (*(v.to(wide).reshape(trials, -1) for v in involved), left, right)
    magnitudes = [_finite_abs_max(v) for v in values]
    tol = atol + rtol * torch.stack(magnitudes).amax(0, keepdim=True).T
    excess = diff - tol
    if not inexact and rtol == 0 and atol == 0:
        # Integers compare exactly, even beyond float64's 53 bits.
        excess = torch.where(lhs.reshape(trials, -1) != rhs.reshape(trials, -1), 1.0, -1.0)
    if not bool((excess > 0).any()):
        return None
    flat = int(excess.argmax())
    trial, entry = divmod(flat, excess.shape[1])
    index = tuple(torch.unravel_index(torch.tensor(entry), lhs.shape[1:])) if lhs.ndim > 1 else ()
    return Violation(
        trial=trial,
        index=tuple(int(i) for i in index),
        lhs=lhs.reshape(trials, -1)[trial, entry].item(),
        rhs=rhs.reshape(trials, -1)[trial, entry].item(),
        diff=float(diff[trial, entry]),
        tol=float(tol[trial, 0]),
        exact=not inexact,
    )


def _finite_abs_max(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(v), v.abs(), 0.0).amax(1)


def violation_message(
    api: str, spec: PyTreeSpec, found: Failure, dim: int, positions: list[int] | None = None
) -> str:
    """What failed, for the elements at ``positions`` along ``dim`` (the check drew
    from those; from every element when None)."""
    worst = found.worst
    path = spec.accessors()[found.leaf].codify("xs")
    at = f" at index {worst.index} of the element" if worst.index else ""
    runs = []
    for k, name in enumerate("abc"):
        start, length = int(found.starts[k, worst.trial]), int(found.lengths[k, worst.trial])
        run = list(range(start, start + length))
        runs.append(
            f"{name} = {_describe_run(run if positions is None else [positions[i] for i in run])}"
        )
    if worst.exact:
        gap = f"they differ by {worst.diff:.6g}"
    else:
        gap = f"they differ by {worst.diff:.3g}, above the tolerance {worst.tol:.3g}"
    return (
        f"{api}: `combine_fn` is not associative: for leaf {path}{at}, "
        f"f(f(a, b), c) = {_fmt(worst.lhs)} but f(a, f(b, c)) = {_fmt(worst.rhs)}; {gap}, "
        f"with {', '.join(runs)} along dim {dim}. A scan regroups combine_fn calls freely, "
        f"so it needs f(f(a, b), c) == f(a, f(b, c)) for all elements."
    )


def _describe_run(positions: list[int]) -> str:
    if len(positions) == 1:
        return f"element {positions[0]}"
    if positions == list(range(positions[0], positions[-1] + 1)):
        return f"the combination of elements {positions[0]}..{positions[-1]}"
    return f"the combination of elements {', '.join(map(str, positions))}"


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
