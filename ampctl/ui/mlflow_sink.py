"""The MLflow sink (``logging.mlflow=true``; ``pip install "ampctl[mlflow]"``).

Where: by default a SQLite store in the run folder, ``<run>/mlruns.db``, with artifacts in
``<run>/mlartifacts/`` -- no server, no network (``mlflow ui --backend-store-uri
sqlite:///runs/<name>/mlruns.db`` shows it). SQLite rather than a ``./mlruns`` file store because
MLflow 3 refuses the file store unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set (it is "in
maintenance mode"); the SQLite store needs ``sqlalchemy`` and ``alembic`` beside
``mlflow-skinny``, which is what the extra installs. Creating the store runs MLflow's schema
migrations once per run folder (a few seconds). ``logging.mlflow_uri=`` sends to any tracking
URI instead (``http://host:5000``, ``sqlite:///runs/mlruns.db`` to keep many runs side by side,
``databricks``). When the process already has an active MLflow run (the HF Trainer's
``report_to="mlflow"``, or your own ``mlflow.start_run()``) in the same tracking store, the
figures join it instead of opening a second run, and the sink leaves it open at the end.

What: each numeric metrics.jsonl key as the metric ``ampctl/<key>`` at ``step = row["step"]``;
the row's step itself as ``ampctl/step``; string keys (``precision``) as tags ``ampctl.<key>``;
each event as a step up of ``ampctl/events/<kind>`` (the running count of its kind) plus the tag
``ampctl.last_event``, and all of them as the artifact ``ampctl/events.jsonl`` at the end; the
composed config as parameters (``group.key``; ``ampctl.group.key`` in a joined run; ``name`` is
the run's name when the config leaves it null, as ``--name`` does); the summary as the artifact
``ampctl/summary.json``, its numbers as ``ampctl/summary/<key>`` and its status as the tag
``ampctl.status``; the plot as the artifact ``ampctl/plot.png``.

MLflow's *latest* value of a metric (the run page, ``run.data.metrics``, search) is its point of
the largest step, then timestamp, then value. A rollback rewinds the training step, so points
logged after it would lose to the ones before: the counters ``ampctl/events/<kind>`` and
``ampctl/step`` are logged at the *high-water* step (the largest training step this sink has
seen; equal to the event's own step until a rollback), and every point carries a timestamp later
than the one before, so each of them reads back, as its latest value, the one logged last (the
count in events.jsonl; the step the run stopped at). The training figures stay at their own
steps: a rolled-back stretch is logged again at the steps it replays.

A tracking server that is down must not hold a run up for minutes: unless you set them,
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` and ``MLFLOW_HTTP_REQUEST_TIMEOUT`` are 1 and 10 s for this
sink's own requests (MLflow's defaults, 7 retries and 120 s, would keep a dead server's first
failure waiting about four minutes); the process's environment is restored after each call.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ampctl.ui.sinks import event_text, flatten, numeric_items, param_value, text_items

__all__ = ["MlflowSink", "LOCAL_STORE", "LOCAL_ARTIFACTS"]

LOCAL_STORE = "mlruns.db"
LOCAL_ARTIFACTS = "mlartifacts"
_STATUS = {"ok": "FINISHED", "aborted": "FAILED", "failed": "FAILED", "interrupted": "KILLED"}
_SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _require():
    import mlflow  # ImportError: the factory turns it into the install hint
    from mlflow.tracking import MlflowClient

    return mlflow, MlflowClient


def _require_sql(uri: str) -> None:
    """What MLflow's database stores (the default one is SQLite) need and mlflow-skinny leaves
    out: ModuleNotFoundError naming the missing package (the factory's install hint). Without
    this check MLflow reports it as an unsupported model-registry URI."""
    if uri.split(":", 1)[0].split("+")[0] not in _SQL_SCHEMES:
        return
    for module in ("sqlalchemy", "alembic"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise ModuleNotFoundError(f"{module} is needed for an SQL store", name=module) from None


@contextlib.contextmanager
def _scoped(uri: str) -> Iterator[None]:
    """Quiet MLflow's and alembic's INFO lines (creating a store logs them; they would cut
    through the live table) and, for an HTTP store, the short retry budget (module docstring);
    both undone on exit."""
    loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    set_env = []
    if uri.startswith(("http://", "https://")):
        set_env = [k for k in _HTTP_DEFAULTS if k not in os.environ]
    try:
        for lg in loggers:
            lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
        for k in set_env:
            os.environ[k] = _HTTP_DEFAULTS[k]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # SQLAlchemy's, inside mlflow
            yield
    finally:
        for k in set_env:
            os.environ.pop(k, None)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class MlflowSink:
    """Mirror the run into MLflow (module docstring).

    Args:
        run_dir: the run folder (the default store lives in it).
        uri: a tracking URI, or None for ``<run_dir>/mlruns.db``.
        experiment: the experiment a new run goes into (created when missing).
        run_name: the MLflow run's name (the run folder's).
        params: the composed config (nested mappings), logged as parameters.

    Raises ImportError when mlflow is missing (or, for a database store, sqlalchemy or alembic),
    and whatever MLflow raises when the store or server cannot be reached (the caller turns both
    into one warning).
    """

    name = "mlflow"

    def __init__(
        self,
        run_dir: str | Path,
        *,
        uri: str | None,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
    ) -> None:
        mlflow, MlflowClient = _require()
        from mlflow.entities import Metric, Param, RunTag

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        run_dir = Path(run_dir).resolve()
        active = mlflow.active_run()
        joined = active is not None and (uri is None or uri == mlflow.get_tracking_uri())
        self.uri = (
            mlflow.get_tracking_uri() if joined else uri or f"sqlite:///{run_dir / LOCAL_STORE}"
        )
        self.owned = not joined
        if self.owned:
            _require_sql(self.uri)
        self._events: list[str] = []
        self._tags: dict[str, str] = {}
        self._high = 0  # the largest training step seen: counters are logged at it
        self._ts = 0  # the last timestamp given out (ms): each point's is later
        if "name" in params and params["name"] is None and run_name:
            params = {**params, "name": run_name}  # the config's null name: the run's own
        with _scoped(self.uri):
            self.client = MlflowClient(tracking_uri=self.uri)
            if joined:
                self.run_id = active.info.run_id
            else:
                self.run_id = self._create_run(run_dir, uri is None, experiment, run_name)
            self._log_params(params, prefix="ampctl." if joined else "")

    def _create_run(self, run_dir: Path, local: bool, experiment: str, run_name: str) -> str:
        c = self.client
        exp = c.get_experiment_by_name(experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            where = (run_dir / LOCAL_ARTIFACTS).as_uri() if local else None
            exp_id = c.create_experiment(experiment, artifact_location=where)
        run = c.create_run(exp_id, run_name=run_name, tags={"ampctl.run_dir": str(run_dir)})
        return run.info.run_id

    def _log_params(self, params: Mapping[str, Any], prefix: str) -> None:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        items = [
            self._Param(prefix + k, param_value(v)[:MAX_PARAM_VAL_LENGTH])
            for k, v in flatten(params).items()
        ]
        for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_TAGS_PER_BATCH])

    def _now(self) -> int:
        """Milliseconds since the epoch, each call later than the last (module docstring)."""
        self._ts = max(int(time.time() * 1000), self._ts + 1)
        return self._ts

    def _high_water(self, step: int) -> int:
        self._high = max(self._high, step)
        return self._high

    def metrics(self, row: Mapping[str, Any]) -> None:
        step, ts = int(row["step"]), self._now()
        ms = [self._Metric(f"ampctl/{k}", v, ts, step) for k, v in numeric_items(row)]
        ms.append(self._Metric("ampctl/step", float(step), ts, self._high_water(step)))
        tags = [
            self._RunTag(f"ampctl.{k}", v) for k, v in text_items(row) if self._tags.get(k) != v
        ]
        with _scoped(self.uri):
            self.client.log_batch(self.run_id, metrics=ms, tags=tags)
        self._tags.update({t.key.removeprefix("ampctl."): t.value for t in tags})

    def event(self, ev: Mapping[str, Any], count: int) -> None:
        kind, step = str(ev.get("kind", "event")), int(ev.get("step", 0))
        text = event_text(ev)
        with _scoped(self.uri):
            self.client.log_batch(
                self.run_id,
                metrics=[
                    self._Metric(
                        f"ampctl/events/{kind}", float(count), self._now(), self._high_water(step)
                    )
                ],
                tags=[self._RunTag("ampctl.last_event", text[:5000])],
            )
        self._events.append(json.dumps(dict(ev), default=str))

    def summary(self, summary: Mapping[str, Any]) -> None:
        step = int(summary.get("steps") or 0)
        ts = self._now()
        ms = [self._Metric(f"ampctl/summary/{k}", v, ts, step) for k, v in numeric_items(summary)]
        tags = [self._RunTag("ampctl.status", str(summary.get("status")))]
        with _scoped(self.uri):
            self.client.log_batch(self.run_id, metrics=ms, tags=tags)
            self.client.log_dict(self.run_id, dict(summary), "ampctl/summary.json")

    def artifact(self, path: Path) -> None:
        with _scoped(self.uri):
            self.client.log_artifact(self.run_id, str(path), artifact_path="ampctl")

    def close(self, status: str) -> None:
        with _scoped(self.uri):
            if self._events:
                text = "".join(line + "\n" for line in self._events)
                self.client.log_text(self.run_id, text, "ampctl/events.jsonl")
                self._events = []
            if self.owned:
                self.client.set_terminated(self.run_id, _STATUS.get(status, "FAILED"))
                self.owned = False  # closed: a second close terminates nothing

    def abandon(self) -> None:
        """After a call failed: write nothing more. A store that refused once (its SQLite file
        locked by another process makes every call wait MLflow's 20 s ``busy_timeout`` first, a
        server that is down its retries) would stall training again on each call; the MLflow
        run stays as the failure left it, its figures up to there kept."""
        self._events = []
        self.owned = False
