"""Metric sinks beside metrics.jsonl behind one small interface: TensorBoard, MLflow, W&B.

A :class:`Sink` receives what the run logger writes to the run folder -- each metrics row, each
event (with the running count of its kind), the summary, the end-of-run plot -- and is closed
with the run's status. The composed config reaches it when it is opened (as run parameters).
:class:`Sinks` holds the sinks that ``logging.*`` enabled (:func:`open_sinks` builds them) and
calls each of them; a sink that raises (disk full, server down, a run deleted under it) is
dropped after one warning and the run goes on: the run folder never depends on a sink.

Names are the same in every sink: each numeric metrics.jsonl key is ``ampctl/<key>`` at
``step = row["step"]``, each event kind's running count is ``ampctl/events/<kind>``.

Sinks receive plain host-side rows the loop has already written: nothing here reads the device.
Each library is imported only when its sink is enabled; a missing one becomes a one-line
install hint instead of an error.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ampctl.runlog import RunLayout, read_jsonl

__all__ = ["Sink", "Sinks", "open_sinks", "flatten", "numeric_items", "event_text"]

#: how to install each sink's package (the hint when ``logging.<key>=true`` finds it missing)
INSTALL = {
    "tensorboard": 'pip install "ampctl[tensorboard]" (or pip install tensorboard)',
    "mlflow": 'pip install "ampctl[mlflow]"',
    "wandb": 'pip install "ampctl[wandb]"',
}


class Sink(Protocol):
    """One place a run's figures go besides the run folder. ``name`` is the ``logging.*`` key
    that enabled it (named in the warning when it fails)."""

    name: str

    def metrics(self, row: Mapping[str, Any]) -> None: ...

    def event(self, ev: Mapping[str, Any], count: int) -> None:
        """``count``: how many events of ``ev["kind"]`` the run has recorded, this one included."""

    def summary(self, summary: Mapping[str, Any]) -> None: ...

    def artifact(self, path: Path) -> None:
        """A file of the run folder (the plot) to keep with the run."""

    def close(self, status: str) -> None:
        """End the sink; ``status`` is the run's (``ok``, ``aborted``, ``interrupted``,
        ``failed``). A run the sink joined (an active MLflow / W&B run) is left open. A sink
        that failed is dropped with ``abandon()`` when it has one (nothing more is written to
        a store that just refused), else with ``close("failed")``."""


def install_hint(key: str, missing: str | None = None) -> str:
    """``logging.mlflow=true needs the mlflow package: pip install "ampctl[mlflow]"; ...``
    (``missing``: the package that is missing, when it is not the sink's own)."""
    return (
        f"logging.{key}=true needs the {missing or key} package: {INSTALL[key]}; metrics.jsonl "
        "is written anyway"
    )


def _reason(e: BaseException) -> str:
    """The first line of an exception, capped: a warning is one line."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def open_sinks(
    run_dir: Path, logging: Any, *, params: Mapping[str, Any], name: str
) -> tuple[list[Sink], list[str]]:
    """The sinks ``logging`` (a ``LoggingConfig``) enables, opened, and one warning line for each
    that could not be (its package is missing, its store or server refused). ``params``: the
    composed config (nested mappings); ``name``: the run's name in the tracking tools."""
    sinks: list[Sink] = []
    warnings: list[str] = []
    lg = logging
    wanted = [
        ("tensorboard", "ampctl.ui.tensorboard", "TensorBoardSink", {}),
        (
            "mlflow",
            "ampctl.ui.mlflow_sink",
            "MlflowSink",
            {"uri": lg.mlflow_uri, "experiment": lg.mlflow_experiment},
        ),
        (
            "wandb",
            "ampctl.ui.wandb_sink",
            "WandbSink",
            {"mode": lg.wandb_mode, "project": lg.wandb_project},
        ),
    ]
    for key, module, cls, kw in wanted:
        if not getattr(lg, key):
            continue
        if key != "tensorboard":
            kw = {**kw, "run_name": name, "params": params}
        try:
            sinks.append(getattr(importlib.import_module(module), cls)(run_dir, **kw))
        except ImportError as e:
            warnings.append(install_hint(key, (e.name or key).split(".")[0]))
        except Exception as e:
            warnings.append(
                f"logging.{key}=true: not started ({_reason(e)}); metrics.jsonl is written anyway"
            )
    return sinks, warnings


class Sinks:
    """The run's enabled sinks behind one call each (see the module docstring).

    Args:
        run_dir: the run folder (its ``events.jsonl`` gives the event counts a resumed run
            continues from).
        logging: the ``LoggingConfig`` that says which sinks to open.
        warn: ``warn(step, message)`` records a warning event (the run logger's); called once
            for a sink that cannot start and once for a sink that fails later.

    Events recorded before :meth:`open` are kept and handed to the sinks when they open.
    """

    def __init__(self, run_dir: Path, logging: Any, warn: Callable[[int, str], None]) -> None:
        self.run_dir = Path(run_dir)
        self.logging = logging
        self.warn = warn
        self.sinks: list[Sink] = []
        self.opened = False
        self._early: list[dict[str, Any]] = []
        self._counts: dict[str, int] = {}
        self._step = 0

    @property
    def wanted(self) -> bool:
        lg = self.logging
        return bool(lg.tensorboard or lg.mlflow or lg.wandb)

    def open(self, step: int, params: Mapping[str, Any], name: str) -> None:
        """Open the enabled sinks (once): each gets ``params`` and then the events recorded
        so far; a sink that cannot start becomes one warning event at ``step``."""
        if self.opened:
            return
        self.opened = True
        self._step = int(step)
        if not self.wanted:
            self._early.clear()
            return
        self.sinks, problems = open_sinks(self.run_dir, self.logging, params=params, name=name)
        # counts go on from the run folder's history (a resume); the early events are in it
        # already and are counted again as they are handed over
        self._counts = _kind_counts(read_jsonl(RunLayout(self.run_dir).events))
        for kind, n in _kind_counts(self._early).items():
            self._counts[kind] = max(self._counts.get(kind, 0) - n, 0)
        early, self._early = self._early, []
        for ev in early:
            self.event(ev)
        for line in problems:
            self.warn(self._step, line)

    def _call(self, method: str, *args: Any) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as e:
                self._drop(sink, method, e)

    def _drop(self, sink: Sink, method: str, e: Exception) -> None:
        self.sinks.remove(sink)
        abandon = getattr(sink, "abandon", None)  # a sink whose store failed: no more writes
        try:
            abandon() if callable(abandon) else sink.close("failed")
        except Exception:
            pass  # it has failed once already: one warning is enough
        self.warn(
            self._step,
            f"logging.{sink.name}: {method} failed ({_reason(e)}); {sink.name} logging stopped, "
            "metrics.jsonl is complete",
        )

    def metrics(self, row: Mapping[str, Any]) -> None:
        self._step = int(row.get("step", self._step))
        self._call("metrics", row)

    def event(self, ev: Mapping[str, Any]) -> None:
        if not self.opened:
            self._early.append(dict(ev))
            return
        if not self.sinks:
            return
        kind = str(ev.get("kind", "event"))
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self._call("event", ev, self._counts[kind])

    def summary(self, summary: Mapping[str, Any]) -> None:
        self._call("summary", summary)

    def artifact(self, path: Path) -> None:
        self._call("artifact", Path(path))

    def close(self, status: str = "ok") -> None:
        """Close every sink (idempotent); a sink that fails to close is reported like any other
        failure."""
        self._call("close", status)
        self.sinks = []


def _kind_counts(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ev in events:
        kind = str(ev.get("kind"))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ---------------------------------------------------------------------------- shared helpers
def numeric_items(row: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    """The row's numbers as ``(key, float)``, ``step`` excepted: None (a figure not computed),
    bools and strings are left out; NaN and inf are kept."""
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        yield key, float(value)


def text_items(row: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """The row's strings (``precision``; fp8's worst-layer names)."""
    for key, value in row.items():
        if isinstance(value, str):
            yield key, value


def event_text(ev: Mapping[str, Any]) -> str:
    """``kind step N: message`` (the form every sink shows an event in)."""
    return f"{ev.get('kind', 'event')} step {ev.get('step', 0)}: {ev.get('message', '')}"


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1e-3}}`` -> ``{"optim.lr": 1e-3}``; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def param_value(v: Any) -> str:
    """A config leaf as a run parameter's string: strings as they are, the rest as JSON
    (``true``, ``null``, ``[1, 2]``)."""
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return str(v)
