"""The error every command turns into one line on stderr and exit code 2 (bad input)."""

from __future__ import annotations

from typing import Any

__all__ = ["UsageError", "ConfigError", "BuildError", "first_line", "require_int"]


class UsageError(ValueError):
    """Bad user input: a config key, a path, a checkpoint, a name. The message is one line
    naming the input and what is allowed."""


class ConfigError(UsageError):
    """Bad user input in the config: the message is one line meant for the user."""


class BuildError(UsageError):
    """The config names something that cannot be built (a bad ``_target_``, a data path, a model
    whose output holds no loss ...): one line naming the key."""


def first_line(e: BaseException | str) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(e).strip()
    if text:
        return text.splitlines()[0]
    return type(e).__name__ if isinstance(e, BaseException) else ""


def require_int(name: str, value: Any, minimum: int, error: type[ValueError] = ValueError) -> int:
    """``value`` when it is an int (not a bool) >= ``minimum``; else ``error`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise error(f"{name} ({value}) must be >= {minimum}")
    return value
