"""The error every command turns into one line on stderr and exit code 2 (bad input)."""

from __future__ import annotations

__all__ = ["UsageError", "ConfigError", "BuildError", "first_line"]


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
