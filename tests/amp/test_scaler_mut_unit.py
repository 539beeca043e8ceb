"""LossScaler's corners that the mutation run found untested (issue 31): the bounds with one of
them off, the slow rule (hysteresis > 1) on every kind of skip, lowering the growth interval with
and without a device state, the state's dtypes whatever torch's default dtype, the fresh
found-inf flag, several per-device flags handed to an AMP-aware optimizer, a disabled scaler's
scale after an update, the fold's cadence and the clamp's cost -- a 2-parameter model,
milliseconds each."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampctl.amp.scaler as scaler_module
from ampctl.amp import records as rec
from ampctl.amp.scaler import CallOrderError, LossScaler
from ampctl.opcount import count_ops

INF, NAN = math.inf, math.nan


class Run:
    """A scaler over a 2-parameter model with planted losses and gradients."""

    def __init__(self, **kw) -> None:
        torch.manual_seed(0)
        self.s = LossScaler(**{"init_scale": 64.0, **kw})
        self.model = nn.Linear(1, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def until_update(self) -> None:
        """``scale``, gradients of ones, ``step``: the iteration up to its ``update()``."""
        self.s.scale(torch.tensor(1.0))
        for p in self.model.parameters():
            p.grad = torch.ones_like(p)
        self.s.step(self.opt)

    def step(self, grad: float = 1.0, loss: float = 1.0, norm: float | None = None) -> None:
        """One iteration: ``scale(loss)``, then gradients set to ``grad`` (times the scale, as
        a backward pass would leave them), ``unscale_``, an optional norm, ``step``, ``update``."""
        self.s.scale(torch.tensor(loss, requires_grad=True))
        sc = self.s.get_scale() if self.s.is_enabled() else 1.0
        for p in self.model.parameters():
            p.grad = torch.full_like(p, grad * sc)
        self.s.unscale_(self.opt)
        if norm is not None:
            self.s.report_grad_norm(torch.tensor(norm))
        self.s.step(self.opt)
        self.s.update()

    def trackers(self) -> tuple[float, int, int]:
        sd = self.s.state_dict()
        return sd["scale"], sd["_growth_tracker"], sd["_hysteresis_tracker"]


# ------------------------------------------------------------------ bounds (hysteresis=1)
def test_a_ceiling_alone_clamps_the_grown_scale():
    r = Run(init_scale=4.0, growth_interval=1, min_scale=0.0, max_scale=4.0)
    r.step()
    assert r.s.get_scale() == 4.0


def test_a_floor_of_one_alone_holds_the_scale_after_a_back_off():
    r = Run(init_scale=1.0, min_scale=1.0, max_scale=INF)
    r.step(grad=INF)
    assert r.s.skipped_steps == 1 and r.s.get_scale() == 1.0


def test_a_scaler_without_bounds_spends_no_clamp_on_the_update():
    r = Run(min_scale=0.0, max_scale=INF)
    r.until_update()
    with count_ops() as c:
        r.s.update()
    assert c.by_op["clamp"] + c.by_op["clamp_"] == 0
    r.s.set_bounds(1.0, INF)  # with a bound: exactly one clamp
    r.step()
    r.until_update()
    with count_ops() as c:
        r.s.update()
    assert c.by_op["clamp"] + c.by_op["clamp_"] == 1


# ------------------------------------------------------------------ the slow rule (hysteresis 2)
def test_the_slow_rule_keeps_both_bounds():
    r = Run(init_scale=1.0, hysteresis=2, growth_interval=1, min_scale=1.0, max_scale=2.0)
    r.step(grad=INF)
    r.step(grad=INF)  # hysteresis spent: backs off, to the floor
    assert r.trackers() == (1.0, 0, 0)
    r.step()
    r.step()  # grows twice, to the ceiling
    assert r.trackers() == (2.0, 0, 2)


def test_without_the_loss_check_a_skip_with_a_nan_loss_spends_hysteresis():
    r = Run(hysteresis=2, check_loss=False)
    r.step(grad=NAN, loss=NAN)
    assert r.trackers() == (64.0, 0, 1)
    r.step(grad=NAN, loss=NAN)
    assert r.trackers() == (32.0, 0, 0)
    assert r.s.forward_overflows == 0 and r.s.skipped_steps == 2


def test_with_the_loss_check_a_skip_with_a_nan_loss_moves_nothing():
    r = Run(hysteresis=2)
    r.step(grad=NAN, loss=NAN)
    assert r.trackers() == (64.0, 0, 2) and r.s.forward_overflows == 1


def test_a_loss_spike_alone_is_skipped_without_spending_hysteresis():
    r = Run(hysteresis=2)
    r.s.set_spike_thresholds(loss=10.0)
    r.step(loss=11.0)
    r.step(loss=11.0)
    assert r.trackers() == (64.0, 0, 2) and r.s.stats()["spikes"] == 2


def test_a_norm_spike_alone_is_skipped_without_spending_hysteresis():
    r = Run(hysteresis=2)
    r.s.set_spike_thresholds(grad_norm=10.0)
    r.step(norm=11.0)
    assert r.trackers() == (64.0, 0, 2) and r.s.stats()["spikes"] == 1


@pytest.mark.parametrize("at", ["loss", "norm"])
def test_an_overflow_at_exactly_the_threshold_is_a_gradient_overflow(at):
    r = Run(hysteresis=2)
    r.s.set_spike_thresholds(**({"loss": 5.0} if at == "loss" else {"grad_norm": 5.0}))
    r.step(grad=INF, loss=5.0, norm=5.0 if at == "norm" else None)
    assert r.trackers() == (64.0, 0, 1)  # one unit of hysteresis spent
    assert r.s.state_dict()["history"][-1, 2].item() == rec.GRADIENT


def test_a_step_that_was_not_skipped_counts_as_clean_whatever_its_loss():
    # a loss that is not finite but finite gradients: the step was applied, so it is clean
    r = Run(hysteresis=2, growth_interval=1)
    r.step(loss=NAN)
    assert r.trackers() == (128.0, 0, 2) and r.s.skipped_steps == 0


def test_a_reported_norm_costs_no_op_without_a_norm_threshold():
    r = Run()
    r.s.scale(torch.tensor(1.0))
    for p in r.model.parameters():
        p.grad = torch.ones_like(p)
    r.s.unscale_(r.opt)
    norm = torch.tensor(3.0)
    with count_ops() as c:
        r.s.report_grad_norm(norm)  # recorded only: no veto to compute
    assert c.total == 0
    r.s.set_spike_thresholds(grad_norm=10.0)
    with count_ops() as c:
        r.s.report_grad_norm(norm)  # the veto: two ops
    assert c.total == 2


# ------------------------------------------------------------------ set_growth_interval
def test_lowering_the_interval_clamps_the_live_tracker_and_grows_next():
    r = Run(growth_interval=10)
    for _ in range(5):
        r.step()
    assert r.s._growth_tracker.item() == 5
    r.s.set_growth_interval(3)
    assert r.s._growth_tracker.item() == 2 and r.s.get_growth_interval() == 3
    r.step()
    assert r.trackers() == (128.0, 0, 1)


def test_raising_or_keeping_the_interval_leaves_the_tracker():
    r = Run(growth_interval=10)
    r.s.init_state("cpu")
    r.s._growth_tracker = 12  # a tracker past the interval (assigned, as GradScaler allows)
    r.s.set_growth_interval(10)  # the same interval: untouched
    assert r.s._growth_tracker.item() == 12
    r.s.set_growth_interval(20)
    assert r.s._growth_tracker.item() == 12


def test_lowering_the_interval_before_the_state_clamps_the_start_value():
    s = LossScaler(growth_interval=10)
    s._init_growth_tracker = 7
    s.set_growth_interval(3)
    assert s._init_growth_tracker == 2 and s._get_growth_tracker() == 2
    s.init_state("cpu")
    assert s._growth_tracker.item() == 2 and s._growth_tracker.dtype == torch.int32
    s2 = LossScaler(growth_interval=10)
    s2._init_growth_tracker = 1
    s2.set_growth_interval(3)
    assert s2._init_growth_tracker == 1


# ------------------------------------------------------------------ the device state
def test_the_device_state_dtypes():
    s = LossScaler()
    s.init_state("cpu")
    t = s._t
    assert t["vec"].dtype == torch.float32 and t["history"].dtype == torch.float32
    assert t["growth_tracker"].dtype == torch.int32
    assert t["hysteresis_tracker"].dtype == torch.int32
    assert t["base"].dtype == torch.float64


def test_the_device_state_is_float32_whatever_the_default_dtype(float64_default):
    s = LossScaler()
    s.init_state("cpu")
    assert s._scale.dtype == torch.float32 and s.recent_records(1).dtype == torch.float32
    assert s._t["history"].dtype == torch.float32


def test_a_fresh_state_flags_no_skip():
    s = LossScaler()
    s.init_state("cpu")
    assert s.skip_flag().item() == 0.0
    assert s._t["vec"].tolist()[:2] == [65536.0, 0.0]


def test_a_state_made_without_a_loss_records_nan_for_loss_and_norm():
    s = LossScaler()
    s.init_state("cpu")
    assert s._t["nan"].shape == (1,) and math.isnan(s._t["nan"].item())
    opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.0)
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    s.step(opt)
    s.update()
    row = s.recent_records(1)[0].tolist()
    assert row[:4] == [65536.0, 0.0, INF, INF]
    assert math.isnan(row[rec.LOSS]) and math.isnan(row[rec.GNORM])


def test_the_last_step_loss_is_none_before_any_step():
    assert LossScaler().last_step_loss is None


def test_check_scale_growth_tracker_returns_the_live_tensors():
    s = LossScaler()
    with pytest.raises(CallOrderError, match=r"^LossScaler\.foo\(\) was called before scale"):
        s._check_scale_growth_tracker("foo")
    s.init_state("cpu")
    scale, tracker = s._check_scale_growth_tracker("foo")
    assert scale is s._t["scale"] and tracker is s._t["growth_tracker"]


# ------------------------------------------------------------------ the found-inf flags
def test_the_first_optimizer_gets_the_packed_flag_at_once():
    r = Run()
    r.s.scale(torch.tensor(1.0))
    for p in r.model.parameters():
        p.grad = torch.full_like(p, INF)
    r.s.step(r.opt)
    # before update(): the step's flag is already set (a fused loop counts from it)
    assert r.s.skip_flag().item() == 1.0
    assert r.s._found_inf_per_device(r.opt)[torch.device("cpu")] is r.s.skip_flag()


def test_the_loss_veto_reaches_the_first_step():
    r = Run()
    r.s.set_spike_thresholds(loss=10.0)
    r.step(loss=11.0)
    assert r.s.skipped_steps == 1 and r.s.stats()["spikes"] == 1


def test_a_loss_threshold_without_a_loss_given_vetoes_nothing():
    r = Run()
    r.s.init_state("cpu")
    r.s.set_spike_thresholds(loss=10.0)
    for p in r.model.parameters():
        p.grad = torch.ones_like(p)
    r.s.step(r.opt)  # no scale() this step: no loss to veto
    r.s.update()
    assert r.s.skipped_steps == 0 and r.s.num_updates == 1


def test_a_second_optimizers_flag_is_float32_whatever_the_default_dtype(float64_default):
    s = LossScaler()
    a = torch.optim.SGD([nn.Parameter(torch.ones(1, dtype=torch.float32))], lr=0.0)
    b = torch.optim.SGD([nn.Parameter(torch.ones(1, dtype=torch.float32))], lr=0.0)
    s.scale(torch.tensor(1.0, dtype=torch.float32))
    for opt in (a, b):
        opt.param_groups[0]["params"][0].grad = torch.ones(1, dtype=torch.float32)
        s.unscale_(opt)
    flag = s._found_inf_per_device(b)[torch.device("cpu")]
    assert flag is not s.skip_flag() and flag.dtype == torch.float32 and flag.shape == ()


class _AmpAware(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None):  # noqa: ARG002 (the fused kernels' protocol)
        self.seen = (self.grad_scale, self.found_inf)


def test_an_amp_aware_optimizer_gets_the_sum_of_every_devices_flag():
    s = LossScaler()
    opt = _AmpAware([nn.Parameter(torch.ones(1))], lr=0.0)
    s.scale(torch.tensor(1.0))
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    s.unscale_(opt)
    flags = s._found_inf_per_device(opt)
    flags["other"] = torch.ones(())  # a planted second device's flag: it overflowed
    s.step(opt)
    assert opt.seen[0] is None and opt.seen[1].item() == 1.0


def test_an_amp_aware_optimizer_gets_the_one_flag_itself():
    s = LossScaler()
    opt = _AmpAware([nn.Parameter(torch.ones(1))], lr=0.0)
    s.scale(torch.tensor(1.0))
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    s.step(opt)
    assert opt.seen[1] is s.skip_flag() and opt.seen[0] is s._t["scale"]


# ------------------------------------------------------------------ a disabled scaler
def test_a_disabled_scalers_state_keeps_scale_one_through_updates():
    r = Run(enabled=False, growth_interval=1, min_scale=0.0, max_scale=INF)
    r.step()
    r.step()
    r.step(grad=INF)
    assert r.s.get_scale_tensor().item() == 1.0
    assert r.s.state_dict()["scale"] == 1.0 and r.s.skipped_steps == 1


# ------------------------------------------------------------------ the fold's cadence
def test_the_record_is_folded_once_per_ring_of_steps(monkeypatch):
    r = Run(history_size=2)
    folds = []
    fold = r.s._fold
    monkeypatch.setattr(r.s, "_fold", lambda t: (folds.append(r.s.num_updates), fold(t)))
    for _ in range(7):
        r.step(grad=INF)
    assert folds == [2, 4, 6]
    assert r.s.skipped_steps == 7 and r.s.consecutive_overflows == 7


# ------------------------------------------------------------------ warnings' frames
_MUTATED = "mutants" in Path(scaler_module.__file__).parts  # mutmut's trampolines add frames


@pytest.mark.skipif(_MUTATED, reason="mutmut's trampolines add a frame")
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_like_gradscalers_warning_points_at_the_caller():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        LossScaler.like_gradscaler("cuda")
    assert [x.filename for x in w] == [__file__]


@pytest.mark.skipif(_MUTATED, reason="mutmut's trampolines add a frame")
def test_the_grad_scaler_protocol_warning_points_at_the_step_call():
    class Proto(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):  # noqa: ARG002
            grad_scaler.unscale_(self)

    s = LossScaler()
    opt = Proto([nn.Parameter(torch.ones(1))], lr=0.0)
    s.scale(torch.tensor(1.0))
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s.step(opt)
    assert [(x.category, x.filename) for x in w] == [(FutureWarning, __file__)]
