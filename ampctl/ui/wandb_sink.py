"""The Weights & Biases sink (``logging.wandb=true``; ``pip install "ampctl[wandb]"``).

Where: offline by default (``logging.wandb_mode=offline``): the run is written to
``<run>/wandb/offline-run-*/`` and never touches the network; ``wandb sync <that folder>``
uploads it later. ``logging.wandb_mode=online`` streams to W&B (needs ``wandb login`` or
``WANDB_API_KEY``). The project is ``logging.wandb_project``, the W&B run's name the run
folder's. The mode, ``silent`` and ``console="off"`` (W&B leaves stdout alone, so the live table
stays intact) are passed as this run's ``wandb.Settings``: nothing is set in the process's
environment. When the process already has a W&B run (``wandb.run``: the HF Trainer's
``report_to="wandb"``, or your own ``wandb.init()``) the figures join it, and the sink leaves it
open at the end.

What: every row as one ``log`` call with ``ampctl/step`` (the x-axis of all ``ampctl/*``
charts, declared with ``define_metric``) and each numeric metrics.jsonl key as ``ampctl/<key>``
and string key (``precision``) as ``ampctl/<key>`` too (W&B keeps strings in the history);
each event as a step up of ``ampctl/events/<kind>`` (the running count of its kind), and all
of them as the table ``ampctl/event_log`` (step, kind, message) at the end; the composed config
as the run's config (nested, shown as ``group.key``; under ``ampctl`` in a joined run); the
summary as ``ampctl/summary/<key>`` in the run summary; the plot as the image ``ampctl/plot``.

No explicit ``step=`` is passed to ``log``: a resumed or rolled-back run logs steps again, which
W&B's own step counter would drop.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ampctl.ui.sinks import flatten, numeric_items, text_items

__all__ = ["WandbSink"]


def _require():
    import wandb  # ImportError: the factory turns it into the install hint

    return wandb


class WandbSink:
    """Mirror the run into W&B (module docstring).

    Args:
        run_dir: the run folder (the offline run is written under ``<run_dir>/wandb``).
        mode: ``offline`` or ``online``.
        project: the W&B project.
        run_name: the W&B run's display name.
        params: the composed config (nested mappings), the run's config.

    Raises ImportError when wandb is missing, and whatever ``wandb.init`` raises (no
    credentials online, an unwritable folder); the caller turns both into one warning.
    """

    name = "wandb"

    def __init__(
        self,
        run_dir: str | Path,
        *,
        mode: str,
        project: str,
        run_name: str,
        params: Mapping[str, Any],
    ) -> None:
        wandb = _require()
        self._wandb = wandb
        self._events: list[list[Any]] = []
        if wandb.run is not None:
            self.run, self.owned = wandb.run, False
            self.run.config.update({"ampctl": dict(params)}, allow_val_change=True)
        else:
            settings = wandb.Settings(mode=mode, silent=True, console="off")
            self.run = wandb.init(
                project=project,
                name=run_name,
                dir=str(Path(run_dir)),
                config=dict(params),
                settings=settings,
            )
            self.owned = True
        # where the owned run keeps its record; W&B's writer process raises nothing when that
        # folder is removed under it, so the sink looks before each row (one stat)
        self._record = Path(self.run.settings.sync_dir) if self.owned else None
        self.run.define_metric("ampctl/step")
        self.run.define_metric("ampctl/*", step_metric="ampctl/step")

    def _check_record(self) -> None:
        if self._record is not None and not self._record.is_dir():
            raise FileNotFoundError(
                f"the W&B run folder {self._record} was removed during the run; its record from "
                "there on is lost"
            )

    def metrics(self, row: Mapping[str, Any]) -> None:
        self._check_record()
        data: dict[str, Any] = {"ampctl/step": int(row["step"])}
        data.update((f"ampctl/{k}", v) for k, v in numeric_items(row))
        data.update((f"ampctl/{k}", v) for k, v in text_items(row))
        self.run.log(data)

    def event(self, ev: Mapping[str, Any], count: int) -> None:
        kind, step = str(ev.get("kind", "event")), int(ev.get("step", 0))
        self.run.log({"ampctl/step": step, f"ampctl/events/{kind}": count})
        self._events.append([step, kind, str(ev.get("message", ""))])

    def summary(self, summary: Mapping[str, Any]) -> None:
        flat = flatten(summary)
        self.run.summary.update(
            {
                f"ampctl/summary/{k}": v if isinstance(v, int | float | str | bool) else str(v)
                for k, v in flat.items()
                if v is not None
            }
        )

    def artifact(self, path: Path) -> None:
        self.run.log({"ampctl/plot": self._wandb.Image(str(path))})

    def close(self, status: str) -> None:
        if self._events:
            table = self._wandb.Table(columns=["step", "kind", "message"], data=self._events)
            self._events = []
            self.run.log({"ampctl/event_log": table})
        if self.owned:
            self.owned = False  # closed: a second close finishes nothing
            self.run.finish(exit_code=0 if status == "ok" else 1)
