"""Gloo groups for the tests: start ``world`` ranks, run cases in them, collect verdicts.

Every multi-rank test file starts each world size once (starting ranks costs seconds,
a case milliseconds), runs its cases in every rank and sends back one dict of
verdicts per rank. This module is that machinery, once:

* :func:`run_cases` is a rank's body: join the group, run every case in order, stop
  at the first failure (the ranks may be out of step: do not wait on them);
* :func:`spawn` starts the ranks from a fork server that imported torch, its compiler
  stack and the cases once (a rank starts in well under a second; ``spawn`` pays
  5-15 s of imports per rank on 2 cores) and waits at most ``join_s`` in all;
* :func:`assert_case` reads one case's verdict on every rank.

A rank that sends nothing is explained, not only counted: its exit status (a
signal's name where it crashed) and what :mod:`faulthandler` wrote in it, the
stacks of all its threads at a crash or, where it still runs, shortly before the
parent stops waiting. The ranks that did answer are shown beside it: a rank's
collective fails when a peer dies, and which came first is the finding.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue as queue_module
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A collective's timeout: long enough for a rank whose first call traces a kernel or
# waits on a disk cache lock on a loaded 2-core machine (the suite's other worker
# building kernels beside it), short enough that a real hang fails within ``JOIN_S``.
TIMEOUT_S = 60.0
# The parent's wait for all ranks, in all (it was 240 s for each rank's result: the
# compiled cases of tests/distributed_cases.py build graphs in every rank at once).
JOIN_S = 480.0
_DUMP_MARGIN_S = 20.0  # a silent rank prints its stacks this long before the parent gives up
_SHOWN = 4000  # characters of a dump or a verdict shown in a failure message

Case = Callable[[int, int], Any]


@dataclass
class Ranks:
    """What a world's ranks sent: ``got[rank]`` its verdicts, ``silent[rank]`` why it
    sent none (exit status and stacks)."""

    world: int
    got: dict[int, dict[str, Any]] = field(default_factory=dict)
    silent: dict[int, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(
    cases: Mapping[str, Any],
    rank: int,
    world: int,
    port: int,
    results: Any,
    *,
    timeout_s: float = TIMEOUT_S,
    threads: int | None = 1,
    verdict: Callable[[Any, int, int], Any] | None = None,
    ok: Callable[[Any], bool] = lambda v: v == "ok",
    setting: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> None:
    """Join the group, run every case, put ``(rank, {case: verdict})`` on ``results``.

    ``verdict(case, rank, world)`` judges one case (default: ``"ok"``, or the
    traceback of what it raised); after the first verdict that is not ``ok`` the
    remaining cases are marked not run. ``setting()`` is entered around the cases;
    ``threads`` None leaves torch's thread count as the caller set it.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    judge = verdict or _raised
    verdicts: dict[str, Any] = {}
    try:
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        with setting():
            stopped = None
            for name, case in cases.items():
                if stopped is not None:
                    verdicts[name] = f"not run: this rank stopped after case {stopped!r}"
                    continue
                verdicts[name] = judge(case, rank, world)
                if not ok(verdicts[name]):
                    stopped = name
    except Exception:
        verdicts["<setup>"] = traceback.format_exc()
    results.put((rank, verdicts))
    if dist.is_initialized():
        dist.destroy_process_group()


def _raised(case: Case, rank: int, world: int) -> str:
    try:
        case(rank, world)
    except Exception:
        return traceback.format_exc(limit=-4)
    return "ok"


def _rank_main(dump: str, stop_at: float, body: Callable[..., None], *args: Any) -> None:
    """A rank: stacks to ``dump`` at a crash, and once if it still runs at ``stop_at``."""
    out = open(dump, "w")  # noqa: SIM115  (faulthandler writes to it until the process ends)
    faulthandler.enable(out, all_threads=True)
    faulthandler.dump_traceback_later(max(1.0, stop_at - time.time()), file=out)
    body(*args)
    faulthandler.cancel_dump_traceback_later()


def spawn(
    world: int,
    preload: list[str],
    body: Callable[..., None],
    *args: Any,
    join_s: float = JOIN_S,
) -> Ranks:
    """Start ``world`` ranks running ``body(rank, world, port, results, *args)``
    (a module-level function of a module in ``preload``) and collect their verdicts."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch._dynamo", "fscan", __name__, *preload])
    else:
        ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    start = time.time()
    deadline = start + join_s
    ranks = Ranks(world)
    with tempfile.TemporaryDirectory(prefix="fscan-gloo-") as tmp:
        dumps = [os.path.join(tmp, f"rank{r}.txt") for r in range(world)]
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(dumps[r], deadline - _DUMP_MARGIN_S, body, r, world, port, results, *args),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        while len(ranks.got) < world and time.time() < deadline:
            with contextlib.suppress(queue_module.Empty):
                rank, verdicts = results.get(timeout=min(1.0, max(0.1, deadline - time.time())))
                ranks.got[rank] = verdicts
                continue
            if not any(p.is_alive() for r, p in enumerate(procs) if r not in ranks.got):
                # every silent rank ended (a crash): what one put may still be in the pipe
                with contextlib.suppress(queue_module.Empty):
                    while len(ranks.got) < world:
                        rank, verdicts = results.get(timeout=2.0)
                        ranks.got[rank] = verdicts
                break
        for rank, p in enumerate(procs):
            p.join(timeout=10 if rank in ranks.got else 1)  # a silent one had its time
            if rank in ranks.got:
                if p.is_alive():
                    p.kill()  # only the ranks started here
                continue
            if p.is_alive():
                status = f"still running after {time.time() - start:.0f} s: killed"
                p.kill()
            elif p.exitcode is not None and p.exitcode < 0:
                status = f"died of {signal.Signals(-p.exitcode).name}"
            else:
                status = f"exited with status {p.exitcode} without a result"
            with open(dumps[rank]) as f:
                stacks = f.read()
            ranks.silent[rank] = status + ("\n" + stacks[-_SHOWN:] if stacks else "")
    return ranks


def assert_case(
    ranks: Ranks,
    case: str,
    *,
    ok: Callable[[Any], bool] = lambda v: v == "ok",
    text: Callable[[Any], str] = str,
) -> None:
    """Every rank judged ``case`` ``ok``; else the ranks that did not, each with its
    verdict (``text(verdict)``), and the silent ones with why, beside the first
    failure of each rank that answered (a collective fails when a peer dies: which
    came first is the finding)."""
    lines = [f"rank {r}/{ranks.world} sent no result: {why}" for r, why in ranks.silent.items()]
    for rank, verdicts in sorted(ranks.got.items()):
        where = f"rank {rank}/{ranks.world}"
        if "<setup>" in verdicts:
            lines.append(f"{where} failed to start:\n{text(verdicts['<setup>'])}")
            continue
        first = next((n for n, v in verdicts.items() if not ok(v)), None)
        verdict = verdicts.get(case, "not run: no verdict")
        if not ok(verdict):
            lines.append(f"{where}:\n{text(verdict)[-_SHOWN:]}")
        if ranks.silent and first is not None and first != case:
            lines.append(f"{where}, case {first!r}:\n{text(verdicts[first])[-_SHOWN:]}")
    assert not lines, "\n".join(lines)
