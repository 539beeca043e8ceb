"""A checkpoint or a run folder is data from a stranger.

Nothing a saved config names is imported, called or resolved unless it ships with ampctl or the
user allowed it on the command line (compare Hugging Face's ``trust_remote_code=False``):

* ``_target_`` (anywhere in the config): allowed when it names a model that ships with ampctl
  (exported by :mod:`ampctl.train.models`), when the user passes ``--trust-code``, or when the
  user gives the same ``KEY._target_=VALUE`` as an override on the command line.
* Interpolations and resolvers (``${...}``, e.g. ``${oc.env:SECRET}``): never evaluated in a saved
  config. ampctl saves configs resolved, so one in a checkpoint was written by hand or another
  tool; it is refused with a line naming the key.

Configs the user composes (``conf/``, ``--config-dir``, overrides) are the user's own and are not
restricted.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from typing import Any

from ampctl.errors import UsageError

__all__ = [
    "UntrustedConfigError",
    "SHIPPED_MODEL_MODULE",
    "is_shipped_target",
    "find_targets",
    "find_interpolations",
    "check_saved_config",
    "check_targets",
    "refuse_interpolations",
    "targets_in_overrides",
]

SHIPPED_MODEL_MODULE = "ampctl.train.models"


class UntrustedConfigError(UsageError):
    """A saved config names code that ampctl will not run without the user's consent."""

    def __init__(self, message: str, *, key: str, value: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


def is_shipped_target(target: str) -> bool:
    """Whether ``target`` names a model that ships with ampctl (a name exported by
    ``ampctl.train.models``, reached through that package or one of its submodules).

    Only ampctl's own modules are imported to answer; any other name is not shipped."""
    if not isinstance(target, str):
        return False
    module_name, _, attr = target.rpartition(".")
    if module_name != SHIPPED_MODEL_MODULE and not module_name.startswith(
        SHIPPED_MODEL_MODULE + "."
    ):
        return False
    try:
        shipped = importlib.import_module(SHIPPED_MODEL_MODULE)
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    obj = getattr(module, attr, None)
    exported = {id(getattr(shipped, n, None)) for n in getattr(shipped, "__all__", ())}
    return obj is not None and id(obj) in exported


def _walk(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            yield key, v
            yield from _walk(v, key)
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            key = f"{prefix}[{i}]"
            yield key, v
            yield from _walk(v, key)


def find_targets(tree: Any) -> list[tuple[str, str]]:
    """Every ``(key, value)`` whose key ends in ``_target_``."""
    return [(k, v) for k, v in _walk(tree) if k.rsplit(".", 1)[-1] == "_target_"]


def find_interpolations(tree: Any) -> list[tuple[str, str]]:
    """Every ``(key, text)`` of a string value that holds an interpolation or resolver."""
    return [(k, v) for k, v in _walk(tree) if isinstance(v, str) and "${" in v]


def targets_in_overrides(overrides: Iterable[str]) -> dict[str, str]:
    """``{key: value}`` of the ``KEY._target_=VALUE`` overrides a user typed."""
    out: dict[str, str] = {}
    for o in overrides:
        key, sep, value = o.lstrip("+").partition("=")
        if sep and key.rsplit(".", 1)[-1] == "_target_":
            out[key] = value.strip().strip("'\"")
    return out


def refuse_interpolations(saved: Any, *, source: str) -> None:
    """Refuse a saved config holding an interpolation or resolver (never evaluated)."""
    for key, text in find_interpolations(saved):
        raise UntrustedConfigError(
            f"{source}: {key} holds the interpolation {text!r}; a saved config is data and "
            "ampctl evaluates nothing in it (ampctl saves configs resolved: this one was edited "
            "or written by another tool); set the key on the command line instead",
            key=key,
            value=text,
        )


def check_targets(
    tree: Any,
    *,
    source: str,
    trust_code: bool = False,
    overrides: Iterable[str] = (),
    flag: str = "--trust-code",
) -> None:
    """Refuse a ``_target_`` that does not ship with ampctl, unless ``trust_code`` or the user
    gave the same ``KEY._target_=VALUE`` in ``overrides``."""
    given = targets_in_overrides(overrides)
    for key, target in find_targets(tree):
        if trust_code or is_shipped_target(target) or given.get(key) == target:
            continue
        raise UntrustedConfigError(
            f"{source}: {key}={target!r} does not ship with ampctl and a checkpoint is data, so "
            f"it is not imported; if you trust it, add {flag} or give {key}={target} on the "
            "command line",
            key=key,
            value=str(target),
        )


def check_saved_config(
    saved: Any,
    *,
    source: str,
    trust_code: bool = False,
    overrides: Iterable[str] = (),
    flag: str = "--trust-code",
) -> None:
    """Refuse a saved config that would run code (:func:`refuse_interpolations`, then
    :func:`check_targets`). Raises :class:`UntrustedConfigError` naming the key, the value and
    how to allow it."""
    refuse_interpolations(saved, source=source)
    check_targets(saved, source=source, trust_code=trust_code, overrides=overrides, flag=flag)
