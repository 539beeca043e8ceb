"""Field validation for the components' own configs: one rule in one place.

A component's ``@dataclass(kw_only=True)`` config validates itself in ``__post_init__`` with
:func:`need`, which raises :class:`FieldError` naming the field, the value and what is allowed.
The config layer (``ampctl.config``) turns it into a one-line error that also names the group
(``scaler.init_scale=-1 is not allowed: scaler.init_scale must be a number > 0``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FieldError", "need", "is_finite", "is_int", "show"]


def show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


class FieldError(ValueError):
    """A config field with a value that is not allowed."""

    def __init__(self, owner: str, field: str, value: Any, allowed: str) -> None:
        self.owner, self.field, self.value, self.allowed = owner, field, value, allowed
        super().__init__(
            f"{owner}: {field}={show(value)} is not allowed: {field} must be {allowed}"
        )

    def named(self, prefix: str) -> str:
        """The message with the field named ``prefix.field`` (no owner)."""
        key = f"{prefix}.{self.field}" if prefix else self.field
        return f"{key}={show(self.value)} is not allowed: {key} must be {self.allowed}"


def need(cond: bool, owner: Any, field: str, value: Any, allowed: str) -> None:
    """Raise :class:`FieldError` unless ``cond``; ``owner`` is the config object or its name."""
    if not cond:
        name = owner if isinstance(owner, str) else type(owner).__name__
        raise FieldError(name, field, value, allowed)


def is_finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
