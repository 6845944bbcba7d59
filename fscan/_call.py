"""The call records: one scan call, checked, as every door hands it to the internal
entry; one elementwise linear recurrence, as its doors hand it on.

The public doors (``fscan.associative_scan``, DTensor's, the drop-ins, the
recurrences, ``fscan.lax``, ``fscan.distributed``) check their arguments, flatten
``xs`` and build a :class:`ScanCall`; :func:`fscan._entry.run_scan` runs it. Nothing
below the doors checks the arguments again or calls a public function.
A :class:`RecurrenceCall` holds a recurrence's arguments as given: its solve
(:func:`fscan._recurrences.solve.run_linear_recurrence`) checks them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

__all__ = ["SCAN_API", "RecurrenceCall", "ScanCall"]

# The name errors give for every scan that reaches the entry through fscan's own code
# (a drop-in's blocked scan, the chunked recurrence's tree, DTensor's local scan).
SCAN_API = "fscan.associative_scan"


class ScanCall(NamedTuple):
    """One scan of ``leaves`` (the flat ``xs``, structure ``spec``) along ``dim``.

    ``dim`` is non-negative and every leaf has it, with one length: the door checked
    them. ``api`` names the public function in errors. ``reset``, ``initial`` and
    ``exclusive`` are the public options (None, False: not given); ``validate`` as for
    ``fscan.associative_scan``.
    (A NamedTuple, immutable like a frozen dataclass: made on every call, and cheaper.)
    """

    api: str
    combine_fn: Callable[[Any, Any], Any]
    xs: Any
    spec: PyTreeSpec
    leaves: list[torch.Tensor]
    dim: int
    reverse: bool
    combine_mode: str
    validate: bool | None = None
    reset: torch.Tensor | None = None
    initial: Any = None
    exclusive: bool = False


class RecurrenceCall(NamedTuple):
    """One elementwise linear recurrence ``h_t = a_t * h_{t-1} + b_t`` along ``dim``.

    The arguments of ``fscan.linear_recurrence`` as given (``a`` a tensor or a number),
    not yet checked; ``api`` names the public function in errors. The fields are in
    the order of :func:`fscan._recurrences.solve.run_linear_recurrence`'s parameters.
    """

    api: str
    a: Any
    b: torch.Tensor
    dim: int
    initial: torch.Tensor | None = None
    reverse: bool = False
    reset: torch.Tensor | None = None
    acc_dtype: torch.dtype | None = None
