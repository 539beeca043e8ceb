"""Training histories other tools logged beside a checkpoint, found where each tool puts them,
read through that tool's own reader, and mapped onto one health schema.

========================= =====================================================================
where                     what is read
========================= =====================================================================
``tb/<timestamp>/``       torchtitan's TensorBoard events (beside ``checkpoint/step-N``)
``tensorboard/``, ...     Megatron's ``--tensorboard-dir`` (any folder of ``events.out.tfevents.*``
                          beside the checkpoint, or one level below it)
``runs/<date>_<host>/``   the HF Trainer's TensorBoard logs (``trainer_state.json`` missing)
``wandb/``                W&B offline runs (``offline-run-*/run-*.wandb``, ``latest-run``)
``mlruns/``, ``*.db``     MLflow stores (a file store, or a ``sqlite:`` one), read-only
========================= =====================================================================

Each reader (:mod:`.tb_history`, :mod:`.wandb_history`, :mod:`.mlflow_history`) yields rows
``{"step": int, NAME: float, ...}`` in the tool's own metric names; :func:`build_history`
(:mod:`.history_names`) maps them with :data:`METRIC_NAMES` (one table for every tool, the same
as in docs/diagnose.md) and is the one place a :class:`~.base.ForeignHistory` is built from them. Only names in the table
are kept per row (memory: rows x known names); a name not in it is listed in the notes, never
guessed into a role.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError, first_line
from ampctl.trust import FileRefused

from .base import ForeignHistory, Found
from .history_names import (
    METRIC_NAMES,
    NAME_ROLES,
    ROLES,
    _entries,
    _has_events,
    _tb_dirs,
    as_float,
    build_history,
    schema_table,
)

__all__ = [  # the table and the builder live in .history_names, re-exported here
    "ROLES",
    "METRIC_NAMES",
    "NAME_ROLES",
    "as_float",
    "build_history",
    "schema_table",
    "history_beside",
    "candidates",
    "read_candidate",
    "history_rows",
]

# ---------------------------------------------------------------------------- finding them
_UP = 3  # folders above the checkpoint searched


_TB_NAMES = ("tb", "tensorboard", "tensorboard_logs", "tb_logs", "runs", "logs")


def candidates(start: Path) -> Iterator[tuple[str, Path]]:
    """``(kind, path)`` of the histories beside a checkpoint, nearest folder first: ``kind`` is
    ``tensorboard`` (a folder whose event files, with those of its sibling runs, are one
    history), ``wandb`` (a ``wandb/`` folder) or ``mlflow`` (an ``mlruns/`` folder or a sqlite
    file). Looks in the checkpoint's folder and up to three above it, never below a
    folder's children, and never follows a symlinked folder."""
    d = start if start.is_dir() else start.parent
    seen: set[Path] = set()
    for _ in range(_UP + 1):
        for p in _entries(d):
            if p in seen or p.is_symlink():
                continue
            seen.add(p)
            if p.is_dir() and p.name in _TB_NAMES:
                dirs = _tb_dirs(p)
                if dirs:
                    yield "tensorboard", p
            elif p.is_dir() and p.name == "wandb":
                yield "wandb", p
            elif p.is_dir() and p.name == "mlruns":
                yield "mlflow", p
            elif p.is_file() and (
                p.suffix == ".db" and "mlflow" in p.name or p.name == "mlruns.db"
            ):
                yield "mlflow", p
        if _has_events(d):
            yield "tensorboard", d
        if d.parent == d:
            break
        d = d.parent


def read_candidate(kind: str, path: Path, step_limit: int | None = None) -> ForeignHistory | None:
    """One history found by :func:`candidates`, through its tool's reader. Raises
    :class:`~ampctl.runlog.readers.RunFileError` for one that is there but cannot be read."""
    if kind == "tensorboard":
        from .tb_history import read_tensorboard

        return read_tensorboard(path)
    if kind == "wandb":
        from .wandb_history import read_wandb

        return read_wandb(path)
    from .mlflow_history import read_mlflow

    return read_mlflow(path)


def _losses(h: ForeignHistory) -> int:
    return sum(1 for r in h.rows if "loss" in r)


def history_beside(found: Found) -> ForeignHistory | None:
    """The best history another tool logged beside ``found``'s checkpoint (the one with the
    most logged losses, the nearest first on a tie); the others found are named in its notes.
    One that is there but cannot be read goes to ``found.history_errors``."""
    got: list[ForeignHistory] = []
    for kind, path in candidates(found.path):
        try:
            h = read_candidate(kind, path, found.step)
        except (UsageError, FileRefused, OSError) as e:
            found.history_errors.append((str(path), first_line(e)))
            continue
        if h is not None and (h.rows or h.notes):
            got.append(h)
    if not got:
        return None
    best = max(got, key=lambda h: (_losses(h), len(h.rows), -got.index(h)))
    others = [h.source for h in got if h is not best]
    if others:
        best.notes.append("also found, not used: " + ", ".join(others[:5]))
    return best


#: role -> ampctl's metrics.jsonl key (for drawing another tool's history as a run)
_AMPCTL_KEYS = {"learning_rate": "lr"}


def history_rows(path: Path) -> tuple[str, list[dict[str, Any]], list[str]] | None:
    """``(source, rows, notes)`` of the best history beside ``path`` with ampctl's metrics keys
    (``step``, ``loss``, ``scale``, ``skipped``, ``grad_norm``, ``lr``), for ``ampctl plot``;
    None when there is none with rows. Raises :class:`UsageError` for one that cannot be
    read."""
    found = Found(format="foreign", path=path)
    h = history_beside(found)
    if found.history_errors and (h is None or not h.rows):
        name, why = found.history_errors[0]
        raise UsageError(f"{name!r}: {why}")
    if h is None or not h.rows:
        return None
    rows = [{_AMPCTL_KEYS.get(k, k): v for k, v in r.items()} for r in h.rows]
    return h.source, rows, h.notes
