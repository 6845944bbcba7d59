"""Agreeing on a distributed call before its first exchange: the SPMD checks."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._call import RecurrenceCall, ScanCall
from .._errors import PeerRankError, ScanValueError
from .._pytree import describe, leaf_paths
from .layout import Layout, resolve_group

# ---- agreeing on the call: the SPMD checks --------------------------------------
#
# A collective only works when every rank enters it with buffers of one size: a rank
# that raises before it (a wrong argument, an error inside combine_fn on its data)
# leaves the others waiting until the group's timeout, and ranks whose leaves differ
# in element shape or dtype make gloo abort the process (or, where the sizes happen
# to match, mix up bytes silently). So every call with peers first all-gathers a
# fixed-size digest, two int64 words per rank: a status (0: ready, 1: raised) and a
# hash of the facts the exchange depends on. Only when the words differ do the ranks
# gather the facts themselves (all_gather_object) to say who differs in what; every
# rank sees the same words, so every rank takes the same path and raises.

__all__ = [
    "CURRENT_CALL",
    "Agreement",
    "agree",
    "agreeing",
    "recurrence_facts",
    "scan_facts",
]


Facts = list[tuple[str, int | None, str]]  # (what, leaf index or None, value)


def _no_facts() -> tuple[Facts, Callable[[], list[str]]]:
    return [], list


@dataclass
class Agreement:
    """One distributed call in progress on this rank: its group, and how to describe it.

    ``describe()`` gives the facts of the call and a function that names its leaves
    (for error messages); the call's body sets it once its arguments are checked, and
    the exchange adds ``more`` (what it sends, whether its backward runs). Run only
    when the exchange is reached, after this rank's own checks passed.
    """

    api: str
    group: Any
    describe: Callable[[], tuple[Facts, Callable[[], list[str]]]] = _no_facts
    more: Facts = field(default_factory=list)
    # the door's options that the engine's ``describe`` does not know of (the
    # recurrences' ``exclusive``: one more exchange)
    options: Facts = field(default_factory=list)
    agreed: bool = False


CURRENT_CALL: ContextVar[Agreement | None] = ContextVar("fscan_distributed_call", default=None)

_FAILED, _READY = 1, 0


def _hash64(text: str) -> int:
    """A 64-bit hash of ``text``, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True
    )


def _collective_device(group: Any) -> torch.device:
    """The device the group's backend gathers host objects on (CPU for gloo)."""
    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    return torch.device(pick(group) if pick is not None else "cpu")


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def agree(call: Agreement, error: Exception | None = None) -> None:
    """Check that every rank of ``call.group`` is ready with the same facts; else raise.

    ``error``: what this rank raised before the exchange (it is re-raised here, after
    the peers have heard of it). Every other rank raises :class:`PeerRankError` when
    a peer failed, and every rank raises the same ``ScanValueError`` when the facts
    differ.
    """
    call.agreed = True
    world = dist.get_world_size(call.group)
    if world == 1:
        if error is not None:
            raise error
        return
    facts, paths = None, None
    if error is None:
        try:
            facts, paths = call.describe()
        except Exception as err:  # whatever this rank cannot describe, it must not hide
            error = err
    if facts is not None:
        facts = facts + call.options
    word = 0 if facts is None else _hash64(repr(facts + call.more))
    device = _collective_device(call.group)
    mine = torch.tensor([_READY if error is None else _FAILED, word], device=device)
    rows = torch.empty(world * 2, dtype=torch.int64, device=device)
    _gather_into(rows, mine, group=call.group)
    words = rows.tolist()  # one host read: compared in Python
    if words[0] == _READY and words == words[:2] * world:
        return
    # The slow path, taken by every rank alike (they all see the same rows).
    report = None if error is None else (type(error).__name__, str(error))
    names = None
    if facts is not None:
        facts = facts + call.more
        try:
            names = paths()
        except Exception:  # a message without leaf paths; the peers must hear from us
            names = None
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (report, facts, names), group=call.group)
    failed = [r for r, (rep, _, _) in enumerate(got) if rep is not None]
    if error is not None:
        raise error
    if failed:
        raise PeerRankError(_peer_message(call.api, got, failed, world))
    raise ScanValueError(_mismatch_message(call.api, got))


def _peer_message(api: str, got: list[Any], failed: list[int], world: int) -> str:
    name, text = got[failed[0]][0]
    others = f" (ranks {', '.join(map(str, failed[1:]))} failed too)" if failed[1:] else ""
    return (
        f"{api}: rank {failed[0]} of the {world} ranks in the group raised {name}{others} "
        f"before the exchange, so this rank stopped too instead of waiting for it: {text}"
    )


def _ranks(values: list[str]) -> str:
    """``"a on ranks 0, 2; b on rank 1"``: which rank gave which value."""
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    parts = []
    for v, ranks in by_value.items():
        word = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{v} on {word} {', '.join(map(str, ranks))}")
    return "; ".join(parts)


def _mismatch_message(api: str, got: list[Any]) -> str:
    """What differs between the ranks' facts, leaf by leaf where the structures agree."""
    tables = [{(label, leaf): value for label, leaf, value in facts} for _, facts, _ in got]
    paths = got[0][2]
    same_leaves = len({t.get(("tree structure", None)) for t in tables}) == 1
    keys = list(dict.fromkeys(key for t in tables for key in t))
    if len({t.get(("function", None)) for t in tables}) > 1:  # the rest cannot compare
        keys = [("function", None)]
    lines = []
    for label, leaf in keys:
        if leaf is not None and not same_leaves:
            continue  # leaf by leaf means nothing when the trees differ
        values = [t.get((label, leaf), "absent") for t in tables]
        if len(set(values)) > 1:
            if leaf is None:
                where = ""
            else:
                where = f" of leaf {f'#{leaf}' if paths is None else paths[leaf]}"
            lines.append(f"{label}{where}: {_ranks(values)}")
    what = "`b`" if tables[0].get(("function", None)) == "linear_recurrence" else "leaves"
    return (
        f"{api}: the ranks of the group made different calls, so their pieces cannot "
        f"be exchanged: {'; '.join(lines)}. Every rank must make the same call (SPMD, as "
        f"with DDP): {what} of the same structure, dtypes, device type and shapes but "
        "for the length along `dim`, the same options, requires_grad set alike."
    )


def agreeing(api: str, group: Any) -> contextlib.AbstractContextManager[Agreement]:
    """Open a distributed call on ``group``: make sure the ranks agree (:func:`agree`,
    run by the first :func:`~fscan._sharded.exchange.exchange`) before the first
    exchange, also when one of them raises before it.

    Everything that may raise on one rank alone (argument checks, a DTensor's shard
    metadata, ``combine_fn`` on its data) runs inside: an error reaches the peers, who
    hear of it where they agree, and then propagates here. The body sets the
    agreement's ``describe`` once the arguments are checked.

    Under ``torch.compile`` the check is skipped (the agreement is born agreed): it
    reads the gathered digests on the host, which a graph cannot, and Dynamo cannot
    trace the context variable. A traced call's collectives do not depend on the data
    (see :mod:`fscan._sharded.traced`), so ranks that make the same call meet in them.
    """
    # A plain function, not the context manager: Dynamo traces this one.
    if torch.compiler.is_compiling():
        return contextlib.nullcontext(Agreement(api, resolve_group(api, group), agreed=True))
    return _agreeing(Agreement(api, resolve_group(api, group)))


@contextlib.contextmanager
def _agreeing(state: Agreement) -> Iterator[Agreement]:
    token = CURRENT_CALL.set(state)
    try:
        yield state
    except Exception as err:
        if not state.agreed:  # else the peers have moved on: nothing of theirs waits
            agree(state, err)  # raises err, after telling the peers
        raise
    finally:
        CURRENT_CALL.reset(token)


def _shape_along(x: torch.Tensor, dim: int) -> str:
    """``x``'s shape with the scan dimension shown as ``n`` (its length may differ by rank)."""
    return str(tuple("n" if i == dim else s for i, s in enumerate(x.shape))).replace("'", "")


def _mask_fact(reset: Any, dim: int) -> str:
    if reset is None:
        return "None"
    return f"a mask of shape {_shape_along(reset, 0 if reset.ndim == 1 else dim)}"


def scan_facts(
    call: ScanCall, layout: Layout | None, deterministic: bool = False
) -> tuple[Facts, Callable[[], list[str]]]:
    """What :func:`~fscan._sharded.scan.sharded_scan`'s exchange depends on (``call``
    is checked: ``dim`` is non-negative and every leaf has it); ``deterministic``:
    the other algorithm, with other exchanges (:mod:`fscan._sharded.deterministic`)."""
    dim, reset = call.dim, call.reset
    facts: Facts = [
        ("function", None, "associative_scan"),
        ("tree structure", None, str(call.spec)),
        ("`dim`", None, str(dim)),
        ("`reverse`", None, str(call.reverse)),
        ("`combine_mode`", None, str(call.combine_mode)),
        ("`layout`", None, repr(layout)),
        ("`reset`", None, _mask_fact(reset, dim)),
        ("`deterministic`", None, str(deterministic)),
        ("`initial`", None, "None" if call.initial is None else "given"),
        ("`exclusive`", None, str(call.exclusive)),
    ]
    for i, x in enumerate(call.leaves):
        facts.append(("dtype", i, str(x.dtype)))
        facts.append(("device type", i, x.device.type))
        facts.append(("shape (n: the scan dimension)", i, _shape_along(x, dim)))
    return facts, lambda: leaf_paths(call.xs)


def recurrence_facts(
    call: RecurrenceCall, deterministic: bool = False
) -> tuple[Facts, Callable[[], list[str]]]:
    """What :func:`~fscan._sharded.scan.sharded_recurrence`'s exchange depends on: the
    arguments as given (checked before the exchange), and ``deterministic`` as in
    :func:`scan_facts`.

    A number ``a`` may differ by rank (it is this rank's gate); ``initial``'s values
    are not compared (that would read them on the host)."""
    a, b, initial, reset = call.a, call.b, call.initial, call.reset
    d = call.dim % b.ndim
    gate = f"a tensor of dtype {a.dtype}" if isinstance(a, torch.Tensor) else "a number"
    start = "None" if initial is None else describe(initial)
    facts: Facts = [
        ("function", None, "linear_recurrence"),
        ("dtype of `b`", None, str(b.dtype)),
        ("device type of `b`", None, b.device.type),
        ("shape of `b` (n: the scan dimension)", None, _shape_along(b, d)),
        ("`a`", None, gate),
        ("`initial`", None, start),
        ("`reverse`", None, str(call.reverse)),
        ("`reset`", None, _mask_fact(reset, d)),
        ("`acc_dtype`", None, str(call.acc_dtype)),
        ("`deterministic`", None, str(deterministic)),
    ]
    return facts, list
