"""``fscan.associative_reduce``: the total of an associative scan, without its prefixes.

A tree reduction (:mod:`fscan._engines.reduce`): ``n - 1`` combines in
``ceil(log2 n)`` calls and no down-sweep, where the scan's engine does about
``2 n`` combines and writes ``n`` outputs. ``reverse=True`` reduces with the operands
swapped, ``g(a, b) = combine_fn(b, a)``, which is associative whenever
``combine_fn`` is and gives the reverse scan's first output. ``initial``
joins last, ``combine_fn(initial, total)`` in both directions: by associativity
that is the scan with ``initial`` in front (behind for ``reverse``).

The tree runs ``combine_fn`` on plain torch ops, so autograd and
``torch.func`` transforms apply unchanged; on CPU, where the scan would run its
generated kernel and no gradient is wanted, the router (:mod:`fscan._routing.reduce`)
runs the generated reduce kernel instead, and answers a call identical to one that
kernel served from its repeat route, before the checks here. Under ``torch.compile`` and
``torch.export`` the tree is not traced: its levels and the odd elements set
aside depend on the length, so the graph would be specialised to it (one
compile per length with ``dynamic=True``, and an export guard on its parity).
There the total is the last output of fscan's length-polymorphic traced scan
(:mod:`fscan._engines.traced`, the first output for ``reverse``): one graph for every
length, about twice the combines of the tree, which the compiled kernels fuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._call import ScanCall
from ._carry import check_initial
from ._checks import check_scan_args
from ._errors import ScanValueError
from ._pytree import flatten, unflatten
from ._route_log import logs_route
from ._routing.reduce import reduce_flat, repeat_reduce

__all__ = ["associative_reduce"]

_API = "fscan.associative_reduce"


@logs_route(_API)
def associative_reduce(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    *,
    combine_mode: str = "pointwise",
    initial: Any = None,
    reverse: bool = False,
    validate: bool | None = None,
) -> Any:
    """The total ``combine_fn(...combine_fn(xs[0], xs[1])..., xs[n-1])`` along ``dim``.

    The last output of ``fscan.associative_scan`` (the first for ``reverse``) with
    half its work and memory: a tree reduction, O(n) work, O(log n) depth.

    Args:
        combine_fn: ``(pytree, pytree) -> pytree``, associative and pure, as for
            ``fscan.associative_scan``.
        xs: a tensor or a pytree of tensors of one length along ``dim``.
        dim (int): the dimension to reduce; negative counts from the end.
        combine_mode (str, default "pointwise"): as for ``fscan.associative_scan``;
            keyword-only, like every argument after ``dim``, so that a port of
            ``associative_scan(fn, xs, dim, reverse)`` cannot pass ``reverse`` here.
        initial (pytree or None, default None): one element combined in front
            (behind for ``reverse``): the result is ``combine_fn(initial, total)``.
            It is the result for an empty ``dim``, which is an error without it.
        reverse (bool, default False): reduce from the end,
            ``combine_fn(...combine_fn(xs[n-1], xs[n-2])..., xs[0])``.
        validate (bool or None, default None): as for ``fscan.associative_scan``.

    Returns:
        A pytree of the structure of ``xs`` whose leaves have ``dim`` removed, in
        new memory.

    Examples:
        >>> import fscan, torch
        >>> fscan.associative_reduce(torch.add, torch.arange(1.0, 5.0), 0)
        tensor(10.)
        >>> fscan.associative_reduce(torch.logaddexp, torch.zeros(2, 4), 1)
        tensor([1.3863, 1.3863])
        >>> shear = torch.tensor([[1.0, 1.0], [0.0, 1.0]]).expand(5, 2, 2)
        >>> fscan.associative_reduce(torch.matmul, shear, 0, combine_mode="generic")
        tensor([[1., 5.],
                [0., 1.]])
    """
    if initial is None:  # a repeat the kernel served: see fscan._routing.reduce
        out = repeat_reduce(combine_fn, xs, dim, reverse, combine_mode, validate)
        if out is not None:
            return out
    leaves, spec = flatten(xs)
    dim = check_scan_args(_API, combine_fn, xs, leaves, dim, reverse, combine_mode)
    init = None if initial is None else check_initial(_API, initial, xs, leaves, spec, dim)
    n = leaves[0].shape[dim]
    if n == 0:
        if init is None:
            raise ScanValueError(
                f"{_API}: `xs` has length 0 along dim {dim} and there is no `initial` to "
                "return; pass `initial=` (the identity of `combine_fn`, say)."
            )
        return unflatten(spec, [i.clone() for i in init])
    call = ScanCall(_API, combine_fn, xs, spec, leaves, dim, reverse, combine_mode, validate)
    total = reduce_flat(call, init)  # the router: fscan._routing.reduce
    # One element's copy: the total may be an input's view (length 1, or a combine_fn
    # returning an operand), and outputs never alias inputs; cheap next to n elements.
    return unflatten(spec, [t.squeeze(0).clone() for t in total])
