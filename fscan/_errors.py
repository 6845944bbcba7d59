"""The exception hierarchy: one base class, each subclass also a built-in type.

Every error fscan raises is a :class:`ScanError`, so ``except fscan.ScanError``
catches them all, while each subclass also derives from the built-in type a
user would naturally catch (``TypeError`` for a wrong type, ``ValueError`` for a
wrong value, ...), so existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations

__all__ = [
    "CombineFnError",
    "ImpureCombineError",
    "NotAssociativeError",
    "ScanError",
    "ScanTypeError",
    "ScanValueError",
    "UnsupportedScanError",
]


class ScanError(Exception):
    """Base class of every error raised by fscan."""


class ScanTypeError(ScanError, TypeError):
    """An argument has the wrong type (e.g. a non-tensor leaf, a non-bool ``reverse``)."""


class ScanValueError(ScanError, ValueError):
    """An argument has the right type but a wrong value (e.g. ``dim`` out of range)."""


class CombineFnError(ScanValueError):
    """``combine_fn`` returned the wrong structure, shape, dtype or device."""


class NotAssociativeError(ScanValueError):
    """``combine_fn`` failed a randomized associativity check."""


class ImpureCombineError(ScanError, RuntimeError):
    """``combine_fn`` mutated an input in place or used randomness."""


class UnsupportedScanError(ScanError, NotImplementedError):
    """A valid request that fscan cannot carry out (e.g. in a traced context)."""
