"""The gloo harness of the multi-rank tests (tests/gloo_ranks.py) explains a rank that
sends no result: the signal that killed it or that it still ran, with its stacks,
beside what the ranks that answered saw first."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import gloo_ranks
import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


def _crash_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.barrier()


def _sleep_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(600)
    dist.barrier()


def _crashing(rank: int, world: int, port: int, results: Any) -> None:
    cases = {"crash": _crash_on_rank_1, "after": lambda r, w: None}
    gloo_ranks.run_cases(cases, rank, world, port, results, timeout_s=30)


def _hanging(rank: int, world: int, port: int, results: Any) -> None:
    gloo_ranks.run_cases({"hang": _sleep_on_rank_1}, rank, world, port, results, timeout_s=5)


def test_a_crashed_rank_is_named_with_its_signal_and_stacks():
    start = time.time()
    ranks = gloo_ranks.spawn(2, [__name__], _crashing, join_s=300)
    assert time.time() - start < 150  # a dead rank ends the wait, not the deadline
    assert set(ranks.got) == {0} and set(ranks.silent) == {1}
    with pytest.raises(AssertionError) as err:
        gloo_ranks.assert_case(ranks, "after")
    text = str(err.value)
    assert "rank 1/2 sent no result: died of SIGSEGV" in text
    assert "_crash_on_rank_1" in text  # its stack, written by faulthandler
    assert "rank 0/2, case 'crash'" in text  # what the peer saw first: its barrier failed
    assert "not run: this rank stopped after case 'crash'" in text


def test_a_hung_rank_is_killed_with_its_stacks():
    ranks = gloo_ranks.spawn(2, [__name__], _hanging, join_s=25)
    assert set(ranks.got) == {0} and set(ranks.silent) == {1}
    why = ranks.silent[1]
    assert why.startswith("still running after") and "killed" in why
    assert "_sleep_on_rank_1" in why  # dumped 20 s before the parent stopped waiting
    with pytest.raises(AssertionError, match=r"[Tt]imed out|Timeout"):
        gloo_ranks.assert_case(ranks, "hang")
