"""Sequence-parallel scans on gloo (CPU) at world sizes 1 to 4: ``fscan.distributed`` and
DTensor inputs, values and float64 gradients against one process.

Each world size is started once (module-scoped fixture) and runs every case of
``distributed_cases.py`` in its ranks; each test then reads one case's verdict
on every rank. Collectives time out after ``TIMEOUT_S`` and the parent stops
waiting after ``JOIN_S``, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import queue as queue_module

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_cases import CASES, free_port, worker

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORLD_SIZES = (1, 2, 3, 4)
TIMEOUT_S = 20.0
JOIN_S = 240.0  # as the other gloo files: at load 14 a world of 2-3 ranks took over 120 s


def spawn(world: int) -> dict[int, dict[str, str]]:
    """Start ``world`` ranks, run every case, return ``{rank: {case: verdict}}``."""
    # A fork server that imported torch, its compiler stack (fscan's first-call
    # checks load it) and fscan once starts every rank of every world size in
    # well under a second; spawn pays ~5-15 s of imports per rank on 2 cores.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch._dynamo", "distributed_cases"])
    else:
        ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=worker, args=(r, world, port, results, TIMEOUT_S), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, dict[str, str]] = {}
    try:
        for _ in range(world):
            rank, verdicts = results.get(timeout=JOIN_S)
            got[rank] = verdicts
    except queue_module.Empty:
        pass  # reported below as missing ranks
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # only the ranks this function started
    return got


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def verdicts(request):
    world = request.param
    return world, spawn(world)


@pytest.mark.parametrize("case", list(CASES))
def test_case_on_every_rank(verdicts, case):
    world, got = verdicts
    missing = [r for r in range(world) if r not in got]
    assert not missing, f"ranks {missing} of {world} sent no result (hung or crashed)"
    setup = {r: v["<setup>"] for r, v in got.items() if "<setup>" in v}
    assert not setup, setup
    failed = {r: v[case] for r, v in got.items() if v.get(case) != "ok"}
    assert not failed, "\n".join(f"rank {r}/{world}:\n{msg}" for r, msg in failed.items())


def test_torch_has_no_sharded_scan_of_its_own():
    """Why this module exists: torch's cumsum on a sequence-sharded DTensor gathers it."""
    assert hasattr(torch.distributed, "all_gather_single") or hasattr(
        torch.distributed, "all_gather_into_tensor"
    )
