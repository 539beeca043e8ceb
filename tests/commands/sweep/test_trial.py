"""One trial folder read as data, and the status of a trial process (no process is started)."""

from __future__ import annotations

import json

import pytest

from ampctl.commands.sweep import PieceResult, SweepPlan, Trial, config_diff, trial_row
from ampctl.commands.sweep.trial import read_trial
from ampctl.config import to_yaml


def _plan(tmp_path, cfg):
    return SweepPlan(
        name="s",
        sweep_dir=tmp_path,
        trials=[],
        swept_keys=["scaler.init_scale"],
        fixed=[],
        steps=None,
        baseline="fp32",
        config_dir=None,
        budgets=[4, 8],
    )


def _trial(name, cfg):
    return Trial(name=name, kind="trial", swept={"scaler.init_scale": "1"}, overrides=[], cfg=cfg)


def _write(d, *, metrics=(), events=(), summary=None):
    d.mkdir(exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))


def _m(step, loss, skipped=0, elapsed=1.0, amax=0.5, scale=1024.0):
    return {
        "step": step,
        "loss": loss,
        "skipped": skipped,
        "elapsed_s": elapsed,
        "grad_amax": amax,
        "scale": scale,
        "precision": "fp16",
    }


def test_trial_row_classifies_crashes_and_guard_aborts(fast_cfg, tmp_path):
    cfg = fast_cfg()
    plan = _plan(tmp_path, cfg)
    crashed = _trial("init_scale=1", cfg)
    (tmp_path / crashed.name).mkdir()
    lines = [f"line {i}" for i in range(30)] + ["RuntimeError: boom"]
    (tmp_path / crashed.name / "stderr.log").write_text("\n".join(lines) + "\n")
    row = trial_row(plan, crashed, PieceResult(1, 8))
    assert (row["status"], row["reason"]) == ("crashed", "exit code 1, no summary.json")
    assert row["stderr_tail"] == "\n".join(lines[-20:])
    assert trial_row(plan, crashed, PieceResult(-9, 8))["reason"] == (
        "killed by signal 9, no summary.json"
    )
    gone = trial_row(plan, crashed, PieceResult(None, 8, error="Ray: the worker died"))
    assert (gone["status"], gone["reason"]) == ("crashed", "Ray: the worker died")

    aborted = _trial("init_scale=2", cfg)
    _write(
        tmp_path / aborted.name,
        metrics=[_m(2, 4.0)],
        events=[
            {"step": 2, "kind": "overflow", "message": "m"},
            {"step": 3, "kind": "abort", "message": "scale at its floor"},
        ],
        summary={"status": "aborted", "final_loss": float("nan"), "steps": 3},
    )
    row = trial_row(plan, aborted, PieceResult(1, 8))
    assert (row["status"], row["reason"]) == (
        "diverged",
        "aborted by the guard: scale at its floor",
    )
    assert row["first_overflow_step"] == 2 and row["stderr_tail"] == ""
    assert trial_row(plan, aborted, PieceResult(None, 8))["status"] == "diverged"  # on resume
    assert trial_row(plan, aborted, PieceResult(2, 8))["status"] == "crashed"  # no abort exit


def test_a_trial_is_read_at_its_rung_step(fast_cfg, tmp_path):
    """A trial that went on to a later rung reads at an earlier rung as it did then."""
    cfg = fast_cfg()
    plan = _plan(tmp_path, cfg)
    t = _trial("init_scale=3", cfg)
    d = tmp_path / t.name
    _write(
        d,
        metrics=[_m(2, 5.0), _m(4, 4.5, skipped=1, elapsed=0.5), _m(6, 4.4), _m(8, 4.2, 1, 2.0)],
        events=[{"step": 3, "kind": "overflow", "message": "m"}],
        summary={"status": "ok", "steps": 8, "max_steps": 8},
    )
    at4 = trial_row(plan, t, PieceResult(None, 4, rung=0))
    assert (at4["status"], at4["steps"], at4["final_loss"], at4["rung"]) == ("ok", 4, 4.5, 0)
    assert at4["steps_per_s"] == 4 / 0.5 and at4["steps_spent"] == 8
    at8 = trial_row(plan, t, PieceResult(0, 8, rung=1))
    assert (at8["status"], at8["steps"], at8["final_loss"]) == ("ok", 8, 4.2)
    assert at8["first_overflow_step"] == 3 and at8["overflow_rate"] == 1 / 8
    # the next rung's process died: the summary is still the one of step 4
    (d / "summary.json").write_text(json.dumps({"status": "ok", "steps": 4}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(_m(s, 4.5)) + "\n" for s in (2, 4, 6)))
    row = trial_row(plan, t, PieceResult(-9, 8, rung=1))
    assert (row["status"], row["reason"]) == ("crashed", "killed by signal 9 (summary status ok)")
    assert row["steps"] == 6 and row["steps_spent"] == 6  # how far it got
    row = trial_row(plan, t, PieceResult(0, 8, rung=1))
    assert row["reason"] == "exit code 0 but the run reached step 6, not 8"
    # a stop by the sweep (divergence) wins over a clean exit
    row = trial_row(plan, t, PieceResult(0, 4, stopped="stopped at step 4: loss nan"))
    assert (row["status"], row["reason"]) == ("diverged", "stopped at step 4: loss nan")


def test_overflow_rate_counts_the_steps_a_rollback_replayed(tmp_path):
    _write(
        tmp_path / "t",
        metrics=[_m(4, 4.1, skipped=6)],
        events=[{"step": 0, "kind": "rollback", "from_step": 3, "to_step": 0}],
        summary={"status": "ok", "steps": 4, "skipped": 6, "overflow_rate": 6 / 7},
    )
    info = read_trial(tmp_path / "t", at_step=4)
    assert info["overflow_rate"] == pytest.approx(6 / 7) and info["rollbacks"] == 1


def test_config_diff_names_the_first_changed_key_and_evaluates_nothing(
    fast_cfg, tmp_path, monkeypatch
):
    planned = fast_cfg("scaler.growth_interval=500")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(fast_cfg("scaler.growth_interval=500", "trainer.runs_dir=/elsewhere")))
    assert config_diff(path, planned) is None  # the folder a trial ran in is not its config
    path.write_text(to_yaml(fast_cfg("scaler.growth_interval=500", "model.hidden_size=48")))
    assert config_diff(path, planned) == ("model.hidden_size", 48, 32)
    path.write_text(to_yaml(fast_cfg("scaler.growth_interval=500", "trainer.max_steps=4")))
    assert config_diff(path, planned) == ("trainer.max_steps", 4, 12)
    assert config_diff(path, planned, ignore=("trainer.runs_dir", "trainer.max_steps")) is None
    assert config_diff(tmp_path / "missing.yaml", planned) is None
    # a trial folder is data: an interpolation in its config is compared as text
    monkeypatch.setenv("SWEEP_SECRET", "48")
    text = to_yaml(fast_cfg("scaler.growth_interval=500")).replace(
        "hidden_size: 32", "hidden_size: ${oc.env:SWEEP_SECRET}"
    )
    path.write_text(text)
    assert config_diff(path, planned) == ("model.hidden_size", "${oc.env:SWEEP_SECRET}", 32)
