"""Pure results logic: gaps, divergence, ranking (whole 0.1% gap steps), promotion, the live
divergence rule, the recommended scale."""

from __future__ import annotations

import math

import pytest

from ampctl.amp.formats import recommended_init_scale
from ampctl.commands.sweep import (
    finalize_rows,
    live_divergence,
    plan_sweep,
    rank_key,
    threads_per_trial,
)
from ampctl.commands.sweep.rank import recommend, s_star, select_promoted
from tests.conftest import FAST


def _row(name, loss, skipped=0, speed=10.0, kind="trial", status="ok", rung=0, steps=8, **more):
    return {
        **more,
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
        "rung": rung,
        "steps": steps,
    }


def test_finalize_rows_gaps_divergence_and_ranking():
    rows = [
        _row("base", 2.0, kind="baseline"),
        _row("a", 2.0009, skipped=5),  # +0.045%: same 0.1% step as a loss below the baseline
        _row("b", 1.9, skipped=1, speed=5.0),
        _row("c", 1.95, skipped=1, speed=9.0),
        _row("d", 2.1),  # +5%
        _row("e", 2.3),  # +15%: diverged
        _row("f", float("nan"), status="diverged"),
    ]
    groups = {r["trial"]: "base" for r in rows if r["kind"] == "trial"}
    ranking = finalize_rows(rows, 0.10, groups)
    by = {r["trial"]: r for r in rows}
    # b and c tie (both below the baseline, 1 skip): the faster c does not jump ahead of b
    assert ranking == ["b", "c", "a", "d"]
    assert [by[n]["rank"] for n in ranking] == [1, 2, 3, 4]
    assert by["d"]["loss_gap"] == pytest.approx(0.05) and by["d"]["reference"] == "base"
    assert by["e"]["status"] == "diverged" and by["e"]["rank"] is None
    assert by["e"]["reason"] == "final loss +15.0% vs base (threshold +10%)"
    assert by["f"]["loss_gap"] is None and by["base"]["rank"] is None
    # a second pass (the sweep refreshes after every trial) gives the same rows
    before = [dict(r) for r in rows]
    assert finalize_rows(rows, 0.10, groups) == ranking and rows == before
    # without a usable baseline the best trial of the group is the reference
    rows2 = [
        _row("base", float("nan"), kind="baseline", status="diverged"),
        _row("x", 4.0),
        _row("y", 5.0),
    ]
    assert finalize_rows(rows2, 0.10, {"x": "base", "y": "base"}) == ["x"]
    assert rows2[1]["reference"] == "best trial (x)" and rows2[2]["loss_gap"] == 0.25
    assert rows2[2]["status"] == "diverged"


def test_gaps_are_compared_in_whole_steps_of_0_1_percent():
    # truncated, not rounded: +0.09% ties with the reference, +0.10% is one step worse
    assert rank_key({"loss_gap": 0.0009, "skipped": 0})[0] == 0
    assert rank_key({"loss_gap": 0.001, "skipped": 0})[0] == 1
    assert rank_key({"loss_gap": 0.002, "skipped": 0})[0] == 2  # float noise does not drop it
    assert rank_key({"loss_gap": 0.0199, "skipped": 0})[0] == 19
    assert rank_key({"loss_gap": -0.3, "skipped": 0})[0] == 0  # below the reference: on track
    rows = [
        _row("base", 2.0, kind="baseline"),
        _row("lag", 2.0018, skipped=0),  # +0.09%: ties with the baseline on the gap
        _row("skips", 2.0, skipped=3),
    ]
    assert finalize_rows(rows, 0.1, {"lag": "base", "skips": "base"}) == ["lag", "skips"]


def test_halving_rows_rank_by_rung_and_use_the_reference_at_their_step():
    rows = [
        _row("base", 3.0, kind="baseline", rung=1, steps=100),
        _row("full", 3.05, rung=1, steps=100),  # +1.7%
        _row("early", 4.0, status="stopped", rung=0, steps=30),  # +0% vs base at step 30
        _row("lagging", 6.5, status="stopped", rung=0, steps=30),  # +62.5%: far above
    ]
    groups = {r["trial"]: "base" for r in rows[1:]}
    refs = {"base": {30: 4.0, 100: 3.0}}
    ranking = finalize_rows(rows, 0.01, groups, references=refs, stop_gap=0.5, top_rung=1)
    by = {r["trial"]: r for r in rows}
    assert by["early"]["reference_loss"] == 4.0 and by["early"]["loss_gap"] == 0.0
    # the last rung uses diverge_gap (1% here), the earlier rungs stop_gap (50%)
    assert by["full"]["status"] == "diverged" and "threshold +1%" in by["full"]["reason"]
    assert by["lagging"]["status"] == "diverged"
    assert by["lagging"]["reason"] == (
        "loss at step 30 +62.5% vs base (threshold +50% before the last rung)"
    )
    assert ranking == ["early"]
    rows[1]["final_loss"] = 3.01  # +0.3%: now ok, and ranked above every lower rung
    assert finalize_rows(rows, 0.01, groups, references=refs, stop_gap=0.5, top_rung=1) == [
        "full",
        "early",
    ]
    assert select_promoted([rows[1], rows[2]], 1) == ["full"]  # only ok rows are promoted


def test_promotion_keeps_ties_at_the_cut_instead_of_asking_the_clock():
    rows = [
        _row("base", 4.0, kind="baseline"),
        _row("a", 4.0, skipped=0, speed=9.0),
        _row("b", 4.0, skipped=0, speed=5.0),  # ties with a: only speed differs
        _row("c", 4.0, skipped=3, speed=12.0),
        _row("d", 4.2, skipped=0, speed=20.0),  # +5%: a worse gap step
    ]
    groups = {r["trial"]: "base" for r in rows[1:]}
    finalize_rows(rows, 0.1, groups)
    assert select_promoted(rows, 1) == ["a", "b"]
    assert select_promoted(rows, 2) == ["a", "b"]
    assert select_promoted(rows, 3) == ["a", "b", "c"]
    assert select_promoted(rows, 0) == []


def test_live_divergence_stops_non_finite_and_far_above_only():
    assert live_divergence(4, 4.1, 4.0, "baseline-fp32") is None
    assert live_divergence(4, 5.9, 4.0, "baseline-fp32") is None  # +47.5%: a lagging trial
    assert live_divergence(4, 6.1, 4.0, "baseline-fp32") == (
        "stopped at step 4: loss 6.1 is +52% vs baseline-fp32 (4; threshold +50%)"
    )
    assert live_divergence(8, "nan", None, "x") == "stopped at step 8: loss nan"
    assert live_divergence(8, float("inf"), 4.0, "x") == "stopped at step 8: loss inf"
    assert live_divergence(8, 1e9, None, "x") is None  # no reference yet: wait for it
    assert live_divergence(4, 4.5, 4.0, "b", stop_gap=0.1) is not None


def test_recommended_scale_is_the_one_diagnose_uses(tmp_path):
    plan = plan_sweep(
        [*FAST, f"trainer.runs_dir={tmp_path}", "scaler.init_scale=1024,65536"], baseline=False
    )
    rows = [
        dict(_row("init_scale=1024", 4.0, rung=0, steps=12), max_grad_amax=0.5, _amax_rows=3),
        dict(_row("init_scale=65536", 4.1, rung=0, steps=12), max_grad_amax=2.0, _amax_rows=3),
    ]
    ranking = finalize_rows(rows, 0.1, {}, top_rung=0)
    rec = recommend(plan, rows, ranking)
    assert rec["trial"] == "init_scale=1024"
    assert rec["command"].endswith("scaler.init_scale=1024 scaler.growth_interval=100")
    s = s_star(plan, rows, rec)
    assert s["value"] == 65504 / 2.0  # S* itself is the estimate
    assert s["exponent"] == round(math.log2(65504 / 2.0), 2)
    assert s["init_scale"] == recommended_init_scale(2.0) == 8192  # 32752 -> 2^14, halved
    assert s["rows"] == 6 and "command" not in s  # information, not a second recommendation
    # 8192 is not in the grid: offered as the override that adds it, not as a train command
    assert s["tried"] is None and s["grid_override"] == "scaler.init_scale=1024,8192,65536"
    # a grid that has it: the trial that tried it, no override
    plan2 = plan_sweep(
        [*FAST, f"trainer.runs_dir={tmp_path}", "scaler.init_scale=8192,1024"], baseline=False
    )
    rows2 = [
        dict(_row("init_scale=8192", 4.1, rung=0, steps=12), max_grad_amax=2.0, _amax_rows=3),
        dict(_row("init_scale=1024", 4.0, rung=0, steps=12), max_grad_amax=0.5, _amax_rows=3),
    ]
    rec2 = recommend(plan2, rows2, finalize_rows(rows2, 0.1, {}, top_rung=0))
    s2 = s_star(plan2, rows2, rec2)
    assert rec2["trial"] == "init_scale=1024"
    assert (s2["tried"], s2["tried_rank"], s2["grid_override"]) == ("init_scale=8192", 2, None)
    # a trial that stopped at an early rung is ranked, but only a full-length one is recommended
    rows[0]["status"] = rows[0]["_base_status"] = "stopped"
    rows[1]["status"] = rows[1]["_base_status"] = "stopped"
    assert recommend(plan, rows, finalize_rows(rows, 0.1, {}, top_rung=1)) is None


def test_threads_per_trial_keeps_jobs_times_threads_within_cores():
    assert threads_per_trial(1, 8, env={}) == 8
    assert threads_per_trial(2, 8, env={}) == 4
    assert threads_per_trial(3, 8, env={}) == 2
    assert threads_per_trial(4, 2, env={}) == 1
    assert threads_per_trial(1, 8, env={"OMP_NUM_THREADS": "1"}) == 1  # a set limit stays
