"""The TensorBoard sink (``logging.tensorboard=true``; one :class:`~ampctl.ui.sinks.Sink`).

``TensorBoardSink(run_dir)`` writes into ``run_dir/tensorboard/`` the same numbers as
metrics.jsonl (each numeric key as the scalar ``ampctl/<key>`` at ``step = row["step"]``) and
every event as text (tag ``events``) plus a scalar per event kind (``ampctl/events/<kind>``, the
running count of that kind, so each event shows as a step up in its curve), and the summary as
text (tag ``summary``).

The sink receives the plain host-side rows the loop already wrote to metrics.jsonl: it reads
nothing from the device. ``tensorboard`` is imported lazily; :func:`make_tensorboard_sink`
returns a one-line install hint instead of raising when it is missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ampctl.runlog import RunLayout, read_jsonl

__all__ = ["TB_HINT", "TensorBoardSink", "make_tensorboard_sink"]

TB_HINT = (
    'logging.tensorboard=true needs the tensorboard package: pip install "ampctl[tensorboard]" '
    "(or pip install tensorboard); metrics.jsonl is written anyway"
)


def _require_tensorboard():
    """``torch.utils.tensorboard.SummaryWriter``; ImportError when tensorboard is missing."""
    importlib.import_module("tensorboard")  # torch's wrapper needs it; check it first
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class TensorBoardSink:
    """Mirror metrics rows and events into TensorBoard event files under ``run_dir/tensorboard``.

    Args:
        run_dir: the run folder (must exist); the ``tensorboard/`` sub-folder is created. Event
            counts start from the events already in ``events.jsonl`` (a resumed run).
        flush_secs: how often the writer flushes to disk (``close()`` always flushes).

    Raises ImportError when the tensorboard package is missing (use :func:`make_tensorboard_sink`
    for the hint instead). No device reads: rows are plain Python numbers.
    """

    name = "tensorboard"

    def __init__(self, run_dir: str | Path, *, flush_secs: int = 30) -> None:
        SummaryWriter = _require_tensorboard()
        self.log_dir = Path(run_dir) / "tensorboard"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)
        self._counts = _event_counts(RunLayout(Path(run_dir)).events)  # a resumed run counts on
        self._closed = False

    def log_metrics(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row: every numeric key except ``step`` becomes ``ampctl/<key>``.
        None (grad stats not computed), strings (precision) and bools are left out; NaN and inf
        are written as they are (TensorBoard shows them as gaps/spikes)."""
        step = int(row["step"])
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self._writer.add_scalar(f"ampctl/{key}", float(value), step)

    def log_event(self, ev: dict[str, Any], count: int | None = None) -> None:
        """One events.jsonl object: a text entry under ``events`` ("**kind** step N: message")
        and the running count of its kind as ``ampctl/events/<kind>`` (``count``: that count as
        the caller keeps it; None: counted here, from the run folder's events)."""
        kind = str(ev.get("kind", "event"))
        step = int(ev.get("step", 0))
        self._counts[kind] = self._counts.get(kind, 0) + 1 if count is None else int(count)
        self._writer.add_text("events", f"**{kind}** step {step}: {ev.get('message', '')}", step)
        self._writer.add_scalar(f"ampctl/events/{kind}", float(self._counts[kind]), step)

    # the Sink interface (ampctl.ui.sinks)
    def metrics(self, row: dict[str, Any]) -> None:
        self.log_metrics(row)

    def event(self, ev: dict[str, Any], count: int) -> None:
        self.log_event(ev, count)

    def summary(self, summary: dict[str, Any]) -> None:
        """The summary as a text entry (tag ``summary``) at its last step."""
        text = "\n".join(f"- **{k}**: {v}" for k, v in summary.items())
        self._writer.add_text("summary", text, int(summary.get("steps") or 0))

    def artifact(self, path: Path) -> None:
        """Nothing: the plot is in the run folder beside ``tensorboard/`` already."""

    def flush(self) -> None:
        self._writer.flush()

    def close(self, status: str = "ok") -> None:
        """Flush and close the event file (idempotent)."""
        if not self._closed:
            self._writer.close()
            self._closed = True

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _event_counts(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ev in read_jsonl(path):
        kind = str(ev.get("kind"))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def make_tensorboard_sink(run_dir: str | Path, enabled: bool) -> TensorBoardSink | None | str:
    """The sink for ``logging.tensorboard``: None when disabled, a :class:`TensorBoardSink` when
    enabled and tensorboard is installed, else the one-line install hint (never raises for a
    missing package)."""
    if not enabled:
        return None
    try:
        return TensorBoardSink(run_dir)
    except ImportError:
        return TB_HINT
