"""The fold of the gathered piece totals when the piece lengths are not known on the
host: :func:`masked_prefix`, the path of ``fscan.distributed.associative_scan`` under
``torch.compile`` without static lengths (``layout=None``).

Eagerly, :func:`fscan._sharded.scan.sharded_scan` reads the gathered lengths on the
host to skip empty pieces. A trace cannot (that read would be a graph break, and a
rank whose piece is empty would trace another path than its peers). So here every
rank folds the totals of *every* rank before it in sequence order (a static list: the
world size and this rank's position are constants of the trace), and whether a
piece is empty is a gathered flag, used only through ``torch.where``::

    valid, acc = False, 1
    for q in ranks before this one, in scan order:
        acc = where(nonempty[q], where(valid, combine_fn(acc, total[q]), total[q]), acc)
        valid = valid | nonempty[q]
    out = where(valid, combine_fn(acc, local), local)

The combine runs on ones wherever its result is discarded (an empty piece's zeros
or the not-yet-valid accumulator), so that neither its values nor a zero
cotangent times an infinite partial (``0 * inf``) reach the kept results, as in
:mod:`fscan._segmented`. Every rank runs the same collectives (one ``all_gather``
forward, one ``reduce_scatter`` backward) whatever the data: an empty piece still
sends its zeros and its flag.
"""

from __future__ import annotations

import torch

from .._call import ScanCall
from .._pytree import flatten, unflatten

__all__ = ["combine_elements", "masked_prefix"]


def combine_elements(
    call: ScanCall, left: list[torch.Tensor], right: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``combine_fn(left, right)`` on single elements (leaves without ``dim``): generic
    mode takes them as they are, pointwise mode as slices of length 1 along ``dim``."""
    spec, dim = call.spec, call.dim
    if call.combine_mode == "generic":
        return flatten(call.combine_fn(unflatten(spec, left), unflatten(spec, right)))[0]
    left = [x.unsqueeze(dim) for x in left]
    right = [x.unsqueeze(dim) for x in right]
    out = flatten(call.combine_fn(unflatten(spec, left), unflatten(spec, right)))[0]
    return [x.squeeze(dim) for x in out]


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones((), dtype=x.dtype, device=x.device)


def masked_prefix(
    call: ScanCall,
    totals: list[torch.Tensor],
    nonempty: torch.Tensor,
    before: list[int],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The fold of ``totals`` (leaves of shape ``(W, *element)``) over the ranks
    ``before`` (in scan order), skipping those whose ``nonempty`` flag is False.

    Returns the prefix (ones where nothing came before: see the module docstring) and
    whether any non-empty piece came before, a bool tensor.
    """
    acc = [_ones(t).expand(t.shape[1:]) for t in totals]
    valid = torch.zeros((), dtype=torch.bool, device=nonempty.device)
    for q in before:
        flag = nonempty[q]
        here = [torch.where(flag, t[q], _ones(t)) for t in totals]
        merged = combine_elements(call, acc, here)
        both = valid & flag
        acc = [torch.where(both, m, torch.where(flag, h, a)) for m, h, a in zip(merged, here, acc)]
        valid = valid | flag
    return acc, valid
