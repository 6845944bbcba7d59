"""Affine maps ``v -> g + M v`` on per-position blocks, composed elementwise.

The adjoint of a pointwise scan is a reverse scan of such maps
(:mod:`fscan._engines.adjoint` eagerly, :mod:`fscan._engines.traced_adjoint` in a trace): each
block entry and each vector component is a separate tensor, so every product is
an elementwise op and the composition is itself a pointwise combine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from .._combine import FlatCombine

__all__ = ["BlockIndex", "affine_combine"]

BlockIndex = tuple[int, int]  # (row, column) of a per-position L x L block


def affine_combine(pattern: list[BlockIndex], n: int, absorb_zeros: bool = False) -> FlatCombine:
    """Compose ``v -> g + M v`` maps, ``acc`` applied first: ``(Mi Ma, gi + Mi ga)``.

    Leaves are the block entries in ``pattern`` order, then the ``n`` vectors.
    A lone entry ``(0, 0)`` with ``n > 1`` stands for ``m * I``. With
    ``absorb_zeros``, a product with an exact zero factor is zero, inf and NaN included
    (what a trace, which cannot fall back stepwise, needs: ``fscan._engines.traced_adjoint``).

    Example:
        >>> compose = affine_combine([(0, 0)], 1)
        >>> compose([torch.tensor(2.0), torch.tensor(1.0)], [torch.tensor(3.0), torch.tensor(4.0)])
        [tensor(6.), tensor(7.)]
    """
    size = len(pattern)
    if pattern == [(0, 0)] and n > 1:
        m_terms = [[(0, 0)]]
        g_terms = [[(0, j)] for j in range(n)]
    else:
        index = {e: p for p, e in enumerate(pattern)}
        m_terms = [
            [
                (index[(j, m)], index[(m, k)])
                for m in range(n)
                if (j, m) in index and (m, k) in index
            ]
            for j, k in pattern
        ]
        g_terms = [[(index[(j, m)], m) for m in range(n) if (j, m) in index] for j in range(n)]

    def combine(acc: Sequence[torch.Tensor], elem: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ma, ga, mi, gi = acc[:size], acc[size:], elem[:size], elem[size:]
        ms = [_sum_of_products(None, mi, ma, terms, absorb_zeros) for terms in m_terms]
        gs = [
            _sum_of_products(gi[j], mi, ga, terms, absorb_zeros) for j, terms in enumerate(g_terms)
        ]
        return [*ms, *gs]

    return combine


def _sum_of_products(
    start: torch.Tensor | None,
    lhs: Sequence[torch.Tensor],
    rhs: Sequence[torch.Tensor],
    terms: list[tuple[int, int]],
    absorb_zeros: bool = False,
) -> torch.Tensor:
    """``start + sum(lhs[a] * rhs[b] for a, b in terms)`` with fused multiply-adds.

    ``terms`` is never empty when ``start`` is None: an entry of a closed
    pattern is always the product of two entries.
    """
    total = start
    for a, b in terms:
        if absorb_zeros:
            zero = (lhs[a] == 0) | (rhs[b] == 0)
            product = torch.where(zero, 0, lhs[a] * rhs[b])
            total = product if total is None else total + product
        else:
            total = lhs[a] * rhs[b] if total is None else torch.addcmul(total, lhs[a], rhs[b])
    return cast(torch.Tensor, total)
