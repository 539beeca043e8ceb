"""logging.mlflow=true with the real MLflow, offline (a SQLite store in the run folder): the
figures read back with ``MlflowClient`` equal metrics.jsonl, a planted overflow is an event, the
config is the run's parameters, the summary and events are artifacts; a store that fails (a run
deleted under the sink, a server that is down) costs one warning and the run goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

from ampctl.runlog import new_run_dir  # noqa: E402
from ampctl.train.trainer import train  # noqa: E402
from ampctl.ui.sinks import flatten  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402
from tests.ui.readback import (  # noqa: E402
    assert_series_equal,
    local_uri,
    mlflow_run,
    numeric_series,
    seed_store,
)

OVERFLOW_AT = 5  # not a log step (4, 8, 12): the rows stay finite


def plant(tr, step, phase):
    if step == OVERFLOW_AT:
        tr.model.bert.encoder.layer[1].output.dense.weight.grad[0, 0] = float("inf")


def _run(fast_cfg, template, name, *extra, fault=plant):
    cfg = fast_cfg("guard.rollback_after=0", "logging.mlflow=true", *extra)
    run_dir = new_run_dir(cfg.trainer.runs_dir, name)
    if template is not None:
        seed_store(template, run_dir)
    return train(cfg, run_dir, fault=fault)


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_mlflow_histories_equal_metrics_jsonl_and_the_overflow_is_an_event(
    fast_cfg, mlflow_template
):
    res = _run(fast_cfg, mlflow_template, "ml")
    d = res.run_dir
    assert res.status == "ok"
    client, run = mlflow_run(local_uri(d))
    rid = run.info.run_id
    assert run.info.run_name == d.name and run.info.status == "FINISHED"
    assert run.data.tags["ampctl.run_dir"] == str(d.resolve())
    rows = read_jsonl(d / "metrics.jsonl")
    expected = numeric_series(rows)
    assert {"loss", "scale", "skipped", "overflow_rate", "grad_norm", "grad_amax", "lr"} <= set(
        expected
    )
    assert {"grad_underflow_frac", "act_grad_underflow_frac", "tokens_per_s"} <= set(expected)
    got = {k: history(client, rid, k) for k in run.data.metrics}
    assert_series_equal(expected, got)
    assert run.data.tags["ampctl.precision"] == rows[-1]["precision"] == "fp16"
    # the planted overflow: a step up of its kind's count at its step, the last event's text,
    # and every event in the events artifact
    events = read_jsonl(d / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("overflow", OVERFLOW_AT)]
    assert history(client, rid, "ampctl/events/overflow") == [(OVERFLOW_AT, 1.0)]
    assert (
        run.data.tags["ampctl.last_event"]
        == f"overflow step {OVERFLOW_AT}: " + (events[0]["message"])
    )
    art = client.download_artifacts(rid, "ampctl/events.jsonl", str(d / "dl"))
    assert read_jsonl(art) == [json.loads(json.dumps(e, default=str)) for e in events]
    # the composed config as parameters, flattened
    config = flatten(yaml.safe_load((d / "config.yaml").read_text()))
    params = run.data.params
    assert set(params) == set(config)
    assert params["trainer.max_steps"] == "12" and params["precision.name"] == "fp16"
    assert params["scaler.init_scale"] == "1024.0" and params["guard.rollback_after"] == "0"
    assert config["name"] is None and params["name"] == d.name  # the run's name, not 'null'
    # the step as a metric too: its latest value is the step the run ended at
    assert history(client, rid, "ampctl/step") == [(r["step"], r["step"]) for r in rows]
    assert run.data.metrics["ampctl/step"] == 12
    # the summary: the same object as summary.json, its numbers as metrics, its status a tag
    summary = json.loads((d / "summary.json").read_text())
    art = client.download_artifacts(rid, "ampctl/summary.json", str(d / "dl"))
    assert json.loads(open(art).read()) == summary
    assert history(client, rid, "ampctl/summary/skipped") == [(12, 1.0)]
    assert run.data.tags["ampctl.status"] == "ok"
    assert (d / "mlartifacts").is_dir()  # the artifacts stay in the run folder


def test_a_run_deleted_under_the_sink_costs_one_warning(fast_cfg, mlflow_template):
    from mlflow.tracking import MlflowClient

    def delete_run(tr, step, phase):
        if step == 6:  # after the first row (step 4) went out
            client = MlflowClient(tracking_uri=local_uri(tr.run_dir))
            (run,) = client.search_runs([client.get_experiment_by_name("ampctl").experiment_id])
            client.delete_run(run.info.run_id)

    res = _run(fast_cfg, mlflow_template, "gone", fault=delete_run)
    assert res.status == "ok" and res.exit_code == 0
    d = res.run_dir
    assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [4, 8, 12]
    events = read_jsonl(d / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("warning", 8)]
    msg = events[0]["message"]
    assert msg.startswith("logging.mlflow: metrics failed (MlflowException: ")
    assert msg.endswith("; mlflow logging stopped, metrics.jsonl is complete")
    assert "\n" not in msg
    client = MlflowClient(tracking_uri=local_uri(d))
    (run,) = client.search_runs(
        [client.get_experiment_by_name("ampctl").experiment_id], run_view_type=2
    )
    assert run.info.lifecycle_stage == "deleted"
    assert history(client, run.info.run_id, "ampctl/loss")[0][0] == 4  # what went out before


def test_a_tracking_server_that_is_down_costs_one_warning(fast_cfg, monkeypatch):
    for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    # a loopback port nothing listens on: connection refused
    res = _run(fast_cfg, None, "down", "logging.mlflow_uri=http://127.0.0.1:9", fault=None)
    assert res.status == "ok"
    d = res.run_dir
    assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [4, 8, 12]
    (ev,) = read_jsonl(d / "events.jsonl")
    assert ev["kind"] == "warning" and ev["step"] == 0
    assert ev["message"].startswith(
        "logging.mlflow=true: not started (MlflowException: API request to "
        "http://127.0.0.1:9/api/2.0/mlflow/experiments/get-by-name failed"
    )
    assert ev["message"].endswith("; metrics.jsonl is written anyway")
    assert not (d / "mlruns.db").exists()
    # the short retry budget was this sink's only: the process environment is as it was
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_mlflow_without_its_sql_store_packages_is_a_one_line_hint(tmp_path):
    """mlflow-skinny alone has no SQL store: the hint names what is missing and the extra (a
    fresh process where sqlalchemy cannot be imported, as on a machine without it: MLflow then
    registers no SQL stores at all)."""
    import subprocess
    import sys

    from tests.test_cli import train_args

    runs = tmp_path / "runs"
    code = "import sys; sys.modules['sqlalchemy'] = None; from ampctl.cli import app; app()"
    out = subprocess.run(
        # no plot.png: none is read, and matplotlib costs seconds in a fresh process
        [sys.executable, "-c", code, *train_args(runs, "logging.mlflow=true", "logging.plot=false")]
        + ["--name", "sk"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr
    d = runs / "sk"
    (ev,) = read_jsonl(d / "events.jsonl")
    assert (ev["kind"], ev["step"], ev["message"]) == (
        "warning",
        0,
        'logging.mlflow=true needs the sqlalchemy package: pip install "ampctl[mlflow]"; '
        "metrics.jsonl is written anyway",
    )
    assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [4, 8, 12]
    assert not (d / "mlruns.db").exists()


def test_after_rollbacks_the_latest_counters_and_step_are_the_last_ones_logged(
    tmp_path, mlflow_template
):
    """A rollback rewinds the training step: the points logged after it are at smaller steps.
    MLflow's latest value is the point of the largest step (then timestamp, then value), so the
    counters and ``ampctl/step`` go at the high-water step: their latest values are the
    events.jsonl count and the step the run ended at."""
    from ampctl.ui.mlflow_sink import MlflowSink

    d = tmp_path / "rb"
    seed_store(mlflow_template, d)
    sink = MlflowSink(
        d, uri=None, experiment="ampctl", run_name="rb", params={"name": None, "seed": 0}
    )
    # steps 1-20, then three rollbacks to step 10 (11-20 again): an overflow every other step
    # of the first pass and at 11, 13, 15 of each replay (below the first pass's 19), a row
    # every 4 steps, a rollback event at each rewind
    steps = list(range(1, 21)) + [s for _ in range(3) for s in range(11, 21)]
    n_overflow = n_rollback = 0
    for i, step in enumerate(steps):
        if i and step < steps[i - 1]:
            n_rollback += 1
            sink.event({"step": steps[i - 1], "kind": "rollback", "message": "to 10"}, n_rollback)
        if step % 2 and (i < 20 or step <= 15):
            n_overflow += 1
            sink.event({"step": step, "kind": "overflow", "message": "inf"}, n_overflow)
        if step % 4 == 0:
            sink.metrics({"step": step, "loss": 1.0 / step})
    sink.metrics({"step": 15, "loss": 0.5})  # the run stops at 15, below its high-water 20
    sink.close("ok")
    assert n_overflow == 19 and n_rollback == 3
    client, run = mlflow_run(local_uri(d))
    latest = run.data.metrics
    assert latest["ampctl/events/overflow"] == 19.0  # was 10: the count at step 19
    assert latest["ampctl/events/rollback"] == 3.0
    assert latest["ampctl/step"] == 15.0
    # every count is in the history, in order, and never at a step below the one before
    hist = history(client, run.info.run_id, "ampctl/events/overflow")
    assert [v for _, v in hist] == [float(k) for k in range(1, 20)]
    assert [s for s, _ in hist] == sorted(s for s, _ in hist) and hist[0][0] == 1
    # the training figures stay at their own steps (the replayed stretch logged again)
    loss_steps = [s for s, _ in history(client, run.info.run_id, "ampctl/loss")]
    assert loss_steps == [4, 8, 12, 16, 20, 12, 16, 20, 12, 16, 20, 12, 16, 20, 15]
    assert run.data.params["name"] == "rb" and run.data.params["seed"] == "0"
