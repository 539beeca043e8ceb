"""Lightning ``.ckpt`` files (``state_dict``, ``optimizer_states``, ``global_step``, and the
precision plugin's ``GradScaler`` state under its class name, e.g. ``MixedPrecision``), read with
``weights_only=True``. A ``version_N`` or ``checkpoints`` folder gives its newest ``.ckpt``. The
history is the logger's ``metrics.csv`` (CSVLogger) or TensorBoard event files
(``events.out.tfevents.*``, read through ``tensorboard`` when installed) of the same
``version_N`` folder.

Lightning's optimizer state is indexed in the order ``configure_optimizers`` listed the
parameters; the ``state_dict`` order (the module's) is the usual one (``self.parameters()``),
checked by shape.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ampctl.runlog.readers import RunFileError
from ampctl.trust import FileRefused, iter_lines

from ..rows import RowKeeper
from ..stages import Row
from .base import FileNote, ForeignHistory, Found, NotACheckpoint, float_tensors, load_torch
from .plain import is_optimizer_state, is_scaler_state

__all__ = ["FORMAT_NAME", "claims", "read", "read_loaded", "is_lightning", "history_beside"]

FORMAT_NAME = "lightning"


def is_lightning(obj: Any) -> bool:
    return isinstance(obj, dict) and "state_dict" in obj and "pytorch-lightning_version" in obj


def _ckpts(folder: Path) -> list[Path]:
    found = [p for p in folder.rglob("*.ckpt") if p.is_file()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def claims(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".ckpt"
    return path.is_dir() and bool(_ckpts(path))


def read(path: Path) -> Found:
    siblings: list[Path] = []
    if path.is_dir():
        ckpts = _ckpts(path)
        if not ckpts:
            raise NotACheckpoint(f"{str(path)!r} holds no .ckpt file")
        path, siblings = ckpts[0], ckpts[1:]
    obj = load_torch(path)
    if not is_lightning(obj):
        raise NotACheckpoint(
            f"{str(path)!r} is not a Lightning checkpoint (no state_dict / "
            "pytorch-lightning_version)"
        )
    found = read_loaded(obj, path)
    if siblings:
        found.siblings = siblings
    return found


def siblings_of(path: Path) -> list[Path]:
    """The other ``.ckpt`` files beside one, written before it, newest first."""
    mine = path.stat().st_mtime
    return [p for p in _ckpts(path.parent) if p != path and p.stat().st_mtime <= mine]


def read_loaded(obj: dict[str, Any], path: Path) -> Found:
    sd = obj.get("state_dict") or {}
    found = Found(format=FORMAT_NAME, path=path, weights=float_tensors(sd))
    found.param_orders = [
        (
            "state_dict order",
            [
                (k, tuple(v.shape))
                for k, v in sd.items()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            ],
        )
    ]
    step = obj.get("global_step")
    found.step = step if isinstance(step, int) else None
    opts = [o for o in obj.get("optimizer_states") or [] if is_optimizer_state(o)]
    if opts:
        found.optimizer = opts[0]
        if len(opts) > 1:
            found.notes.append(f"{len(opts)} optimizers: the first is checked")
    for key, v in obj.items():
        if is_scaler_state(v):
            found.scaler, found.scaler_kind = v, "GradScaler"
            found.precision, found.precision_source = "fp16", f"{key} (GradScaler: 16-mixed)"
            break
    found.files.append(FileNote(path.name, True, "state_dict, optimizer_states, scaler"))
    found.siblings = siblings_of(path)  # a .ckpt given alone is judged with those beside it
    try:
        found.history = history_beside(path)
    except RunFileError as e:
        found.history_errors.append((e.path.name, e.reason))
    return found


# ---------------------------------------------------------------------------- history
def _version_dir(ckpt: Path) -> Path | None:
    for d in (ckpt.parent, ckpt.parent.parent):
        if (d / "metrics.csv").is_file() or any(d.glob("events.out.tfevents.*")):
            return d
    return None


def history_beside(ckpt: Path) -> ForeignHistory | None:
    d = _version_dir(ckpt)
    if d is None:
        return None
    if (d / "metrics.csv").is_file():
        return _csv_history(d / "metrics.csv")
    return _tb_history(d)


def _role(name: str) -> str | None:
    low = name.lower()
    if "grad" in low and "norm" in low:
        return "grad_norm"
    if low.startswith("lr") or "learning_rate" in low or low.startswith("lr-"):
        return "learning_rate"
    if "loss" in low and not low.startswith(("val", "test", "eval")):
        return "loss"
    return None


def _pick(columns: list[str]) -> dict[str, str]:
    """role -> column; for the loss prefer ``train_loss_step`` / ``train_loss`` / ``loss``."""
    out: dict[str, str] = {}
    for c in sorted(columns, key=lambda c: (not c.endswith("_step"), c.endswith("_epoch"), len(c))):
        role = _role(c)
        if role and role not in out:
            out[role] = c
    return out


def _float(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


#: Steps of metrics.csv merged in memory before the lowest are handed on (a logger writes a
#: step's metrics on neighbouring rows; a file with fewer steps is merged whole, as it was).
_PENDING = 4096


def _csv_lines(path: Path, skipped: list[int]) -> Iterator[str]:
    """The lines of a CSV file, streamed (:func:`~ampctl.trust.iter_lines`); one longer than the
    per-line cap is skipped and its number kept in ``skipped``."""
    for n, raw in iter_lines(path):
        if raw is None:
            skipped.append(n)
            continue
        yield raw.decode("utf-8", errors="replace") + "\n"


def _csv_history(path: Path) -> ForeignHistory | None:
    """The logger's ``metrics.csv``, one record at a time in one pass (a line over the per-line
    cap is skipped and counted, never the file refused for its size), its rows merged by step
    into a bounded :class:`~..rows.RowKeeper`. Raises
    :class:`~ampctl.runlog.readers.RunFileError` for one that cannot be read at all."""
    skipped: list[int] = []
    keeper = RowKeeper()
    pending: dict[int, dict[str, Any]] = {}
    cols: dict[str, str] | None = None
    broken = None
    try:
        reader = csv.DictReader(_csv_lines(path, skipped))
        for r in reader:
            if cols is None:
                cols = _pick([k for k in r if isinstance(k, str)])
            step = _float(r.get("step"))
            if step is None or not math.isfinite(step):
                continue
            row = pending.setdefault(int(step), {"step": int(step)})
            for role, col in cols.items():
                v = _float(r.get(col)) if r.get(col) not in (None, "") else None
                if v is not None:
                    row[role] = v
            if len(pending) > _PENDING:
                _hand_on(keeper, pending, min(pending))
    except FileRefused as e:
        raise RunFileError(path, e.reason) from None
    except csv.Error as e:
        broken = f"is not a CSV file the logger wrote: {e}"
    for s in sorted(pending):
        _hand_on(keeper, pending, s)
    if broken is not None and not keeper.seen:
        raise RunFileError(path, broken)
    if cols is None:
        return None
    notes = [f"{path}: {broken} (the rows before it were read)"] if broken else []
    if skipped:
        where = ", ".join(map(str, skipped[:5]))
        notes.append(f"{path}: skipped {len(skipped)} line(s) over the per-line cap ({where})")
    if (n := keeper.note(str(path))) is not None:
        notes.append(n)
    rows = [
        {"step": r.step} | {k: v for k, v in _roles(r).items() if v is not None}
        for r in keeper.rows()
    ]
    return ForeignHistory(
        source=str(path), rows=rows, columns=cols, notes=notes, logged=keeper.seen
    )


def _hand_on(keeper: RowKeeper, pending: dict[int, dict[str, Any]], step: int) -> None:
    r = pending.pop(step)
    keeper.add(
        Row(
            step=step,
            loss=r.get("loss"),
            grad_norm=r.get("grad_norm"),
            learning_rate=r.get("learning_rate"),
        )
    )


def _roles(r: Row) -> dict[str, float | None]:
    return {"loss": r.loss, "grad_norm": r.grad_norm, "learning_rate": r.learning_rate}


def _tb_history(d: Path) -> ForeignHistory | None:
    from .tb_history import read_tensorboard  # streamed, bounded (never EventAccumulator)

    return read_tensorboard(d, pick=_pick)
