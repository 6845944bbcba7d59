"""A temporary re-export for :mod:`fscan._recurrences.chunked`, which still imports
``KERNEL_MIN_NUMEL`` from here: it lives beside the C++ kernel's face now
(:mod:`fscan._engines.cpp.cpu_kernel`). The drop-ins' routing moved to
:mod:`fscan._routing.cumulative`, their blocked scan to :mod:`fscan._engines.blocked`.
"""

from __future__ import annotations

from .._engines.cpp.cpu_kernel import KERNEL_MIN_NUMEL

__all__ = ["KERNEL_MIN_NUMEL"]
