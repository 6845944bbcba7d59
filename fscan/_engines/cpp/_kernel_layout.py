"""How a kernel call's tensors are laid out: strides the kernels read, ``out=`` checks.

The kernels index element ``(o, t, i)`` of the ``(outer, T, inner)`` view of each
leaf through runtime strides (:func:`strided_view`, :func:`strided_layout`), so
transposes, step slices and broadcasts need no copy; :func:`reads_in_place` says
whether one does. The checks of the ``out=``, ``keep=`` and ``head=`` arguments of
:func:`~fscan._engines.cpp.cpu_kernel.kernel_scan` live here too, with the
:data:`counters` of copies a test may want to see.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import threading
from collections.abc import Sequence

import torch

from ..._errors import ScanTypeError, ScanValueError
from ._cpp_source import csrc

__all__ = [
    "Counters",
    "check_disjoint",
    "check_out",
    "checked_heads",
    "counters",
    "dropped_leaves",
    "element_shape",
    "gathers",
    "read_leaves",
    "reads_in_place",
    "strided_layout",
    "strided_view",
]


def check_out(
    out: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    dropped: tuple[int, ...],
    positions: tuple[int, ...],
    head: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """``out`` checked (one tensor per kept output, of its leaf's shape and dtype, on CPU,
    each element its own memory, sharing none with the leaves read, ``head`` or another
    output), or an error naming the argument and the fix. The captured tensors, known
    once the combine is looked up, are checked by :func:`check_disjoint`."""
    kept = [k for k in range(len(leaves)) if k not in dropped]
    if isinstance(out, torch.Tensor) or len(out) != len(kept):
        got = "a tensor" if isinstance(out, torch.Tensor) else f"{len(out)} entries"
        raise ScanValueError(
            f"kernel_scan: out must be a sequence of one tensor per kept output "
            f"({len(kept)}: leaves {kept}), got {got}."
        )
    outs = list(out)
    for j, (k, y) in enumerate(zip(kept, outs)):
        x = leaves[k]
        if type(y) is not torch.Tensor:
            raise ScanTypeError(
                f"kernel_scan: out[{j}] must be a plain torch.Tensor, got {type(y).__name__}."
            )
        if y.shape != x.shape or y.dtype != x.dtype or not y.is_cpu:
            raise ScanValueError(
                f"kernel_scan: out[{j}] (the output of leaf {k}) is {y.dtype} "
                f"{tuple(y.shape)} on {y.device}, expected {x.dtype} {tuple(x.shape)} on cpu "
                f"like leaf {k}."
            )
        if y.requires_grad and torch.is_grad_enabled():
            raise ScanValueError(
                f"kernel_scan: out[{j}] requires grad; out= memory is written without "
                "autograd: pass a tensor that does not require grad, or run under no_grad."
            )
        if not _distinct_elements(y):
            raise ScanValueError(
                f"kernel_scan: out[{j}] has strides {y.stride()} for shape {tuple(y.shape)}, "
                "whose elements may share memory (an expand, say); each output element "
                "needs its own memory: pass a fresh tensor or a view such as a narrow, "
                "step slice or transpose of one."
            )
    inputs = [(f"leaf {k}", x) for k, x in enumerate(leaves) if k not in positions]
    inputs += [(f"head leaf {k}", h) for k, h in enumerate(head or ())]
    check_disjoint(outs, inputs)
    for j in range(1, len(outs)):
        check_disjoint(outs[j : j + 1], [(f"out[{i}]", outs[i]) for i in range(j)], j)
    return outs


def check_disjoint(
    outs: Sequence[torch.Tensor], inputs: Sequence[tuple[str, torch.Tensor]], first: int = 0
) -> None:
    """An error naming the first output (``out[first + j]``) that overlaps a named input."""
    for j, y in enumerate(outs):
        for name, t in inputs:
            if _overlap(y, t):
                raise ScanValueError(
                    f"kernel_scan: out[{first + j}] overlaps {name} in memory; outputs must "
                    "not alias the inputs or each other: pass separate memory for out."
                )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a tensor's elements lie in (empty: ``(0, 0)``)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` intersect (conservative: interleaved
    views of one tensor, e.g. its even and odd columns, count as overlapping)."""
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements certainly lie at distinct addresses: its dims of size > 1,
    ordered by stride, each step past the whole span of the dims below (true of every
    narrow, slice, transpose or permutation of a fresh tensor; false of an expand).

    Example:
        >>> _distinct_elements(torch.zeros(3, 4).t()[::2])
        True
        >>> _distinct_elements(torch.zeros(3).expand(2, 3))
        False
    """
    reach = 0  # the farthest offset the dims of smaller strides reach
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def checked_heads(
    head: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    element: tuple[int, ...],
    positions: tuple[int, ...],
) -> list[torch.Tensor]:
    """``head`` as the kernel reads it: contiguous elements, or an error naming the leaf."""
    if positions:
        raise ValueError("kernel_scan: head= with positions= (position leaves read no input)")
    if len(head) != len(leaves):
        raise ValueError(f"kernel_scan: head has {len(head)} leaves, expected {len(leaves)}")
    out = []
    for k, (h, x) in enumerate(zip(head, leaves)):
        if h.dtype != x.dtype or tuple(h.shape) != element or not h.is_cpu:
            raise ValueError(
                f"kernel_scan: head leaf {k} is {h.dtype} {tuple(h.shape)} on {h.device}, "
                f"expected one element of leaf {k}: {x.dtype} {element} on cpu"
            )
        out.append(h.contiguous())
    return out


def dropped_leaves(keep: Sequence[bool], n: int) -> tuple[int, ...]:
    """The leaves ``keep`` drops (``keep``: one bool per leaf, at least one True)."""
    if len(keep) != n or not any(keep):
        raise ValueError(
            f"kernel_scan: keep must hold one bool per leaf ({n}) and keep at least one "
            f"output, got {tuple(keep)!r}"
        )
    return tuple([k for k, kept in enumerate(keep) if not kept])


def element_shape(leaves: Sequence[torch.Tensor], dim: int) -> tuple[int, ...]:
    shape = tuple(leaves[0].shape)
    if len(shape) == 1:
        return ()
    dim = dim % max(1, len(shape))
    return shape[:dim] + shape[dim + 1 :]


class Counters:
    """What the kernel runs did that a test may want to see (not timing): ``copies``,
    the inputs copied to contiguous memory because :func:`strided_view` could not
    describe their layout; ``in_place``, the outputs written straight into a caller's
    ``out=`` memory; ``out_copies``, those computed densely and copied into it (a layout
    :func:`strided_layout` cannot describe). Counted under a lock."""

    def __init__(self) -> None:
        self.copies = 0
        self.in_place = 0
        self.out_copies = 0
        self.lock = threading.Lock()

    def copied(self, n: int) -> None:
        with self.lock:
            self.copies += n

    def wrote(self, n: int) -> None:
        with self.lock:
            self.in_place += n

    def copied_out(self, n: int) -> None:
        with self.lock:
            self.out_copies += n


counters = Counters()


def strided_view(
    tensors: Sequence[torch.Tensor], dim: int
) -> tuple[list[torch.Tensor], int, list[int]]:
    """The tensors (same shape) as the kernels read them, ``nb`` and each one's strides.

    The kernels index element ``(o, t, i)`` of the ``(outer, T, inner)`` view (``T``
    the scan dim) at ``(o // nb) * sa + (o % nb) * sb + t * st + i * si``: the dims
    before ``dim`` in at most two groups (``nb`` lanes in the second), those after it
    in one. A view fits when its dims merge that way (size-1 dims ignored): transposes,
    permutations such as a ``(B, C, T)`` view of ``(B, T, C)`` memory, step slices,
    slices along the scan dim, stride-0 broadcasts (``expand``, the cotangent of
    ``.sum()``). A tensor that does not fit (nor, where the groups of the others
    disagree with its own, one with a split of its own) is copied to contiguous memory,
    counted in ``counters.copies``. Nothing is written: the tensors are read only.
    :func:`strided_layout` describes outputs too.

    Example:
        >>> x = torch.zeros(4, 6)
        >>> _, nb, strides = strided_view([x.t()], 0)  # (6, 4): T stride 1, lanes 6 apart
        >>> nb, strides
        (1, [0, 0, 1, 6])
        >>> _, nb, strides = strided_view([torch.zeros(2, 5, 3).transpose(1, 2)], 2)
        >>> nb, strides  # outer (2, 3): 15 and 1 apart; T: 3 apart
        (3, [15, 1, 3, 1])
    """
    found = strided_layout(tensors, dim)
    assert found is not None  # every tensor may be copied
    return found


def strided_layout(
    tensors: Sequence[torch.Tensor], dim: int, fixed: int = 0
) -> tuple[list[torch.Tensor], int, list[int]] | None:
    """:func:`strided_view` where the last ``fixed`` tensors (outputs, written in place)
    are never copied: None where one of them does not fit, or where their outer groups
    disagree with each other.

    Example:
        >>> x, out = torch.zeros(4, 6), torch.zeros(6, 4).t()  # out: T stride 1
        >>> _, nb, strides = strided_layout([x, out], 0, fixed=1)
        >>> nb, strides
        (1, [0, 0, 6, 1, 0, 0, 1, 4])
        >>> y, out = torch.zeros(4, 2, 3), torch.zeros(4, 3, 2).transpose(1, 2)
        >>> strided_layout([y, out], 0, fixed=1) is None  # out's (2, 3) lanes do not merge
        True
    """
    if not tensors:  # every leaf a position leaf: nothing is read
        return [], 1, []
    shape = tensors[0].shape
    for x in tensors:  # all contiguous, the common case, kept cheap (no generator)
        if not x.is_contiguous():
            break
    else:
        steps, inner = shape[dim], math.prod(shape[dim + 1 :])
        return list(tensors), 1, [steps * inner, 0, inner, 1] * len(tensors)
    outer = [d for d in range(dim) if shape[d] != 1]
    inner = [d for d in range(dim + 1, len(shape)) if shape[d] != 1]
    xs = list(tensors)

    def merges(stride: Sequence[int], a: int, b: int) -> bool:
        return stride[a] == stride[b] * shape[b]

    copies = 0
    splits: list[set[int]] = []
    free = len(xs) - fixed  # the tensors that may be copied
    for k, x in enumerate(xs):
        stride = x.stride()
        if not all(merges(stride, a, b) for a, b in itertools.pairwise(inner)):
            if k >= free:
                return None
            xs[k] = x.contiguous()
            stride, copies = xs[k].stride(), copies + 1
        pairs = enumerate(itertools.pairwise(outer))
        splits.append({j for j, (a, b) in pairs if not merges(stride, a, b)})
    if len(set().union(*splits)) > 1:  # more than two outer groups: copy the split ones
        kept: set[int] = set().union(*splits[free:])  # the fixed ones' split, if any
        if len(kept) > 1:
            return None
        for k, split in enumerate(splits[:free]):
            if split and split != kept:
                xs[k], splits[k], copies = xs[k].contiguous(), set(), copies + 1
    if copies:
        counters.copied(copies)
    split = set().union(*splits)
    cut = min(split) if split else None
    nb = 1 if cut is None else math.prod(shape[d] for d in outer[cut + 1 :])
    strides: list[int] = []
    for x in xs:
        stride = x.stride()
        sa = 0 if not outer else stride[outer[-1] if cut is None else outer[cut]]
        sb = 0 if cut is None else stride[outer[-1]]
        strides += [sa, sb, stride[dim], stride[inner[-1]] if inner else 1]
    return xs, nb, strides


def reads_in_place(x: torch.Tensor, dim: int) -> bool:
    """Whether :func:`strided_view` reads ``x`` alone, scanned along ``dim`` (>= 0), in
    place: its dims after ``dim`` merge into one, those before into at most two groups.

    Example:
        >>> x = torch.zeros(2, 6, 5, 4).contiguous(memory_format=torch.channels_last)
        >>> reads_in_place(x, 1), reads_in_place(x, 3)  # over C; over W: copied
        (True, False)
    """
    if x.is_contiguous():
        return True
    shape, stride = x.shape, x.stride()
    outer = [d for d in range(dim) if shape[d] != 1]
    inner = [d for d in range(dim + 1, len(shape)) if shape[d] != 1]
    if any(stride[a] != stride[b] * shape[b] for a, b in itertools.pairwise(inner)):
        return False
    return sum(stride[a] != stride[b] * shape[b] for a, b in itertools.pairwise(outer)) <= 1


@functools.cache
def _vec_min() -> int:
    """``VEC_MIN`` of csrc/tuning.h: inner sizes below it take the chain path."""
    found = re.search(r"VEC_MIN = (\d+);", csrc("tuning.h"))
    assert found is not None
    return int(found.group(1))


def gathers(strides: Sequence[int], inner: int) -> bool:
    """Whether a forward kernel call with these strides (``sa, sb, st, si`` of each tensor
    read, then of each written, as the kernel is passed them) over ``inner`` lanes needs the
    kernel's gather variant: it takes the lane path (``inner >= VEC_MIN`` and no tensor
    laid out along T) and some tensor's inner stride is not 1, as ``scan`` in
    csrc/forward.h and ``lane_path`` decide (the ordinary kernel compiles no gather).

    Example:
        >>> gathers([4096, 0, 16, 1] * 2, 16), gathers([8192, 0, 32, 2, 4096, 0, 16, 1], 16)
        (False, True)
        >>> gathers([0, 0, 1, 16, 4096, 0, 16, 1], 16)  # read along T: the chain path
        False
    """
    if inner < _vec_min():
        return False
    unit = True
    for k in range(0, len(strides), 4):
        st, si = strides[k + 2], strides[k + 3]
        if st != 0 and abs(st) < abs(si):  # along(): the chain path, which has no gather
            return False
        unit = unit and si == 1
    return not unit


def read_leaves(leaves: Sequence[torch.Tensor], positions: Sequence[int]) -> Sequence[torch.Tensor]:
    """The leaves a kernel reads: all but the position leaves (cummax/cummin's indices, which
    the kernel computes from each step's position): ``leaves`` itself where there are none
    (no copy on the hot path), so read it, never change it."""
    return [x for k, x in enumerate(leaves) if k not in positions] if positions else leaves
