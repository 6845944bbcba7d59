"""A parallel Kalman filter: matrix-valued scan elements in generic mode.

Sarkka and Garcia-Fernandez (2021, "Temporal parallelization of Bayesian
smoothers", IEEE TAC) write the filter for a linear Gaussian model

    x_k = F x_{k-1} + q_k,  q_k ~ N(0, Q)        y_k = H x_k + r_k,  r_k ~ N(0, R)

as a scan over elements ``(A, b, C, eta, J)``: each step's conditional density
of the state given the previous one and the step's measurement, with an
associative operator that conditions one on the other. The prefix combination
up to step ``k`` holds the filtering mean (``b``) and covariance (``C``). The
operator multiplies and inverts matrices, so it runs in generic mode, where it
sees one element at a time. Checked against the sequential filter.

Run: python examples/kalman_filter.py
"""

import torch

import fscan

torch.set_default_dtype(torch.float64)

# A constant-velocity model in 2-D: state (x, y, vx, vy), noisy positions measured.
dt, T = 0.1, 500
F = torch.eye(4) + dt * torch.diag(torch.ones(2), 2)
Q = 0.05 * torch.diag(torch.tensor([dt**3 / 3, dt**3 / 3, dt, dt]))
H = torch.eye(2, 4)
R = 0.5 * torch.eye(2)
m0, P0 = torch.zeros(4), torch.eye(4)


def simulate(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """True states and their measurements."""
    x, xs, ys = m0, [], []
    for _ in range(T):
        x = F @ x + torch.linalg.cholesky(Q) @ torch.randn(4, generator=gen)
        xs.append(x)
        ys.append(H @ x + torch.linalg.cholesky(R) @ torch.randn(2, generator=gen))
    return torch.stack(xs), torch.stack(ys)


def sequential_filter(ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook filter: predict, update, one step at a time."""
    m, P, means, covs = m0, P0, [], []
    for y in ys:
        m, P = F @ m, F @ P @ F.T + Q
        S = H @ P @ H.T + R
        K = torch.linalg.solve(S, H @ P).T  # P H^T S^-1 (S and P are symmetric)
        m, P = m + K @ (y - H @ m), P - K @ S @ K.T
        means.append(m)
        covs.append(P)
    return torch.stack(means), torch.stack(covs)


def elements(ys: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scan elements of every step, in one batch (Sarkka and Garcia-Fernandez, Lemma 7)."""
    n, eye = ys.shape[0], torch.eye(4)
    S = H @ Q @ H.T + R
    K = torch.linalg.solve(S, H @ Q).T  # Q H^T S^-1
    HF_S = torch.linalg.solve(S, H @ F).T  # F^T H^T S^-1
    A = ((eye - K @ H) @ F).expand(n, 4, 4).clone()
    b = ys @ K.T
    C = ((eye - K @ H) @ Q).expand(n, 4, 4).clone()
    eta = ys @ HF_S.T
    J = (HF_S @ H @ F).expand(n, 4, 4).clone()
    # The first step conditions on the prior N(m0, P0) instead of the previous state.
    m, P = F @ m0, F @ P0 @ F.T + Q
    S1 = H @ P @ H.T + R
    K1 = torch.linalg.solve(S1, H @ P).T
    A[0], b[0], C[0] = 0.0, m + K1 @ (ys[0] - H @ m), P - K1 @ S1 @ K1.T
    eta[0], J[0] = 0.0, 0.0
    return {"A": A, "b": b, "C": C, "eta": eta, "J": J}


def combine(i: dict, j: dict) -> dict:
    """Condition the later element ``j`` on the earlier ``i`` (their Lemma 8): single elements."""
    eye = torch.eye(i["A"].shape[-1])
    # (I + C_i J_j)^-1 A_i, (I + C_i J_j)^-1 (b_i + C_i eta_j), (I + C_i J_j)^-1 C_i at once
    M = eye + i["C"] @ j["J"]
    rhs = torch.cat([i["A"], (i["b"] + i["C"] @ j["eta"]).unsqueeze(-1), i["C"]], dim=-1)
    solved = torch.linalg.solve(M, rhs)
    A_, b_, C_ = solved[:, :4], solved[:, 4], solved[:, 5:]
    # (I + J_j C_i)^-1 = ((I + C_i J_j)^-1)^T, as C and J are symmetric
    N = torch.linalg.solve(M.T, torch.cat([(j["eta"] - j["J"] @ i["b"]).unsqueeze(-1), j["J"]], -1))
    return {
        "A": j["A"] @ A_,
        "b": j["A"] @ b_ + j["b"],
        "C": j["A"] @ C_ @ j["A"].T + j["C"],
        "eta": i["A"].T @ N[:, 0] + i["eta"],
        "J": i["A"].T @ N[:, 1:] @ i["A"] + i["J"],
    }


truth, ys = simulate(torch.Generator().manual_seed(0))
want_means, want_covs = sequential_filter(ys)

elems = elements(ys)
fscan.check_associative(combine, elems)  # the operator is associative on this data
filtered = fscan.associative_scan(combine, elems, dim=0, combine_mode="generic")
torch.testing.assert_close(filtered["b"], want_means, rtol=1e-8, atol=1e-8)
torch.testing.assert_close(filtered["C"], want_covs, rtol=1e-8, atol=1e-8)
print(f"{T} steps filtered in O(log T) parallel steps; matches the sequential filter")
raw = (ys - truth[:, :2]).norm(dim=-1).mean()
kept = (filtered["b"][:, :2] - truth[:, :2]).norm(dim=-1).mean()
print(f"mean position error: measurements {raw:.3f}, filtered {kept:.3f}")
assert kept < raw / 2
print("ok")
