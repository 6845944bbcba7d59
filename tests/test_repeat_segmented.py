"""The repeat shortcut for the segmented drop-ins
(fscan._routing.repeat_drop_ins.repeat_segmented): ``fscan.cumsum(x, dim, reset=mask)``
& co., identical to a call the segmented kernel served in everything its verdict
depends on (the input's dtype, shape and layout, ``dim``, ``reverse``, grad mode and the
mask's shape and strides), reruns that kernel without the checks, reading the mask's
values anew; any change takes the checked path. Results are a per-segment float64
loop's; inputs are unchanged, outputs new."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import repeat_drop_ins

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.usefixtures("fresh_eager_kernel"),
]


@pytest.fixture
def served(runs_of):
    """The segmented runs the repeat shortcut served, as they happen."""
    return runs_of("run_segmented_prepared", repeat_drop_ins)


STEP = {
    "cumsum": torch.add,
    "cumprod": torch.mul,
    "logcumsumexp": torch.logaddexp,
    "cummax": torch.ge,  # the extrema: the later element in scan order wins ties
    "cummin": torch.le,
}
EXTREMA = ("cummax", "cummin")


def full_mask(reset: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """``reset`` as one flag an element of ``x``."""
    if reset.ndim == 1:
        reset = reset.reshape([1] * dim + [-1] + [1] * (x.ndim - 1 - dim))
    return reset.expand(x.shape)


def reference(name, x, dim, reverse, reset):
    """The segmented drop-in step by step in float64, restarting where ``reset`` is True
    (cummax/cummin: (values, indices), positions in ``x``)."""
    xs = x.double().movedim(dim, 0)
    flags = full_mask(reset, x, dim).movedim(dim, 0)
    n = xs.shape[0]
    out, at_out = [None] * n, [None] * n
    carry = at = None
    for k, t in enumerate(range(n - 1, -1, -1) if reverse else range(n)):
        if name in EXTREMA:
            take = STEP[name](xs[t], carry) | flags[t] if k else torch.ones_like(flags[t])
            carry = xs[t] if not k else torch.where(take, xs[t], carry)
            at = torch.full_like(flags[t], t, dtype=torch.int64) if not k else at
            at = torch.where(take, t, at)
        else:
            step = xs[t] if not k else STEP[name](carry, xs[t])
            carry = torch.where(flags[t], xs[t], step)
        out[t], at_out[t] = carry, at
    values = torch.stack(out).movedim(0, dim)
    if name in EXTREMA:
        return values, torch.stack(at_out).movedim(0, dim)
    return values


def check(name, out, want):
    if name in EXTREMA:
        torch.testing.assert_close(out.values, want[0].to(out.values.dtype), rtol=0, atol=0)
        assert torch.equal(out.indices, want[1])
    else:
        torch.testing.assert_close(out, want.to(out.dtype))


def make_input(name, shape, dtype=torch.float32):
    if name in EXTREMA:  # distinct values: ties cannot hide an index off by one
        return torch.randperm(math.prod(shape)).reshape(shape).to(dtype)
    x = torch.randn(shape, dtype=dtype)
    return x.abs() * 0.5 + 0.75 if name == "cumprod" else x  # products that stay finite


def run(name, x, dim, reset, reverse=False, **kw):
    return getattr(fscan, name)(x, dim, reverse=reverse, reset=reset, **kw)


def masks(n: int, shape, dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The mask kinds: one flag a step, one an element, broadcast along the other dims, and
    a 1-D step slice (stride 2)."""
    g = torch.Generator().manual_seed(seed)
    lanes = [1] * len(shape)
    lanes[dim] = n
    return {
        "1-D": torch.rand(n, generator=g) < 0.05,
        "full": torch.rand(shape, generator=g) < 0.05,
        "broadcast": torch.rand(lanes, generator=g) < 0.05,
        "1-D strided": (torch.rand(2 * n, generator=g) < 0.05)[::2],
    }


CASES = [((256, 128), 0, False), ((256, 128), 0, True), ((4, 256, 32), 1, True), ((4096,), 0, True)]


@pytest.mark.parametrize("name", sorted(STEP))
@pytest.mark.parametrize("kind", ["1-D", "full", "broadcast", "1-D strided"])
@pytest.mark.parametrize(
    ("shape", "dim", "reverse"),
    CASES,
    ids=["lanes", "lanes-reversed", "middle-reversed", "one-lane-reversed"],
)
def test_a_repeated_segmented_drop_in_is_served_and_right(served, name, kind, shape, dim, reverse):
    """Called again with the same input and mask kind, the stored segmented kernel run
    serves it (before the checks), with the reference's values; inputs unchanged, outputs
    new."""
    x = make_input(name, shape)
    reset = masks(shape[dim], shape, dim)[kind]
    before, mask_before = x.clone(), reset.clone()
    first = run(name, x, dim, reset, reverse)
    assert served == []
    out = run(name, x, dim, reset, reverse)
    assert len(served) == 1
    want = reference(name, x, dim, reverse, reset)
    check(name, first, want)
    check(name, out, want)
    assert torch.equal(x, before) and torch.equal(reset, mask_before)
    for y in out if name in EXTREMA else [out]:
        assert y.data_ptr() not in (x.data_ptr(), reset.data_ptr())
        assert y.is_contiguous()
    if x.ndim == 1:  # one lane: the kernel's one thread, as on the full path
        assert served[0].threads == 1


@pytest.mark.parametrize("name", ["cumsum", "cummax"])
@pytest.mark.parametrize("kind", ["1-D", "full", "broadcast"])
def test_a_changed_mask_of_the_same_kind_gives_the_new_answer(served, name, kind):
    """The mask is a runtime input: its values are read on every call."""
    shape, dim = (256, 64), 0
    x = make_input(name, shape)
    first, second = masks(256, shape, dim, seed=1)[kind], masks(256, shape, dim, seed=2)[kind]
    run(name, x, dim, first)
    out = run(name, x, dim, second)
    assert len(served) == 1
    check(name, out, reference(name, x, dim, False, second))
    none = torch.zeros_like(second)  # no restart: the inclusive op
    out = run(name, x, dim, none)
    check(name, out, reference(name, x, dim, False, none))
    assert len(served) == 2


# Each changes one thing the segmented drop-in's verdict depends on: no stored run serves it.
VARIANTS = {
    "dtype": lambda x, r: (x.double(), 0, r, False, {}),
    "shape": lambda x, r: (torch.randn(256, 136), 0, r, False, {}),
    "dim": lambda x, r: (torch.randn(128, 256), 1, r, False, {}),
    "reverse": lambda x, r: (x, 0, r, True, {}),
    "layout": lambda x, r: (torch.randn(128, 256).t(), 0, r, False, {}),
    "requires_grad": lambda x, r: (x.clone().requires_grad_(), 0, r, False, {}),
    "mask kind": lambda x, r: (x, 0, full_mask(r, x, 0).clone(), False, {}),
    "mask strides": lambda x, r: (x, 0, torch.stack([r, r], 1)[:, 0], False, {}),
    "mask broadcast": lambda x, r: (x, 0, r[:, None], False, {}),
    "dtype=": lambda x, r: (x, 0, r, False, {"dtype": torch.float32}),
    "out=": lambda x, r: (x, 0, r, False, {"out": torch.empty_like(x)}),
    "exclusive=": lambda x, r: (x, 0, r, False, {"exclusive": True}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_segmented_drop_in_is_not_repeated(served, variant):
    x = torch.randn(256, 128)
    reset = torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.cumsum(x, 0, reset=reset)
    y, dim, mask, reverse, kw = VARIANTS[variant](x, reset)
    served.clear()
    out = fscan.cumsum(y, dim, reverse=reverse, reset=mask, **kw)
    assert served == []
    if "out" in kw:
        assert out is kw["out"]
    want = reference("cumsum", y.detach(), dim, reverse, mask)
    if kw.get("exclusive"):  # the carry into each step: the inclusive one step earlier
        shifted = torch.zeros_like(want)
        shifted[1:] = want[:-1]
        want = torch.where(mask[:, None], 0.0, shifted.double())
    check("cumsum", out.detach(), want)


def test_a_mask_of_another_dtype_is_refused_as_before(served):
    """The shortcut never skips the mask's checks: a uint8 mask of the stored shape still
    gets fscan's error."""
    x, reset = torch.randn(256, 128), torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.cumsum(x, 0, reset=reset)
    served.clear()
    with pytest.raises(fscan.ScanTypeError, match="`reset` must be a bool tensor"):
        fscan.cumsum(x, 0, reset=reset.to(torch.uint8))
    with pytest.raises(fscan.ScanValueError, match="`reset` has length 255"):
        fscan.cumsum(x, 0, reset=reset[1:])
    assert served == []


def test_a_segmented_drop_in_repeats_only_its_own_op_and_grad_mode(served):
    x = make_input("cumprod", (256, 128))
    reset = torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.cumsum(x, 0, reset=reset)
    served.clear()
    check("cumprod", fscan.cumprod(x, 0, reset=reset), reference("cumprod", x, 0, False, reset))
    assert served == []  # another op: its own key, stored by its first call
    fscan.cumsum(x, 0)  # the inclusive call: its own route
    assert served == []
    with fscan.config.override(cpu_kernel="off"):
        check("cumsum", fscan.cumsum(x, 0, reset=reset), reference("cumsum", x, 0, False, reset))
    assert served == []
    with torch.no_grad():  # grad mode is in the key
        fscan.cumsum(x, 0, reset=reset)
    assert served == []
    fscan.cumsum(x, 0, reset=reset)
    assert len(served) == 1


def test_integer_inputs_are_stored_under_the_dtype_scanned(served):
    """An int32 cumsum is promoted to int64 before the kernel: the stored run is int64's,
    which an int64 call takes and an int32 one never does."""
    x = torch.randint(-5, 5, (256, 64), dtype=torch.int32)
    reset = torch.arange(256) % 37 == 5
    for _ in range(2):
        out = fscan.cumsum(x, 0, reset=reset)
    assert served == [] and out.dtype == torch.int64
    assert torch.equal(out, reference("cumsum", x, 0, False, reset).long())
    out = fscan.cumsum(x.long(), 0, reset=reset)
    assert len(served) == 1
    assert torch.equal(out, reference("cumsum", x, 0, False, reset).long())


def test_gradients_transforms_and_dispatch_modes_take_the_full_path(served):
    x, reset = torch.randn(256, 64), torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.cumsum(x, 0, reset=reset)
    served.clear()
    w = x.double().requires_grad_()
    fscan.cumsum(w, 0, reset=reset).sum().backward()  # gradients: the pairs' scan
    assert w.grad is not None
    batched = torch.func.vmap(lambda t: fscan.cumsum(t, 0, reset=reset[:64]), in_dims=0)(x)
    want = torch.stack([reference("cumsum", row, 0, False, reset[:64]) for row in x])
    check("cumsum", batched, want)

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        out = fscan.cumsum(x, 0, reset=reset)
    check("cumsum", out, reference("cumsum", x, 0, False, reset))
    assert served == []


def test_segmented_repeats_under_torch_compile_take_the_traced_path(served):
    x, reset = torch.randn(64, 8), torch.arange(64) % 7 == 3
    for _ in range(2):
        fscan.cumsum(x, 0, reset=reset)
    served.clear()
    compiled = torch.compile(
        lambda t, r: fscan.cumsum(t, 0, reset=r), backend="eager", fullgraph=True
    )
    check("cumsum", compiled(x, reset), reference("cumsum", x, 0, False, reset))
    assert served == []


def test_segmented_repeats_in_inference_mode_match_the_full_path(served):
    with torch.inference_mode():
        x, reset = torch.randn(256, 64), torch.arange(256) % 37 == 5
        for _ in range(2):
            out = fscan.cumsum(x, 0, reset=reset)
        assert len(served) == 1
        check("cumsum", out, reference("cumsum", x, 0, False, reset))
    served.clear()
    y = x.clone()  # out of inference mode: grad mode differs, the key too
    check("cumsum", fscan.cumsum(y, 0, reset=reset), reference("cumsum", y, 0, False, reset))
    assert served == []


def test_segmented_repeats_are_forgotten_with_the_caches(served):
    x, reset = torch.randn(256, 64), torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.logcumsumexp(x, 0, reset=reset)
    assert len(served) == 1
    fscan.clear_caches()
    fscan.logcumsumexp(x, 0, reset=reset)
    assert len(served) == 1


def test_a_repeated_segmented_drop_in_logs_the_kernel(served, caplog):
    x, reset = torch.randn(256, 64), torch.arange(256) % 37 == 5
    for _ in range(2):
        fscan.cummax(x, 0, reset=reset)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served.clear()
    fscan.cummax(x, 0, reset=reset)
    assert len(served) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp"
