"""LossScaler piece by piece: the update rule's every branch, every error message word for word,
the counters, the history ring, the state dict, the GradScaler attributes -- on a 2-parameter
model, milliseconds each (tests/amp/test_scaler.py holds the parity and trajectory tests)."""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.scaler import CallOrderError, LossScaler, OptState, next_scale

INF, NAN = float("inf"), float("nan")


def _t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


def _rule(scale, gt, ht, grad=False, fwd=False, **kw):
    args = dict(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=3,
        hysteresis=2,
        min_scale=1.0,
        max_scale=2.0**24,
    )
    args.update(kw)
    s, g, h = next_scale(
        _t(scale), _t(gt, torch.int32), _t(ht, torch.int32), _t(grad), _t(fwd), **args
    )
    assert (s.dtype, g.dtype, h.dtype) == (torch.float32, torch.int32, torch.int32)
    return s.item(), g.item(), h.item()


# ------------------------------------------------------------------ the update rule
@pytest.mark.parametrize(
    "state, flags, kw, expected",
    [
        ((64.0, 0, 2), {}, {}, (64.0, 1, 2)),  # 3) clean: count it
        ((64.0, 1, 2), {}, {}, (64.0, 2, 2)),
        ((64.0, 2, 1), {}, {}, (128.0, 0, 2)),  # the 3rd clean step grows and refills
        ((64.0, 5, 1), {}, {}, (128.0, 0, 2)),  # past the interval (it was lowered): grows
        ((64.0, 2, 0), {}, {"growth_factor": 3.0}, (192.0, 0, 2)),
        ((64.0, 2, 2), {}, {"max_scale": 100.0}, (100.0, 0, 2)),  # 4) the ceiling
        ((2.0**127, 2, 2), {}, {"max_scale": INF}, (2.0**127, 0, 2)),  # inf: keeps the scale
        ((64.0, 2, 2), {"grad": True}, {}, (64.0, 0, 1)),  # 1) hysteresis absorbs one
        ((64.0, 2, 1), {"grad": True}, {}, (32.0, 0, 0)),  # spent: back off
        ((64.0, 0, 0), {"grad": True}, {}, (32.0, 0, 0)),  # stays spent
        ((64.0, 1, 1), {"grad": True}, {"backoff_factor": 0.25}, (16.0, 0, 0)),
        ((1.5, 1, 1), {"grad": True}, {}, (1.0, 0, 0)),  # 4) the floor
        ((64.0, 2, 1), {"fwd": True}, {}, (64.0, 2, 1)),  # 2) forward: nothing moves
        ((0.5, 0, 2), {}, {}, (1.0, 1, 2)),  # the bounds apply on every update
    ],
)
def test_next_scale_branches(state, flags, kw, expected):
    assert _rule(*state, **flags, **kw) == pytest.approx(expected, rel=0, abs=0)


def test_next_scale_grows_every_step_with_interval_one():
    assert _rule(8.0, 0, 1, growth_interval=1) == (16.0, 0, 2)


def test_next_scale_takes_int_flags_and_factors_in_float64():
    s, g, h = next_scale(
        _t(3.0),
        _t(0, torch.int32),
        _t(1, torch.int32),
        _t(1, torch.int64),
        _t(0, torch.int64),
        growth_factor=2.0,
        backoff_factor=1 / 3,
        growth_interval=2,
        hysteresis=1,
        min_scale=0.0,
        max_scale=INF,
    )
    assert s.item() == 1.0 and g.item() == 0 and h.item() == 0


# ------------------------------------------------------------------ construction and setters
def _message(exc_type, fn, *args, **kwargs) -> str:
    with pytest.raises(exc_type) as e:
        fn(*args, **kwargs)
    return str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"init_scale": 0.0},
            "init_scale=0.0 is not allowed: init_scale must be a finite number > 0",
        ),
        (
            {"init_scale": INF},
            "init_scale=inf is not allowed: init_scale must be a finite number > 0",
        ),
        (
            {"init_scale": True},
            "init_scale=True is not allowed: init_scale must be a finite number > 0",
        ),
        (
            {"growth_factor": 1.0},
            "growth_factor=1.0 is not allowed: growth_factor must be a number > 1",
        ),
        (
            {"growth_factor": INF},
            "growth_factor=inf is not allowed: growth_factor must be a number > 1",
        ),
        (
            {"backoff_factor": 0},
            "backoff_factor=0 is not allowed: backoff_factor must be in (0, 1)",
        ),
        (
            {"backoff_factor": 1},
            "backoff_factor=1 is not allowed: backoff_factor must be in (0, 1)",
        ),
        (
            {"backoff_factor": NAN},
            "backoff_factor=nan is not allowed: backoff_factor must be in (0, 1)",
        ),
        (
            {"growth_interval": 0},
            "growth_interval=0 is not allowed: growth_interval must be an integer >= 1",
        ),
        (
            {"growth_interval": 2.0},
            "growth_interval=2.0 is not allowed: growth_interval must be an integer >= 1",
        ),
        (
            {"growth_interval": True},
            "growth_interval=True is not allowed: growth_interval must be an integer >= 1",
        ),
        ({"hysteresis": 0}, "hysteresis=0 is not allowed: hysteresis must be an integer >= 1"),
        ({"hysteresis": 1.0}, "hysteresis=1.0 is not allowed: hysteresis must be an integer >= 1"),
        (
            {"min_scale": -1.0},
            "min_scale=-1.0 is not allowed: min_scale must be a finite number >= 0",
        ),
        (
            {"min_scale": INF, "max_scale": INF},
            "min_scale=inf is not allowed: min_scale must be a finite number >= 0",
        ),
        (
            {"max_scale": 0.0},
            "max_scale=0.0 is not allowed: max_scale must be a number > 0 (inf for no ceiling)",
        ),
        (
            {"max_scale": NAN},
            "max_scale=nan is not allowed: max_scale must be a number > 0 (inf for no ceiling)",
        ),
        (
            {"max_scale": "big"},
            "max_scale='big' is not allowed: max_scale must be a number > 0 (inf for no ceiling)",
        ),
        (
            {"min_scale": 8.0, "max_scale": 4.0},
            "min_scale=8.0 is not allowed: min_scale must be <= max_scale (4.0)",
        ),
        (
            {"history_size": 0},
            "history_size=0 is not allowed: history_size must be an integer >= 1",
        ),
        (
            {"history_size": 2.0},
            "history_size=2.0 is not allowed: history_size must be an integer >= 1",
        ),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    assert _message(ValueError, LossScaler, **kwargs) == f"LossScaler: {message}"


@pytest.mark.parametrize("device", ["cuda", torch.device("cpu")])
def test_gradscalers_device_argument_is_refused_with_the_fix(device):
    d = str(device)
    assert _message(ValueError, LossScaler, device) == (
        f"LossScaler: init_scale={d!r} is not allowed: it looks like GradScaler's device "
        f"argument: write LossScaler(device={d!r}, ...) or LossScaler.like_gradscaler({d!r}, ...)"
    )


def test_boundary_arguments_are_accepted():
    s = LossScaler(
        init_scale=1e-3, growth_factor=1.001, backoff_factor=0.999, growth_interval=1,
        hysteresis=1, min_scale=0, max_scale=0.5, history_size=1,
    )  # fmt: skip
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        1.001,
        0.999,
        1,
    )
    assert (s.hysteresis, s.min_scale, s.max_scale, s.history_size) == (1, 0.0, 0.5, 1)
    assert s.get_scale() == 1e-3  # within [0, 0.5]
    assert LossScaler(min_scale=4.0, max_scale=4.0).get_scale() == 4.0  # clamped from 2**16
    assert LossScaler(init_scale=0.25).get_scale() == 1.0  # the default floor
    s.set_bounds(2.0, INF)
    assert (s.min_scale, s.max_scale) == (2.0, INF)


def test_setters_change_the_rule_and_validate():
    s = LossScaler()
    s.set_growth_factor(4)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(5)
    s.set_hysteresis(3)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (
        4.0,
        0.25,
        5,
    )
    assert type(s.get_growth_factor()) is float and type(s.get_backoff_factor()) is float
    assert s.hysteresis == 3
    with pytest.raises(ValueError, match="growth_factor=0.5 is not allowed"):
        s.set_growth_factor(0.5)
    with pytest.raises(ValueError, match="min_scale=9.0 is not allowed"):
        s.set_bounds(9.0, 8.0)


def test_defaults():
    s = LossScaler()
    assert s.get_scale() == 65536.0 and s.get_growth_factor() == 2.0
    assert s.get_backoff_factor() == 0.5 and s.get_growth_interval() == 2000
    assert (s.hysteresis, s.min_scale, s.max_scale, s.history_size) == (1, 1.0, 2.0**24, 1024)
    assert s.is_enabled() and s._check_finite and s._check_loss
    assert s.reduce_flags is None and s._skip_read is None and s.num_updates == 0
    assert s.last_skip_read is None and s.device is None
    assert s.skipped_steps == 0 and s.forward_overflows == 0 and s.consecutive_overflows == 0
    assert s.last_step_skipped is False and s.history() == []
    assert s._get_growth_tracker() == 0


def test_disabled_scaler_keeps_scale_one_and_hides_gradscaler_attributes():
    s = LossScaler(init_scale=64.0, enabled=False)
    assert not s.is_enabled() and s.get_scale() == 1.0 and s._check_finite
    for attr in ("_scale", "_growth_tracker", "_init_scale", "_init_growth_tracker"):
        assert not hasattr(s, attr)
        with pytest.raises(AttributeError) as e:
            getattr(s, attr)
        assert str(e.value) == f"'LossScaler' object has no attribute '{attr}' (disabled)"
    assert s._get_growth_tracker() == 0
    pure = LossScaler(enabled=False, check_finite=False)
    assert not pure._check_finite


# ------------------------------------------------------------------ a tiny model
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 1)


def _backward(scaler: LossScaler, model: nn.Module, plant: float | None = None, loss_mul=1.0):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    loss = model(x).pow(2).mean() * loss_mul
    scaler.scale(loss).backward()
    if plant is not None:
        model.weight.grad[0, 0] = plant


def _step(scaler, model, opt, plant=None, loss_mul=1.0):
    opt.zero_grad()
    _backward(scaler, model, plant, loss_mul)
    out = scaler.step(opt)
    scaler.update()
    return out


def test_scale_multiplies_tensors_and_containers():
    s = LossScaler(init_scale=4.0)
    x = torch.tensor(3.0)
    assert s.scale(x).item() == 12.0 and s.device == torch.device("cpu")
    a, b = s.scale((torch.tensor(1.0), torch.tensor(2.0)))
    assert (a.item(), b.item()) == (4.0, 8.0)
    out = s.scale([torch.tensor(1.0), [torch.tensor(0.5)]])
    assert isinstance(out, list) and out[0].item() == 4.0 and out[1][0].item() == 2.0
    gen = s.scale(t for t in (torch.tensor(1.0), torch.tensor(3.0)))
    assert [t.item() for t in gen] == [4.0, 12.0]
    assert _message(ValueError, s.scale, 3) == (
        "LossScaler.scale: outputs must be a Tensor or an iterable of Tensors, got int"
    )


def test_scale_records_the_steps_loss_over_micro_batches():
    """The record's loss is the sum of what scale() was given (a NaN micro-batch makes it NaN,
    i.e. a forward overflow); containers count every tensor; a non-scalar loss its sum."""
    s = LossScaler(init_scale=4.0)
    s.scale(torch.tensor(NAN))
    s.scale(torch.tensor(1.0))
    assert math.isnan(s._loss_sum.item())
    t = LossScaler(init_scale=4.0, check_loss=False)
    t.scale(torch.tensor(INF))
    assert t._loss_sum.item() == INF  # recorded; check_loss only decides the kind
    u = LossScaler(init_scale=4.0)
    u.scale([torch.tensor(1.0), torch.tensor(2.0)])
    u.scale(torch.tensor([0.5, 0.25]))
    assert u._loss_sum.item() == 3.75


def test_disabled_scale_returns_what_it_was_given_and_still_records():
    s = LossScaler(enabled=False)
    x = torch.tensor(2.0)
    assert s.scale(x) is x
    pair = (torch.tensor(1.0), torch.tensor(INF))
    assert s.scale(pair) is pair and s._loss_sum.item() == INF
    items = [torch.tensor(1.0)]
    assert s.scale(items) is items
    gen = s.scale(t for t in (torch.tensor(5.0),))
    assert [t.item() for t in gen] == [5.0]
    assert s.scale(7) == 7
    pure = LossScaler(enabled=False, check_finite=False)
    y = torch.tensor(INF)
    assert pure.scale(y) is y and pure._loss_sum is None and pure.device is None


def test_a_clean_step_unscales_steps_and_counts():
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=8.0, growth_interval=2)
    assert _step(s, model, opt) is None  # SGD.step returns None
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    ref(x).pow(2).mean().backward()
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, rtol=0, atol=0)
    assert s.last_skip_read is False and s.last_step_skipped is False
    assert s.history() == [(1, 8.0, False)]
    _step(s, model, opt)
    assert s.get_scale() == 16.0 and s.num_updates == 2 and s._get_growth_tracker() == 0
    assert s.stats() == {
        "scale": 16.0,
        "skipped_total": 0,
        "forward_overflows": 0,
        "spikes": 0,
        "consecutive_overflows": 0,
        "last_skipped": False,
        "steps": 2,
    }


def test_step_returns_what_the_optimizer_returns():
    class Returns(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            return "stepped"

    model = _model()
    s = LossScaler(init_scale=8.0)
    assert _step(s, model, Returns(model.parameters(), lr=0.1)) == "stepped"
    assert _step(s, model, Returns(model.parameters(), lr=0.1), plant=INF) is None


def test_skipped_steps_are_counted_by_kind_and_in_a_row():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=64.0)
    _step(s, model, opt, plant=INF)
    w = model.weight.detach().clone()
    _step(s, model, opt, loss_mul=NAN)
    assert torch.equal(model.weight, w)
    assert s.last_skip_read is True
    assert (s.skipped_steps, s.forward_overflows, s.consecutive_overflows) == (2, 1, 2)
    # hysteresis 1 is GradScaler's kernel, but the forward overflow keeps the scale it used (a
    # smaller scale cannot cure it): only the gradient overflow backed off
    assert s.get_scale() == 32.0
    _step(s, model, opt)
    assert (s.skipped_steps, s.forward_overflows, s.consecutive_overflows) == (2, 1, 0)
    assert s.last_step_skipped is False
    assert s.history() == [(1, 64.0, True), (2, 32.0, True), (3, 32.0, False)]
    assert s._history_tensor()[:, 2].tolist() == [1.0, 2.0, 0.0]  # the kinds
    recs = s.recent_records(3)
    assert recs[:, rec.SCALE].tolist() == [64.0, 32.0, 32.0]
    assert recs[:, rec.SKIPPED].tolist() == [1.0, 1.0, 0.0]
    assert math.isnan(recs[1, rec.LOSS]) and math.isfinite(recs[2, rec.LOSS])
    assert s.recent_skips(2).item() == 1.0 and s.recent_skips(10).item() == 2.0
    assert s.recent_skips(0).item() == 0.0 and s.recent_skips(0).dtype == torch.float64
    assert s.recent_records(0).shape == (0, len(rec.COLUMNS))
    counters = s.device_counters()
    assert sorted(counters) == sorted(
        ["scale", "skipped_total", "forward_overflows", "spikes", "consecutive_overflows",
         "last_skipped"]
    )  # fmt: skip
    assert [counters[k].item() for k in sorted(counters)] == [0, 1, 0, 32.0, 2, 0]


def test_the_history_is_a_ring_of_the_last_steps():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=64.0, history_size=3)
    for i in range(5):
        _step(s, model, opt, plant=INF if i in (1, 3) else None)
    assert s.history() == [(3, 32.0, False), (4, 32.0, True), (5, 16.0, False)]
    assert s.recent_records(10)[:, :2].tolist() == [[32.0, 0.0], [32.0, 1.0], [16.0, 0.0]]
    assert s.recent_records(2)[:, :2].tolist() == [[32.0, 1.0], [16.0, 0.0]]
    # the counters cover every step, not only the three kept
    assert (s.skipped_steps, s.consecutive_overflows) == (2, 0)
    assert s.recent_skips(10).item() == 1.0 and s.recent_skips(3).item() == 1.0
    assert s.recent_skips(1).item() == 0.0
    sd = s.state_dict()
    assert sd["history"].tolist() == [[3.0, 32.0, 0.0], [4.0, 32.0, 1.0], [5.0, 16.0, 0.0]]
    # a scaler with a smaller ring keeps the newest records, in order
    t = LossScaler(history_size=2)
    t.load_state_dict(sd)
    assert t.history() == [(4, 32.0, True), (5, 16.0, False)]
    t.init_state("cpu")
    assert t.recent_records(5)[:, :2].tolist() == [[32.0, 1.0], [16.0, 0.0]]
    assert t.skipped_steps == 2  # the folded step before the ring's records still counts
    _step(t, model, opt)
    assert t.history() == [(5, 16.0, False), (6, 16.0, False)]


def test_state_dict_holds_every_counter():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=2, min_scale=2.0, max_scale=2**20)
    _step(s, model, opt)
    _step(s, model, opt, plant=INF)
    _step(s, model, opt, loss_mul=INF)
    sd = s.state_dict()
    hist = sd.pop("history")
    records = sd.pop("records")
    assert sd == {
        "scale": 64.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": 0,
        "hysteresis": 2,
        "_hysteresis_tracker": 1,
        "min_scale": 2.0,
        "max_scale": float(2**20),
        "enabled": True,
        "skipped_total": 2,
        "forward_overflows": 1,
        "spikes": 0,
        "consecutive_overflows": 2,
        "last_skipped": 1,
        "num_updates": 3,
        "spike_thresholds": [INF, INF],
    }
    assert records.shape == (3, len(rec.COLUMNS)) and records.device.type == "cpu"
    assert records[:, rec.SKIPPED].tolist() == [0.0, 1.0, 1.0]
    assert math.isfinite(records[0, rec.LOSS]) and records[2, rec.LOSS] == INF
    assert hist.dtype == torch.float64 and hist.device.type == "cpu"
    assert hist.tolist() == [[1.0, 64.0, 0.0], [2.0, 64.0, 1.0], [3.0, 64.0, 2.0]]
    assert LossScaler(enabled=False, check_finite=False).state_dict() == {}
    fresh = LossScaler(init_scale=8.0, enabled=False).state_dict()
    assert fresh["scale"] == 1.0 and fresh["enabled"] is False and fresh["history"].shape == (0, 3)


def test_load_state_dict_restores_every_counter_and_the_rule():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=3, min_scale=2.0, max_scale=2**20)
    s.set_growth_factor(4.0)
    s.set_backoff_factor(0.25)
    _step(s, model, opt)
    _step(s, model, opt, plant=INF)
    _step(s, model, opt, loss_mul=INF)
    sd = s.state_dict()
    t = LossScaler()
    t.load_state_dict(sd)
    got = t.state_dict()
    assert torch.equal(got.pop("history"), sd["history"])
    torch.testing.assert_close(got.pop("records"), sd["records"], rtol=0, atol=0, equal_nan=True)
    assert got == {k: v for k, v in sd.items() if k not in ("history", "records")}
    assert (t.get_growth_factor(), t.get_backoff_factor(), t.get_growth_interval()) == (
        4.0,
        0.25,
        3,
    )
    assert (t.hysteresis, t.min_scale, t.max_scale, t.num_updates) == (3, 2.0, 2.0**20, 3)
    assert (t.skipped_steps, t.forward_overflows, t.consecutive_overflows) == (2, 1, 2)
    assert t.last_step_skipped is True and t._get_growth_tracker() == 0
    # the next steps follow the same rule from the same state
    for scaler in (s, t):
        _step(scaler, model, opt, plant=INF)
        _step(scaler, model, opt, plant=INF)
    assert t.state_dict()["scale"] == s.state_dict()["scale"] == 16.0


def test_load_state_dict_of_a_gradscaler_starts_the_counters_at_zero():
    ref = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=3.0, growth_interval=9)
    ref._lazy_init_scale_growth_tracker("cpu")
    ref._growth_tracker.fill_(4)
    s = LossScaler(hysteresis=2, min_scale=0.5, max_scale=1e6)
    s.load_state_dict(ref.state_dict())
    sd = s.state_dict()
    assert sd.pop("history").shape == (0, 3) and sd.pop("records").shape == (0, len(rec.COLUMNS))
    assert sd == {
        "scale": 256.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.5,
        "growth_interval": 9,
        "_growth_tracker": 4,
        "hysteresis": 2,
        "_hysteresis_tracker": 2,
        "min_scale": 0.5,
        "max_scale": 1e6,
        "enabled": True,
        "skipped_total": 0,
        "forward_overflows": 0,
        "spikes": 0,
        "consecutive_overflows": 0,
        "last_skipped": 0,
        "num_updates": 0,
        "spike_thresholds": [INF, INF],
    }
    assert s.history() == []


def test_load_state_dict_refuses_what_it_cannot_restore():
    s = LossScaler()
    with pytest.raises(RuntimeError) as e:
        s.load_state_dict({})
    assert str(e.value) == (
        "LossScaler.load_state_dict: the state dict is empty (saved from a disabled GradScaler?); "
        "nothing to restore."
    )
    with pytest.raises(KeyError) as e:
        s.load_state_dict({"scale": 2.0, "growth_interval": 3})
    assert e.value.args[0] == (
        "LossScaler.load_state_dict: missing keys ['growth_factor', 'backoff_factor', "
        "'_growth_tracker']"
    )
    off = LossScaler(enabled=False)
    off.load_state_dict({})  # what a disabled GradScaler saves
    assert off.get_scale() == 1.0
    pure = LossScaler(enabled=False, check_finite=False)
    pure.load_state_dict({"junk": 1})
    assert pure.state_dict() == {}


def test_a_disabled_scaler_loads_counters_but_keeps_scale_one():
    sd = LossScaler(init_scale=64.0).state_dict()
    sd["skipped_total"] = 5
    off = LossScaler(enabled=False)
    off.load_state_dict(sd)
    assert off.get_scale() == 1.0 and off.state_dict()["scale"] == 1.0
    assert off.skipped_steps == 5


def test_load_state_dict_after_init_writes_into_the_live_tensors():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=64.0)
    _step(s, model, opt, plant=INF)
    held = {k: s.device_counters()[k] for k in ("scale", "skipped_total")}
    opt.zero_grad()
    _backward(s, model)  # a step under way is discarded by the load
    src = LossScaler(init_scale=512.0)
    s.load_state_dict(src.state_dict())
    assert s.device_counters()["scale"] is held["scale"] and held["scale"].item() == 512.0
    assert held["skipped_total"].item() == 1  # a count read before the load stays what it was
    assert s.device_counters()["skipped_total"].item() == 0  # the counters follow the load
    assert s._loss_sum is None and len(s._per_optimizer_states) == 0
    assert s.num_updates == 0 and s.history() == []


def test_values_read_before_and_after_the_state_exists():
    s = LossScaler(init_scale=32.0, hysteresis=2)
    before = s._values()
    assert before.pop("rows").shape == (0, len(rec.COLUMNS))
    assert before.pop("base") == [0, 0, 0, 0]
    assert before == {
        "scale": 32.0,
        "growth_tracker": 0,
        "hysteresis_tracker": 2,
        "skipped_total": 0,
        "forward_overflows": 0,
        "spikes": 0,
        "consecutive_overflows": 0,
    }
    s.init_state("cpu")
    after = s._values()
    assert after.pop("rows").shape == (0, len(rec.COLUMNS))
    assert after.pop("base") == [0, 0, 0, 0]
    assert (
        after == before and type(after["scale"]) is float and type(after["growth_tracker"]) is int
    )


# ------------------------------------------------------------------ GradScaler attributes
def test_assigning_scale_and_tracker():
    s = LossScaler(init_scale=64.0)
    s._scale = 16
    s._growth_tracker = 3
    assert s._init["scale"] == 16 and s._init["growth_tracker"] == 3 and s.device is None
    s.init_state("cpu")
    assert s._scale.item() == 16.0 and s._growth_tracker.item() == 3
    held = s._scale
    s._scale = torch.tensor([8.0])
    assert s._scale is held and held.item() == 8.0 and held.shape == ()
    with torch.no_grad():
        s._scale = torch.tensor(4.0, requires_grad=True)
    assert held.item() == 4.0 and not held.requires_grad
    assert _message(ValueError, setattr, s, "_scale", None) == (
        "LossScaler: 'scale' cannot be set to None; to start over, load a state_dict"
    )
    assert _message(ValueError, setattr, s, "_growth_tracker", torch.ones(2)) == (
        "LossScaler: 'growth_tracker' takes one value, got shape (2,)"
    )


def test_assigning_a_tensor_on_another_device_moves_the_state():
    s = LossScaler(init_scale=64.0)
    s.init_state("cpu")
    s._scale = torch.tensor(2.0, device="meta")
    assert s.device.type == "meta" and s._growth_tracker.device.type == "meta"
    t = LossScaler(init_scale=64.0)
    t._growth_tracker = torch.tensor(5, device="meta")  # no state yet: created there
    assert t.device.type == "meta"


def test_init_values_and_device_type():
    s = LossScaler(init_scale=64.0, growth_interval=4)
    assert s._init_scale == 64.0 and s._init_growth_tracker == 0
    s._init_scale = 8
    s._init_growth_tracker = 2.0
    assert s._init_scale == 8.0 and type(s._init_scale) is float
    assert s._init_growth_tracker == 2 and type(s._init_growth_tracker) is int
    assert s.get_scale() == 8.0 and s._get_growth_tracker() == 2
    s.init_state("cpu")
    assert s._get_growth_tracker() == 2 and s._get_scale_async() is s._scale
    assert s._device == "cpu"
    u = LossScaler(device="meta")
    assert u._device == "meta"
    u._device = torch.device("cpu")
    assert u._device == "cpu"
    v = LossScaler()
    assert v._device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert LossScaler(device="cuda:1")._device == "cuda"


def test_lazy_init_scale_growth_tracker():
    s = LossScaler(init_scale=64.0)
    s._lazy_init_scale_growth_tracker("cpu")
    held = s._scale
    s._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert s._scale is held
    assert _message(CallOrderError, s._lazy_init_scale_growth_tracker, "meta") == (
        "LossScaler: the state already lives on cpu, not meta; assign scaler._scale = "
        "scaler._scale.to('meta') to move it"
    )
    m = LossScaler()
    m._lazy_init_scale_growth_tracker("meta")
    m._lazy_init_scale_growth_tracker("meta")  # same type, no index: the same device
    assert _message(CallOrderError, m._lazy_init_scale_growth_tracker, "meta:0") == (
        "LossScaler: the state already lives on meta, not meta:0; assign scaler._scale = "
        "scaler._scale.to('meta:0') to move it"
    )


def test_calls_before_scale_say_the_fix():
    s = LossScaler()
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    for name, call in (
        ("step", lambda: s.step(opt)),
        ("unscale_", lambda: s.unscale_(opt)),
        ("update", lambda: s.update()),
        ("device_counters", s.device_counters),
        ("recent_skips", lambda: s.recent_skips(1)),
        ("recent_records", lambda: s.recent_records(1)),
        ("_check_inf_per_device", lambda: s._check_inf_per_device(opt)),
        (
            "_check_scale_growth_tracker",
            lambda: s._check_scale_growth_tracker("_check_scale_growth_tracker"),
        ),
    ):
        assert _message(CallOrderError, call) == (
            f"LossScaler.{name}() was called before scale(): call scaler.scale(loss).backward() "
            "first in each iteration, then unscale_/step/update."
        )
    assert s.get_scale_tensor() is None and s._scale is None and s._growth_tracker is None


def test_call_order_errors_word_for_word():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler()
    _backward(s, model)
    s.unscale_(opt)
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    assert _message(CallOrderError, s.unscale_, opt) == (
        "LossScaler.unscale_() was already called for this optimizer in this step: call it once "
        "per step, after all backward passes, and call update() before the next step."
    )
    s.step(opt)
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    assert _message(CallOrderError, s.step, opt) == (
        "LossScaler.step() was already called for this optimizer in this step: call update() "
        "after step(), once per iteration."
    )
    assert _message(CallOrderError, s.unscale_, opt) == (
        "LossScaler.unscale_() was called after step(): call unscale_ before step(), or call "
        "update() to start the next step."
    )
    with pytest.raises(CallOrderError) as e:
        pickle.dumps(s)
    assert str(e.value) == (
        "LossScaler can be pickled or copied only at the start of an iteration or after update(), "
        "not between scale() and update()."
    )
    s.update()
    assert _message(CallOrderError, s.update) == (
        "LossScaler.update() was called before step(): call scaler.step(optimizer) for every "
        "optimizer, then update() once per iteration."
    )
    assert _message(RuntimeError, s.step, opt, closure=lambda: 0) == (
        "LossScaler.step: closures are not supported; compute the loss before step()."
    )


def test_fp16_gradients_are_refused_and_allowed_when_disabled():
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler()
    s.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    assert _message(ValueError, s.unscale_, opt) == (
        "LossScaler: attempting to unscale FP16 gradients (the parameters are fp16). Keep "
        "parameters in fp32 and run the forward under autocast, or use precision=fp16-pure, which "
        "gives the optimizer an fp32 master copy."
    )
    off = LossScaler(enabled=False)
    off.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    model.weight.grad[0, 0] = INF
    off.unscale_(opt)
    off.step(opt)
    off.update()
    assert off.skipped_steps == 1
    # checking without unscaling accepts fp16 (what the grad_scaler= protocol calls)
    t = LossScaler()
    t.init_state("cpu")
    flags = t._check_inf_per_device(opt)
    assert [v.item() for v in flags.values()] == [1.0]
    assert model.weight.grad[0, 0].item() == INF


def test_unscale_divides_by_the_scale_and_flags_per_device():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=3.0)
    _backward(s, model)
    scaled = model.weight.grad.clone()
    model.bias.grad = None  # a parameter without a gradient is skipped
    s.unscale_(opt)
    inv = torch.tensor(1.0 / 3.0, dtype=torch.float64).float()  # 1/scale in float64, as GradScaler
    assert torch.equal(model.weight.grad, scaled * inv)
    found = s._found_inf_per_device(opt)
    assert list(found) == [torch.device("cpu")] and found[torch.device("cpu")].item() == 0.0


def test_check_inf_per_device_flags_without_unscaling_or_changing_the_stage():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=8.0)
    _backward(s, model, plant=NAN)
    g = model.bias.grad.clone()
    flags = s._check_inf_per_device(opt)
    assert torch.equal(model.bias.grad, g)
    assert [v.item() for v in flags.values()] == [1.0]
    assert s._found_inf_per_device(opt) is flags
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    s.update()  # checked, not stepped: the overflow still counts
    assert s.skipped_steps == 1 and s.get_scale() == 4.0


def test_sparse_gradients_are_checked_through_their_values():
    emb = nn.Embedding(4, 2, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    s = LossScaler(init_scale=2.0)
    s.scale(emb(torch.tensor([1, 2])).sum()).backward()
    s.unscale_(opt)
    assert emb.weight.grad.coalesce().values().abs().max().item() == 1.0
    s.update()
    assert s.skipped_steps == 0
    s.scale(emb(torch.tensor([1])).sum() * INF).backward()
    s.step(opt)
    s.update()
    assert s.skipped_steps == 1


def test_flags_reduced_across_ranks_decide_the_skip():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=8.0)
    seen = []

    def everyone_else_overflowed(flag):
        seen.append(flag.tolist())
        return torch.ones_like(flag)

    s.reduce_flags = everyone_else_overflowed
    w = model.weight.detach().clone()
    _step(s, model, opt)
    assert seen == [0.0]  # this rank's own found-inf flag, before the one read
    assert torch.equal(model.weight, w) and s.skipped_steps == 1 and s.forward_overflows == 0
    assert s.get_scale() == 4.0  # another rank overflowed: every rank skips and backs off alike
    s.reduce_flags = lambda flag: flag
    _step(s, model, opt, plant=INF, loss_mul=NAN)
    assert s.forward_overflows == 1 and s.history()[-1] == (2, 4.0, True)
    assert s._history_tensor()[-1, 2].item() == 2.0  # this rank's loss was not finite


def test_several_optimizers_share_one_update():
    a, b = _model(), _model()
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    s = LossScaler(init_scale=16.0)
    x = torch.ones(1, 2)
    s.scale(a(x).sum() + b(x).sum()).backward()
    b.weight.grad[0, 0] = INF
    wa = a.weight.detach().clone()
    s.step(oa)
    assert s._skip_read is False
    s.step(ob)
    assert s._skip_read is True  # skipped for either: recorded as skipped
    s.update()
    assert not torch.equal(a.weight, wa)  # a's own step was clean and ran
    assert s.last_skip_read is True and s.skipped_steps == 1 and s.get_scale() == 8.0
    assert s._skip_read is None


def test_update_with_a_new_scale():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=16.0, min_scale=2.0, max_scale=64.0, growth_interval=1)
    s.init_state("cpu")
    s.update(new_scale=4)  # nothing recorded: only the scale changes
    assert s.get_scale() == 4.0 and s.num_updates == 0
    s.update(new_scale=torch.tensor([1000.0]))
    assert s.get_scale() == 64.0  # clamped
    _backward(s, model)
    s.step(opt)
    s.update(new_scale=0.5)  # a recorded step with a hand-set scale: no growth on top
    assert s.get_scale() == 2.0 and s.num_updates == 1 and s._get_growth_tracker() == 0
    assert s.history() == [(1, 64.0, False)]
    new = torch.tensor(8.0)
    s.update(new_scale=new)
    new.fill_(3.0)
    assert s.get_scale() == 8.0  # copied
    assert _message(ValueError, s.update, new_scale=torch.ones(2)) == (
        "LossScaler.update: new_scale must be a number or a one-element tensor that does not "
        "require grad (got shape (2,), requires_grad=False)"
    )
    assert _message(ValueError, s.update, new_scale=torch.ones((), requires_grad=True)) == (
        "LossScaler.update: new_scale must be a number or a one-element tensor that does not "
        "require grad (got shape (), requires_grad=True)"
    )
    assert _message(ValueError, s.update, new_scale="8") == (
        "LossScaler.update: new_scale='8' is not allowed: give a number or a one-element tensor"
    )
    off = LossScaler(enabled=False)
    off.init_state("cpu")
    off.update(new_scale=8.0)
    assert off.get_scale() == 1.0


def test_a_pure_pass_through_does_nothing():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(enabled=False, check_finite=False)
    x = torch.ones(1, 2)
    loss = model(x).sum()
    assert s.scale(loss) is loss
    loss.backward()
    model.weight.grad[0, 0] = INF
    s.unscale_(opt)
    s.step(opt)  # applied: a pass-through checks nothing
    s.update()
    assert torch.isinf(model.weight).any() or torch.isnan(model.weight).any()
    assert s.device is None and s.num_updates == 0


def test_a_disabled_scaler_runs_a_closure_unchecked():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(enabled=False)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        return loss

    assert s.step(opt, closure=closure) is not None and calls == [1]
    st = s._per_optimizer_states[id(opt)]
    assert st["stage"] is OptState.STEPPED
    assert [v.item() for v in st["found_inf_per_device"].values()] == [0.0]
    assert s._skip_read is None and s.device == torch.device("cpu")
    s.update()
    assert s.num_updates == 1 and s.skipped_steps == 0


class _TakesScaler(torch.optim.SGD):
    """The deprecated protocol: the optimizer gets the scaler and unscales through it."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.got = grad_scaler
        grad_scaler.unscale_(self)
        if not any(v.item() for v in grad_scaler._found_inf_per_device(self).values()):
            super().step()
        return "done"


class _ReadsTensors(torch.optim.SGD):
    """The current protocol: grad_scale / found_inf set on the optimizer for its step."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.got = (self.grad_scale, self.found_inf.clone())
        return "read"


def test_amp_aware_optimizer_gets_the_scaler_itself():
    model = _model()
    opt = _TakesScaler(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model, plant=INF)
    with pytest.warns(FutureWarning, match="LossScaler passes itself as grad_scaler="):
        assert s.step(opt) == "done"
    assert opt.got is s and s._skip_read is None
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    s.update()
    assert s.skipped_steps == 1 and s.get_scale() == 2.0


def test_amp_aware_optimizer_gets_the_scale_and_the_flag():
    model = _model()
    opt = _ReadsTensors(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert s.step(opt) == "read"
    scale, found = opt.got
    assert scale is s._scale and found.item() == 0.0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert s._skip_read is None
    s.update()
    # the optimizer's own grad_scale is multiplied in; found_inf is the flag after any reduction
    opt.grad_scale = torch.tensor(3.0)
    _backward(s, model, loss_mul=NAN)
    s.step(opt)
    scale, found = opt.got
    assert scale.item() == 12.0 and found.item() == 1.0
    assert not hasattr(opt, "grad_scale")  # removed after the step, as GradScaler does
    s.update()
    assert s.skipped_steps == 1 and s.forward_overflows == 1


def test_amp_aware_optimizer_after_unscale_gets_no_scale():
    model = _model()
    opt = _ReadsTensors(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model, plant=INF)
    s.unscale_(opt)
    s.step(opt)
    assert opt.got[0] is None and opt.got[1].item() == 1.0
    off = LossScaler(enabled=False)
    opt2 = _ReadsTensors(model.parameters(), lr=0.1)
    opt2.zero_grad()
    off.scale(model(torch.ones(1, 2)).sum()).backward()
    off.step(opt2)
    assert opt2.got[0] is None and opt2.got[1].item() == 0.0


# ------------------------------------------------------------------ like_gradscaler, pickling
def test_like_gradscaler_arguments():
    s = LossScaler.like_gradscaler(
        "cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=5,
        history_size=6,
    )  # fmt: skip
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor()) == (8.0, 3.0, 0.25)
    assert (s.get_growth_interval(), s.history_size, s.hysteresis) == (5, 6, 1)
    assert (s.min_scale, s.max_scale, s._check_loss, s._check_finite) == (0.0, INF, False, True)
    assert s.is_enabled() and s._device == "cpu"
    d = LossScaler.like_gradscaler("cpu")
    assert d.get_scale() == 65536.0 and d.get_growth_interval() == 2000 and d.history_size == 1024
    off = LossScaler.like_gradscaler("cpu", enabled=False)
    assert not off.is_enabled() and not off._check_finite


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
def test_like_gradscaler_cuda_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning) as rec:
        s = LossScaler.like_gradscaler("cuda", init_scale=8.0)
    assert [str(w.message) for w in rec] == [
        "LossScaler.like_gradscaler: device='cuda' but CUDA is not available; scaling is "
        "disabled (as torch.amp.GradScaler does)."
    ]
    assert not s.is_enabled() and s._device == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not LossScaler.like_gradscaler("cuda", enabled=False).is_enabled()


def test_pickle_and_deepcopy_between_iterations():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=64.0, history_size=4)
    s.reduce_flags = lambda flags: flags
    _step(s, model, opt, plant=INF)
    _step(s, model, opt)
    for t in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s)):
        assert t._t is None and t.reduce_flags is None and t._loss_sum is None
        assert t.history() == s.history() and t.num_updates == 2
        mine, theirs = t._values(), s._values()
        rows = mine.pop("rows"), theirs.pop("rows")
        assert mine == theirs
        torch.testing.assert_close(*rows, rtol=0, atol=0, equal_nan=True)
        assert len(t._per_optimizer_states) == 0
        _step(t, model, opt, plant=INF)
        assert t.get_scale() == 16.0 and t.skipped_steps == 2


# ------------------------------------------------------------------ device placement
class _MetaAware(torch.optim.SGD):
    """Steps nothing: records what it was handed (the meta device has no values to read)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.got = (self.grad_scale, self.found_inf)
        return "ok"


def test_every_tensor_of_a_step_lives_on_the_scalers_device():
    """``meta`` stands in for an accelerator: nothing may land on the CPU along the way."""
    model = nn.Linear(2, 1, device="meta")
    opt = _MetaAware(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0, history_size=4)
    seen = []
    s.reduce_flags = lambda flags: seen.append(flags.device.type) or flags
    for unscale_first in (False, True):
        s.scale(model(torch.ones(1, 2, device="meta")).sum()).backward()
        if unscale_first:
            s.unscale_(opt)
            assert [f.device.type for f in s._found_inf_per_device(opt).values()] == ["meta"]
        assert s.step(opt) == "ok"
        assert opt.got[1].device.type == "meta"
        s.update()
    assert seen == ["meta", "meta"]
    assert opt.got[0] is None  # unscaled already: no scale handed over
    assert {k: v.device.type for k, v in s._t.items()} == dict.fromkeys(s._t, "meta")
    assert s.recent_skips(0).device.type == "meta" and s.recent_skips(2).device.type == "meta"
    assert s.recent_records(2).device.type == "meta"
    s.update(new_scale=2.0)
    s.load_state_dict(LossScaler(init_scale=8.0).state_dict())
    assert {k: v.device.type for k, v in s._t.items()} == dict.fromkeys(s._t, "meta")
    m = LossScaler()
    m.init_state("meta")
    assert m.device.type == "meta" and m._check_inf_per_device(opt) is not None
    assert [f.device.type for f in m._found_inf_per_device(opt).values()] == ["meta"]


def test_a_disabled_scalers_closure_step_creates_the_state_on_the_parameters_device():
    p = nn.Parameter(torch.zeros(2, device="meta"))
    opt = torch.optim.SGD([p], lr=0.1)
    s = LossScaler(enabled=False)
    s.step(opt, closure=lambda: None)
    assert s.device.type == "meta"
    (flag,) = s._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
    assert flag.device.type == "meta" and flag.dtype == torch.float32
    q = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    q.param_groups[0]["params"] = []  # no parameters at all: the CPU
    t = LossScaler(enabled=False)
    t.step(q, closure=lambda: None)
    assert t.device == torch.device("cpu")


# ------------------------------------------------------------------ odds and ends
def test_step_passes_the_optimizers_own_arguments_through():
    class Args(torch.optim.SGD):
        def step(self, *args, **kwargs):
            self.got = (args, kwargs)
            return "stepped"

    class AwareArgs(Args):
        _step_supports_amp_scaling = True

    class TakesScalerArgs(_TakesScaler):
        def step(self, closure=None, grad_scaler=None, *, extra=None):
            self.args = (closure, extra)
            return super().step(grad_scaler=grad_scaler)

    model = _model()
    for cls in (Args, AwareArgs):
        opt = cls(model.parameters(), lr=0.1)
        s = LossScaler(init_scale=4.0)
        _backward(s, model)
        assert s.step(opt, "pos", key="word") == "stepped"
        assert opt.got == (("pos",), {"key": "word"})
        s.update()
    opt = TakesScalerArgs(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model)
    with pytest.warns(FutureWarning):
        s.step(opt, "pos", extra="word")
    assert opt.args == ("pos", "word")
    s.update()
    off = LossScaler(enabled=False)
    opt = Args(model.parameters(), lr=0.1)
    off.step(opt, "pos", closure="c")
    assert opt.got == (("pos",), {"closure": "c"})


def test_the_distributed_hook_runs_once_per_optimizer_and_step():
    """Every rank must make the same number of collective calls: one reduction per step."""
    model = _model()
    s = LossScaler(init_scale=4.0)
    calls = []
    s.reduce_flags = lambda flags: calls.append(1) or flags
    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1),
        _TakesScaler(model.parameters(), lr=0.1),
        _ReadsTensors(model.parameters(), lr=0.1),
    ):
        calls.clear()
        opt.zero_grad()
        _backward(s, model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            s.step(opt)
        s.update()
        assert calls == [1], type(opt).__name__


def test_the_grad_scaler_protocol_warning_word_for_word_and_step_once():
    model = _model()
    opt = _TakesScaler(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model)
    with pytest.warns(FutureWarning) as rec:
        s.step(opt)
    assert [str(w.message) for w in rec] == [
        "LossScaler passes itself as grad_scaler= to this optimizer, as GradScaler does; "
        "GradScaler is going to stop passing itself and set `grad_scale` and `found_inf` tensors "
        "on the optimizer instead."
    ]
    with pytest.raises(CallOrderError, match="step\\(\\) was already called"):
        s.step(opt)
    s.update()
    opt2 = _ReadsTensors(model.parameters(), lr=0.1)
    _backward(s, model)
    s.step(opt2)
    with pytest.raises(CallOrderError, match="step\\(\\) was already called"):
        s.step(opt2)


def test_recent_skips_of_one_step_and_stats_after_a_skip():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _step(s, model, opt, plant=INF)
    assert s.recent_skips(1).item() == 1.0
    assert s.stats()["last_skipped"] is True and s.stats()["skipped_total"] == 1


def test_an_empty_history_before_the_first_step_has_three_float64_columns():
    s = LossScaler()
    s.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    h = s.state_dict()["history"]
    assert h.shape == (0, 3) and h.dtype == torch.float64
    t = LossScaler()  # a state of ampctl 0.2: the history, no records
    old = {k: v for k, v in LossScaler().state_dict().items() if k != "records"}
    t.load_state_dict({**old, "history": [[1, 8, 1], [2, 4, 0]], "num_updates": 2})
    h = t.state_dict()["history"]
    assert h.dtype == torch.float64 and h.tolist() == [[1.0, 8.0, 1.0], [2.0, 4.0, 0.0]]


def test_a_disabled_scaler_pickles_without_its_step_under_way():
    s = LossScaler(enabled=False)
    s.scale(torch.tensor(INF))
    s._per_optimizer_states[0]["stage"] = OptState.UNSCALED
    t = pickle.loads(pickle.dumps(s))
    assert t._loss_sum is None and len(t._per_optimizer_states) == 0
    assert s._loss_sum is not None  # the original is left as it was


def test_histories_are_float64_with_three_columns_from_the_start():
    s = LossScaler()
    assert s.state_dict()["history"].dtype == torch.float64
    s.init_state("cpu")
    h = s.state_dict()["history"]
    assert h.shape == (0, 3) and h.dtype == torch.float64
    assert s.get_scale_tensor() is s._scale and s.get_scale_tensor().dtype == torch.float32


def test_a_short_history_loaded_into_a_larger_ring_keeps_its_order():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    src = LossScaler(init_scale=64.0, history_size=3)
    for i in range(5):
        _step(src, model, opt, plant=INF if i == 3 else None)
    want = src._history_tensor().tolist()
    dst = LossScaler(history_size=4)
    dst.load_state_dict(src.state_dict())
    dst.init_state("cpu")
    assert dst._history_tensor().tolist() == want
    _step(dst, model, opt)
    assert dst._history_tensor().tolist() == [*want, [6.0, 32.0, 0.0]]
    assert dst.skipped_steps == 1


def test_update_numbers_stay_exact_past_float32_integers():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=8.0)
    s.init_state("cpu")
    s._num_updates = 2**24 + 2
    _step(s, model, opt)
    assert s._history_tensor()[-1, 0].item() == 2**24 + 3
    assert s.history()[-1][0] == 2**24 + 3


def test_a_disabled_scaler_records_losses_from_any_iterable():
    s = LossScaler(enabled=False)
    gen = s.scale(t for t in (torch.tensor(1.0), torch.tensor(NAN)))
    assert [t.item() == t.item() for t in gen] == [True, False]  # handed back as given
    assert math.isnan(s._loss_sum.item())
    assert s.stats()["scale"] == 1.0


def test_a_missing_gradient_does_not_hide_the_next_ones():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=8.0)
    _backward(s, model)
    model.weight.grad = None  # the first parameter: skipped, the bias still checked
    model.bias.grad[0] = INF
    s.step(opt)
    s.update()
    assert s.skipped_steps == 1


def test_a_pure_pass_through_passes_the_step_arguments():
    class Args(torch.optim.SGD):
        def step(self, *args, **kwargs):
            self.got = (args, kwargs)
            return "stepped"

    opt = Args(_model().parameters(), lr=0.1)
    s = LossScaler(enabled=False, check_finite=False)
    assert s.step(opt, "pos", key=1) == "stepped" and opt.got == (("pos",), {"key": 1})


def test_maybe_opt_step_reached_into_directly_decides_from_the_recorded_flags():
    """GradScaler's internal, as training code calls it after unscale_: it computes the flags
    itself when step() has not."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=8.0)
    _backward(s, model, plant=INF)
    s.unscale_(opt)
    state = s._per_optimizer_states[id(opt)]
    w = model.weight.detach().clone()
    assert s._maybe_opt_step(opt, state) is None
    flags = lambda: [v.item() for v in state["found_inf_per_device"].values()]  # noqa: E731
    assert torch.equal(model.weight, w) and flags() == [1.0]
    assert s._skip_read is True
    s.update()
    opt.zero_grad()
    _backward(s, model)
    s.unscale_(opt)
    state = s._per_optimizer_states[id(opt)]
    s._maybe_opt_step(opt, state)
    assert not torch.equal(model.weight, w) and flags() == [0.0]


def test_the_step_read_remembers_a_skip_across_optimizers_in_any_order():
    a, b = _model(), _model()
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    s = LossScaler(init_scale=16.0)
    x = torch.ones(1, 2)
    s.scale(a(x).sum() + b(x).sum()).backward()
    a.weight.grad[0, 0] = INF
    s.step(oa)
    s.step(ob)
    assert s._skip_read is True
    s.update()
    assert s.last_skip_read is True


def test_recent_history_never_returns_more_than_was_recorded():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=8.0)
    _step(s, model, opt)
    _step(s, model, opt)
    assert s._history_tensor().tolist() == [[1.0, 8.0, 0.0], [2.0, 8.0, 0.0]]
    assert s.recent_records(5).shape == (2, len(rec.COLUMNS))


def test_a_disabled_scaler_reports_scale_one_whatever_its_state_holds():
    s = LossScaler(enabled=False)
    s._scale = 8.0  # GradScaler's attribute, written on a disabled scaler
    assert s.stats()["scale"] == 1.0 and s.get_scale() == 1.0


def test_counters_cover_every_step_when_the_ring_wraps_and_survive_a_save():
    """history_size=3 over 11 steps: the oldest records are folded into the counters as the ring
    wraps; a pickled, reloaded or state-dict copy counts exactly the same (no step twice, none
    lost), and so does a run of skips that crosses a fold."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    s = LossScaler(init_scale=2.0**20, history_size=3)
    plan = [None, INF, None, None, INF, INF, INF, INF, None, "nan", None]
    for p in plan:
        if p == "nan":
            _step(s, model, opt, loss_mul=NAN)
        else:
            _step(s, model, opt, plant=p)
    want = {"skipped_total": 6, "forward_overflows": 1, "consecutive_overflows": 0, "steps": 11}
    assert {k: s.stats()[k] for k in want} == want
    for copy_ in (
        pickle.loads(pickle.dumps(s)),
        copy.deepcopy(s),
        _loaded(s.state_dict()),
        _loaded(s.state_dict(), history_size=8),
    ):
        assert {k: copy_.stats()[k] for k in want} == want
        _step(copy_, model, opt, plant=INF)
        _step(copy_, model, opt, plant=INF)
        assert copy_.skipped_steps == 8 and copy_.consecutive_overflows == 2
    # a run of four skips across a fold (steps 5-8 with a ring of 3)
    t = LossScaler(init_scale=2.0**20, history_size=3)
    for p in [None, None, None, None, INF, INF, INF, INF]:
        _step(t, model, opt, plant=p)
    assert t.consecutive_overflows == 4 and t.skipped_steps == 4
    assert _loaded(t.state_dict()).consecutive_overflows == 4


def _loaded(sd: dict, **kw) -> LossScaler:
    out = LossScaler(**kw)
    out.load_state_dict(sd)
    return out
