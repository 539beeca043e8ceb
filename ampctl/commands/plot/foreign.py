"""Another tool's history as a run to draw (#40): a folder or checkpoint with no metrics.jsonl
whose TensorBoard events, W&B offline run or MLflow store diagnose finds beside it
(:func:`ampctl.commands.diagnose.readers.histories.history_rows`), read by the same readers.

Handed to :func:`ampctl.ui.plot.run_data.load_run_data` by ``ampctl plot`` (one call), so the
drawing code stays its own and below the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampctl.runlog import RunLayout

__all__ = ["foreign_run_data"]


def foreign_run_data(path: str | Path, make: Any) -> Any:
    """``make(...)`` (the plot's ``RunData``, passed in: no import cycle; ``make.KEYS`` the
    series it draws) from another tool's
    log beside ``path`` (None: an ampctl run folder, or nothing
    found: the caller's own message stands). Rows carry ampctl's keys (``loss``, ``scale``,
    ``grad_norm``, ``lr``, ``skipped``) where the tool logged them; no events, no summary."""
    p = Path(path)
    if not p.exists() or RunLayout(p).metrics.is_file():
        return None
    from ampctl.commands.diagnose.readers.histories import history_rows

    found = history_rows(p)
    if found is None:
        return None
    source, rows, notes = found
    from ampctl.ui.plot.decimate import Decimator

    keys = tuple(dict.fromkeys((*make.KEYS, "lr")))  # the drawn series, and the lr
    metrics = Decimator(keys)
    last: dict[str, Any] | None = None
    for r in rows:
        metrics.add(float(r["step"]), tuple(_number(r.get(k)) for k in keys))
        last = r
    if last is None:
        return None
    return make(
        run_dir=p if p.is_dir() else p.parent,
        metrics=metrics,
        last_row=last,
        events=[],
        summary=None,
        notes=[f"history read from {source}", *notes],
    )


def _number(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError, OverflowError):
        return float("nan")
