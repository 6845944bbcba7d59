"""Sequence-parallel scans on ``torch.distributed``: each rank holds a piece of one
long sequence and gets back its piece of the scan of the whole.

``import fscan.distributed`` (``torch.distributed`` must be available). DTensor
inputs need no import: ``fscan.associative_scan`` and ``fscan.linear_recurrence``
run these on DTensors sharded along the scan dimension. See ``docs/distributed.md``.
"""

from ._distributed import associative_scan as associative_scan
from ._distributed import linear_recurrence as linear_recurrence
from ._sharded.exchange import exchange_bytes as exchange_bytes
from ._sharded.layout import Layout as Layout

__all__ = ["Layout", "associative_scan", "exchange_bytes", "linear_recurrence"]
