"""Which engine ran a public call, and why the faster ones were passed over: the ``"fscan"`` log.

Every eager public call (``associative_scan``, the drop-ins, the recurrences,
``associative_reduce``) sends one DEBUG record to the standard ``logging`` logger
``"fscan"`` naming the public function, the engine that ran it and the engines it
passed over with their reasons; the same facts are record attributes
(``fscan_api``, ``fscan_engine``, ``fscan_refused``). The engine names are the
closed set :data:`ENGINES` (docs/routes.md describes each).

How the facts are gathered, at no cost while DEBUG is off:

* :func:`logs_route` wraps each public function. With DEBUG off (or while Dynamo
  traces: no record, no graph break) it only calls the function. With DEBUG on, the
  outermost public call opens a :class:`Route` in a context variable, runs, then
  emits one record; public calls made inside it (``reset=``, the drop-ins' parallel
  scan, the recurrences' tree scan) add to that route instead of logging their own.
* The places where an engine is chosen call :func:`ran` with the engine that served
  the call (a no-op without an open route). The outermost public call's own choice
  wins over those of the calls nested in it; among choices at one depth, the first.
* The reasons are worked out after the call by the function registered for the public
  function (:func:`register`; :mod:`fscan._explain` registers them, with the same
  side-effect-free reading of fscan's state that ``fscan.explain`` uses).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

__all__ = [
    "ENGINES",
    "Engine",
    "Route",
    "logger",
    "logs_route",
    "quiet",
    "ran",
    "register",
]

Engine = Literal["empty", "native", "cpp", "triton", "tree", "blocked", "traced", "distributed"]
# The closed set of engine names, in the logger, ``fscan.explain``, the docs and the
# benchmark tables alike (docs/routes.md says what each one is).
ENGINES: frozenset[str] = frozenset(Engine.__args__)  # type: ignore[attr-defined]

logger = logging.getLogger("fscan")

# (engine or None, args, kwargs, route) -> (engine, refused): see register()
Why = Callable[[Any, tuple, dict, "Route"], tuple[str, dict[str, str]]]
_why: dict[str, Why] = {}
_before: dict[str, Callable[[tuple, dict], Any]] = {}
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass
class Route:
    """What the engine choices of one public call noted (see module doc)."""

    api: str
    depth: int = 0  # how many public calls deep the notes are made now
    noted: list[tuple[int, str]] = field(default_factory=list)  # (depth, engine)
    before: Any = None  # what the registered ``before`` read ahead of the call

    def engine(self) -> str | None:
        """The engine the outermost choice named (the first at the smallest depth)."""
        if not self.noted:
            return None
        return min(self.noted, key=lambda n: n[0])[1]


_route: contextvars.ContextVar[Route | None] = contextvars.ContextVar("fscan_route", default=None)
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity
# logging's memo of isEnabledFor, per level: cleared in place whenever any level changes,
# and refilled by the next isEnabledFor. One dict read answers the common case, DEBUG off,
# cheaper than the method call (without the memo, an empty dict: the call answers).
_enabled: dict[int, bool] = getattr(logger, "_cache", {})
_DEBUG = logging.DEBUG


def register(api: str, why: Why, before: Callable[[tuple, dict], Any] | None = None) -> None:
    """Register how the record of ``api`` gets its engine and reasons: ``why(engine,
    args, kwargs, route)`` with the engine the choices noted (None if none did), the
    public call's arguments and its route, returns ``(engine, refused)``. ``before(args,
    kwargs)``, if given, reads state ahead of the call into ``route.before`` (it must
    change nothing; if it raises, None: the call then raises its own error)."""
    _why[api] = why
    if before is not None:
        _before[api] = before


def ran(engine: Engine) -> None:
    """Note that ``engine`` serves the current public call (a no-op while no DEBUG
    record is being gathered)."""
    route = _route.get()
    if route is not None:
        route.noted.append((route.depth, engine))


# Dynamo cannot trace the ContextVar read: it calls ran() at trace time instead (a
# no-op there: logs_route gathers no record while compiling), at no cost to eager calls.
ran._dynamo_marked_constant = True  # type: ignore[attr-defined]


def quiet() -> bool:
    """Whether a public call made now gathers no record: eager, and DEBUG off. A door may
    then take a route ahead of :func:`logs_route`'s wrapper, which would only call through
    (~0.3 µs of a 6 µs call: the wrapper's frame and its ``*args, **kwargs``); where this
    is False, the wrapper's way. ``is_compiling`` first, as in the wrapper: Dynamo folds
    it and reads no memo. Logging's memo answers (asked where it is empty, which fills
    it), so two calls with no level changed between give one answer."""
    if _is_compiling():
        return False
    enabled = _enabled.get(_DEBUG)
    if enabled is None:
        enabled = logger.isEnabledFor(_DEBUG)
    return enabled is False


def logs_route(api: str) -> Callable[[_F], _F]:
    """Wrap the public function ``api`` so that it logs its route (see module doc)."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def public(*args: Any, **kwargs: Any) -> Any:
            # is_compiling first: Dynamo would break the graph on a logging call, and
            # guard on the memo (recompiling when a level is first read).
            if _is_compiling() or _enabled.get(_DEBUG) is False:
                return fn(*args, **kwargs)
            if not logger.isEnabledFor(_DEBUG):
                return fn(*args, **kwargs)
            return _logged(api, fn, args, kwargs)

        return public  # type: ignore[return-value]

    return wrap


def _logged(api: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    outer = _route.get()
    if outer is not None:  # a public call inside another: its choices join that record
        outer.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            outer.depth -= 1
    route = Route(api)
    read = _before.get(api)
    if read is not None:
        try:
            route.before = read(args, kwargs)
        except Exception:  # bad arguments: the call raises its own error
            route.before = None
    token = _route.set(route)
    try:
        out = fn(*args, **kwargs)
    finally:
        _route.reset(token)
    _emit(route, args, kwargs)
    return out


def _emit(route: Route, args: tuple, kwargs: dict) -> None:
    why = _why.get(route.api)
    engine, refused, trouble = route.engine() or "tree", {}, ""
    if why is not None:
        try:
            engine, refused = why(route.engine(), args, kwargs, route)
        except Exception as err:  # a report must never fail the user's call
            trouble = f" (its reasons could not be worked out: {type(err).__name__}: {err})"
    logger.debug(
        describe(route.api, engine, refused) + trouble,
        extra={"fscan_api": route.api, "fscan_engine": engine, "fscan_refused": dict(refused)},
    )


def describe(api: str, engine: str, refused: Mapping[str, str]) -> str:
    """One line: the public function, its engine, and the engines passed over and why.

    Example:
        >>> describe("fscan.cumsum", "native", {"cpp": "fewer than 2**15 elements"})
        'fscan.cumsum ran on engine native; passed over cpp (fewer than 2**15 elements)'
    """
    line = f"{api} ran on engine {engine}"
    if refused:
        line += "; passed over " + ", ".join(f"{e} ({why})" for e, why in refused.items())
    return line
