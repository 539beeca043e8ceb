"""The run's loggers behind one call each (torchtitan's metrics logger container): a metrics
row or an event goes to the run folder (metrics.jsonl, events.jsonl), the display and TensorBoard
at once; the summary goes to summary.json (the loop shows it on the display itself).

Only the main rank writes; on other ranks every call is a no-op. A failing display never stops
training (the display swallows its own errors).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ampctl.runlog import RunLayout, RunWriter, read_jsonl
from ampctl.ui.tensorboard import make_tensorboard_sink

__all__ = ["RunLogger"]


class RunLogger:
    """Fan-out of metrics rows, events and the summary (see the module docstring).

    Args:
        run_dir: the run folder (created by the caller).
        is_main: whether this process writes (rank 0).
        display: object with ``update(row)``, ``event(ev)``, ``summary(s)``, or None.
        tensorboard: also write TensorBoard scalars and event text (needs ``tensorboard``).
    """

    def __init__(
        self, run_dir: Path, *, is_main: bool = True, display: Any = None, tensorboard: bool = False
    ) -> None:
        self.layout = RunLayout(Path(run_dir))
        self.writer = RunWriter(run_dir)
        self.is_main = is_main
        self.display = display if is_main else None
        self.tb = None
        self.tb_hint: str | None = None
        if is_main:  # every run folder has events.jsonl, empty while nothing happened
            self.layout.events.touch()
        if is_main and tensorboard:
            sink = make_tensorboard_sink(run_dir, True)
            self.tb, self.tb_hint = (None, sink) if isinstance(sink, str) else (sink, None)

    def metrics(self, row: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.writer.metrics(row)
        if self.tb is not None:
            self.tb.log_metrics(row)
        if self.display is not None:
            self.display.update(row)

    def event(self, ev: dict[str, Any]) -> None:
        """Record an event (a dict with at least ``step``, ``kind``, ``message``)."""
        if not self.is_main:
            return
        ev = {**ev}
        ev.setdefault("time", time.time())
        self.writer.event(ev)
        if self.tb is not None:
            self.tb.log_event(ev)
        if self.display is not None:
            self.display.event(ev)

    def event_counts(self) -> dict[str, int]:
        """Events per kind in the run's main line (read from events.jsonl: across resumes)."""
        counts: dict[str, int] = {}
        for ev in read_jsonl(self.layout.events):
            kind = str(ev.get("kind"))
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def summary(self, summary: dict[str, Any]) -> str | None:
        """Write summary.json atomically; returns an error line instead of raising."""
        if not self.is_main:
            return None
        try:
            self.writer.summary(summary)
        except OSError as e:
            return f"summary.json not written: {e.strerror or e}"
        return None

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
