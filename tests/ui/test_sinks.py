"""The sinks behind the run logger, without their libraries: a sink that raises is dropped with
one warning while the run and the other sinks go on, events recorded before the sinks open reach
them with counts that continue a resumed run's, a missing package is a one-line hint, and bad
``logging.*`` values are refused with one line."""

from __future__ import annotations

import sys

import pytest

from ampctl.config import ConfigError, load_config
from ampctl.protect.logger import RunLogger
from ampctl.protect.settings import LoggingConfig
from ampctl.runlog import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import read_jsonl
from tests.test_cli import assert_bad, run, train_args


class Recorder:
    """A sink that keeps what it is given."""

    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def metrics(self, row):
        self.calls.append(("metrics", row["step"]))

    def event(self, ev, count):
        self.calls.append(("event", ev["kind"], ev["step"], count))

    def summary(self, summary):
        self.calls.append(("summary", summary["status"]))

    def artifact(self, path):
        self.calls.append(("artifact", path.name))

    def close(self, status):
        self.calls.append(("close", status))


class DiskFull(Recorder):
    """A sink whose writes fail from its second metrics row on, as a full disk would."""

    name = "mlflow"

    def metrics(self, row):
        super().metrics(row)
        if len([c for c in self.calls if c[0] == "metrics"]) >= 2:
            raise OSError(28, "No space left on device")


def _logger(tmp_path, *sinks):
    log = RunLogger(tmp_path, logging=LoggingConfig())
    log.open(0, {})
    log.sinks.sinks = list(sinks)
    return log


def test_a_failing_sink_warns_once_and_is_dropped(tmp_path):
    ok, bad = Recorder(), DiskFull()
    log = _logger(tmp_path, bad, ok)
    for step in (4, 8, 12):
        log.metrics({"step": step, "loss": 1.0})
    log.event({"step": 12, "kind": "overflow", "message": "m"})
    assert log.summary({"status": "ok"}) is None
    log.close("ok")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [4, 8, 12]  # the run folder is complete
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("warning", 8), ("overflow", 12)]
    assert events[0]["message"] == (
        "logging.mlflow: metrics failed (OSError: [Errno 28] No space left on device); mlflow "
        "logging stopped, metrics.jsonl is complete"
    )
    # the failing sink was closed once and never called again; the other one saw everything
    assert bad.calls == [("metrics", 4), ("metrics", 8), ("close", "failed")]
    assert ok.calls == [
        ("metrics", 4),
        ("event", "warning", 8, 1),  # the failing sink comes first: its warning, then the row
        ("metrics", 8),
        ("metrics", 12),
        ("event", "overflow", 12, 1),
        ("summary", "ok"),
        ("close", "ok"),
    ]


def test_early_events_reach_the_sinks_with_counts_that_continue(tmp_path, monkeypatch):
    (tmp_path / "events.jsonl").write_text(
        '{"step": 3, "kind": "overflow", "message": "before the resume"}\n'
    )
    log = RunLogger(tmp_path, logging=LoggingConfig())
    log.event({"step": 6, "kind": "branch", "message": "resumed"})  # before open: kept
    rec = Recorder()
    log.sinks.logging = LoggingConfig(tensorboard=True)  # something is wanted
    monkeypatch.setattr("ampctl.ui.sinks.open_sinks", lambda *a, **k: ([rec], []))
    log.open(6, {"a": 1})
    log.event({"step": 7, "kind": "overflow", "message": "after"})
    assert rec.calls == [("event", "branch", 6, 1), ("event", "overflow", 7, 2)]


def test_missing_packages_are_one_line_hints_and_the_run_goes_on(fast_cfg, monkeypatch):
    for mod in ("mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails as if not installed
    cfg = fast_cfg("logging.mlflow=true", "logging.wandb=true", "logging.tensorboard=false")
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "hint"))
    assert res.status == "ok"
    events = read_jsonl(res.run_dir / "events.jsonl")
    assert [(e["kind"], e["step"], e["message"]) for e in events] == [
        (
            "warning",
            0,
            'logging.mlflow=true needs the mlflow package: pip install "ampctl[mlflow]"; '
            "metrics.jsonl is written anyway",
        ),
        (
            "warning",
            0,
            'logging.wandb=true needs the wandb package: pip install "ampctl[wandb]"; '
            "metrics.jsonl is written anyway",
        ),
    ]
    assert [r["step"] for r in read_jsonl(res.run_dir / "metrics.jsonl")] == [4, 8, 12]
    assert not (res.run_dir / "mlruns.db").exists() and not (res.run_dir / "wandb").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "logging.wandb_mode=cloud",
            "logging.wandb_mode='cloud' is not allowed: logging.wandb_mode must be offline or "
            "online",
        ),
        (
            "logging.mlflow_uri=''",
            "logging.mlflow_uri='' is not allowed: logging.mlflow_uri must be null (a store in "
            "the run folder) or a tracking URI",
        ),
        ("logging.mlflow=maybe", "logging.mlflow: Value 'maybe' is not a valid bool"),
        (
            "logging.wandb_project=' '",
            "logging.wandb_project=' ' is not allowed: logging.wandb_project must be a non-empty "
            "name",
        ),
    ],
)
def test_bad_logging_values_are_refused_with_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert message in str(e.value)
    runs = tmp_path / "runs"
    assert_bad(run(*train_args(runs, override)), message)
    assert not runs.exists() or not any(runs.iterdir())  # no run folder was made


def test_protected_run_refuses_a_bad_logging_argument(tmp_path):
    import torch

    from ampctl.integrations import IntegrationError, ProtectedRun

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(IntegrationError) as e:
        ProtectedRun(model, opt, run_dir=tmp_path / "r", logging={"mlfow": True})
    assert str(e.value).startswith("ProtectedRun: logging has unknown fields ['mlfow']; allowed: ")
    with pytest.raises(IntegrationError) as e:
        ProtectedRun(model, opt, run_dir=tmp_path / "r", logging={"wandb_mode": "cloud"})
    assert str(e.value) == (
        "logging.wandb_mode='cloud' is not allowed: logging.wandb_mode must be offline or online"
    )
    with pytest.raises(IntegrationError, match="logging must be a LoggingConfig or a mapping"):
        ProtectedRun(model, opt, run_dir=tmp_path / "r", logging=True)
    assert not (tmp_path / "r").exists()


def test_tensorboard_through_the_run_logger_continues_a_resumed_runs_counts(fast_cfg):
    """logging.tensorboard=true behind the sink interface: the rows, a planted overflow's count,
    the summary text; resumed from step 6, the counts go on from events.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = fast_cfg("guard.rollback_after=0", "logging.tensorboard=true")

    def plant(tr, step, phase):
        if step in (5, 9):
            tr.model.bert.encoder.layer[1].output.dense.weight.grad[0, 0] = float("inf")

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "tb"), fault=plant)
    d = res.run_dir

    def scalars(tag):
        acc = EventAccumulator(str(d / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        return acc, [(s.step, s.value) for s in acc.Scalars(tag)]

    acc, loss = scalars("ampctl/loss")
    rows = read_jsonl(d / "metrics.jsonl")
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert scalars("ampctl/events/overflow")[1] == [(5, 1.0), (9, 2.0)]
    assert sorted(acc.Tags()["tensors"]) == ["events/text_summary", "summary/text_summary"]
    (summary,) = acc.Tensors("summary/text_summary")
    assert "- **skipped**: 2" in summary.tensor_proto.string_val[0].decode()
    # resume from the step-6 checkpoint: history after 6 is set aside, the overflow at 9 comes
    # again and is the second overflow of the run's main line
    res2 = train(cfg, d, resume=d / "checkpoints" / "step_00000006.pt", fault=plant)
    assert res2.status == "ok"
    assert [e["kind"] for e in read_jsonl(d / "events.jsonl")] == ["overflow", "branch", "overflow"]
    assert scalars("ampctl/events/overflow")[1][-1] == (9, 2.0)
    assert scalars("ampctl/events/branch")[1][-1] == (6, 1.0)
