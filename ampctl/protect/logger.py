"""The run's loggers behind one call each (torchtitan's metrics logger container): a metrics
row, an event or the summary goes to the run folder, the display and the sinks that
``logging.*`` enables (TensorBoard, MLflow, W&B: :mod:`ampctl.ui.sinks`) at once.

Only the main rank writes; on other ranks every call is a no-op. A failing display or sink
never stops training (the display swallows its own errors; a sink that fails is dropped after
one warning event).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from ampctl.files import touch
from ampctl.protect.settings import LoggingConfig
from ampctl.runlog import RunLayout, RunWriter, read_jsonl
from ampctl.ui.sinks import Sinks

__all__ = ["RunLogger"]


class RunLogger:
    """Fan-out of metrics rows, events and the summary (see the module docstring).

    Args:
        run_dir: the run folder (created by the caller).
        is_main: whether this process writes (rank 0).
        display: object with ``update(row)``, ``event(ev)``, ``summary(s)``, or None.
        tensorboard: also write TensorBoard scalars and event text (needs ``tensorboard``).
        logging: the :class:`LoggingConfig` whose sinks to open (``tensorboard=True`` adds
            TensorBoard to it).

    The sinks open in :meth:`open` (the start of training: they get the config and the events
    recorded since the logger was made) and end in :meth:`close`.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        is_main: bool = True,
        display: Any = None,
        tensorboard: bool = False,
        logging: LoggingConfig | None = None,
    ) -> None:
        self.layout = RunLayout(Path(run_dir))
        self.writer = RunWriter(run_dir)
        self.is_main = is_main
        self.display = display if is_main else None
        if is_main:  # every run folder has events.jsonl, empty while nothing happened
            touch(self.layout.events)
        lg = logging or LoggingConfig()
        if tensorboard and not lg.tensorboard:
            lg = dataclasses.replace(lg, tensorboard=True)
        self.sinks = Sinks(Path(run_dir), lg, self._warn)

    def _warn(self, step: int, message: str) -> None:
        self.event({"step": step, "kind": "warning", "message": message})

    def open(self, step: int, config: dict[str, Any]) -> None:
        """Open the sinks ``logging.*`` enables (once), with ``config`` as the run's
        parameters; a sink that cannot start (its package missing, its store refusing) becomes
        one warning event at ``step``."""
        if self.is_main:
            self.sinks.open(step, config, self.layout.root.name)

    def metrics(self, row: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.writer.metrics(row)
        self.sinks.metrics(row)
        if self.display is not None:
            self.display.update(row)

    def event(self, ev: dict[str, Any]) -> None:
        """Record an event (a dict with at least ``step``, ``kind``, ``message``)."""
        if not self.is_main:
            return
        ev = {**ev}
        ev.setdefault("time", time.time())
        self.writer.event(ev)
        self.sinks.event(ev)
        if self.display is not None:
            self.display.event(ev)

    def event_counts(self) -> dict[str, int]:
        """Events per kind in the run's main line (read from events.jsonl: across resumes);
        none on other ranks."""
        counts: dict[str, int] = {}
        if not self.is_main:
            return counts
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
        finally:
            self.sinks.summary(summary)
        return None

    def artifact(self, path: Path) -> None:
        """A file of the run folder (the plot) for the sinks to keep with the run."""
        if self.is_main:
            self.sinks.artifact(Path(path))

    def close(self, status: str = "ok") -> None:
        """End the sinks (idempotent); ``status`` is the run's."""
        self.sinks.close(status)
