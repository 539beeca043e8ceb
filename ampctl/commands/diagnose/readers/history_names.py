"""The one table of metric names (every tool's name -> its health role) and the one place a
:class:`~.base.ForeignHistory` is built from a reader's rows; the folder helpers the history
readers share. See :mod:`.histories` for where histories are found."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .base import ForeignHistory, install_hint

__all__ = [
    "ROLES",
    "METRIC_NAMES",
    "NAME_ROLES",
    "build_history",
    "not_read",
    "schema_table",
    "as_float",
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
    ``notes`` come first, read once the rows are (a reader may add to them while they are
    read). None when no row has a step."""
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


def not_read(source: Path, what: str, package: str, extra: str = "diagnose") -> ForeignHistory:
    """A history with no rows: ``what`` was found but not read, ``package`` is not installed."""
    hint = install_hint(package, extra)
    return ForeignHistory(source=str(source), notes=[f"{what} found but not read: {hint}"])


def as_float(value: Any) -> float | None:
    """A logged number as a float (None for anything else; NaN and inf kept)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-inf"):
        return float(value.replace("Infinity", "inf"))
    return None


# ---------------------------------------------------------------------------- folders
_MAX_ENTRIES = 2000  # entries of one folder looked at while searching


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
