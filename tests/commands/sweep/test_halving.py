"""``--halving``: successive halving with real trial processes (2 trials + baseline, ETA 2,
8 steps logged every 2: rungs of 4 and 8 steps, 5 processes)."""

from __future__ import annotations

import json
import math

from tests.commands.sweep.conftest import STEPS, run_sweep_here
from tests.conftest import read_jsonl

ARGS = ("trainer.log_every=2", "scaler.init_scale=1024,16777216", "scaler.growth_interval=2")


def test_halving_promotes_the_best_and_resumes_it_from_its_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    sdir = runs / "h"
    first_rows: dict[str, str] = {}  # metrics.jsonl of each run as its first process left it
    rung0: dict[str, dict] = {}

    def on_result(row):
        if row["rung"] == 0:
            rung0[row["trial"]] = dict(row)
            first_rows[row["trial"]] = (sdir / row["trial"] / "metrics.jsonl").read_text()

    result, out = run_sweep_here(runs, *ARGS, jobs=2, halving=2, name="h", on_result=on_result)
    plan = result.plan
    assert plan.budgets == [4, STEPS]
    assert "successive halving (ETA 2): rungs of 4, 8 steps" in out.splitlines()[0]
    doc = json.loads((sdir / "results.json").read_text())
    rows = {r["trial"]: r for r in doc["trials"]}
    big, small = "init_scale=16777216", "init_scale=1024"

    # 1) the promoted set: the best 1/ETA of rung 0 by the ranking's merit (gap step, skipped)
    def key(r):
        return (math.floor(max(r["loss_gap"], 0) / 1e-3 + 1e-6), r["skipped"])

    best = min((r for r in rung0.values() if r["kind"] == "trial"), key=key)["trial"]
    assert doc["rungs"] == [{"rung": 0, "steps": 4, "trials": 2, "promoted": [best]}]
    assert best == small  # 2^24 skips its first steps (and rolls back): it lags at step 4
    assert rung0[big]["skipped"] > 0 and rung0[small]["skipped"] == 0
    assert f"Rung 0 (4 steps) done: 1 of 2 continue to rung 1 (8 steps): {small}" in out

    # 2) statuses, rungs and the steps each trial spent
    assert (rows[small]["status"], rows[small]["rung"], rows[small]["steps_spent"]) == ("ok", 1, 8)
    assert (rows[big]["status"], rows[big]["rung"], rows[big]["steps_spent"]) == ("stopped", 0, 4)
    assert rows[big]["reason"] == "not promoted after rung 0 (4 steps)" and rows[big]["rank"] == 2
    base = rows["baseline-fp32"]
    assert (base["status"], base["steps_spent"], base["steps"]) == ("ok", 8, 8)
    assert doc["trial_steps"] == 2 * 4 + 1 * 4 == 12 and doc["full_grid_trial_steps"] == 16
    assert doc["baseline_steps"] == 8
    assert doc["recommendation"]["trial"] == small and result.exit_code == 0
    # the stopped trial is compared with the baseline at its own step, not at the end
    b_rows = {m["step"]: m["loss"] for m in read_jsonl(sdir / "baseline-fp32" / "metrics.jsonl")}
    assert rows[big]["reference_loss"] == b_rows[4] and rows[small]["reference_loss"] == b_rows[8]
    assert "Successive halving (--halving 2, rungs of 4, 8 steps): 12 trial steps (75% of" in out

    # 3) resumed, not restarted: the rows up to the rung boundary are the first process's bytes
    #    (elapsed_s / tokens_per_s differ between two runs of the same step), then steps 6 and 8
    for name in (small, "baseline-fp32"):
        text = (sdir / name / "metrics.jsonl").read_text()
        assert text.startswith(first_rows[name])
        later = [json.loads(line) for line in text[len(first_rows[name]) :].splitlines()]
        assert [m["step"] for m in later] == [6, 8]
        rec = json.loads((sdir / name / "sweep_trial.json").read_text())
        assert [p["target"] for p in rec["pieces"]] == [4, 8]
        assert rec["pieces"][1]["resumed_from_step"] == 4
        # the first rung stops at 4 with the full run's lr horizon (max_steps 8); the last one
        # resumes and runs to the end
        assert "trainer.stop_at=4" in rec["pieces"][0]["command"]
        assert all(m["max_steps"] == 8 for m in read_jsonl(sdir / name / "metrics.jsonl"))
        assert (
            f"--resume {sdir.resolve() / name} trainer.stop_at=null" in rec["pieces"][1]["command"]
        )
        ckpts = sorted(p.name for p in (sdir / name / "checkpoints").glob("step_*.pt"))
        assert "step_00000004.pt" in ckpts and "step_00000008.pt" in ckpts
    assert [m["step"] for m in read_jsonl(sdir / big / "metrics.jsonl")][-1] == 4

    # 4) a resumed sweep reads every rung back from the folders and runs nothing
    again, out = run_sweep_here(runs, *ARGS, halving=2, name="h")
    assert again.launched == [] and again.rungs == result.rungs
    assert [(r["trial"], r["status"], r["rung"]) for r in again.rows] == [
        (r["trial"], r["status"], r["rung"]) for r in result.rows
    ]
    assert again.recommendation == result.recommendation
