"""The error every command turns into one line on stderr and exit code 2 (bad input)."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad user input: a config key, a path, a checkpoint, a name. The message is one line
    naming the input and what is allowed."""
