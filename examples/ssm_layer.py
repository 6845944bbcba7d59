"""A diagonal linear state-space layer (Mamba/S5-style), trained through fscan.linear_recurrence.

The layer keeps a state of ``d_state`` channels, each a leaky integrator
``h_t = a_t * h_{t-1} + b_t`` whose decay ``a_t`` depends on the input (Mamba's
selective step size). All ``T`` states come from one ``fscan.linear_recurrence``
call, and gradients flow through it to every parameter. The task: from white
noise, predict two exponential moving averages of it, one fast and one slow.

Run: python examples/ssm_layer.py
"""

import torch
from torch import nn
from torch.nn import functional as F

import fscan


class DiagonalSSM(nn.Module):
    def __init__(self, d_model: int, d_state: int):
        super().__init__()
        self.step = nn.Linear(d_model, d_state)  # selective step size, delta_t
        self.log_rate = nn.Parameter(torch.linspace(-3.0, 1.0, d_state))  # A = -exp(log_rate)
        self.into_state = nn.Linear(d_model, d_state)  # B
        self.out_of_state = nn.Linear(d_state, d_model)  # C
        self.skip = nn.Parameter(torch.zeros(d_model))  # D

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (batch, T, d_model) -> (batch, T, d_model)."""
        delta = F.softplus(self.step(x))
        a = torch.exp(-delta * self.log_rate.exp())  # the discretized decay, in (0, 1)
        h = fscan.linear_recurrence(a, delta * self.into_state(x), dim=1)  # all T states at once
        return self.out_of_state(h) + self.skip * x


def moving_averages(x: torch.Tensor) -> torch.Tensor:
    """The target: a fast (0.5) and a slow (0.9) exponential moving average of channel 0."""
    fast = fscan.linear_recurrence(0.5, 0.5 * x[..., 0], dim=1)
    slow = fscan.linear_recurrence(0.9, 0.1 * x[..., 0], dim=1)
    return torch.stack([fast, slow], dim=-1)


torch.manual_seed(0)
model = DiagonalSSM(d_model=2, d_state=16)
optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
losses = []
for step in range(60):
    x = torch.randn(8, 128, 2)
    loss = F.mse_loss(model(x), moving_averages(x))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 10 == 0:
        print(f"step {step:2d}: loss {loss.item():.4f}")
print(f"step {step:2d}: loss {loss.item():.4f}")
assert losses[-1] < 0.1 * losses[0], losses

# The gradients through the scan are those of a plain sequential loop.
x = torch.randn(2, 50, 2, dtype=torch.float64)
model = model.double()


def sequential(a, b):
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(b.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


grads = []
for recurrence in (fscan.linear_recurrence, lambda a, b, dim: sequential(a, b)):
    delta = F.softplus(model.step(x))
    a = torch.exp(-delta * model.log_rate.exp())
    h = recurrence(a, delta * model.into_state(x), dim=1)
    y = model.out_of_state(h) + model.skip * x
    grads.append(torch.autograd.grad(y.square().sum(), list(model.parameters())))
torch.testing.assert_close(grads[0], grads[1])
print("ok")
