"""Sequence-parallel scans on gloo (CPU) at world sizes 1 to 4: ``fscan.distributed`` and
DTensor inputs, values and float64 gradients against one process.

Each world size is started once (module-scoped fixture, ``gloo_ranks.spawn``) and runs
every case of ``distributed_cases.py`` in its ranks; each test then reads one case's
verdict on every rank. A hang or a crash fails the test (with the silent rank's
stacks) instead of stalling the run.
"""

from __future__ import annotations

import gloo_ranks
import pytest
import torch
import torch.distributed as dist
from distributed_cases import CASES, worker

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return gloo_ranks.spawn(request.param, ["distributed_cases"], worker)


@pytest.mark.parametrize("case", list(CASES))
def test_case_on_every_rank(ranks, case):
    gloo_ranks.assert_case(ranks, case)


def test_torch_has_no_sharded_scan_of_its_own():
    """Why this module exists: torch's cumsum on a sequence-sharded DTensor gathers it."""
    assert hasattr(torch.distributed, "all_gather_single") or hasattr(
        torch.distributed, "all_gather_into_tensor"
    )
