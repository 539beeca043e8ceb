"""Run folders: ``runs/<name>/`` with config.yaml, metrics.jsonl, events.jsonl, checkpoints/,
summary.json. A folder is created exclusively: an existing run is never overwritten."""

from __future__ import annotations

import re
import time
from pathlib import Path

from ampctl.errors import UsageError

__all__ = ["RunExistsError", "new_run_dir", "default_run_name"]

_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=,+-]*$")


class RunExistsError(UsageError):
    pass


def default_run_name(preset: str) -> str:
    return f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def new_run_dir(runs_dir: str | Path, name: str | None, preset: str = "config") -> Path:
    """Create ``runs_dir/name`` (a unique default name when ``name`` is None)."""
    root = Path(runs_dir)
    if name is not None:
        if not _NAME_OK.match(name) or name in (".", ".."):
            raise RunExistsError(
                f"--name {name!r}: use letters, digits and . _ - = , + (no slashes or spaces)"
            )
        path = root / name
        root.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            raise RunExistsError(
                f"run folder {str(path)!r} exists already: pick another --name, or continue it with --resume {path}"
            ) from None
        return path
    root.mkdir(parents=True, exist_ok=True)
    base = default_run_name(preset)
    for i in range(1000):
        path = root / (base if i == 0 else f"{base}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunExistsError(f"could not find a free run name under {root}")
