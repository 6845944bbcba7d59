"""Process-wide switches: ``fscan.config``.

``fscan.config.validate`` (default from the environment variable
``FSCAN_VALIDATE``, else False) is what ``validate=None`` means in
``fscan.associative_scan``: when True every scan first runs the full checks on
``combine_fn`` (uncached purity probe and randomized associativity check, which
raises). A debugging aid; it costs a few combine calls per scan. When False, the
first call per ``combine_fn`` key runs the cached probe and a quick associativity
check that warns.

``fscan.config.cpu_kernel`` (default from ``FSCAN_CPU_KERNEL``, else ``"on"``)
governs the generated C++ kernel for pointwise scans on CPU (``fscan._engines.cpp``):
``"on"`` compiles it in the background once a combine_fn is worth it and uses
it when ready (fscan's torch engine answers meanwhile), ``"eager"`` compiles on
the first call and waits for it (tests, benchmarks, services that warm up),
``"off"`` never uses it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ._errors import ScanTypeError, ScanValueError

__all__ = ["Config", "config"]

ENV_VALIDATE = "FSCAN_VALIDATE"
ENV_CPU_KERNEL = "FSCAN_CPU_KERNEL"
CPU_KERNEL_MODES = ("on", "off", "eager")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _env_flag(name: str) -> bool:
    """Read a boolean environment variable; anything unrecognised is an error, not False."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ScanValueError(
        f"fscan: environment variable {name}={raw!r} is not a boolean, expected one of "
        f"{', '.join(_TRUE[:2] + _FALSE[1:3])} (or unset)."
    )


def _env_mode(name: str) -> str:
    """Read the CPU kernel mode from the environment; anything unrecognised is an error."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower() or "on"
    if value in CPU_KERNEL_MODES:
        return value
    raise ScanValueError(
        f"fscan: environment variable {name}={raw!r} is not a CPU kernel mode, expected one "
        f"of {', '.join(CPU_KERNEL_MODES)} (or unset)."
    )


class Config:
    """fscan's global switches.

    Example:
        >>> import fscan
        >>> with fscan.config.override(validate=True):
        ...     fscan.config.validate
        True
    """

    __slots__ = ("_cpu_kernel", "_validate")

    def __init__(self) -> None:
        self._validate = _env_flag(ENV_VALIDATE)
        self._cpu_kernel = _env_mode(ENV_CPU_KERNEL)

    @property
    def validate(self) -> bool:
        """Run the full ``combine_fn`` checks on every scan whose ``validate`` is None."""
        return self._validate

    @validate.setter
    def validate(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ScanTypeError(
                f"fscan.config: `validate` must be a bool, got {type(value).__name__} {value!r}."
            )
        self._validate = value

    @property
    def cpu_kernel(self) -> str:
        """``"on"``, ``"off"`` or ``"eager"``: the generated CPU scan kernel (module doc)."""
        return self._cpu_kernel

    @cpu_kernel.setter
    def cpu_kernel(self, value: str) -> None:
        if value not in CPU_KERNEL_MODES:
            raise ScanValueError(
                f"fscan.config: `cpu_kernel` must be one of {', '.join(CPU_KERNEL_MODES)}, "
                f"got {value!r}."
            )
        self._cpu_kernel = value

    @contextlib.contextmanager
    def override(
        self, *, validate: bool | None = None, cpu_kernel: str | None = None
    ) -> Iterator[Config]:
        """Set ``validate`` and/or ``cpu_kernel`` inside a ``with`` block, then restore them.

        Process-wide, like the attributes themselves: not a per-thread setting.
        """
        previous = (self._validate, self._cpu_kernel)
        try:
            if validate is not None:
                self.validate = validate
            if cpu_kernel is not None:
                self.cpu_kernel = cpu_kernel
            yield self
        finally:
            self._validate, self._cpu_kernel = previous

    def __repr__(self) -> str:
        return f"fscan.config(validate={self._validate}, cpu_kernel={self._cpu_kernel!r})"


config = Config()
