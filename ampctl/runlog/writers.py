"""Writing a run folder: atomic where a half-written file would mislead (config, summary,
trimmed JSONL), appends for the logs (a crash cuts at most the last line, which the readers skip).

Non-finite numbers are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so every file is
strict JSON (``jq``, pandas and other tools read it); :func:`~ampctl.runlog.readers.as_number`
reads them back.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError
from ampctl.files import append_line, check_appendable, write_text

from .layout import RunLayout

__all__ = [
    "RunExistsError",
    "RunWriter",
    "append_line",
    "atomic_write_text",
    "check_run_writable",
    "default_run_name",
    "dumps_row",
    "jsonable",
    "new_run_dir",
]


def jsonable(obj: Any) -> Any:
    """A copy of ``obj`` that ``json.dumps`` writes as strict JSON (non-finite floats as
    strings, tensors as lists, tuples as lists, anything else unknown as its ``str``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    tolist = getattr(obj, "tolist", None)  # tensors, numpy values
    if callable(tolist):
        return jsonable(tolist())
    return str(obj)


def dumps_row(row: dict[str, Any]) -> str:
    """One JSONL line (no newline)."""
    return json.dumps(jsonable(row), allow_nan=False)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically through :func:`ampctl.files.write_text` (a fresh
    temp file in the same folder, never through a link, and a rename): readers see the old file
    or the new one, never half of one. The temp file is removed on failure."""
    write_text(path, text)


class RunWriter:
    """Appends metrics and events to a run folder, writes its config and summary."""

    def __init__(self, root: str | Path) -> None:
        self.layout = RunLayout(Path(root))

    def write_config(self, yaml_text: str) -> None:
        atomic_write_text(self.layout.config, yaml_text)

    def metrics(self, row: dict[str, Any]) -> None:
        self._append(self.layout.metrics, row)

    def event(self, event: dict[str, Any]) -> None:
        self._append(self.layout.events, event)

    def summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.layout.summary, json.dumps(jsonable(summary), indent=2) + "\n")

    def write_json(self, path: Path, obj: dict[str, Any]) -> None:
        atomic_write_text(path, json.dumps(jsonable(obj), indent=2) + "\n")

    @staticmethod
    def _append(path: Path, row: dict[str, Any]) -> None:
        append_line(path, dumps_row(row))


#: What the trackers' own libraries write inside a run folder (they follow links: a folder here
#: that is a symlink out of the run, or a link at the SQLite store, would make them write
#: outside it): folders, then files (ampctl.ui's sinks spell the same names).
LIBRARY_FOLDERS = ("tensorboard", "wandb", "mlartifacts")
LIBRARY_FILES = ("mlruns.db",)


def check_run_writable(layout: RunLayout) -> None:
    """Before ampctl writes into an existing run folder (``train --resume``): its logs (and the
    trackers' store files) are not symlinks or other non-regular files
    (:func:`ampctl.files.check_appendable`), and its ``checkpoints/``, ``branches/`` and
    trackers' folders are not symlinks out of the run. Raises a one-line
    :class:`~ampctl.errors.UsageError`; nothing is written."""
    from ampctl.trust_paths import check_folder_inside

    for path in (layout.metrics, layout.events, *(layout.root / n for n in LIBRARY_FILES)):
        check_appendable(path)
    check_folder_inside(layout.checkpoints_dir, layout.root, what="the checkpoints folder")
    for folder in (layout.branches_dir, *(layout.root / n for n in LIBRARY_FOLDERS)):
        check_folder_inside(folder, layout.root, what=f"the {folder.name} folder")


# ---------------------------------------------------------------------------- new folders
class RunExistsError(UsageError):
    """A run folder that exists already (a run is never overwritten) or a bad ``--name``."""


_NAME_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=,+-]*")


def default_run_name(preset: str) -> str:
    return f"{preset}-{time.strftime('%Y%m%d-%H%M%S')}"


def new_run_dir(runs_dir: str | Path, name: str | None, preset: str = "config") -> Path:
    """Create ``runs_dir/name`` (a unique default name when ``name`` is None)."""
    root = Path(runs_dir)
    if name is not None:
        if not _NAME_OK.fullmatch(name) or name in (".", ".."):
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
