"""What the integrations share, in milliseconds: the options every integration takes
(RunOptions), the lr schedulers a rollback rewinds (SchedulerProgress), and the scaler settings
config.yaml records for a loop ampctl did not build (the configured init_scale, not the scale
the scaler holds now)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from ampctl.amp import LossScaler
from ampctl.amp.scaler import ScalerConfig
from ampctl.integrations import IntegrationError, ProtectedRun
from ampctl.integrations.common import RunOptions, SchedulerProgress
from ampctl.protect.settings import GuardConfig, LoggingConfig
from tests.integrations.conftest import TinyNet


def test_run_options_are_checked_once_and_pass_through_as_keywords():
    opts = RunOptions.given("X", {"guard": {"rollback_after": 2}, "logging": {"plot": False}})
    assert isinstance(opts.guard, GuardConfig) and opts.guard.rollback_after == 2
    assert isinstance(opts.logging, LoggingConfig) and opts.logging.plot is False
    assert RunOptions().guard == GuardConfig() and RunOptions().logging is None
    again = RunOptions.given("Y", opts.keywords(log_every=7))
    assert again.guard is opts.guard and again.logging is opts.logging and again.log_every == 7
    assert RunOptions(fp32_modules=["a", "b"]).fp32_modules == ("a", "b")
    with pytest.raises(TypeError, match=r"^X\(\) got an unexpected keyword argument 'log_evry'$"):
        RunOptions.given("X", {"log_evry": 3})
    with pytest.raises(IntegrationError) as e:
        RunOptions.given("AmpctlCallback", {"overflow_window": None})
    assert str(e.value) == (
        "AmpctlCallback: overflow_window=None is not allowed: overflow_window must be an "
        "integer >= 1"
    )
    with pytest.raises(IntegrationError) as e:  # a field's message names its key, no owner
        RunOptions.given("AmpctlCallback", {"guard": {"skip_budget": 2}})
    assert str(e.value).startswith("guard.skip_budget=2 is not allowed")
    with pytest.raises(IntegrationError, match="^ProtectedRun: max_steps=0 is not allowed"):
        ProtectedRun(TinyNet(), None, run_dir="unused", max_steps=0)


def test_scheduler_progress_restores_every_scheduler_it_lists():
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    a = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    b = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    listed = [a, b]
    progress = SchedulerProgress(lambda: listed)
    saved = progress.state_dict()
    for _ in range(3):
        opt.step()
        a.step()
        b.step()
    assert (a.last_epoch, b.last_epoch) == (3, 3)
    progress.load_state_dict(saved)
    assert (a.last_epoch, b.last_epoch) == (0, 0)
    listed.clear()  # none made yet (a framework builds them later): nothing to save or restore
    assert progress.state_dict() == {"schedulers": []}
    progress.load_state_dict(saved)


def test_the_scaler_gives_its_configured_settings_not_its_state():
    cfg = ScalerConfig(init_scale=1024.0, growth_interval=7, hysteresis=2, max_scale=2.0**20)
    sc = LossScaler(**dataclasses.asdict(cfg))
    assert sc.config() == dataclasses.asdict(cfg)
    state = sc.state_dict()
    state["scale"], state["growth_factor"] = 64.0, 4.0
    sc.init_state(torch.device("cpu"))
    sc.load_state_dict(state)  # a checkpoint's state: its scale and rules
    assert sc.get_scale() == 64.0 and sc.config()["init_scale"] == 1024.0
    assert sc.config()["growth_factor"] == 4.0  # the rules in force
    sc.reconfigure(cfg, was={"init_scale": 1024.0})  # the config's rules, the state's scale
    assert sc.config() == dataclasses.asdict(cfg) and sc.get_scale() == 64.0
    sc.reconfigure(dataclasses.replace(cfg, init_scale=256.0), was={"init_scale": 1024.0})
    assert sc.get_scale() == 256.0 and sc.config()["init_scale"] == 256.0


def test_config_yaml_records_the_configured_init_scale_not_a_restored_scale(tmp_path):
    """A loop that loads its scaler's state before the run starts (Accelerate's load_state into
    a new run folder): config.yaml's scaler.init_scale is the scaler's setting (1024), not the
    scale it holds (64), as ampctl train's config.yaml records scaler.init_scale."""
    sc = LossScaler(init_scale=1024.0, growth_interval=1000)
    state = sc.state_dict()
    state["scale"] = 64.0
    sc.load_state_dict(state)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ProtectedRun(model, opt, sc, run_dir=tmp_path / "r") as run:
        assert run.scaler.get_scale() == 64.0
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["scaler"] == {
        "init_scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 1,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "history_size": 1024,
        "enabled": True,
    }
