"""fscan's drop-ins in a model whose code you do not edit: ``fscan.swap_cumulative_ops()``.

The model below is written against torch, as library code is: position ids from an
attention mask as Hugging Face transformers computes them, discounted returns by the
flip/cumsum/flip idiom, a running maximum and a running log-normaliser. Inside ``with
fscan.swap_cumulative_ops():`` its ``cumsum``, ``cummax`` and ``logcumsumexp`` calls
run ``fscan.cumsum`` & co.; the outputs and gradients must equal those of the model run
without the swap, and the ``"fscan"`` log shows which engine served each call.

Run: python examples/swap_cumulative_ops.py
"""

import logging
from collections import Counter

import torch

import fscan


# ---- library code, written against torch (not edited) --------------------------------
class ValueHead(torch.nn.Module):
    """A time-major (T, B) value head: discounted returns of per-token rewards, their
    drawdowns, and the running log-normaliser of per-step tag scores (a streaming
    softmax over the steps so far, as in a CRF-style tagger's prefix partition)."""

    def __init__(self, vocab: int, width: int, tags: int, max_positions: int, gamma=0.99):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(max_positions, width)
        self.reward = torch.nn.Linear(width, 1)
        self.tag_scores = torch.nn.Linear(width, tags)
        self.gamma = gamma

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        # transformers' position ids for left-padded sequences (here along dim 0, time)
        position_ids = attention_mask.long().cumsum(0) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        h = torch.tanh(self.tokens(input_ids) + self.positions(position_ids))
        rewards = self.reward(h).squeeze(-1) * attention_mask
        # G_t = sum_{k >= t} gamma^(k - t) r_k, by scaling, flipping and summing
        scale = self.gamma ** torch.arange(rewards.shape[0], dtype=rewards.dtype)[:, None]
        returns = torch.cumsum((rewards * scale).flip(0), 0).flip(0) / scale
        drawdown = torch.cummax(returns, dim=0).values - returns
        log_normaliser = self.tag_scores(h).logcumsumexp(0)
        return position_ids, returns, drawdown, log_normaliser


# ---- the model run as is, and with the swap -------------------------------------------
torch.manual_seed(0)
length, batch = 512, 64
model = ValueHead(vocab=100, width=32, tags=16, max_positions=length).double()
input_ids = torch.randint(0, 100, (length, batch))
pad = torch.randint(0, length // 4, (1, batch))
attention_mask = (torch.arange(length)[:, None] >= pad).long()  # left padding


def run() -> tuple:
    model.zero_grad()
    position_ids, returns, drawdown, log_normaliser = model(input_ids, attention_mask)
    loss = returns.square().mean() + drawdown.mean() + log_normaliser[-1].mean()
    loss.backward()
    outputs = (returns, drawdown, log_normaliser)
    return position_ids, outputs, tuple(p.grad.clone() for p in model.parameters())


want = run()


class Engines(logging.Handler):
    """Counts the (fscan function, engine) of each call from the "fscan" log."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "fscan_api"):  # one record per public call; others are notes
            self.seen[record.fscan_api, record.fscan_engine] += 1


engines = Engines()
log = logging.getLogger("fscan")
log.addHandler(engines)
level = log.level
log.setLevel(logging.DEBUG)
with fscan.swap_cumulative_ops():
    got = run()
log.setLevel(level)

assert torch.equal(got[0], want[0])  # position ids: integers, exactly
for g, w in zip(got[1] + got[2], want[1] + want[2]):  # outputs, then gradients
    torch.testing.assert_close(g, w)
# the (T, B, tags) logcumsumexp over time took fscan's parallel scan
assert engines.seen[("fscan.logcumsumexp", "blocked")] == 1, engines.seen
print("fscan calls under the swap (function, engine): count")
for (api, engine), count in sorted(engines.seen.items()):
    print(f"  {api:<20} {engine:<8} {count}")
print("ok")
