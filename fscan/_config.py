"""Process-wide switches: ``fscan.config``.

``fscan.config.validate`` (default from the environment variable
``FSCAN_VALIDATE``, else False) is what ``validate=None`` means in
``fscan.associative_scan``: when True every scan first runs the full checks on
``combine_fn`` (uncached purity probe and randomized associativity check).
A debugging aid; it costs a few combine calls per scan.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ._errors import ScanTypeError, ScanValueError

__all__ = ["Config", "config"]

ENV_VALIDATE = "FSCAN_VALIDATE"
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


class Config:
    """fscan's global switches.

    Example:
        >>> import fscan
        >>> with fscan.config.override(validate=True):
        ...     fscan.config.validate
        True
    """

    __slots__ = ("_validate",)

    def __init__(self) -> None:
        self._validate = _env_flag(ENV_VALIDATE)

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

    @contextlib.contextmanager
    def override(self, *, validate: bool) -> Iterator[Config]:
        """Set ``validate`` inside a ``with`` block and restore it afterwards.

        Process-wide, like the attribute itself: not a per-thread setting.
        """
        previous = self._validate
        self.validate = validate
        try:
            yield self
        finally:
            self._validate = previous

    def __repr__(self) -> str:
        return f"fscan.config(validate={self._validate})"


config = Config()
