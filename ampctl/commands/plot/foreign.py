"""Another tool's history as a run to draw (#40): a folder or checkpoint with no metrics.jsonl
whose TensorBoard events, W&B offline run or MLflow store diagnose finds beside it
(:func:`ampctl.commands.diagnose.readers.histories.history_rows`), read by the same readers.

Kept to one call from :func:`.run_data.load_run_data` so the plot code stays its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampctl.runlog import RunLayout

__all__ = ["foreign_run_data"]


def foreign_run_data(path: str | Path, make: Any) -> Any:
    """``make(...)`` (the plot's ``RunData``, passed in: no import cycle) from another tool's
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
    data = make(run_dir=p if p.is_dir() else p.parent, rows=rows, events=[], summary=None)
    data.scale_steps = [float(r["step"]) for r in rows if "scale" in r]
    data.scale_values = [float(r["scale"]) for r in rows if "scale" in r]
    data.notes = [f"history read from {source}", *notes]
    return data
