"""A sweep's recommendation never rests on a tie decided by speed: trials equal on loss gap and
skipped steps go to the init_scale closest to the S* estimate (the conventional 2^16 without
one), then the growth_interval closest to 2000; fp16 without loss scaling (init_scale=1) is
recommended only when it is strictly best on loss; the report says who tied and which rule
decided."""

from __future__ import annotations

import pytest

from ampctl.commands.sweep import SweepResult, finalize_rows, plan_sweep, tie_info
from ampctl.commands.sweep.rank import recommend, s_star, scale_target, select_promoted
from ampctl.commands.sweep.report import report_lines
from tests.commands.sweep.test_rank import _row
from tests.conftest import FAST


def _trial(init, growth=100, loss=4.0, skipped=0, speed=10.0, amax=None, steps=12):
    name = f"init_scale={init}" + (f",growth_interval={growth}" if growth != 100 else "")
    more = {} if amax is None else {"max_grad_amax": amax, "_amax_rows": 3}
    return _row(
        name,
        loss,
        skipped,
        speed,
        steps=steps,
        init_scale=float(init),
        growth_interval=growth,
        **more,
    )


def _base(loss=4.0, steps=12):
    return {**_trial(1), "trial": "base", "kind": "baseline", "init_scale": None, "steps": steps}


def _rank(rows, target=None):
    groups = {r["trial"]: "base" for r in rows if r["kind"] == "trial"}
    return finalize_rows(rows, 0.1, groups, target=target)


def test_a_three_way_tie_goes_to_the_scale_closest_to_s_star_not_to_the_fastest():
    # the sweep: every trial level with the baseline, init_scale=1 by far the fastest
    rows = [_base(), _trial(1, speed=28.4), _trial(256, speed=20.0), _trial(65536, speed=12.0)]
    assert _rank(rows, target=65536.0)[0] == "init_scale=65536"
    assert _rank(rows, target=512.0)[0] == "init_scale=256"  # 1 power of two from 512
    assert _rank(rows, target=None)[0] == "init_scale=65536"  # no estimate: the default 2^16
    # whatever the target, the unscaled trial is last: it is only as good, not strictly best
    for target in (None, 1.0, 4.0, 65536.0):
        assert _rank(rows, target=target)[-1] == "init_scale=1"
    _rank(rows, target=512.0)
    best = next(r for r in rows if r["rank"] == 1)
    tie = tie_info(rows, best, 512.0)
    assert tie["tied"] == ["init_scale=256", "init_scale=65536"] and tie["rule"] == "s_star"
    assert tie["target"] == 512.0 and tie["unscaled"] == ["init_scale=1"]


def test_unscaled_fp16_wins_only_when_strictly_best_on_loss():
    # fewer skipped steps do not make init_scale=1 best: same gap step, scaled trials first
    rows = [_base(), _trial(1, skipped=0), _trial(65536, skipped=4)]
    assert _rank(rows) == ["init_scale=65536", "init_scale=1"]
    # strictly better loss (a whole 0.1% step): it wins, and nothing tied with it
    rows = [_base(), _trial(1, loss=4.0), _trial(65536, loss=4.01)]  # +0.25%
    assert _rank(rows) == ["init_scale=1", "init_scale=65536"]
    best = next(r for r in rows if r["rank"] == 1)
    assert tie_info(rows, best) == {
        "tied": ["init_scale=1"],
        "rule": None,
        "target": 65536.0,
        "target_source": "default",
        "unscaled": [],
    }


def test_equal_scales_tie_break_on_the_growth_interval_closest_to_2000_then_plan_order():
    rows = [_base(), _trial(1024, 100, speed=50.0), _trial(1024, 1000), _trial(1024, 4000)]
    assert _rank(rows, target=1024.0) == [
        "init_scale=1024,growth_interval=1000",  # 1 power of two from 2000 (4000: also 1)
        "init_scale=1024,growth_interval=4000",
        "init_scale=1024",
    ]
    best = next(r for r in rows if r["rank"] == 1)
    assert tie_info(rows, best, 1024.0)["rule"] == "order"  # 1000 and 4000 are equally close
    rows = [_base(), _trial(1024, 100, speed=50.0), _trial(1024, 1000)]
    _rank(rows, target=1024.0)
    best = next(r for r in rows if r["rank"] == 1)
    assert best["growth_interval"] == 1000
    assert tie_info(rows, best, 1024.0)["rule"] == "default_growth_interval"
    # equally close to S* (2^12 between 2^10 and 2^14): the one closer to 2^16
    rows = [_base(), _trial(1024), _trial(16384)]
    assert _rank(rows, target=4096.0)[0] == "init_scale=16384"
    best = next(r for r in rows if r["rank"] == 1)
    assert tie_info(rows, best, 4096.0)["rule"] == "default_init_scale"


def test_halving_keeps_every_tied_trial_and_cuts_the_unscaled_one():
    rows = [_base(), _trial(1), _trial(256, speed=1.0), _trial(65536), _trial(8, loss=4.1)]
    _rank(rows, target=256.0)
    # one place: 256 and 65536 tie on merit, both continue; the unscaled and the +2.5% stop
    assert select_promoted(rows, 1, 256.0) == ["init_scale=256", "init_scale=65536"]
    assert select_promoted(rows, 1, 65536.0) == ["init_scale=65536", "init_scale=256"]


def _result(tmp_path, rows, grid="scaler.init_scale=1,256,65536"):
    plan = plan_sweep([*FAST, f"trainer.runs_dir={tmp_path}", grid, "scaler.growth_interval=100"])
    groups = {t.name: t.group for t in plan.trials if t.kind == "trial"}
    for r in rows:
        r["steps"] = 12
    finalize_rows(rows, 0.1, groups, top_rung=0)
    target = scale_target(plan, rows)
    ranking = finalize_rows(rows, 0.1, groups, top_rung=0, target=target)
    rec = recommend(plan, rows, ranking, target)
    return SweepResult(plan, rows, ranking, rec, s_star(plan, rows, rec))


def test_the_report_names_the_tie_and_the_rule_and_never_speed(tmp_path):
    base = {**_base(), "trial": "baseline-fp32"}
    # max|g| = 0.25: S* = 262016 -> 2^17 -> halved: 65536, the estimate
    rows = [
        base,
        _trial(1, speed=28.4, amax=0.25),
        _trial(256, speed=20.0, amax=0.25),
        _trial(65536, speed=12.0, amax=0.25),
    ]
    result = _result(tmp_path, rows)
    assert result.s_star["init_scale"] == 65536
    assert result.recommendation["trial"] == "init_scale=65536"
    assert result.recommendation["tie"]["rule"] == "s_star"
    lines = report_lines(result, "ampctl sweep-scale ...")
    assert lines[0] == "Recommended: init_scale=65536 (gap 0.00% vs baseline-fp32, 0 skipped):"
    assert lines[2] == (
        "  Tie: 2 trials are equal on loss (gap in whole 0.1% steps) and skipped steps "
        "(init_scale=65536, init_scale=256); broken by the init_scale closest (in powers of two) "
        "to the data-driven estimate 65536 (2^16) (S*, below), not by steps/s (machine load)"
    )
    assert lines[3] == (
        "  init_scale=1 (fp16 without loss scaling) is as good on loss here, but is recommended "
        "only when strictly best on loss"
    )
    assert not any("steps/s orders" in line for line in lines)


def test_the_report_says_when_the_default_broke_the_tie(tmp_path):
    rows = [{**_base(), "trial": "baseline-fp32"}, _trial(256), _trial(65536)]  # no grad amax
    result = _result(tmp_path, rows, grid="scaler.init_scale=256,65536")
    assert result.s_star is None and result.recommendation["trial"] == "init_scale=65536"
    tie_line = report_lines(result, "")[2]
    assert tie_line.endswith(
        "broken by the init_scale closest (in powers of two) to the conventional default 65536 "
        "(2^16) (no S* estimate: no fp16 gradients were logged), not by steps/s (machine load)"
    )


@pytest.mark.parametrize("gap_loss", [4.0039, 3.5])  # +0.0975% and below the baseline
def test_gaps_within_one_step_tie_and_the_next_step_does_not(gap_loss):
    rows = [_base(), _trial(65536, loss=gap_loss, speed=1.0), _trial(256, speed=99.0)]
    assert _rank(rows, target=65536.0)[0] == "init_scale=65536"
    rows = [_base(), _trial(65536, loss=4.004, speed=1.0), _trial(256, speed=99.0)]  # +0.1%
    assert _rank(rows, target=65536.0)[0] == "init_scale=256"


def test_the_report_makes_one_recommendation_and_offers_an_s_star_outside_the_grid(tmp_path):
    """The issue's sweep: S* suggests 16384, which the grid (1024, 4096, 65536) did not try. The
    report prints one command (the recommended trial's); S* is information, offered as the
    override that adds 16384 to the grid -- never as a second train command."""
    base = {**_base(), "trial": "baseline-fp32"}
    # max|g| = 1.5: S* = 43669 -> 2^15 -> halved: 16384
    rows = [base, _trial(1024, amax=1.5), _trial(4096, amax=1.5), _trial(65536, amax=1.5)]
    rows[1]["final_loss"] = rows[2]["final_loss"] = 4.1  # 65536 is best on loss
    result = _result(tmp_path, rows, grid="scaler.init_scale=1024,4096,65536")
    assert result.recommendation["trial"] == "init_scale=65536"
    assert result.s_star["init_scale"] == 16384 and result.s_star["tried"] is None
    lines = report_lines(result, "")
    commands = [line for line in lines if "ampctl train" in line]
    assert commands == ["  " + result.recommendation["command"]]
    assert lines[0].startswith("Recommended: init_scale=65536 ")
    s_line = next(i for i, line in enumerate(lines) if line.startswith("S* "))
    assert lines[s_line].startswith(
        "S* (information, not a recommendation): 65504/max|g| = 43669.3 (2^15.41), "
        "max|g| = 1.5 over 9 logged fp16 steps of 3 trial(s); rounded down to a power of two and "
        "halved for a 2x margin: init_scale 16384 (2^14)"
    )
    assert lines[s_line + 1] == (
        "  not tried: add it to the grid: scaler.init_scale=1024,4096,16384,65536"
    )
    assert not any("recommended init_scale" in line for line in lines)


def test_an_s_star_the_grid_tried_names_its_trial(tmp_path):
    base = {**_base(), "trial": "baseline-fp32"}
    # max|g| = 0.25: S* -> 65536, the recommended trial itself; 256 is another trial of the grid
    rows = [base, _trial(256, amax=0.25), _trial(65536, amax=0.25)]
    result = _result(tmp_path, rows, grid="scaler.init_scale=256,65536")
    lines = report_lines(result, "")
    assert result.s_star["tried"] == result.recommendation["trial"] == "init_scale=65536"
    assert "  tried: init_scale=65536, the recommended trial" in lines
    assert sum("ampctl train" in line for line in lines) == 1
    # when it is not the recommended one: its rank and status
    rows = [base, _trial(256, amax=0.25), _trial(65536, amax=0.25, loss=4.1)]
    result = _result(tmp_path, rows, grid="scaler.init_scale=256,65536")
    assert result.recommendation["trial"] == "init_scale=256"
    assert "  tried: init_scale=65536 (ranked 2, ok)" in report_lines(result, "")
