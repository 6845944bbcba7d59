"""docs/porting.md: each one-line replacement against a small reference copy of the code it
replaces (re-written here from the published algorithms, same interfaces and semantics)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import parametrize

import fscan

F64 = dict(dtype=torch.float64)


# ---- mamba.py: pscan(A, X, H_0=None), Blelloch in place on (B, L, D, N) -----------------


def mambapy_pscan(A_in, X_in, H_0=None):
    """H[t] = A[t] * H[t-1] + X[t] over dim 1 of (B, L, D, N): mamba.py's interface.

    Its algorithm: prepend H_0 as a step with gate 1, pad L to a power of two, then an
    in-place up-sweep and down-sweep (Blelloch) over the time axis.
    """
    if H_0 is not None:
        X_in = torch.cat([H_0.unsqueeze(1), X_in], 1)
        A_in = torch.cat([torch.ones_like(A_in[:, :1]), A_in], 1)
    length = X_in.shape[1]
    padded = 2 ** math.ceil(math.log2(length))
    A = F.pad(A_in, (0, 0, 0, 0, 0, padded - length)).transpose(1, 2).clone()
    X = F.pad(X_in, (0, 0, 0, 0, 0, padded - length)).transpose(1, 2).clone()
    steps = int(math.log2(padded))
    for k in range(steps):  # up-sweep: node i*2^(k+1) + 2^(k+1) - 1 absorbs its left sibling
        right = slice(2 ** (k + 1) - 1, padded, 2 ** (k + 1))
        left = slice(2**k - 1, padded, 2 ** (k + 1))
        X[:, :, right] += A[:, :, right] * X[:, :, left]
        A[:, :, right] *= A[:, :, left]
    for k in range(steps - 2, -1, -1):  # down-sweep: fill in the remaining prefixes
        target = slice(2 ** (k + 1) + 2**k - 1, padded, 2 ** (k + 1))
        source = slice(2 ** (k + 1) - 1, padded - 2**k, 2 ** (k + 1))
        X[:, :, target] += A[:, :, target] * X[:, :, source]
        A[:, :, target] *= A[:, :, source]
    H = X.transpose(1, 2)
    return H[:, 1:length] if H_0 is not None else H[:, :length]


@parametrize(length=[1, 5, 8, 13, 64], initial=[False, True])
def test_mambapy_pscan(length, initial):
    B, D, N = 2, 3, 4
    A = torch.rand(B, length, D, N, **F64)
    X = torch.randn(B, length, D, N, **F64)
    H0 = torch.randn(B, D, N, **F64) if initial else None
    expected = mambapy_pscan(A, X, H0)
    torch.testing.assert_close(fscan.linear_recurrence(A, X, 1, initial=H0), expected)


# ---- accelerated-scan: scan(gates, tokens, reverse=False) on (B, C, T) ------------------


def accelerated_scan_ref(gates, tokens, reverse=False):
    """x_t = a_t x_{t-1} + b_t over the last dim of (B, C, T): accelerated-scan's reference
    interface. Its algorithm: pad T to a power of two (gate 1, token 0), split each level
    into left and right children, combine upwards, and push the exclusive prefix back down.
    """
    T = tokens.shape[-1]
    padded = 1 << (T - 1).bit_length()
    gates = F.pad(gates, (0, padded - T), value=1.0)
    tokens = F.pad(tokens, (0, padded - T), value=0.0)
    if padded == 1:
        return tokens[..., :T].clone()
    _, exclusive = _down(gates, tokens, reverse)
    return (exclusive * gates + tokens)[..., :T]


def _down(gates, tokens, reverse):
    """(gates, states) of the exclusive prefix at every position of this level."""
    first_g, second_g = gates[..., 0::2], gates[..., 1::2]
    first_x, second_x = tokens[..., 0::2], tokens[..., 1::2]
    # in reverse the right child comes first
    lg, rg, lx, rx = (
        (second_g, first_g, second_x, first_x)
        if reverse
        else (first_g, second_g, first_x, second_x)
    )
    up_g, up_x = lg * rg, rg * lx + rx
    if up_x.shape[-1] == 1:
        root_g, root_x = torch.ones_like(up_x), torch.zeros_like(up_x)
    else:
        root_g, root_x = _down(up_g, up_x, reverse)
    left = (root_g, root_x)
    right = (root_g * lg, root_x * lg + lx)
    first, second = (right, left) if reverse else (left, right)
    return tuple(torch.stack([f, s], -1).flatten(-2) for f, s in zip(first, second))


@parametrize(length=[1, 2, 7, 32], reverse=[False, True])
def test_accelerated_scan(length, reverse):
    gates, tokens = torch.rand(2, 3, length, **F64), torch.randn(2, 3, length, **F64)
    expected = accelerated_scan_ref(gates, tokens, reverse)
    got = fscan.linear_recurrence(gates, tokens, -1, reverse=reverse)
    torch.testing.assert_close(got, expected)


# ---- minGRU: the log-space scan (Heinsen 2023, two cumulative passes) ---------------------


def heinsen_scan_log(log_coeffs, log_values):
    """h_t = a_t h_{t-1} + b_t in log space over dim 1, (B, T, D); ``log_values`` holds
    log h_0 first, (B, T + 1, D), as minGRU builds it. Returns h (not log h), (B, T, D)."""
    a_star = F.pad(log_coeffs.cumsum(1), (0, 0, 1, 0))
    log_h = a_star + (log_values - a_star).logcumsumexp(1)
    return log_h.exp()[:, 1:]


def log_space_scan(log_a, log_b, log_h0):
    """docs/porting.md's replacement: fscan.log_linear_recurrence."""
    return fscan.log_linear_recurrence(log_a, log_b, 1, initial=log_h0).exp()


def test_mingru_log_space_scan():
    B, T, D = 2, 40, 3
    log_a = F.logsigmoid(torch.randn(B, T, D, **F64))
    log_b = torch.randn(B, T, D, **F64)
    log_h0 = torch.randn(B, 1, D, **F64)
    expected = heinsen_scan_log(log_a, torch.cat([log_h0, log_b], 1))
    torch.testing.assert_close(log_space_scan(log_a, log_b, log_h0.squeeze(1)), expected)


# ---- S5 (PyTorch port): jax_compat.associative_scan(operator, elems, axis, reverse) -----


def jax_compat_associative_scan(operator, elems, axis=0, reverse=False):
    """JAX's odd/even associative scan in torch, with the port's argument order:
    ``axis`` before ``reverse`` (JAX has ``reverse`` first)."""
    leaves, spec = torch.utils._pytree.tree_flatten(elems)
    if reverse:
        leaves = [x.flip(axis) for x in leaves]
    out = _odd_even(operator, spec, leaves, axis)
    if reverse:
        out = [x.flip(axis) for x in out]
    return torch.utils._pytree.tree_unflatten(out, spec)


def _odd_even(operator, spec, xs, axis):
    n = xs[0].shape[axis]
    if n < 2:
        return xs

    def op(a, b):
        tree = lambda leaves: torch.utils._pytree.tree_unflatten(leaves, spec)
        return torch.utils._pytree.tree_leaves(operator(tree(a), tree(b)))

    def sl(x, start, stop=None, step=1):
        return x[(slice(None),) * axis + (slice(start, stop, step),)]

    odd = _odd_even(
        operator, spec, op([sl(x, 0, -1, 2) for x in xs], [sl(x, 1, None, 2) for x in xs]), axis
    )
    prev = odd if n % 2 else [sl(o, 0, -1) for o in odd]
    even = op(prev, [sl(x, 2, None, 2) for x in xs])  # empty when n == 2
    even = [torch.cat([sl(x, 0, 1), e], axis) for x, e in zip(xs, even)]
    out = []
    for e, o in zip(even, odd):
        m = o.shape[axis]
        woven = torch.stack([e.narrow(axis, 0, m), o], axis + 1).flatten(axis, axis + 1)
        out.append(torch.cat([woven, e.narrow(axis, m, 1)], axis) if n % 2 else woven)
    return out


def s5_binary_operator(q_i, q_j):
    """S5's operator: compose the diagonal affine maps (Lambda_bar, Bu) elementwise."""
    A_i, b_i = q_i
    A_j, b_j = q_j
    return A_j * A_i, A_j * b_i + b_j


@parametrize(length=[1, 2, 5, 16], reverse=[False, True], axis=[0, 1])
def test_s5_jax_compat(length, reverse, axis):
    shape = (length, 3, 2) if axis == 0 else (3, length, 2)
    lam = torch.exp(torch.complex(-torch.rand(shape, **F64), torch.randn(shape, **F64)))
    bu = torch.randn(shape, dtype=torch.complex128)
    expected = jax_compat_associative_scan(s5_binary_operator, (lam, bu), axis, reverse)
    # the same positional order on fscan.associative_scan (dim, then reverse) ...
    got = fscan.associative_scan(s5_binary_operator, (lam, bu), axis, reverse)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    # ... or by keyword on fscan.lax, whose positional order is JAX's (reverse, then axis)
    got = fscan.lax.associative_scan(s5_binary_operator, (lam, bu), reverse=reverse, axis=axis)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# ---- a linear-chain CRF: the forward algorithm with a padding mask ------------------------


def crf_normalizer(emissions, mask, start, end, transitions):
    """log Z per sequence, batch-first: (B, T, K) emissions, (B, T) mask with the first step
    always on, as the usual torch CRF computes it step by step."""
    score = start + emissions[:, 0]
    for t in range(1, emissions.shape[1]):
        nxt = torch.logsumexp(score[:, :, None] + transitions + emissions[:, t, None, :], 1)
        score = torch.where(mask[:, t, None], nxt, score)
    return torch.logsumexp(score + end, 1)


def log_matmul(x, y):
    return torch.logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), dim=-2)


def crf_normalizer_fscan(emissions, mask, start, end, transitions):
    """docs/porting.md's replacement: one associative_reduce in the log semiring; padded
    steps are the semiring's identity (0 on the diagonal, -inf elsewhere)."""
    K = emissions.shape[-1]
    eye = torch.full((K, K), -math.inf, dtype=emissions.dtype).fill_diagonal_(0)
    steps = torch.where(mask[:, 1:, None, None], transitions + emissions[:, 1:, None, :], eye)
    total = fscan.associative_reduce(log_matmul, steps, 1, combine_mode="generic", initial=eye)
    return torch.logsumexp((start + emissions[:, 0])[:, :, None] + total + end, (1, 2))


@pytest.mark.parametrize("T", [1, 2, 9, 30])
def test_crf_forward_algorithm(T):
    B, K = 4, 5
    emissions = torch.randn(B, T, K, **F64, requires_grad=True)
    lengths = torch.tensor([T, max(1, T - 3), 1, max(1, T // 2)])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    start, end, transitions = torch.randn(K, **F64), torch.randn(K, **F64), torch.randn(K, K, **F64)
    args = (emissions, mask, start, end, transitions)
    expected = crf_normalizer(*args)
    got = crf_normalizer_fscan(*args)
    torch.testing.assert_close(got, expected)
    (g,) = torch.autograd.grad(got.sum(), emissions)
    (e,) = torch.autograd.grad(expected.sum(), emissions)
    torch.testing.assert_close(g, e)
