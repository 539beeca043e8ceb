"""Tests for ``ampctl sweep-scale`` (ampctl.sweep).

The sweeps here run real ``python -m ampctl train`` processes on the tiny FAST model with 8 steps;
process start-up dominates, so the number of trials is kept small: one 2 x 2 grid plus baseline
(module fixture, shared by the results and resume tests), a 2-trial lr sweep that diverges, and a
--jobs 1 sweep stopped by Ctrl-C after its first trial, which is compared with the grid's --jobs 2
run of the same settings (the resume test re-runs another grid trial with --jobs 1 as well).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.config import ConfigError, to_yaml
from ampctl.sweep import (
    COLUMNS,
    DIVERGE_GAP,
    SweepPlan,
    Trial,
    config_diff,
    finalize_rows,
    ideal_scale,
    parse_sweep,
    plan_sweep,
    sweep,
    threads_per_trial,
    trial_row,
)
from tests.conftest import FAST, read_jsonl

STEPS = 8


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200), buf


def _run(runs: Path, *overrides: str, **kw):
    console, buf = _console()
    kw.setdefault("mode", "plain")
    # one thread per trial whatever --jobs is: --jobs 1 and --jobs 2 then do the same float
    # reductions, so their losses are bit-identical (two threads would reorder the sums)
    kw.setdefault("threads", 1)
    result = sweep(
        [*FAST, f"trainer.runs_dir={runs}", *overrides], steps=STEPS, console=console, **kw
    )
    return result, buf.getvalue()


def _by_setting(rows: list[dict]) -> dict[tuple[float, int], dict]:
    return {(r["init_scale"], r["growth_interval"]): r for r in rows if r["kind"] == "trial"}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    runs = tmp_path_factory.mktemp("grid") / "runs"
    result, out = _run(
        runs, "scaler.init_scale=1024,65536", "scaler.growth_interval=2,1000", jobs=2, name="g"
    )
    return runs, result, out


# ----------------------------------------------------------------------------- real sweeps
def test_grid_writes_one_row_per_trial_with_all_columns(grid):
    runs, result, out = grid
    sdir = runs / "g"
    assert result.sweep_dir == sdir.resolve()
    assert out.splitlines()[0].startswith(f"Sweep {sdir.resolve()}: 4 trials + 1 fp32 baseline")
    doc = json.loads((sdir / "results.json").read_text())
    assert doc["columns"] == COLUMNS
    assert [r["trial"] for r in doc["trials"]] == [
        "baseline-fp32",
        "init_scale=1024,growth_interval=2",
        "init_scale=1024,growth_interval=1000",
        "init_scale=65536,growth_interval=2",
        "init_scale=65536,growth_interval=1000",
    ]
    assert all(list(r) == COLUMNS for r in doc["trials"])
    with open(sdir / "results.csv", newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == COLUMNS
    assert len(table) == 1 + 5 and all(len(r) == len(COLUMNS) for r in table)
    assert [r["status"] for r in doc["trials"]] == ["ok"] * 5
    assert doc["complete"] is True and doc["interrupted"] is False
    assert result.exit_code == 0 and result.launched and not result.reused

    base = doc["trials"][0]
    assert base["kind"] == "baseline" and base["precision"] == "fp32"
    assert base["init_scale"] is None and base["loss_gap"] is None and base["rank"] is None
    for r in doc["trials"][1:]:
        tdir = sdir / r["trial"]
        summary = json.loads((tdir / "summary.json").read_text())
        events = (
            [e for e in read_jsonl(tdir / "events.jsonl")]
            if (tdir / "events.jsonl").exists()
            else []
        )
        overflows = [e["step"] for e in events if e["kind"] == "overflow"]
        cfg_yaml = (tdir / "config.yaml").read_text()
        assert f"max_steps: {STEPS}" in cfg_yaml and f"runs_dir: {sdir.resolve()}" in cfg_yaml
        assert r["precision"] == "fp16" and r["steps"] == STEPS
        assert r["final_loss"] == summary["final_loss"]
        assert r["skipped"] == summary["skipped"] == len(overflows)
        assert r["overflow_rate"] == r["skipped"] / STEPS
        assert r["first_overflow_step"] == (overflows[0] if overflows else None)
        assert r["steps_per_s"] == pytest.approx(STEPS / summary["wall_time_s"])
        assert r["reference"] == "baseline-fp32" and r["reference_loss"] == base["final_loss"]
        assert r["loss_gap"] == (r["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        if r["skipped"] == 0:  # clean run: the scale doubled every growth_interval steps
            assert r["final_scale"] == r["init_scale"] * 2 ** (STEPS // r["growth_interval"])
    # the ranking follows (clipped, 0.1%-rounded gap, skipped, -steps/s)
    ranked = sorted(doc["trials"][1:], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranked] == [1, 2, 3, 4] and doc["ranking"] == [
        r["trial"] for r in ranked
    ]
    keys = [(round(max(r["loss_gap"], 0) / 1e-3), r["skipped"], -r["steps_per_s"]) for r in ranked]
    assert keys == sorted(keys)
    best = ranked[0]
    cmd = f"scaler.init_scale={int(best['init_scale'])} scaler.growth_interval={best['growth_interval']}"
    assert doc["recommendation"]["command"].startswith("ampctl train trainer.max_steps=12 ")
    assert doc["recommendation"]["command"].endswith(cmd)
    assert "scaler.init_scale=1024 " not in doc["recommendation"]["command"].replace(cmd, "")
    assert f"Recommended: {best['trial']} " in out and "  ampctl train " in out
    # S* from the gradients the fp16 trials logged
    amax = max(
        m["grad_amax"]
        for r in doc["trials"][1:]
        for m in read_jsonl(sdir / r["trial"] / "metrics.jsonl")
        if math.isfinite(m["grad_amax"])
    )
    s = doc["s_star"]
    assert s["max_grad_amax"] == amax and s["value"] == ideal_scale(amax)
    assert s["value"] * amax <= 65504 < 2 * s["value"] * amax
    assert s["command"].endswith(
        f"scaler.init_scale={int(s['value'])} scaler.growth_interval={best['growth_interval']}"
    )
    assert f"S* = 65504/max|g| rounded down = {int(s['value'])}" in out


def test_resume_runs_nothing_again_and_reruns_a_trial_without_summary(grid):
    runs, first, _ = grid
    sdir = runs / "g"
    names = [r["trial"] for r in first.rows]
    stamps = {n: (sdir / n / "summary.json").stat().st_mtime_ns for n in names}

    again, out = _run(
        runs, "scaler.init_scale=1024,65536", "scaler.growth_interval=2,1000", jobs=2, name="g"
    )
    assert again.launched == [] and sorted(again.reused) == sorted(names)
    assert "Resuming: 5 finished trial(s) kept, 0 to run" in out
    assert {n: (sdir / n / "summary.json").stat().st_mtime_ns for n in names} == stamps
    assert [r["final_loss"] for r in again.rows] == [r["final_loss"] for r in first.rows]

    victim = "init_scale=1024,growth_interval=2"
    old = json.loads((sdir / victim / "summary.json").read_text())
    (sdir / victim / "summary.json").unlink()  # as if killed before the end
    third, out = _run(
        runs, "scaler.init_scale=1024,65536", "scaler.growth_interval=2,1000", jobs=1, name="g"
    )
    assert third.launched == [victim] and third.moved_aside == [f"{victim}.incomplete-1"]
    assert (sdir / f"{victim}.incomplete-1" / "metrics.jsonl").is_file()  # moved aside, not deleted
    new = json.loads((sdir / victim / "summary.json").read_text())
    assert (
        new["final_loss"] == old["final_loss"] and new["skipped"] == old["skipped"]
    )  # --jobs 1 == 2
    assert all(
        (sdir / n / "summary.json").stat().st_mtime_ns == stamps[n] for n in names if n != victim
    )


def test_jobs_1_matches_jobs_2_and_ctrl_c_stops_launching(grid, tmp_path):
    _, grid_result, _ = grid
    runs = tmp_path / "runs"

    def ctrl_c_after_first(row):
        raise KeyboardInterrupt

    args = ("scaler.init_scale=65536,1024", "scaler.growth_interval=2")
    part, out = _run(runs, *args, jobs=1, baseline=False, name="j1", on_result=ctrl_c_after_first)
    assert part.interrupted and part.exit_code == 130
    assert part.launched == ["init_scale=65536"]
    assert [r["status"] for r in part.rows] == ["ok", "pending"]
    assert not (runs / "j1" / "init_scale=1024").exists()  # nothing launched after Ctrl-C
    doc = json.loads((runs / "j1" / "results.json").read_text())
    assert doc["interrupted"] is True and doc["complete"] is False
    assert [r["status"] for r in doc["trials"]] == ["ok", "pending"]
    assert "Interrupted: 1 of 2 trials finished. Resume with: ampctl sweep-scale " in out
    assert out.rstrip().endswith("--steps 8 --no-baseline --name j1")
    # the trial run alone (--jobs 1) is the one the grid ran two at a time (--jobs 2)
    r = part.rows[0]
    twin = _by_setting(grid_result.rows)[(65536.0, 2)]
    assert (r["final_loss"], r["skipped"], r["final_scale"], r["first_overflow_step"]) == (
        twin["final_loss"],
        twin["skipped"],
        twin["final_scale"],
        twin["first_overflow_step"],
    )


def test_diverging_trial_is_labelled_and_others_stay_ok(tmp_path):
    console = Console(file=io.StringIO(), width=160, force_terminal=True)  # the live table
    result = sweep(
        [*FAST, f"trainer.runs_dir={tmp_path}", "optim.lr=1e-3,1e4"],
        steps=STEPS,
        jobs=2,
        baseline=False,
        name="lr",
        console=console,
        mode="auto",
    )
    rows = {r["trial"]: r for r in result.rows}
    assert list(rows) == ["lr=0.001", "lr=10000.0"]
    ok, bad = rows["lr=0.001"], rows["lr=10000.0"]
    assert ok["status"] == "ok" and ok["rank"] == 1 and ok["loss_gap"] == 0.0
    assert ok["reference"] == "best trial (lr=0.001)"
    assert bad["status"] == "diverged" and bad["rank"] is None and bad["reason"]
    summary = json.loads((tmp_path / "lr" / "lr=10000.0" / "summary.json").read_text())
    if summary["status"] == "aborted":
        assert bad["reason"].startswith("aborted by the guard")
    else:  # finished, but far off the track (or non-finite)
        assert not math.isfinite(bad["final_loss"]) or bad["loss_gap"] > DIVERGE_GAP
    assert result.ranking == ["lr=0.001"] and result.exit_code == 0
    doc = json.loads((tmp_path / "lr" / "results.json").read_text())
    i = COLUMNS.index("growth_interval") + 1
    assert doc["columns"] == COLUMNS[:i] + ["optim.lr"] + COLUMNS[i:]
    assert [r["optim.lr"] for r in doc["trials"]] == ["0.001", "10000.0"]
    assert "optim.lr=0.001" in result.recommendation["overrides"]


# ----------------------------------------------------------------------------- bad input
def test_bad_sweep_key_exits_2_with_one_line(tmp_path):
    res = CliRunner().invoke(
        app,
        ["sweep-scale", f"trainer.runs_dir={tmp_path / 'runs'}", "scaler.init_scal=1,2"],
    )
    assert res.exit_code == 2
    assert res.stderr == (
        "ampctl: error: unknown key 'scaler.init_scal' (did you mean 'scaler.init_scale'?) "
        "(to add a new key use +scaler.init_scal=VALUE) (sweep trial init_scal=1)\n"
    )
    assert not (tmp_path / "runs").exists()  # nothing ran, nothing written


def test_every_trial_is_validated_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError) as e:
        sweep([*FAST, f"trainer.runs_dir={runs}", "scaler.init_scale=1024,-1"], mode="quiet")
    assert str(e.value) == (
        "scaler.init_scale=-1.0 is not allowed: scaler.init_scale must be a finite number > 0 "
        "(sweep trial init_scale=-1)"
    )
    with pytest.raises(
        ConfigError, match=r"^precision=bf16 \(sweep trial growth_interval=100\): loss scaling"
    ):
        plan_sweep([*FAST, f"trainer.runs_dir={runs}", "precision=bf16"])
    with pytest.raises(
        ConfigError, match=r"^scaler.init_scale=interval\(1,2\): this kind of sweep"
    ):
        plan_sweep([*FAST, "scaler.init_scale=interval(1,2)"])
    with pytest.raises(ConfigError, match=r"^--jobs 0: give an integer >= 1$"):
        sweep([*FAST], jobs=0, mode="quiet")
    with pytest.raises(ConfigError, match=r"^--name 'a/b': use letters"):
        plan_sweep([*FAST], name="a/b")
    assert not runs.exists()


def test_resume_with_other_settings_is_refused(grid):
    runs, _, _ = grid
    with pytest.raises(ConfigError) as e:
        sweep(
            [
                *FAST,
                f"trainer.runs_dir={runs}",
                "scaler.init_scale=1024,65536",
                "scaler.growth_interval=2,1000",
            ],
            steps=STEPS + 1,
            name="g",
            mode="quiet",
        )
    assert str(e.value).startswith("--name g: trial baseline-fp32 in ") and str(e.value).endswith(
        "was run with trainer.max_steps=8, this sweep gives trainer.max_steps=9; re-run it with the "
        "same overrides and --steps, or pick another --name"
    )


# ----------------------------------------------------------------------------- planning, pure logic
def test_parse_sweep_uses_hydra_sweeps_and_the_default_grid():
    fixed, sweeps = parse_sweep(
        ["conf=bert_base", "scaler.growth_interval=range(100,2001,400)", "a.b=1"]
    )
    assert fixed == ["conf=bert_base", "a.b=1"]
    assert sweeps == [("scaler.growth_interval", ["100", "500", "900", "1300", "1700"])]
    assert parse_sweep(["optim.lr=1e-3"]) == (
        ["optim.lr=1e-3"],
        [
            ("scaler.init_scale", ["1024", "8192", "65536"]),
            ("scaler.growth_interval", ["100", "500", "2000"]),
        ],
    )
    # a fixed init_scale stays; only growth_interval gets the default grid
    assert parse_sweep(["scaler.init_scale=1024"]) == (
        ["scaler.init_scale=1024"],
        [("scaler.growth_interval", ["100", "500", "2000"])],
    )
    # a swept key replaces a fixed value of the same key
    assert parse_sweep(["scaler.init_scale=1024", "scaler.init_scale=8,16"]) == (
        [],
        [("scaler.init_scale", ["8", "16"])],
    )


def test_default_plan_is_3x3_plus_fp32_baseline(tmp_path):
    no_scale = [o for o in FAST if not o.startswith("scaler.")]
    plan = plan_sweep([*no_scale, f"trainer.runs_dir={tmp_path}"], steps=5, name="d")
    assert plan.sweep_dir == (tmp_path / "d").resolve() and not plan.sweep_dir.exists()
    assert [t.name for t in plan.trials][:2] == [
        "baseline-fp32",
        "init_scale=1024,growth_interval=100",
    ]
    assert (
        len(plan.trials) == 10 and plan.trials[-1].name == "init_scale=65536,growth_interval=2000"
    )
    assert {(t.cfg.scaler.init_scale, t.cfg.scaler.growth_interval) for t in plan.trials[1:]} == {
        (float(s), g) for s in (2**10, 2**13, 2**16) for g in (100, 500, 2000)
    }
    assert all(t.cfg.trainer.max_steps == 5 and t.group == "baseline-fp32" for t in plan.trials[1:])
    assert plan.trials[0].cfg.precision.name == "fp32" and plan.baseline == "fp32"
    unique = plan_sweep(
        [*FAST, f"trainer.runs_dir={tmp_path}", "scaler.growth_interval=7"], baseline=False
    )
    assert [t.name for t in unique.trials] == ["trial"]  # nothing swept: one trial
    assert re.fullmatch(r"sweep-\d{8}-\d{6}", unique.name) and not unique.sweep_dir.exists()


def test_threads_per_trial_keeps_jobs_times_threads_within_cores():
    assert threads_per_trial(1, cores=8, env={}) == 8
    assert threads_per_trial(2, cores=8, env={}) == 4
    assert threads_per_trial(3, cores=8, env={}) == 2
    assert threads_per_trial(4, cores=2, env={}) == 1
    assert threads_per_trial(1, cores=8, env={"OMP_NUM_THREADS": "1"}) == 1  # a set limit stays


def test_ideal_scale_is_the_largest_power_of_two_under_fp16_max():
    assert ideal_scale(1.0) == 32768.0  # 65504 -> 2^15
    assert ideal_scale(0.906) == 65536.0
    assert ideal_scale(65504 / 2**20) == 2.0**20
    assert ideal_scale(65504 / 2**20 * 1.0001) == 2.0**19
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ideal_scale(bad)


def _row(name, loss, skipped=0, speed=10.0, kind="trial", status="ok"):
    return {
        "trial": name,
        "kind": kind,
        "status": status,
        "reason": "",
        "final_loss": loss,
        "skipped": skipped,
        "steps_per_s": speed,
        "rank": None,
        "reference": None,
        "reference_loss": None,
        "loss_gap": None,
    }


def test_finalize_rows_gaps_divergence_and_ranking():
    rows = [
        _row("base", 2.0, kind="baseline"),
        _row("a", 2.0009, skipped=5),  # +0.045%: same 0.1% bucket as a loss below the baseline
        _row("b", 1.9, skipped=1, speed=5.0),
        _row("c", 1.95, skipped=1, speed=9.0),
        _row("d", 2.1),  # +5%
        _row("e", 2.3),  # +15%: diverged
        _row("f", float("nan"), status="diverged"),
    ]
    groups = {r["trial"]: "base" for r in rows if r["kind"] == "trial"}
    ranking = finalize_rows(rows, 0.10, groups)
    by = {r["trial"]: r for r in rows}
    assert ranking == ["c", "b", "a", "d"]
    assert [by[n]["rank"] for n in ranking] == [1, 2, 3, 4]
    assert by["d"]["loss_gap"] == pytest.approx(0.05) and by["d"]["reference"] == "base"
    assert by["e"]["status"] == "diverged" and by["e"]["rank"] is None
    assert by["e"]["reason"] == "final loss +15.0% vs base (threshold +10%)"
    assert by["f"]["loss_gap"] is None and by["base"]["rank"] is None
    # without a usable baseline the best trial of the group is the reference
    rows2 = [
        _row("base", float("nan"), kind="baseline", status="diverged"),
        _row("x", 4.0),
        _row("y", 5.0),
    ]
    assert finalize_rows(rows2, 0.10, {"x": "base", "y": "base"}) == ["x"]
    assert rows2[1]["reference"] == "best trial (x)" and rows2[2]["loss_gap"] == 0.25
    assert rows2[2]["status"] == "diverged"


def test_trial_row_classifies_crashes_and_guard_aborts(fast_cfg, tmp_path):
    cfg = fast_cfg()
    plan = SweepPlan(
        name="s",
        sweep_dir=tmp_path,
        trials=[],
        swept_keys=["scaler.init_scale"],
        fixed=[],
        steps=None,
        baseline="fp32",
        config_dir=None,
    )
    crashed = Trial(
        name="init_scale=1", kind="trial", swept={"scaler.init_scale": "1"}, overrides=[], cfg=cfg
    )
    (tmp_path / crashed.name).mkdir()
    lines = [f"line {i}" for i in range(30)] + ["RuntimeError: boom"]
    (tmp_path / crashed.name / "stderr.log").write_text("\n".join(lines) + "\n")
    row = trial_row(plan, crashed, 1)
    assert (row["status"], row["reason"]) == ("crashed", "exit code 1, no summary.json")
    assert row["stderr_tail"] == "\n".join(lines[-20:])
    assert trial_row(plan, crashed, -9)["reason"] == "killed by signal 9, no summary.json"

    aborted = Trial(
        name="init_scale=2", kind="trial", swept={"scaler.init_scale": "2"}, overrides=[], cfg=cfg
    )
    d = tmp_path / aborted.name
    d.mkdir()
    (d / "summary.json").write_text(
        json.dumps({"status": "aborted", "final_loss": float("nan"), "steps": 3})
    )
    (d / "events.jsonl").write_text(
        json.dumps({"step": 2, "kind": "overflow", "message": "m"})
        + "\n"
        + json.dumps({"step": 3, "kind": "abort", "message": "scale at its floor"})
        + "\n"
    )
    row = trial_row(plan, aborted, 1)
    assert (row["status"], row["reason"]) == (
        "diverged",
        "aborted by the guard: scale at its floor",
    )
    assert row["first_overflow_step"] == 2 and row["stderr_tail"] == ""
    assert trial_row(plan, aborted, None)["status"] == "diverged"  # found finished on resume
    assert trial_row(plan, aborted, 2)["status"] == "crashed"  # a non-zero exit that is no abort


def test_config_diff_names_the_first_changed_key(fast_cfg, tmp_path):
    planned = fast_cfg("scaler.growth_interval=500")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(fast_cfg("scaler.growth_interval=500", "trainer.runs_dir=/elsewhere")))
    assert config_diff(path, planned) is None  # the folder a trial ran in is not its config
    path.write_text(to_yaml(fast_cfg("scaler.growth_interval=500", "model.hidden_size=48")))
    assert config_diff(path, planned) == ("model.hidden_size", 48, 32)
    assert config_diff(tmp_path / "missing.yaml", planned) is None
