"""``guard.*`` and ``logging.*`` (ampctl.protect.settings): every refused value is one exact line
naming the field and what is allowed, every boundary value is accepted, and the rule objects the
protection builds from a GuardConfig carry its values."""

from __future__ import annotations

import math

import pytest

from ampctl.amp.checks import FieldError
from ampctl.amp.fp8 import DemoteRules
from ampctl.amp.guard import DivergenceRules
from ampctl.protect.settings import WANDB_MODES, GuardConfig, LoggingConfig

INF = math.inf
FRACTION = "a fraction in [0, 1]"
BOOL = "true or false"


def _message(owner: str, field: str, value, allowed: str) -> str:
    shown = repr(value) if isinstance(value, str) else str(value)
    return f"{owner}: {field}={shown} is not allowed: {field} must be {allowed}"


@pytest.mark.parametrize(
    "kw, field, value, allowed",
    [
        ({}, "fp8_sat_threshold", -0.01, FRACTION),
        ({}, "fp8_sat_threshold", 1.01, FRACTION),
        ({}, "fp8_sat_threshold", INF, FRACTION),
        ({}, "fp8_under_threshold", -0.01, FRACTION),
        ({}, "fp8_under_threshold", 1.01, FRACTION),
        ({}, "fp8_under_threshold", "0.1", FRACTION),
        ({}, "fp8_patience", 0, "an integer >= 1 (log steps in a row above a threshold)"),
        ({}, "fp8_patience", 2.0, "an integer >= 1 (log steps in a row above a threshold)"),
        ({}, "spike", 1, BOOL),
        ({}, "spike_z", 0, "a number > 0 (standard deviations above the window's mean)"),
        ({}, "spike_z", INF, "a number > 0 (standard deviations above the window's mean)"),
        (
            {"spike_min_steps": None},
            "spike_window",
            1,
            "an integer in [2, 4096] (clean steps; at most scaler.history_size are kept)",
        ),
        (
            {},
            "spike_window",
            4097,
            "an integer in [2, 4096] (clean steps; at most scaler.history_size are kept)",
        ),
        (
            {},
            "spike_window",
            64.0,
            "an integer in [2, 4096] (clean steps; at most scaler.history_size are kept)",
        ),
        ({}, "spike_min_steps", 1, "null or an integer in [2, spike_window=128]"),
        ({}, "spike_min_steps", 129, "null or an integer in [2, spike_window=128]"),
        ({}, "spike_min_steps", 4.0, "null or an integer in [2, spike_window=128]"),
        ({"spike_window": 8}, "spike_min_steps", 9, "null or an integer in [2, spike_window=8]"),
        ({}, "spike_grad_norm", "yes", BOOL),
        ({}, "divergence", 1, BOOL),
        ({}, "rerun", 0, BOOL),
        ({}, "divergence_factor", 1, "a number > 1 (times the lowest log-row loss)"),
        ({}, "divergence_factor", INF, "a number > 1 (times the lowest log-row loss)"),
        ({}, "divergence_patience", 0, "an integer >= 1 (log rows in a row)"),
        ({}, "divergence_patience", 3.0, "an integer >= 1 (log rows in a row)"),
        ({}, "divergence_action", "halt", "one of stop, rollback, warn"),
        (
            {},
            "divergence_lr_cut",
            0,
            "in (0, 1) (the lr multiplier of a rollback for divergence)",
        ),
        (
            {},
            "divergence_lr_cut",
            1,
            "in (0, 1) (the lr multiplier of a rollback for divergence)",
        ),
        (
            {},
            "divergence_lr_cut",
            INF,
            "in (0, 1) (the lr multiplier of a rollback for divergence)",
        ),
        ({}, "skip_batches", -1, "an integer >= 0 (0: no data skipped after a rollback)"),
        ({}, "skip_batches", 1.0, "an integer >= 0 (0: no data skipped after a rollback)"),
        ({}, "attribution_limit", True, "an integer >= 1"),
    ],
)
def test_guard_config_refuses_a_bad_value_in_one_line(kw, field, value, allowed):
    with pytest.raises(FieldError) as e:
        GuardConfig(**{**kw, field: value})
    assert str(e.value) == _message("GuardConfig", field, value, allowed)
    assert (e.value.field, e.value.value) == (field, value)


def test_guard_config_accepts_every_boundary_value():
    cfg = GuardConfig(
        fp8_sat_threshold=0.0,
        fp8_under_threshold=1.0,
        fp8_patience=1,
        spike=False,
        spike_z=1e-9,
        spike_window=2,
        spike_min_steps=2,
        spike_grad_norm=False,
        divergence=False,
        rerun=True,
        divergence_factor=1.0001,
        divergence_patience=1,
        divergence_action="warn",
        divergence_lr_cut=0.999,
        skip_batches=0,
        snapshot_every=0,
    )
    assert (cfg.spike_window, cfg.spike_min_steps, cfg.divergence_lr_cut) == (2, 2, 0.999)
    big = GuardConfig(fp8_sat_threshold=1.0, fp8_under_threshold=0.0, spike_window=4096)
    assert big.spike_min_steps == 32
    assert GuardConfig(spike_window=4096, spike_min_steps=4096).spike_min_steps == 4096
    assert GuardConfig(spike_min_steps=None).spike_min_steps is None
    assert GuardConfig(spike_window=32).spike_min_steps == 32  # equal to the window
    for action in ("stop", "rollback"):
        assert GuardConfig(divergence_action=action).divergence_action == action
    assert GuardConfig(divergence_lr_cut=1e-6, skip_batches=3).skip_batches == 3


def test_guard_config_builds_the_rules_the_protection_applies():
    cfg = GuardConfig(
        divergence_factor=7.5,
        divergence_patience=4,
        divergence_action="rollback",
        divergence_lr_cut=0.25,
        fp8_sat_threshold=0.2,
        fp8_under_threshold=0.05,
        fp8_patience=2,
    )
    assert cfg.divergence_rules == DivergenceRules(factor=7.5, patience=4, action="rollback")
    assert cfg.fp8_rules == DemoteRules(sat_threshold=0.2, under_threshold=0.05, patience=2)
    assert GuardConfig().divergence_rules == DivergenceRules()
    assert GuardConfig().fp8_rules == DemoteRules()


def test_guard_config_defaults():
    c = GuardConfig()
    assert (c.enabled, c.attribution, c.attribution_limit, c.locate_forward, c.promote) == (
        True,
        True,
        5,
        True,
        True,
    )
    assert (c.rollback_backoff, c.snapshot_every, c.fp8_demote) == (0.25, 10, True)
    assert (c.spike, c.spike_z, c.spike_window, c.spike_min_steps, c.spike_grad_norm) == (
        True,
        6.0,
        128,
        32,
        True,
    )
    assert (c.divergence, c.rerun, c.skip_batches) == (True, False, 0)


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("tensorboard", 1, BOOL),
        ("mlflow", "no", BOOL),
        ("wandb", 0, BOOL),
        ("plot", None, BOOL),
        ("act_grads", 1.0, BOOL),
        ("mlflow_uri", "", "null (a store in the run folder) or a tracking URI"),
        ("mlflow_uri", "  ", "null (a store in the run folder) or a tracking URI"),
        ("mlflow_uri", 5, "null (a store in the run folder) or a tracking URI"),
        ("mlflow_experiment", "", "a non-empty name"),
        ("mlflow_experiment", " ", "a non-empty name"),
        ("wandb_project", 3, "a non-empty name"),
        ("wandb_project", "", "a non-empty name"),
        ("wandb_mode", "dryrun", "offline or online"),
        ("act_grad_layers", -1, "an integer >= 0 (0: every leaf module on every log step)"),
        ("act_grad_layers", 2.0, "an integer >= 0 (0: every leaf module on every log step)"),
        ("act_grad_layers", True, "an integer >= 0 (0: every leaf module on every log step)"),
    ],
)
def test_logging_config_refuses_a_bad_value_in_one_line(field, value, allowed):
    with pytest.raises(FieldError) as e:
        LoggingConfig(**{field: value})
    assert str(e.value) == _message("LoggingConfig", field, value, allowed)


def test_logging_config_accepts_its_boundaries():
    c = LoggingConfig(
        tensorboard=True,
        mlflow=True,
        wandb=True,
        plot=False,
        act_grads=False,
        mlflow_uri="sqlite:///x.db",
        mlflow_experiment="e",
        wandb_project="p",
        wandb_mode="online",
        act_grad_layers=0,
    )
    assert (c.mlflow_uri, c.wandb_mode, c.act_grad_layers) == ("sqlite:///x.db", "online", 0)
    d = LoggingConfig()
    assert (d.mlflow_uri, d.wandb_mode, d.act_grad_layers, d.plot, d.act_grads) == (
        None,
        "offline",
        8,
        True,
        True,
    )
    assert WANDB_MODES == ("offline", "online")
