"""Planning: override expansion, trial names, baselines, halving rungs, bad input (no process)."""

from __future__ import annotations

import re

import pytest

from ampctl.commands.sweep import parse_sweep, plan_sweep, rung_budgets
from ampctl.config import ConfigError
from tests.conftest import FAST


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


def test_unparsable_and_unsupported_sweeps_are_named():
    with pytest.raises(ConfigError, match=r"^cannot parse override 'scaler.init_scale=\[1,2'"):
        parse_sweep(["scaler.init_scale=[1,2"])
    with pytest.raises(ConfigError, match=r"^scaler.init_scale=interval\(1,2\): this kind"):
        parse_sweep(["scaler.init_scale=interval(1,2)"])
    with pytest.raises(ConfigError, match=r"^scaler.init_scale is swept twice"):
        parse_sweep(["scaler.init_scale=1,2", "+scaler.init_scale=3,4"])


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
    assert plan.budgets == [5] and plan.halving is None
    unique = plan_sweep(
        [*FAST, f"trainer.runs_dir={tmp_path}", "scaler.growth_interval=7"], baseline=False
    )
    assert [t.name for t in unique.trials] == ["trial"]  # nothing swept: one trial
    assert re.fullmatch(r"sweep-\d{8}-\d{6}", unique.name) and not unique.sweep_dir.exists()


def test_rung_budgets_follow_eta_and_end_on_logged_steps():
    assert rung_budgets(300, 9, 3, log_every=10) == [30, 100, 300]  # 33 -> 30: a logged step
    assert rung_budgets(300, 9, None) == [300]
    assert rung_budgets(300, 8, 3, log_every=10) == [100, 300]  # log3(8) < 2: one early rung
    assert rung_budgets(300, 2, 3) == [300]  # too few trials to halve
    assert rung_budgets(8, 4, 2, log_every=4) == [2, 4, 8]  # below log_every: kept as is
    assert rung_budgets(1000, 27, 3, log_every=10) == [30, 110, 330, 1000]
    assert rung_budgets(3, 64, 2) == [1, 3]  # collapsed rungs are dropped, never 0 steps


def test_halving_plan_and_its_bad_input(tmp_path):
    base = [*FAST, f"trainer.runs_dir={tmp_path}", "trainer.log_every=10"]
    plan = plan_sweep(
        [*base, "scaler.init_scale=1,2,3,4,5,6,7,8,9"], steps=300, halving=3, baseline=False
    )
    assert plan.budgets == [30, 100, 300] and plan.top_rung == 2 and plan.total_steps == 300
    with pytest.raises(ConfigError, match=r"^--halving 1: give an integer >= 2"):
        plan_sweep(base, halving=1)
    with pytest.raises(ConfigError, match=r"^trainer.max_steps is swept: with --halving"):
        plan_sweep([*base, "trainer.max_steps=10,20"], halving=2)


def test_every_trial_is_validated_before_anything_runs(tmp_path):
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError) as e:
        plan_sweep([*FAST, f"trainer.runs_dir={runs}", "scaler.init_scale=1024,-1"])
    assert str(e.value) == (
        "scaler.init_scale=-1.0 is not allowed: scaler.init_scale must be a finite number > 0 "
        "(sweep trial init_scale=-1)"
    )
    with pytest.raises(
        ConfigError, match=r"^precision=bf16 \(sweep trial growth_interval=100\): loss scaling"
    ):
        plan_sweep([*FAST, f"trainer.runs_dir={runs}", "precision=bf16"])
    with pytest.raises(ConfigError, match=r"^--name 'a/b': use letters"):
        plan_sweep([*FAST], name="a/b")
    with pytest.raises(ConfigError, match=r"^--steps 0: give an integer >= 1$"):
        plan_sweep([*FAST], steps=0)
    assert not runs.exists()
