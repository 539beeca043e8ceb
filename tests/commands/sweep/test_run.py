"""``ampctl sweep-scale`` with the local launcher: real ``python -m ampctl train`` processes on the
tiny FAST model. Process start-up dominates, so the trials are few: one 2 x 2 grid plus baseline
(module fixture, shared by the results and resume tests), a --jobs 1 sweep stopped by Ctrl-C
after its first trial (compared with the grid's --jobs 2 run of the same settings), and an
ok / far-above pair for the live divergence stop.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
from typer.testing import CliRunner

from ampctl.amp.formats import ideal_scale, recommended_init_scale
from ampctl.cli import app
from ampctl.commands.sweep import COLUMNS, sweep
from ampctl.config import ConfigError
from tests.commands.sweep.conftest import NO_PLOT, PLANTED, STEPS, run_sweep_here
from tests.conftest import FAST, read_jsonl

GRID = ("scaler.init_scale=1024,65536", "scaler.growth_interval=2,1000")


def _by_setting(rows: list[dict]) -> dict[tuple[float, int], dict]:
    return {(r["init_scale"], r["growth_interval"]): r for r in rows if r["kind"] == "trial"}


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    runs = tmp_path_factory.mktemp("grid") / "runs"
    result, out = run_sweep_here(runs, *GRID, jobs=2, name="g")
    return runs, result, out


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
    assert doc["halving"] is None and doc["rung_steps"] == [STEPS] and doc["launcher"] == "local"
    assert doc["trial_steps"] == doc["full_grid_trial_steps"] == 4 * STEPS
    assert result.exit_code == 0 and result.launched and not result.reused

    base = doc["trials"][0]
    assert base["kind"] == "baseline" and base["precision"] == "fp32"
    assert base["init_scale"] is None and base["loss_gap"] is None and base["rank"] is None
    for r in doc["trials"][1:]:
        tdir = sdir / r["trial"]
        summary = json.loads((tdir / "summary.json").read_text())
        rows = read_jsonl(tdir / "metrics.jsonl")
        events = read_jsonl(tdir / "events.jsonl") if (tdir / "events.jsonl").exists() else []
        overflows = [e["step"] for e in events if e["kind"] == "overflow"]
        cfg_yaml = (tdir / "config.yaml").read_text()
        assert f"max_steps: {STEPS}" in cfg_yaml and f"runs_dir: {sdir.resolve()}" in cfg_yaml
        assert r["precision"] == "fp16" and r["steps"] == r["steps_spent"] == STEPS
        assert r["rung"] == 0
        assert r["final_loss"] == summary["final_loss"] == rows[-1]["loss"]
        assert r["skipped"] == summary["skipped"] == len(overflows)
        assert r["overflow_rate"] == pytest.approx(summary["overflow_rate"])
        assert r["first_overflow_step"] == (overflows[0] if overflows else None)
        assert r["steps_per_s"] == pytest.approx(STEPS / rows[-1]["elapsed_s"])
        assert r["reference"] == "baseline-fp32" and r["reference_loss"] == base["final_loss"]
        assert r["loss_gap"] == (r["final_loss"] - base["final_loss"]) / abs(base["final_loss"])
        if r["skipped"] == 0:  # clean run: the scale doubled every growth_interval steps
            assert r["final_scale"] == r["init_scale"] * 2 ** (STEPS // r["growth_interval"])
    # the ranking follows (gap in whole 0.1% steps, unscaled, skipped), then the tie break
    # towards the S* estimate's init_scale, then growth_interval 2000 -- never steps/s
    ranked = sorted(doc["trials"][1:], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranked] == [1, 2, 3, 4]
    assert doc["ranking"] == [r["trial"] for r in ranked]
    target = doc["s_star"]["init_scale"]
    keys = [
        (
            math.floor(max(r["loss_gap"], 0) / 1e-3 + 1e-6),
            r["skipped"],
            abs(math.log2(r["init_scale"] / target)),
            abs(math.log2(r["init_scale"] / 65536)),
            abs(math.log2(r["growth_interval"] / 2000)),
        )
        for r in ranked
    ]
    assert keys == sorted(keys)
    tie = doc["recommendation"]["tie"]
    assert tie["tied"][0] == ranked[0]["trial"] and tie["target"] == target
    assert (len(tie["tied"]) > 1) == (f"  Tie: {len(tie['tied'])} trials are equal" in out)
    best = ranked[0]
    cmd = f"scaler.init_scale={int(best['init_scale'])} scaler.growth_interval={best['growth_interval']}"
    assert doc["recommendation"]["command"].startswith("ampctl train trainer.max_steps=12 ")
    assert doc["recommendation"]["command"].endswith(cmd)
    assert "scaler.init_scale=1024 " not in doc["recommendation"]["command"].replace(cmd, "")
    assert f"Recommended: {best['trial']} " in out and "  ampctl train " in out
    # S* from the gradients the fp16 trials logged, and the init_scale diagnose would recommend
    amax = max(
        m["grad_amax"]
        for r in doc["trials"][1:]
        for m in read_jsonl(sdir / r["trial"] / "metrics.jsonl")
        if math.isfinite(m["grad_amax"])
    )
    s = doc["s_star"]
    assert s["max_grad_amax"] == amax and s["value"] == ideal_scale(amax) == 65504 / amax
    assert s["init_scale"] == recommended_init_scale(amax)
    # one recommendation: S* is information, with no command of its own; an init_scale the
    # grid did not try is offered as the override that adds it to the grid
    assert "command" not in s and out.count("  ampctl train ") == 1
    assert f"S* (information, not a recommendation): 65504/max|g| = {s['value']:.6g} " in out
    init = int(s["init_scale"])
    if init in (1024, 65536):
        assert s["tried"] and s["grid_override"] is None and f"  tried: {s['tried']}" in out
    else:
        values = ",".join(str(v) for v in sorted({1024, 65536, init}))
        assert s["tried"] is None and s["grid_override"] == f"scaler.init_scale={values}"
        assert f"  not tried: add it to the grid: scaler.init_scale={values}\n" in out
    # each trial folder keeps the logs and what the sweep ran
    rec = json.loads((sdir / best["trial"] / "sweep_trial.json").read_text())
    assert rec["exit_code"] == 0 and rec["pieces"][0]["launcher"] == "local"
    assert rec["command"].startswith("python -m ampctl train ") and "--name" in rec["command"]
    assert (sdir / best["trial"] / "stderr.log").is_file()


def test_resume_runs_nothing_again_and_reruns_a_trial_without_summary(grid):
    runs, first, _ = grid
    sdir = runs / "g"
    names = [r["trial"] for r in first.rows]
    stamps = {n: (sdir / n / "summary.json").stat().st_mtime_ns for n in names}

    again, out = run_sweep_here(runs, *GRID, jobs=2, name="g")
    assert again.launched == [] and sorted(again.reused) == sorted(names)
    assert "Resumed: 5 trial(s) found done, 0 continued from their checkpoint" in out
    assert {n: (sdir / n / "summary.json").stat().st_mtime_ns for n in names} == stamps
    assert [r["final_loss"] for r in again.rows] == [r["final_loss"] for r in first.rows]
    assert again.ranking == first.ranking

    victim = "init_scale=1024,growth_interval=2"
    old = json.loads((sdir / victim / "summary.json").read_text())
    (sdir / victim / "summary.json").unlink()  # as if killed after its last checkpoint
    third, out = run_sweep_here(runs, *GRID, jobs=1, name="g")
    # continued from its checkpoint (tests/faults/test_sweep_kill.py: killed part way)
    assert third.launched == third.resumed == [victim] and third.moved_aside == []
    new = json.loads((sdir / victim / "summary.json").read_text())
    assert (new["final_loss"], new["skipped"]) == (old["final_loss"], old["skipped"])  # -j1 == 2
    assert all(
        (sdir / n / "summary.json").stat().st_mtime_ns == stamps[n] for n in names if n != victim
    )


def test_jobs_1_matches_jobs_2_and_ctrl_c_stops_launching(grid, tmp_path):
    _, grid_result, _ = grid
    runs = tmp_path / "runs"

    def ctrl_c_after_first(row):
        raise KeyboardInterrupt

    args = ("scaler.init_scale=65536,1024", "scaler.growth_interval=2")
    part, out = run_sweep_here(
        runs, *args, jobs=1, baseline=False, name="j1", on_result=ctrl_c_after_first
    )
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
    keys = ("final_loss", "skipped", "final_scale", "first_overflow_step")
    assert [r[k] for k in keys] == [twin[k] for k in keys]


def test_a_trial_far_above_the_others_is_stopped_at_once(tmp_path, hold_file):
    """The ``far`` trial reports 10x the loss and cannot finish while the hold file exists: only
    the sweep's live check ends it, at a logged step, with a checkpoint written."""
    runs = tmp_path / "runs"
    result, out = run_sweep_here(
        runs,
        PLANTED,
        f"+model.hold_file={hold_file}",
        "+model.role=ok,far",
        jobs=2,
        steps=12,
        baseline=False,
        name="far",
    )
    rows = {r["trial"]: r for r in result.rows}
    far, ok = rows["role=far"], rows["role=ok"]
    assert ok["status"] == "ok" and ok["rank"] == 1 and result.ranking == ["role=ok"]
    assert far["status"] == "diverged" and far["rank"] is None
    assert far["reason"].startswith("stopped at step 4: loss ")
    assert "vs the best other trial" in far["reason"] and "threshold +50%" in far["reason"]
    assert far["steps_spent"] < 12  # it did not run to the end
    tdir = runs / "far" / "role=far"
    assert json.loads((tdir / "summary.json").read_text())["status"] == "interrupted"
    assert list((tdir / "checkpoints").glob("step_*.pt"))  # stopped cleanly: it can be diagnosed
    rec = json.loads((tdir / "sweep_trial.json").read_text())
    assert rec["stopped_by_sweep"] is True and rec["status"] == "diverged"
    assert f"role=far: {far['reason']}" in out
    # a resumed sweep keeps the verdict and does not run the stopped trial again
    hold_file.unlink()
    again, _ = run_sweep_here(
        runs,
        PLANTED,
        f"+model.hold_file={hold_file}",
        "+model.role=ok,far",
        steps=12,
        baseline=False,
        name="far",
    )
    assert again.launched == [] and {r["trial"]: r["status"] for r in again.rows} == {
        "role=ok": "ok",
        "role=far": "diverged",
    }


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


@pytest.mark.parametrize(
    "args, line",
    [
        (["--halving", "1"], "--halving 1: must be an integer >= 2"),
        (["--launcher", "k8s"], "--launcher 'k8s': use one of local, ray, slurm"),
        (["--address", "h:6379"], "--address applies to --launcher ray, not --launcher local"),
        (["--launcher", "ray", "--partition", "gpu"], "--partition applies to --launcher slurm"),
        (
            ["--gpus-per-trial", "1"],
            "--gpus-per-trial applies to --launcher ray or --launcher slurm",
        ),
        (
            ["--launcher", "slurm", "--slurm-param", "account"],
            "--slurm-param 'account': give KEY=VALUE with an sbatch option name",
        ),
        (["--launcher", "slurm", "--time", "1h"], "--time '1h': use minutes, HH:MM:SS"),
        (["--launcher", "ray", "--cpus-per-trial", "0"], "--cpus-per-trial 0: give an integer"),
    ],
)
def test_bad_launcher_options_exit_2_with_one_line(tmp_path, args, line):
    res = CliRunner().invoke(
        app, ["sweep-scale", *FAST, f"trainer.runs_dir={tmp_path / 'runs'}", *args]
    )
    assert res.exit_code == 2, res.output
    assert res.stderr.startswith("ampctl: error: " + line) and res.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_resume_with_other_settings_is_refused(grid):
    runs, _, _ = grid
    with pytest.raises(ConfigError) as e:
        sweep(
            [*FAST, f"trainer.runs_dir={runs}", NO_PLOT, *GRID],
            steps=STEPS + 1,
            name="g",
            mode="quiet",
        )
    assert str(e.value).startswith("--name g: trial baseline-fp32 in ") and str(e.value).endswith(
        "was run with trainer.max_steps=8, this sweep gives trainer.max_steps=9; re-run it with the "
        "same overrides and --steps, or pick another --name"
    )
    with pytest.raises(ConfigError, match=r"^--name g: this sweep was run with no --halving; give"):
        sweep([*FAST, f"trainer.runs_dir={runs}", NO_PLOT, *GRID], steps=STEPS, name="g", halving=2)
    with pytest.raises(ConfigError, match=r"^--jobs 0: give an integer >= 1$"):
        sweep([*FAST], jobs=0, mode="quiet")
