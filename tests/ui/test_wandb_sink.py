"""logging.wandb=true with the real W&B client, offline: the offline run's ``.wandb`` file, read
record by record, holds every metrics.jsonl figure at its step, a planted overflow as an event,
the config, the summary; a run finished under the sink costs one warning and the run goes on."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("wandb")

from ampctl.runlog import new_run_dir  # noqa: E402
from ampctl.train.trainer import train  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402
from tests.ui.readback import (  # noqa: E402
    assert_series_equal,
    numeric_series,
    wandb_config,
    wandb_exit_code,
    wandb_file,
    wandb_history,
    wandb_records,
    wandb_summary,
)
from tests.ui.test_mlflow_sink import OVERFLOW_AT, plant  # noqa: E402


@pytest.fixture(autouse=True)
def _no_stray_run():
    import wandb

    yield
    if wandb.run is not None:  # a failed test must not leave a run for the next to join
        wandb.run.finish()


def series(history: list[dict], key_prefix: str = "ampctl/") -> dict[str, list[tuple[int, float]]]:
    """The history as ``{key: [(ampctl/step, value), ...]}`` over the ``ampctl/*`` numbers."""
    out: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        for k, v in h.items():
            if k.startswith(key_prefix) and k != "ampctl/step" and isinstance(v, int | float):
                out.setdefault(k, []).append((h["ampctl/step"], float(v)))
    return out


def _run(fast_cfg, name, *extra, fault=plant):
    cfg = fast_cfg("guard.rollback_after=0", "logging.wandb=true", *extra)
    return train(cfg, new_run_dir(cfg.trainer.runs_dir, name), fault=fault)


def test_wandb_offline_history_equals_metrics_jsonl_and_the_overflow_is_an_event(fast_cfg):
    import wandb

    res = _run(fast_cfg, "wb")
    d = res.run_dir
    assert res.status == "ok" and wandb.run is None  # the sink finished its run
    f = wandb_file(d)
    hist = wandb_history(f)
    rows = read_jsonl(d / "metrics.jsonl")
    got = series(hist)
    metric_rows = [h for h in hist if "ampctl/loss" in h]
    assert [h["ampctl/precision"] for h in metric_rows] == [r["precision"] for r in rows]
    expected = numeric_series(rows)
    assert {"loss", "scale", "skipped", "overflow_rate", "grad_norm", "lr"} <= set(expected)
    assert_series_equal(expected, {k: v for k, v in got.items() if "/events/" not in k})
    # the planted overflow: its kind's count steps up at its step; the event log table
    assert got["ampctl/events/overflow"] == [(OVERFLOW_AT, 1.0)]
    (table_row,) = [h for h in hist if "ampctl/event_log/_type" in h]
    table = json.loads((f.parent / "files" / table_row["ampctl/event_log/path"]).read_text())
    events = read_jsonl(d / "events.jsonl")
    assert table["columns"] == ["step", "kind", "message"]
    assert table["data"] == [[e["step"], e["kind"], e["message"]] for e in events]
    assert [e["kind"] for e in events] == ["overflow"]
    # config, summary, exit code
    config = wandb_config(f)
    saved = yaml.safe_load((d / "config.yaml").read_text())
    for group in ("trainer", "scaler", "precision", "guard", "logging"):
        assert config[group] == saved[group], group
    summary = json.loads((d / "summary.json").read_text())
    ws = wandb_summary(f)
    assert ws["ampctl/summary/status"] == "ok"
    assert ws["ampctl/summary/skipped"] == summary["skipped"] == 1
    assert ws["ampctl/summary/events.overflow"] == 1
    assert wandb_exit_code(f) == 0
    # an offline run, inside the run folder
    assert f.parent.parent == d / "wandb" and f.parent.name.startswith("offline-run-")
    assert any(r.telemetry.feature.offline for r in wandb_records(f) if r.HasField("telemetry"))


def test_a_run_finished_under_the_sink_costs_one_warning(fast_cfg):
    import wandb

    def finish(tr, step, phase):
        if step == 6:
            wandb.run.finish()  # someone else's code ends the run mid-training

    res = _run(fast_cfg, "wbgone", fault=finish)
    assert res.status == "ok" and res.exit_code == 0
    d = res.run_dir
    assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [4, 8, 12]
    (ev,) = read_jsonl(d / "events.jsonl")
    assert ev["kind"] == "warning" and ev["step"] == 8
    assert ev["message"].startswith("logging.wandb: metrics failed (UsageError: Run (")
    assert ev["message"].endswith("; wandb logging stopped, metrics.jsonl is complete")
    hist = wandb_history(wandb_file(d))
    assert [h["ampctl/step"] for h in hist if "ampctl/loss" in h] == [4]
