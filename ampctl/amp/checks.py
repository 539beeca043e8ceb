"""Field validation for the components' own configs: one rule in one place.

A component's ``@dataclass(kw_only=True)`` config declares its rules as a table of
``(fields, predicate, allowed)`` rows and checks them in ``__post_init__`` with :func:`check`
(:func:`need` for a one-off condition), which raises :class:`FieldError` naming the field, the
value and what is allowed. A predicate takes ``(value, config)``; ``allowed`` is the text, or a
function of the config for a bound that is another field. The config layer (``ampctl.config``)
turns the error into one line that also names the group
(``scaler.init_scale=-1 is not allowed: scaler.init_scale must be a number > 0``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "FieldError",
    "need",
    "check",
    "is_finite",
    "is_int",
    "integer",
    "number",
    "one_of",
    "optional",
    "boolean",
    "nonblank",
    "show",
]

#: ``(fields separated by spaces, predicate(value, config), allowed text or text(config))``
Rule = tuple[str, Callable[[Any, Any], bool], "str | Callable[[Any], str]"]


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


def check(cfg: Any, rules: Iterable[Rule]) -> None:
    """Check the dataclass ``cfg`` against ``rules``, in order: the first field whose value
    breaks its rule raises :class:`FieldError` (a list field's value shown as a list)."""
    lists = {
        f.name for f in dataclasses.fields(cfg) if f.default_factory is not dataclasses.MISSING
    }
    for names, ok, allowed in rules:
        for name in names.split():
            v = getattr(cfg, name)
            if not ok(v, cfg):
                text = allowed(cfg) if callable(allowed) else allowed
                raise FieldError(type(cfg).__name__, name, list(v) if name in lists else v, text)


def is_finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _within(kind: Callable[[Any], bool], gt=-math.inf, ge=-math.inf, lt=math.inf, le=math.inf):
    return lambda v, _: kind(v) and gt < v and ge <= v and v < lt and v <= le


def integer(**bounds: float) -> Callable[[Any, Any], bool]:
    """An int (not a bool) within ``gt``/``ge``/``lt``/``le``."""
    return _within(is_int, **bounds)


def number(**bounds: float) -> Callable[[Any, Any], bool]:
    """A finite int or float (not a bool) within ``gt``/``ge``/``lt``/``le``."""
    return _within(is_finite, **bounds)


def one_of(choices: Iterable[Any]) -> Callable[[Any, Any], bool]:
    choices = tuple(choices)
    return lambda v, _: v in choices


def optional(ok: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    """None, or what ``ok`` allows."""
    return lambda v, c: v is None or ok(v, c)


def boolean(v: Any, _: Any = None) -> bool:
    return isinstance(v, bool)


def nonblank(v: Any, _: Any = None) -> bool:
    """A string with something besides blanks."""
    return isinstance(v, str) and v.strip() != ""
