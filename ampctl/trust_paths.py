"""Where a run folder may make ampctl read and write (the path half of :mod:`ampctl.trust`).

A saved config (a checkpoint's, a run folder's ``config.yaml``) is data from a stranger, and so
are the places it names. On ``train --resume`` a path or URI the saved config names is used only
when it lies inside the run folder or the working directory, or when the user repeats the key on
the command line (``data.path=...``): the refusal is one line naming the override to give. A
network URI (``http://``, ``https://``, ``databricks``, W&B ``online`` ...) from a saved config is
never used on its own, wherever it points.

The keys (:data:`SAVED_PATH_KEYS`): ``data.path``, ``data.tokenizer``, ``data.cache_dir`` (read
and written), ``trainer.runs_dir`` (a fork's new folder), ``logging.mlflow_uri`` (a tracking
store: a ``sqlite:``/``file:`` path or a server), ``logging.wandb_mode=online`` (uploads).

A folder inside a run (``checkpoints/``, DeepSpeed ``global_stepN/``) that is a symlink out of
the run is refused too (:func:`check_folder_inside`): the per-file link check of
:func:`ampctl.trust.checked_file` sees only the file's own name.

Standard library only.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ampctl.errors import UsageError

__all__ = [
    "FolderRefused",
    "SAVED_PATH_KEYS",
    "SavedPathRefused",
    "check_folder_inside",
    "check_saved_paths",
    "overridden_keys",
]

#: key -> what it is, for the refusal.
SAVED_PATH_KEYS = {
    "data.path": "the training data",
    "data.tokenizer": "the tokenizer",
    "data.cache_dir": "the token cache (written)",
    "trainer.runs_dir": "where a new run folder is made",
    "logging.mlflow_uri": "the MLflow tracking store",
}

_LOCAL_SCHEMES = {"", "file", "sqlite"}
NULL_STORE = " (or give logging.mlflow_uri=null for a store in the run folder)"
_NETWORK_NAMES = {"databricks", "databricks-uc", "uc"}  # MLflow's scheme-less servers


class SavedPathRefused(UsageError):
    """A saved config names a place outside the run folder and the working directory, or a
    network destination, that the user did not repeat on the command line."""


class FolderRefused(UsageError):
    """A folder of a run (``checkpoints/``, ``global_stepN/``) is a symlink out of the run."""


def check_folder_inside(folder: str | Path, root: str | Path, *, what: str) -> None:
    """Refuse ``folder`` when it does not resolve inside ``root`` (a symlink out of the run,
    or one of its parents below ``root`` is): nothing is read from or written to it. A folder
    that does not exist passes (nothing to follow). Raises :class:`FolderRefused`."""
    f, r = Path(folder), Path(root)
    if not (f.exists() or f.is_symlink()):
        return
    target, base = f.resolve(), r.resolve()
    if not target.is_relative_to(base):
        raise FolderRefused(
            f"{what} {str(f)!r} is a symlink to {str(target)!r}, outside the run folder "
            f"{str(r)!r}: not used (a run folder is data and its links may not reach out of it)"
        )


def overridden_keys(overrides: Iterable[str]) -> set[str]:
    """The keys a list of ``key=value`` / ``+key=value`` / ``~key`` overrides sets."""
    keys = set()
    for o in overrides:
        k = o.split("=", 1)[0].lstrip("+~").strip()
        if k:
            keys.add(k)
    return keys


def _get(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _resolved(path: Path) -> Path | None:
    try:  # relative to the working directory, as it is used
        return Path(os.path.abspath(path)).resolve()
    except (OSError, RuntimeError):
        return None


def _inside(path: Path, roots: list[Path]) -> bool:
    p = _resolved(path)
    return p is not None and any(p.is_relative_to(r) for r in roots)


def _glob_base(text: str) -> str:
    """The part of a path before its first glob character (a glob reaches only below it)."""
    cut = min((i for i, c in enumerate(text) if c in "*?["), default=len(text))
    base = text[:cut]
    return base if cut == len(text) else os.path.dirname(base) or "."


def _where(key: str, value: str) -> tuple[str, str | None]:
    """``("path", PATH)`` for a local path, ``("network", None)`` for a network URI."""
    if len(value) > 1 and value[1] == ":":  # C:\ is a path
        return "path", value
    try:
        u = urlparse(value)
    except ValueError:  # "http://[bad": not a place ampctl goes to on its own
        return "network", None
    if key != "logging.mlflow_uri":  # a path, unless it is a URL (hf://, https://, s3://)
        if "://" in value and u.scheme.lower() not in _LOCAL_SCHEMES:
            return "network", None
        if u.scheme.lower() == "file":
            return "path", unquote(u.path) or "."
        return "path", _glob_base(value) if glob.has_magic(value) else value
    scheme = u.scheme.lower()
    if scheme not in _LOCAL_SCHEMES or value.strip().lower() in _NETWORK_NAMES:
        return "network", None
    if scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db
        rest = value.split(":", 1)[1]
        rest = rest[3:] if rest.startswith("///") else rest.lstrip("/")
        return "path", unquote(rest) or "."
    if scheme == "file":
        return "path", unquote(u.path) or "."
    return "path", value


def check_saved_paths(
    saved: dict[str, Any],
    overrides: Iterable[str],
    *,
    run_root: str | Path,
    source: str,
    cwd: str | Path | None = None,
    unused: Iterable[str] = (),
) -> None:
    """Refuse a place the saved config names (:data:`SAVED_PATH_KEYS`, and W&B ``online``)
    outside ``run_root`` and the working directory, or a network URI, unless the user gives the
    key on the command line (``overrides``). ``unused``: keys this command does not use (a
    plain resume makes no new folder under ``trainer.runs_dir``). Nothing is opened. Raises
    :class:`SavedPathRefused` naming the override to give."""
    given = overridden_keys(overrides) | set(unused)
    roots = [Path(run_root).resolve(), Path(cwd or os.getcwd()).resolve()]
    for key, what in SAVED_PATH_KEYS.items():
        value = _get(saved, key)
        if key in given or not isinstance(value, str) or not value.strip():
            continue
        if key == "logging.mlflow_uri" and _get(saved, "logging.mlflow") is not True:
            continue  # not used: MLflow is off
        kind, path = _where(key, value)
        if kind == "network":
            verb, prep = ("sends", "to") if key == "logging.mlflow_uri" else ("reads", "from")
            raise SavedPathRefused(
                f"{source}: its saved config {verb} {what} {prep} {key}={value}, a network "
                f"address: not used on its own; to use it, repeat it on the command line: "
                f"{key}={value}" + (NULL_STORE if key == "logging.mlflow_uri" else "")
            )
        if key == "trainer.runs_dir" and _resolved(Path(path)) == roots[0].parent:
            continue  # the folder the run itself is in (where it was made)
        if not _inside(Path(path), roots):
            raise SavedPathRefused(
                f"{source}: its saved config names {key}={value} ({what}), outside the run folder "
                f"and the working directory: not used; to use it, repeat it on the command line: "
                f"{key}={value} (or give another {key}=...)"
            )
    logging = _get(saved, "logging")
    if (
        isinstance(logging, dict)
        and logging.get("wandb") is True
        and logging.get("wandb_mode") == "online"
        and "logging.wandb_mode" not in given
        and "logging.wandb" not in given
    ):
        raise SavedPathRefused(
            f"{source}: its saved config uploads the run to W&B (logging.wandb_mode=online): not "
            "done on its own; to upload, repeat it on the command line: logging.wandb_mode=online "
            "(or give logging.wandb_mode=offline)"
        )
