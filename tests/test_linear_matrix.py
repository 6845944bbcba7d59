"""fscan.linear_recurrence_matrix against a sequential float64 loop (fscan._linear_matrix)."""

from __future__ import annotations

import pytest
import torch
from helpers import parametrize, raises
from torch.utils._python_dispatch import TorchDispatchMode

import fscan

F64 = dict(dtype=torch.float64)


def rand(*shape):
    return torch.randn(*shape, **F64)


def loop(A, b, dim, initial=None, reverse=False, reset=None, matrix_state=False):
    """The oracle, one step at a time; a reset drops the state (a where, never ``0 * h``)."""
    z = b if matrix_state else b.unsqueeze(-1)
    batch = z.shape[:-2]
    A = A.reshape((1,) * (len(batch) + 2 - A.ndim) + tuple(A.shape)).expand(*batch, *A.shape[-2:])
    n = b.shape[dim]
    if reset is not None:
        mask = (
            reset
            if reset.ndim != 1
            else reset.reshape([n if i == dim else 1 for i in range(len(batch))])
        )
        mask = mask.reshape(mask.shape[: len(batch)]).expand(batch)
    h = None
    if initial is not None:
        h = (initial if matrix_state else initial.unsqueeze(-1)).expand(z.select(dim, 0).shape)
    out = [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        zt = z.select(dim, t)
        if h is not None and reset is not None:  # drop the state, never multiply it by 0
            h = torch.where(mask.select(dim, t)[..., None, None], 0, h)
        out[t] = h = zt if h is None else A.select(dim, t) @ h + zt
    result = torch.stack(out, dim) if n else z.clone()
    return result if matrix_state else result.squeeze(-1)


def gates(kind, n, d):
    """Gate shapes for b of shape (2, n, d): shared, shared per batch row, per step."""
    return {
        "shared": rand(d, d) / d**0.5,
        "row": rand(2, 1, d, d) / d**0.5,
        "step": rand(n, d, d) / d**0.5,
        "full": rand(2, n, d, d) / d**0.5,
    }[kind]


KINDS = ["shared", "row", "step", "full"]


@parametrize(kind=KINDS, length=[0, 1, 2, 3, 5, 9, 33], reverse=[False, True])
def test_vector_states(kind, length, reverse):
    A, b = gates(kind, length, 3), rand(2, length, 3)
    out = fscan.linear_recurrence_matrix(A, b, 1, reverse=reverse)
    torch.testing.assert_close(out, loop(A, b, 1, reverse=reverse))


@parametrize(kind=KINDS, reverse=[False, True], initial=[False, True])
def test_matrix_states(kind, reverse, initial):
    n, d, k = 21, 3, 4
    A, B = gates(kind, n, d), rand(2, n, d, k)
    h0 = rand(d, k) if initial else None  # broadcast over the batch
    out = fscan.linear_recurrence_matrix(A, B, 1, initial=h0, reverse=reverse, matrix_state=True)
    expected = loop(A, B, 1, h0, reverse, matrix_state=True)
    torch.testing.assert_close(out, expected)


@parametrize(kind=KINDS, reverse=[False, True])
def test_reset_and_initial(kind, reverse):
    n = 26
    A, b, h0 = gates(kind, n, 3), rand(2, n, 3), rand(2, 3)
    for reset in (torch.rand(n) < 0.25, torch.rand(2, n) < 0.25, torch.rand(2, n, 1) < 0.25):
        reset[-1 if reverse else 0] = False
        out = fscan.linear_recurrence_matrix(A, b, 1, initial=h0, reverse=reverse, reset=reset)
        torch.testing.assert_close(out, loop(A, b, 1, h0, reverse, reset))


def test_time_not_first_and_negative_dim():
    A, B = rand(4, 4) / 2, rand(3, 7, 5, 4, 2)  # batch (3, 7, 5), states (4, 2)
    for dim in (0, 1, 2, -3):
        out = fscan.linear_recurrence_matrix(A, B, dim, matrix_state=True)
        torch.testing.assert_close(out, loop(A, B, dim % 5, matrix_state=True))


def test_shared_gate_is_never_materialised_per_step():
    n, d = 512, 8
    A, b = rand(d, d) / 4, rand(n, d)

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.biggest = max(self.biggest, t.numel())
            return out

    with Largest() as mode:
        fscan.linear_recurrence_matrix(A, b, 0)
    assert mode.biggest <= n * d  # an (n, d, d) gate tensor would be 8x that


# ---- NaN and inf stop at a reset, forward and backward ------------------------------


@parametrize(kind=["shared", "step"], reverse=[False, True])
def test_nan_and_inf_do_not_cross_a_reset(kind, reverse):
    n, d = 12, 2
    A = gates(kind, n, d).requires_grad_()
    b = rand(2, n, d)
    before = slice(7, 12) if reverse else slice(0, 5)  # poisoned steps, before the reset
    b[:, before.start] = float("inf")
    b[:, before.start + 1, 0] = float("nan")
    b.requires_grad_()
    reset = torch.zeros(n, dtype=torch.bool)
    reset[6] = True  # drops everything before (after, in reverse)
    h0 = torch.full((d,), float("inf"), **F64)
    out = fscan.linear_recurrence_matrix(A, b, 1, initial=h0, reverse=reverse, reset=reset)
    expected = loop(A.detach(), b.detach(), 1, h0, reverse, reset)
    after = slice(0, 7) if reverse else slice(6, 12)
    torch.testing.assert_close(out[:, after], expected[:, after])
    assert torch.isfinite(out[:, after]).all()
    # Before the reset the tree regroups products of infinite states, so an inf of
    # the loop may come out as NaN: non-finite in the same places is the contract.
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    gA, gb = torch.autograd.grad(out[:, after].sum(), (A, b))
    # The loop's gradients, NaN where it has them: a gate used on an infinite state
    # before the reset gets 0 * inf there, in any autograd formulation.
    oracle = loop(A, b, 1, h0, reverse, reset)[:, after].sum()
    eA, eb = torch.autograd.grad(oracle, (A, b))
    torch.testing.assert_close(gA, eA, equal_nan=True)
    torch.testing.assert_close(gb, eb)
    assert torch.isfinite(gb).all() and (gb[:, before] == 0).all()
    if kind == "step":  # the gates from the reset on only ever meet finite states
        assert torch.isfinite(gA[after]).all()


@parametrize(case=["overflow, zero state", "underflow, inf state"], shared=[True, False])
@parametrize(reverse=[False, True])
def test_gate_products_out_of_range_give_the_loop_answer(case, shared, reverse):
    """Composed gates leave the range (1e10 I to the 32nd is inf, (1e-10 J)**64 is 0)
    and meet a state the loop carries: 0 or inf, not NaN (inf * 0, 0 * inf)."""
    n, d = 200, 2
    at = (lambda t: n - 1 - t) if reverse else (lambda t: t)
    b = torch.zeros(2, n, d, **F64)
    if case == "overflow, zero state":
        gate = 1e10 * torch.eye(d, **F64)
        b[:, slice(0, 10) if reverse else slice(n - 10, n)] = 1.0  # the last 10 in scan order
    else:
        gate = 1e-10 * torch.ones(d, d, **F64)  # every entry > 0: inf stays inf
        b[:, at(0)] = float("inf")
        b[1, at(n // 2)] = 1.0
    A = gate if shared else gate.expand(n, d, d).clone()
    got = fscan.linear_recurrence_matrix(A, b, 1, reverse=reverse)
    want = loop(A, b, 1, reverse=reverse)
    assert not torch.isnan(want).any()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-9, atol=0)


def test_reset_at_the_first_step_drops_an_infinite_initial():
    A, b = rand(3, 3), rand(4, 3)
    h0 = torch.full((3,), float("inf"), **F64).requires_grad_()
    reset = torch.tensor([True, False, False, False])
    out = fscan.linear_recurrence_matrix(A, b, 0, initial=h0, reset=reset)
    torch.testing.assert_close(out, loop(A, b, 0, reset=reset))
    (g,) = torch.autograd.grad(out.sum(), h0)
    assert (g == 0).all()


# ---- gradients and transforms --------------------------------------------------------


@parametrize(kind=["shared", "row", "step"], reverse=[False, True])
def test_gradcheck(kind, reverse):
    n, d, k = 9, 2, 3
    A = gates(kind, n, d).requires_grad_()
    B = rand(2, n, d, k).requires_grad_()
    h0 = rand(d, k).requires_grad_()
    reset = torch.zeros(n, dtype=torch.bool)
    reset[4] = True

    def run(A, B, h0):
        return fscan.linear_recurrence_matrix(
            A, B, 1, initial=h0, reverse=reverse, reset=reset, matrix_state=True
        )

    assert torch.autograd.gradcheck(run, (A, B, h0))


def test_vmap_over_a_batch():
    A, b, h0 = rand(4, 3, 3) / 2, rand(4, 10, 3), rand(4, 3)
    run = lambda A, b, h0: fscan.linear_recurrence_matrix(A, b, 0, initial=h0)
    out = torch.func.vmap(run)(A, b, h0)
    for i in range(4):
        torch.testing.assert_close(out[i], loop(A[i], b[i], 0, h0[i]))


@pytest.fixture(scope="module")
def compiled_matrix():
    torch._dynamo.reset()

    def fn(A, B, h0):
        return fscan.linear_recurrence_matrix(A, B, 0, initial=h0, matrix_state=True)

    yield fn, torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()


def test_compile_fullgraph_with_gradients(compiled_matrix):
    fn, compiled = compiled_matrix
    args = [torch.randn(3, 3) / 2, torch.randn(11, 3, 2), torch.randn(3, 2)]
    args = [x.requires_grad_() for x in args]
    torch.testing.assert_close(compiled(*args), fn(*args))
    got = torch.autograd.grad(compiled(*args).sum(), args)
    for g, e in zip(got, torch.autograd.grad(fn(*args).sum(), args)):
        torch.testing.assert_close(g, e)


def test_dtype_promotion_and_new_memory():
    A, b = torch.eye(2, dtype=torch.float32), torch.ones(3, 2, **F64)
    out = fscan.linear_recurrence_matrix(A, b, 0)
    assert out.dtype == torch.float64
    one = torch.ones(1, 2)
    assert fscan.linear_recurrence_matrix(torch.eye(2), one, 0).data_ptr() != one.data_ptr()


# ---- errors ---------------------------------------------------------------------------


def test_errors():
    api = "fscan.linear_recurrence_matrix: "
    with raises(fscan.ScanValueError, api + "`A` of shape (3, 3) does not fit `b` of shape (5, 2)"):
        fscan.linear_recurrence_matrix(torch.ones(3, 3), torch.ones(5, 2), 0)
    with raises(fscan.ScanValueError, "for (d, k) states pass matrix_state=True"):
        fscan.linear_recurrence_matrix(torch.ones(5, 3, 3), torch.ones(5, 3, 2), 0)
    with raises(fscan.ScanValueError, api + "`dim` 1 is a state dimension of `b`"):
        fscan.linear_recurrence_matrix(torch.eye(3), torch.ones(5, 3, 2), 1, matrix_state=True)
    with raises(fscan.ScanValueError, api + "`reset` of shape (5, 3) does not fit `b`"):
        reset = torch.zeros(5, 3, dtype=torch.bool)
        fscan.linear_recurrence_matrix(torch.eye(3), torch.ones(5, 3), 0, reset=reset)
    with raises(fscan.ScanTypeError, api + "`matrix_state` must be a bool"):
        fscan.linear_recurrence_matrix(torch.eye(3), torch.ones(5, 3), 0, matrix_state=1)
    with raises(fscan.ScanValueError, api + "`initial` of shape (4,) does not broadcast"):
        fscan.linear_recurrence_matrix(torch.eye(3), torch.ones(5, 3), 0, initial=torch.ones(4))


class Recurrence(torch.nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, A, b, h0, reset):
        return fscan.linear_recurrence_matrix(A, b, 1, initial=h0, reverse=True, reset=reset)


@parametrize(shared=[True, False])
def test_export_with_a_dynamic_length(shared):
    seq = torch.export.Dim("seq", min=2)

    def inputs(n):
        A = torch.randn(3, 3) / 2 if shared else torch.randn(2, n, 3, 3) / 2
        return A, torch.randn(2, n, 3), torch.randn(2, 3), torch.rand(n) < 0.3

    dims = {"A": None if shared else {1: seq}, "b": {1: seq}, "h0": None, "reset": {0: seq}}
    ep = torch.export.export(Recurrence(shared), inputs(5), dynamic_shapes=dims)
    for n in (2, 7, 33):
        args = inputs(n)
        torch.testing.assert_close(ep.module()(*args), Recurrence(shared)(*args))
