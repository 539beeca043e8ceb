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
``{"step": int, NAME: float, ...}`` in the tool's own metric names; :func:`build_history` maps
them with :data:`METRIC_NAMES` (one table for every tool, the same as in docs/diagnose.md) and
is the one place a :class:`~.base.ForeignHistory` is built from them. Only names in the table
are kept per row (memory: rows x known names); a name not in it is listed in the notes, never
guessed into a role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError, first_line
from ampctl.trust import FileRefused

from .base import ForeignHistory, Found

__all__ = [
    "ROLES",
    "METRIC_NAMES",
    "NAME_ROLES",
    "build_history",
    "history_beside",
    "candidates",
    "schema_table",
    "history_rows",
]

#: The health schema: what diagnose reads from a history. ``skipped`` and ``overflow`` are
#: running counts (a step where one goes up was skipped / overflowed).
ROLES = ("loss", "scale", "skipped", "grad_norm", "learning_rate", "overflow")

#: tool -> {the tool's metric name: role (None: known, not a health figure)}. One table: a name
#: means the same role in every tool that logs it (tests/commands/diagnose/test_histories.py).
METRIC_NAMES: dict[str, dict[str, str | None]] = {
    "ampctl": {
        "loss": "loss",
        "scale": "scale",
        "skipped": "skipped",
        "grad_norm": "grad_norm",
        "lr": "learning_rate",
        "ampctl/loss": "loss",
        "ampctl/scale": "scale",
        "ampctl/skipped": "skipped",
        "ampctl/grad_norm": "grad_norm",
        "ampctl/lr": "learning_rate",
        "ampctl/events/overflow": "overflow",
    },
    "torchtitan": {
        "loss_metrics/global_avg_loss": "loss",
        "loss_metrics/global_max_loss": None,
        "grad_norm": "grad_norm",
        "lr": "learning_rate",
    },
    "megatron": {
        "lm loss": "loss",
        "loss-scale": "scale",
        "grad-norm": "grad_norm",
        "num-zeros": None,
        "learning-rate": "learning_rate",
    },
    "hf-trainer": {
        "train/loss": "loss",
        "train/grad_norm": "grad_norm",
        "train/learning_rate": "learning_rate",
        "loss": "loss",
        "grad_norm": "grad_norm",
        "learning_rate": "learning_rate",
    },
    "lightning": {
        "train_loss_step": "loss",
        "train_loss": "loss",
        "grad_2.0_norm_total": "grad_norm",
        "lr-SGD": "learning_rate",
        "lr-Adam": "learning_rate",
        "lr-AdamW": "learning_rate",
    },
}


def _flat() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for names in METRIC_NAMES.values():
        for name, role in names.items():
            out.setdefault(name, role)
    return out


#: every known name -> its role, in table order (the first name of a role a source logs wins)
NAME_ROLES: dict[str, str | None] = _flat()

#: how many unknown names a note lists
_SHOWN = 12


def schema_table() -> str:
    """:data:`METRIC_NAMES` as the Markdown table of docs/diagnose.md (one row per role)."""
    tools = list(METRIC_NAMES)
    lines = ["| role | " + " | ".join(tools) + " |", "|" + " --- |" * (len(tools) + 1)]
    for role in (*ROLES, None):
        cells = []
        for tool in tools:
            names = [f"`{n}`" for n, r in METRIC_NAMES[tool].items() if r == role]
            cells.append(", ".join(names) or "-")
        lines.append(f"| {role or '(known, not used)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_history(
    source: str,
    rows: Iterable[dict[str, Any]],
    *,
    notes: Iterable[str] = (),
    pick: Callable[[list[str]], dict[str, str]] | None = None,
    unknown: Iterable[str] = (),
) -> ForeignHistory | None:
    """The one place a ForeignHistory is built from a reader's rows (``{"step", NAME: value}``
    in the tool's names; a later row of the same step overrides the earlier one's values).

    ``pick``: a tool whose names are the user's own (Lightning's ``self.log``) chooses the
    columns from every name seen; otherwise names are looked up in :data:`NAME_ROLES` and a
    name not there is listed in the notes (with ``unknown``: names a reader left unread).
    None when no row has a step."""
    merged: dict[int, dict[str, float]] = {}
    unknown = dict.fromkeys(unknown)
    known: dict[str, None] = {}
    for row in rows:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        kept = merged.setdefault(step, {})
        for name, value in row.items():
            if name == "step" or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if pick is None and name not in NAME_ROLES:
                if len(unknown) < 10_000:
                    unknown[name] = None
                continue
            known[name] = None
            kept[name] = float(value)
    if not merged:
        return None
    if pick is not None:
        columns = pick(list(known))
    else:
        columns = {}
        for name, role in NAME_ROLES.items():
            if role is not None and role not in columns and name in known:
                columns[role] = name
    out = ForeignHistory(source=source, columns=columns, notes=list(notes))
    for step in sorted(merged):
        vals = merged[step]
        row: dict[str, Any] = {"step": step}
        for role, name in columns.items():
            if name in vals:
                row[role] = vals[name]
        out.rows.append(row)
    if unknown:
        shown = ", ".join(list(unknown)[:_SHOWN])
        more = f" and {len(unknown) - _SHOWN} more" if len(unknown) > _SHOWN else ""
        out.notes.append(
            f"metrics not in diagnose's table, kept out of the health figures: {shown}{more}"
        )
    return out


def as_float(value: Any) -> float | None:
    """A logged number as a float (None for anything else; NaN and inf kept)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-inf"):
        return float(value.replace("Infinity", "inf"))
    return None


# ---------------------------------------------------------------------------- finding them
_MAX_ENTRIES = 2000  # entries of one folder looked at while searching (a huge folder: a note)
_UP = 3  # folders above the checkpoint searched


def _entries(d: Path) -> list[Path]:
    try:
        it = d.iterdir()
        out = []
        for p in it:
            out.append(p)
            if len(out) >= _MAX_ENTRIES:
                break
        return sorted(out)
    except OSError:
        return []


def _has_events(d: Path) -> bool:
    return any(p.name.startswith("events.out.tfevents.") for p in _entries(d) if p.is_file())


def _tb_dirs(d: Path) -> list[Path]:
    """``d`` itself when it holds event files, else its sub-folders that do (one level: the
    ``tb/<timestamp>/`` and ``runs/<date>_<host>/`` layouts)."""
    if _has_events(d):
        return [d]
    return [s for s in _entries(d) if s.is_dir() and not s.is_symlink() and _has_events(s)]


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
