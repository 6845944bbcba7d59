"""``fscan.check_associative``: a randomized test that ``combine_fn`` is associative.

A scan regroups ``combine_fn`` calls freely, so its result is only the sequential
one if ``f(f(a, b), c) == f(a, f(b, c))``. The check draws random triples of
operands from the data itself, each a real element or a partial result (the
combination of a random run of up to ``MAX_RUN`` adjacent elements, as the scan
produces), evaluates both groupings for all triples in a few batched calls, and
compares them leaf by leaf.

Tolerance: exact for integer and bool leaves. For floating and complex leaves
the two groupings differ by roundoff that grows with the magnitude of the
values involved, so a difference is flagged only above
``atol + rtol * scale``, where ``scale`` is the largest finite magnitude among
the operands, the two intermediates and both results of that triple, and the
default ``rtol`` is the cube root of the dtype's machine epsilon (6.1e-6 for
float64, 4.9e-3 for float32, 0.099 for float16, 0.20 for bfloat16). That leaves
a wide margin over the roundoff of associative operations (sums, products,
logaddexp, chains of matrix products, in every float dtype, tested over many
seeds), while the operations that are not associative (``a - b``,
``(a + b) / 2``, ``a * b + 1``) miss by a sizeable fraction of ``scale`` and
are caught within a few trials even in bfloat16.
Positions where either grouping is not finite are skipped: overflow makes
roundoff unbounded.

Two uses: :func:`check_associative` and ``validate=True`` draw ``DEFAULT_TRIALS``
triples from every element and raise; :func:`quick_violation`, the check every
scan's first call runs (see :mod:`fscan._knowledge.validate`), draws ``QUICK_TRIALS``
triples from ``QUICK_ELEMENTS`` finite elements, in float64 where the data is
floating point (so the data's own roundoff is out of the picture), and reports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._call import ScanCall
from .._checks import check_scan_args
from .._combine import FlatCombine, flat_combine
from .._errors import NotAssociativeError, ScanTypeError, ScanValueError
from .._pytree import flatten, leaf_paths
from .pointwise_check import checked_on_first_call
from .purity import probe_purity, probeable
from .store import Knowledge
from .violation import ROUNDOFF_HINT, Failure, violation_message, worst_violation

__all__ = [
    "DEFAULT_TRIALS",
    "MAX_RUN",
    "QUICK_CANDIDATES",
    "QUICK_ELEMENTS",
    "QUICK_TRIALS",
    "assert_associative",
    "check_associative",
    "quick_violation",
]

_API = "fscan.check_associative"
DEFAULT_TRIALS = 64
MAX_RUN = 3
# The first-call check (quick_violation): a few elements, a few triples, so its cost
# stays near a handful of combine_fn calls.
QUICK_ELEMENTS = 8
QUICK_TRIALS = 8
QUICK_CANDIDATES = 32  # the positions the finite elements are picked from


def check_associative(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int = 0,
    *,
    combine_mode: str = "generic",
    trials: int = DEFAULT_TRIALS,
    rtol: float | None = None,
    atol: float | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Check on random triples from ``xs`` that ``combine_fn`` is associative; raise if not.

    For each trial, ``a``, ``b``, ``c`` are elements of ``xs`` along ``dim`` or
    combinations of short runs of adjacent elements, and the check compares::

        combine_fn(combine_fn(a, b), c)  with  combine_fn(a, combine_fn(b, c))

    First ``combine_fn`` goes through the same purity probe as a scan's first call.

    Args:
        combine_fn: the function to check, as passed to ``fscan.associative_scan``.
        xs: a tensor or pytree of tensors, as for ``fscan.associative_scan``.
        dim (int, default 0): the scan dimension.
        combine_mode (str, default "generic"): how ``combine_fn`` is called, as in
            ``fscan.associative_scan``: on single elements, or on batches.
        trials (int, default 64): how many triples to draw (evaluated in one batch).
        rtol (float or None): relative tolerance, against the largest magnitude in
            the triple; None means 0 for integer and bool leaves and ``eps ** (1/3)``
            of the dtype for floating ones.
        atol (float or None): absolute tolerance; None means 0.
        generator (torch.Generator or None): where the positions are drawn from; None
            means a fixed seed, so the check never touches the global random state
            and gives the same verdict for the same data.

    Raises:
        NotAssociativeError: naming the leaf, the two values, their difference and
            the tolerance, and the positions drawn for ``a``, ``b`` and ``c``.
        ImpureCombineError, CombineFnError: as the purity probe of a scan would.

    Examples:
        >>> import fscan, torch
        >>> xs = torch.randn(100, generator=torch.Generator().manual_seed(0))
        >>> fscan.check_associative(torch.logaddexp, xs)  # passes quietly
        >>> try:
        ...     fscan.check_associative(lambda a, b: (a + b) / 2, xs)
        ... except fscan.NotAssociativeError as err:
        ...     print(str(err)[:69])
        fscan.check_associative: `combine_fn` is not associative: for leaf xs
    """
    leaves, spec = flatten(xs)
    dim = check_scan_args(_API, combine_fn, xs, leaves, dim, False, combine_mode)
    if leaves[0].is_meta:  # one device for all leaves: checked above
        raise ScanValueError(
            f"{_API}: leaf {leaf_paths(xs)[0]} is a meta tensor, which holds no values to "
            "compare; pass tensors with data."
        )
    _check_options(trials, rtol, atol, generator)
    call = ScanCall(_API, combine_fn, xs, spec, leaves, dim, False, combine_mode)
    if leaves[0].shape[dim] and probeable(leaves):
        probe_purity(call)
    assert_associative(call, trials, rtol, atol, generator)


def assert_associative(
    call: ScanCall,
    trials: int = DEFAULT_TRIALS,
    rtol: float | None = None,
    atol: float | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """The check on already-checked flat ``leaves``; returns quietly for an empty ``dim``."""
    api, combine_fn, _, spec, leaves, dim, _, combine_mode = call[:8]
    moved = [x.detach().movedim(dim, 0) for x in leaves]
    if moved[0].shape[0] == 0:
        return
    combine = flat_combine(api, combine_fn, spec, combine_mode)
    found = _first_violation(combine, moved, trials, rtol, atol, generator)
    if found is not None:
        hint = "" if found.worst.exact else ROUNDOFF_HINT
        raise NotAssociativeError(violation_message(api, spec, found, dim) + hint)


def quick_violation(
    call: ScanCall,
) -> str | None:
    """The first-call check: what is wrong, if ``combine_fn`` fails on a few elements.

    Runs on up to ``QUICK_ELEMENTS`` elements of ``leaves`` spread along ``dim``
    (the finite ones, if any), in float64 (complex128) where a leaf is floating
    point, so the dtype's own roundoff cannot pass for a violation; in the leaves'
    dtypes if ``combine_fn`` fails in float64 (say it multiplies by a captured
    float32 matrix). ``None`` when it passes, or cannot run at all. Needs plain,
    non-empty ``leaves``.

    Example:
        >>> import optree
        >>> xs = torch.arange(8.0)
        >>> args = (xs, optree.tree_structure(xs), [xs], 0, False, "pointwise")
        >>> quick_violation(ScanCall("demo", torch.add, *args)) is None
        True
        >>> print(quick_violation(ScanCall("demo", torch.sub, *args))[:40])
        demo: `combine_fn` is not associative: f
    """
    api, combine_fn, _, spec, leaves, dim, _, combine_mode = call[:8]
    positions, sample = _sample(leaves, dim)
    wide = [_widen(x) for x in sample]
    attempts = [wide] if all(w is x for w, x in zip(wide, sample)) else [wide, sample]
    combine = flat_combine(api, combine_fn, spec, combine_mode)
    if combine_mode == "pointwise":
        # The scan's own pointwise check runs later, on the scan's first combine call;
        # a combine_fn that is not elementwise mixes the check's triples, so it would
        # look non-associative here: refuse it (quietly, below) and leave the error
        # to the scan. A throwaway entry: this call's verdict is not the scan's.
        combine = checked_on_first_call(api, combine, Knowledge(), sample)
    for operands in attempts:
        try:
            found = _first_violation(combine, operands, QUICK_TRIALS, None, None, None)
        except Exception:
            # The check only advises: a combine_fn that fails here (in float64, or on
            # the check's batch) gets the scan's own errors, from the scan.
            continue
        if found is None:
            return None
        return violation_message(api, spec, found, dim, positions.tolist())
    return None


def _sample(leaves: Sequence[torch.Tensor], dim: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Up to ``QUICK_ELEMENTS`` positions along ``dim`` and those elements, stacked along
    dimension 0: spread over the finite ones among ``QUICK_CANDIDATES`` positions spread
    over the data (over all candidates if none is finite)."""
    candidates = _spread(leaves[0].shape[dim], QUICK_CANDIDATES)
    index = candidates.to(leaves[0].device)
    elements = [x.detach().index_select(dim, index).movedim(dim, 0) for x in leaves]
    finite = torch.ones(len(candidates), dtype=torch.bool, device=index.device)
    for x in elements:
        if x.is_floating_point() or x.is_complex():
            finite &= x.isfinite().reshape(len(candidates), -1).all(1)
    among = finite.nonzero().flatten().cpu() if bool(finite.any()) else torch.arange(len(index))
    chosen = among[_spread(len(among), QUICK_ELEMENTS)]
    index = chosen.to(index.device)
    return candidates[chosen], [x.index_select(0, index) for x in elements]


def _spread(n: int, k: int) -> torch.Tensor:
    """Up to ``k`` positions spread evenly over ``range(n)``, first and last included."""
    k = min(n, k)
    gaps = max(k - 1, 1)
    return torch.tensor(sorted({i * (n - 1) // gaps for i in range(k)}))


def _widen(x: torch.Tensor) -> torch.Tensor:
    if x.is_complex():
        return x.to(torch.complex128)
    return x.to(torch.float64) if x.is_floating_point() else x


def _first_violation(
    combine: FlatCombine,
    moved: Sequence[torch.Tensor],
    trials: int,
    rtol: float | None,
    atol: float | None,
    generator: torch.Generator | None,
) -> Failure | None:
    """Draw ``trials`` triples from non-empty ``moved`` (the scan dimension first) and
    return the worst failure of the first leaf that fails, if any."""
    starts, lengths = _draw(moved[0].shape[0], trials, generator)
    # Four batched combine calls in all: the runs a, b and c folded side by side, then
    # (a, b) with (b, c), then (ab, c) with (a, bc). combine_fn treats the batch
    # lane by lane (vmapped, or checked elementwise), so batching changes no value.
    with torch.no_grad():
        a, b, c = _split(_fold_runs(combine, moved, starts.flatten(), lengths.flatten()), 3)
        ab, bc = _split(combine(_cat(a, b), _cat(b, c)), 2)
        lhs, rhs = _split(combine(_cat(ab, a), _cat(c, bc)), 2)
    for i in range(len(moved)):
        involved = [a[i], b[i], c[i], ab[i], bc[i]]
        worst = worst_violation(lhs[i], rhs[i], involved, rtol, atol)
        if worst is not None:
            return Failure(i, worst, starts, lengths)
    return None


def _check_options(trials: Any, rtol: Any, atol: Any, generator: Any) -> None:
    if isinstance(trials, bool) or not isinstance(trials, int):
        raise ScanTypeError(f"{_API}: `trials` must be an int, got {type(trials).__name__}.")
    if trials < 1:
        raise ScanValueError(f"{_API}: `trials` must be at least 1, got {trials}.")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScanTypeError(
                f"{_API}: `{name}` must be a float or None, got {type(value).__name__}."
            )
        if not value >= 0:
            raise ScanValueError(f"{_API}: `{name}` must be >= 0, got {value}.")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ScanTypeError(
            f"{_API}: `generator` must be a torch.Generator or None, "
            f"got {type(generator).__name__}."
        )


def _draw(
    n: int, trials: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Start positions and run lengths (3 x trials each, on the CPU) of a, b and c."""
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    device = generator.device
    starts = torch.randint(0, n, (3, trials), generator=generator, device=device).cpu()
    lengths = torch.randint(1, MAX_RUN + 1, (3, trials), generator=generator, device=device)
    return starts, torch.minimum(lengths.cpu(), n - starts)


def _cat(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.cat([u, v]) for u, v in zip(x, y)]


def _split(batch: Sequence[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """``batch`` (flat leaves) cut into ``parts`` equal batches along dimension 0."""
    return [list(pieces) for pieces in zip(*(x.chunk(parts) for x in batch))]


def _fold_runs(
    combine: FlatCombine, moved: Sequence[torch.Tensor], starts: torch.Tensor, lengths: torch.Tensor
) -> list[torch.Tensor]:
    """For each trial, the left fold of ``combine`` over ``lengths`` elements from ``starts``."""
    n, device = moved[0].shape[0], moved[0].device
    acc = [x.index_select(0, starts.to(device)) for x in moved]
    for k in range(1, int(lengths.max())):
        step = (starts + k).clamp(max=n - 1).to(device)
        nxt = combine(acc, [x.index_select(0, step) for x in moved])
        # Runs shorter than k + 1 keep their value; their lanes of `nxt` are discarded.
        keep = (lengths > k).to(device)
        acc = [torch.where(keep.view(-1, *[1] * (x.ndim - 1)), y, x) for x, y in zip(acc, nxt)]
    return acc
