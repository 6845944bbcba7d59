"""The exception hierarchy: one base class, each subclass also a built-in type.

Every error fscan raises about its arguments is a :class:`ScanError`, so
``except fscan.ScanError`` catches them all, while each subclass also derives
from the built-in type a user would naturally catch, so existing
``except ValueError`` code keeps working::

    ScanError (Exception)                 anything fscan rejects
    ├── ScanTypeError (TypeError)         an argument of the wrong type
    ├── ScanValueError (ValueError)       an argument of the right type, wrong value
    │   └── CombineFnError                `combine_fn` misbehaves
    │       ├── NotAssociativeError       ... fails the associativity check
    │       ├── NotElementwiseError       ... is not elementwise in pointwise mode
    │       └── ImpureCombineError        ... mutates an input or draws random numbers
    │                                         (also a RuntimeError)
    ├── UnsupportedScanError              valid, but not something fscan can do
    │   (NotImplementedError)
    ├── OutArgumentError (RuntimeError)   a drop-in's `out=` does not fit, as torch says
    └── PeerRankError (RuntimeError)      another rank of a fscan.distributed call failed

    ScanWarning (UserWarning)             fscan ran the call, but it looks like a mistake
    ├── NotAssociativeWarning             `combine_fn` failed the first-call associativity check
    └── ReverseNotBoolWarning             `reverse` is not a bool (fscan.lax, once)

Catch :class:`CombineFnError` for "something is wrong with my ``combine_fn``".
Exceptions raised *by* ``combine_fn`` itself (say a shape error inside it) are
the user's and propagate unchanged, as do torch's own errors from inside
``torch.func.vmap`` in ``"generic"`` mode.

Example:
    >>> import fscan, torch
    >>> try:
    ...     fscan.associative_scan(lambda a, b: a.add_(b), torch.ones(3), 0)
    ... except fscan.CombineFnError as err:
    ...     print(type(err).__name__, isinstance(err, RuntimeError))
    ImpureCombineError True
"""

from __future__ import annotations

__all__ = [
    "CombineFnError",
    "ImpureCombineError",
    "NotAssociativeError",
    "NotAssociativeWarning",
    "NotElementwiseError",
    "OutArgumentError",
    "PeerRankError",
    "ReverseNotBoolWarning",
    "ScanError",
    "ScanIndexError",
    "ScanTypeError",
    "ScanValueError",
    "ScanWarning",
    "UnsupportedScanError",
]


class ScanError(Exception):
    """Base class of every error fscan raises about its arguments."""


class ScanTypeError(ScanError, TypeError):
    """An argument has the wrong type (e.g. a non-tensor leaf, a non-bool ``reverse``)."""


class ScanValueError(ScanError, ValueError):
    """An argument has the right type but a wrong value (e.g. ``dim`` out of range)."""


class ScanIndexError(ScanValueError, IndexError):
    """``dim`` is out of range. Also an ``IndexError``, as torch raises for such a ``dim``."""


class CombineFnError(ScanValueError):
    """``combine_fn`` misbehaves: it returned the wrong structure, shape, dtype or device
    (this class itself), or one of the subclasses below."""


class NotAssociativeError(CombineFnError):
    """``combine_fn`` failed the randomized associativity check
    (``fscan.check_associative`` or ``validate=True``)."""


class NotElementwiseError(CombineFnError):
    """``combine_fn`` was given ``combine_mode="pointwise"`` but mixes positions within a
    batch (a matrix product, a reduction, indexing): ``combine_mode="generic"`` takes it."""


class ImpureCombineError(CombineFnError, RuntimeError):
    """``combine_fn`` modified one of its inputs in place or called a random operation.

    Also a ``RuntimeError``: impurity shows up while running ``combine_fn``.
    """


class UnsupportedScanError(ScanError, NotImplementedError):
    """A valid request that fscan cannot carry out (e.g. in a traced context)."""


class OutArgumentError(ScanError, RuntimeError):
    """A drop-in's ``out=`` does not fit the call: its dtype, its device, or an argument
    that requires grad. Also a ``RuntimeError``, which torch's own op raises there."""


class PeerRankError(ScanError, RuntimeError):
    """Another rank of the process group failed in the same ``fscan.distributed`` call.

    The rank that failed (say, with a wrong argument) raises its own error; every
    other rank raises this one, naming that rank and its error, instead of waiting
    in a collective that rank never enters. Also a ``RuntimeError``, as torch's own
    errors about a failed peer are.
    """


class ScanWarning(UserWarning):
    """Base class of fscan's warnings: the call ran, but something about it looks wrong.

    Silence them all with ``warnings.filterwarnings("ignore", category=fscan.ScanWarning)``.
    """


class NotAssociativeWarning(ScanWarning):
    """``combine_fn`` failed the quick associativity check of its first call.

    The first call with a given ``combine_fn`` key (the key of the purity verdict)
    compares ``f(f(a, b), c)`` with ``f(a, f(b, c))`` on a few elements of the call's
    own data, in float64 where the data is floating point, and warns once if they
    differ beyond roundoff: the scan's result then depends on how it groups the
    ``combine_fn`` calls. ``validate=True`` raises :class:`NotAssociativeError`
    instead; ``validate=False`` skips the check.
    """


class ReverseNotBoolWarning(ScanWarning):
    """``fscan.lax.associative_scan`` got a ``reverse`` that is not a bool.

    JAX treats any truthy ``reverse`` as True, and so does fscan.lax, but the usual
    cause is the argument-order trap: a port of a torch helper called as
    ``(fn, elems, axis, reverse)`` passes the axis as ``reverse`` (JAX's order is
    ``(fn, elems, reverse, axis)``). Pass ``axis=`` and ``reverse=`` by keyword.
    Emitted once per process.
    """
