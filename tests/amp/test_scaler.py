"""LossScaler (ampctl.amp.scaler, with its GradScaler layer scaler_compat.py and its update rule
scale_rule.py) and its config (ScalerConfig), in four parts:

1. Parity with torch.amp.GradScaler, hysteresis, bounds, planted faults, host reads.
2. Piece by piece: the update rule's every branch, every error message word for word, the
   counters, the history ring, the state dict, the GradScaler attributes, ScalerConfig's checks
   -- on a 2-parameter model, milliseconds each.
3. The corners the mutation run found untested (issue 31): the bounds with one of them off, the
   slow rule (hysteresis > 1) on every kind of skip, lowering the growth interval with and
   without a device state, the state's dtypes whatever torch's default dtype, the fresh found-inf
   flag, several per-device flags handed to an AMP-aware optimizer, a disabled scaler's scale
   after an update, the fold's cadence and the clamp's cost -- milliseconds each.
4. LossScaler as a ``torch.amp.GradScaler``: what PyTorch's own GradScaler tests check, on CPU.
   The behaviours come from upstream's grad-scaling tests (read, then rewritten here for CPU and
   for two implementations): test/test_torch.py and test/test_cuda.py (unscale, sparse unscale,
   state_dict, pickling, autocast with plain / foreach / fused optimizers, clipping, gradient
   penalty, accumulation, multiple models / optimizers / losses, the ``grad_scaler=`` optimizer
   protocol, a growth that would overflow, gradients broken between ``unscale_`` and ``step``),
   test/test_optim.py (fused optimizers against their for-loop versions under a scaler) and
   test/test_cuda_multigpu.py (``_found_inf_per_device`` per optimizer, nested outputs). Added to
   them: the private-attribute idioms that public training code uses (reading and writing
   ``_scale``, ``_growth_tracker``, ``_lazy_init_scale_growth_tracker``, all-reducing
   ``_found_inf_per_device``, ``_per_optimizer_states``, ``isinstance``), a long planted-overflow
   trajectory and the absence of bounds.

   Every test of part 4 takes ``make``, a factory with GradScaler's signature minus the device,
   parametrised over ``torch.amp.GradScaler("cpu", ...)`` and ``LossScaler.like_gradscaler("cpu",
   ...)``. Tests that record a trajectory (scales, growth tracker, skips, weights, grads, optimizer
   state) also assert, through ``_matches_reference``, that the run with ``make`` is bit-identical
   to the same scenario run with GradScaler.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import math
import pickle
import random
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import OptState

import ampctl.amp.scaler as scaler_module
from ampctl.amp import records as rec
from ampctl.amp.checks import FieldError
from ampctl.amp.scaler import CallOrderError, LossScaler, ScalerConfig, next_scale
from ampctl.hostreads import count_host_reads
from ampctl.opcount import count_ops


# ======================================================================= 1. parity with GradScaler
def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return (out.float() - y).pow(2).mean()


def _plant(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        next(iter(model.parameters())).grad.view(-1)[3] = value


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parity_with_gradscaler_on_planted_overflows(seed):
    rng = random.Random(seed)
    steps = 60
    planted = {
        s: rng.choice([float("inf"), float("nan"), -float("inf")])
        for s in rng.sample(range(steps), 12)
    }
    kw = dict(init_scale=2.0**14, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    ref_model, our_model = _model(seed), _model(seed)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    our_opt = torch.optim.AdamW(our_model.parameters(), lr=1e-2)
    ref = torch.amp.GradScaler("cpu", **kw)
    ours = LossScaler(**kw, hysteresis=1, min_scale=2.0**-30, max_scale=2.0**60)
    ref_scales, our_scales, ref_skips, our_skips = [], [], [], []
    for step, (x, y) in enumerate(_batches(steps, seed)):
        for model, opt, scaler, scales, skips in (
            (ref_model, ref_opt, ref, ref_scales, ref_skips),
            (our_model, our_opt, ours, our_scales, our_skips),
        ):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
            if step in planted:
                _plant(model, planted[step])
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            skips.append(
                all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            )
            scales.append(scaler.get_scale())
    assert our_scales == ref_scales
    assert our_skips == ref_skips
    assert sum(our_skips) >= len(planted)  # planted ones, plus any natural fp16 overflow
    for a, b in zip(ref_model.parameters(), our_model.parameters(), strict=True):
        assert torch.equal(a, b)
    # the observed skip record agrees with what happened to the weights
    hist = ours.history()
    assert [h[2] for h in hist] == our_skips
    assert ours.skipped_steps == sum(our_skips)


def test_natural_fp16_overflow_matches_gradscaler():
    """A too-large initial scale overflows the fp16 backward by itself; both back off alike."""
    kw = dict(init_scale=2.0**40, growth_interval=2)
    ref_model, our_model = _model(3), _model(3)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    our_opt = torch.optim.SGD(our_model.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu", **kw)
    ours = LossScaler(**kw, max_scale=2.0**60)
    for x, y in _batches(30, 3):
        for model, opt, scaler in ((ref_model, ref_opt, ref), (our_model, our_opt, ours)):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == ref.get_scale()
    assert ours.skipped_steps > 5


def test_skipped_step_leaves_weights_and_adam_state_untouched_and_grads_unscaled():
    for fused in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        scaler = LossScaler(init_scale=1024.0)
        x, y = _batches(1)[0]
        # one clean step so Adam has state
        scaler.scale(_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        weights = [p.detach().clone() for p in model.parameters()]
        state = _state_tensors(opt)
        scaler.scale(_loss(model, x, y)).backward()
        scaled = model[2].weight.grad.clone()
        _plant(model, float("nan"))
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped
        assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
        after = _state_tensors(opt)
        assert len(after) == len(state) and all(
            torch.equal(a, b) for a, b in zip(state, after, strict=True)
        )
        assert scaler.get_scale() == 512.0
        if (
            not fused
        ):  # the standard path unscales, like GradScaler; fused leaves grads to the kernel
            torch.testing.assert_close(model[2].weight.grad, scaled / 1024.0)


def test_hysteresis_backs_off_on_the_nth_overflow_and_refills_on_growth():
    scale = torch.tensor(1024.0)
    gt = torch.tensor(0, dtype=torch.int32)
    ht = torch.tensor(3, dtype=torch.int32)
    kw = dict(
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2,
        hysteresis=3,
        min_scale=1.0,
        max_scale=2.0**24,
    )
    t, f = torch.tensor(True), torch.tensor(False)
    seq = []
    for overflow in [True, True, True, True, False, False, True]:
        scale, gt, ht = next_scale(scale, gt, ht, t if overflow else f, f, **kw)
        seq.append((scale.item(), gt.item(), ht.item()))
    assert seq == [
        (1024.0, 0, 2),  # 1st overflow: hysteresis absorbs it
        (1024.0, 0, 1),  # 2nd
        (512.0, 0, 0),  # 3rd: back off
        (256.0, 0, 0),  # spent: every further overflow backs off
        (256.0, 1, 0),
        (512.0, 0, 3),  # growth refills the counter
        (512.0, 0, 2),
    ]


def test_hysteresis_in_the_scaler_skips_every_overflow():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0, hysteresis=2)
    x, y = _batches(1)[0]
    scales = []
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(model, float("inf"))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [1024.0, 512.0, 256.0]
    assert scaler.skipped_steps == 3 and scaler.consecutive_overflows == 3


def test_bounds_clamp_the_scale():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    x, y = _batches(1)[0]
    scales = []
    for i in range(8):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        if i >= 4:
            _plant(model, float("inf"))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0]
    assert LossScaler(init_scale=2.0**30).get_scale() == 2.0**24  # initial value clamped too


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_forward_overflow_is_skipped_and_counted_and_keeps_the_scale(hysteresis, bad):
    """A non-finite loss: skipped and counted as a forward overflow, and the scale stays at
    every hysteresis (a smaller scale cannot cure an overflow in the forward), with one host
    read for the step (step()'s) and none in update()."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0, growth_interval=1000, hysteresis=hysteresis)
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model, x, y) * torch.tensor(bad)).backward()
    with count_host_reads() as reads:
        scaler.step(opt)
        scaler.update()
    assert reads.total == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    st = scaler.stats()
    assert st["scale"] == 1024.0 and st["skipped_total"] == 1 and st["forward_overflows"] == 1
    assert scaler.last_step_skipped and scaler.history() == [(1, 1024.0, True)]
    assert scaler.state_dict()["_hysteresis_tracker"] == hysteresis  # it spends no hysteresis
    # the gradient overflows that follow back off as ever: the hysteresis-th of them halves
    for _ in range(hysteresis):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        _plant(model, float("inf"))
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 512.0
    assert scaler.forward_overflows == 1 and scaler.skipped_steps == 1 + hysteresis


def test_across_ranks_a_forward_overflow_backs_off_on_every_rank_as_in_gradscaler():
    """With reduce_flags (torch.distributed) the skip is agreed but the loss is this rank's: at
    hysteresis 1 every rank backs off alike, so the ranks' scales stay equal."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0)
    scaler.reduce_flags = lambda flag: flag  # one rank's view of an all-reduce MAX
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0 and scaler.forward_overflows == 1


def test_a_forward_overflow_keeps_the_scale_within_the_bounds_and_then_grows_on_time():
    """Hysteresis 1: the forward overflow's scale is the one the step used (clamped as ever);
    the growth count restarts after it (a skipped step, as GradScaler counts it)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = LossScaler(init_scale=64.0, growth_interval=2, max_scale=128.0)
    x, y = _batches(1)[0]
    scales = []
    for i in range(6):
        opt.zero_grad()
        loss = _loss(model, x, y)
        scaler.scale(loss * float("inf") if i == 1 else loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    # 0 clean (1 of 2), 1 forward (kept, the count restarts), 2 clean, 3 clean: grows to the
    # ceiling, 4-5 clean at the ceiling
    assert scales == [64.0, 64.0, 64.0, 128.0, 128.0, 128.0]
    assert scaler.forward_overflows == 1 and scaler.skipped_steps == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_disabled_scaling_still_skips_nonfinite_steps(dtype):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler(enabled=False)
    x, y = _batches(1)[0]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = (model(x).float() - y).pow(2).mean()
    scaled = scaler.scale(loss)
    assert scaled is loss
    outputs = [loss]
    assert scaler.scale(outputs) is outputs  # checked, handed back as given
    scaled.backward()
    _plant(model, float("nan"))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()


def test_check_finite_false_is_a_pass_through():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(enabled=False, check_finite=False)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    _plant(model, float("nan"))
    scaler.step(opt)
    scaler.update()
    assert torch.isnan(next(iter(model.parameters()))).any()


def test_host_reads_per_step_standard_and_fused():
    x, y = _batches(1)[0]
    for fused, expected in ((False, 1), (True, 0)):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = LossScaler()
        counts = []
        for i in range(4):
            loss = _loss(model, x, y)
            with count_host_reads() as reads:
                scaler.scale(loss).backward()
                if i == 2:
                    _plant(model, float("inf"))
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            counts.append(reads.total)
        assert counts == [expected] * 4, (fused, counts)
        assert scaler.skipped_steps == 1  # the skip is still counted on the fused path


def test_fused_adamw_path_matches_standard_path():
    x, y = _batches(1)[0]
    results = []
    for fused in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = LossScaler(init_scale=256.0, growth_interval=2)
        for i in range(6):
            opt.zero_grad()
            scaler.scale(_loss(model, x, y)).backward()
            if i == 3:
                _plant(model, float("inf"))
            scaler.step(opt)
            scaler.update()
        results.append(([p.detach() for p in model.parameters()], scaler.history()))
    (wa, ha), (wb, hb) = results
    assert ha == hb
    for a, b in zip(wa, wb, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_keeps_counters_and_history(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=512.0, growth_interval=3, hysteresis=2, history_size=4)
    x, y = _batches(1)[0]
    for i in range(6):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        if i in (1, 2):
            _plant(model, float("inf"))
        scaler.step(opt)
        scaler.update()
    sd = scaler.state_dict()
    path = tmp_path / "scaler.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)
    other = LossScaler(history_size=4)
    other.load_state_dict(loaded)
    assert other.state_dict().keys() == sd.keys()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            torch.testing.assert_close(v, other.state_dict()[k], rtol=0, atol=0, equal_nan=True)
        else:
            assert other.state_dict()[k] == v, k
    assert other.history() == scaler.history() and len(other.history()) == 4
    # continuing both gives the same trajectory
    for s in (scaler, other):
        s.scale(_loss(model, x, y)).backward()
        s.step(torch.optim.SGD(model.parameters(), lr=0.0))
        s.update()
    assert other.history() == scaler.history()
    assert other.skipped_steps == scaler.skipped_steps == 2


def test_loads_a_gradscaler_state_dict():
    ref = torch.amp.GradScaler("cpu", init_scale=2048.0, growth_interval=7)
    ours = LossScaler()
    ours.load_state_dict(ref.state_dict())
    assert ours.get_scale() == 2048.0 and ours.get_growth_interval() == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"init_scale": 0.0},
            "init_scale=0.0 is not allowed: init_scale must be a finite number > 0",
        ),
        ({"init_scale": float("inf")}, "init_scale must be a finite number > 0"),
        ({"growth_factor": 1.0}, "growth_factor must be a number > 1"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1)"),
        ({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1)"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
        ({"growth_interval": 2.5}, "growth_interval must be an integer >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale must be <= max_scale (4.0)"),
        ({"min_scale": -1.0}, "min_scale must be a finite number >= 0"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError) as e:
        LossScaler(**kwargs)
    assert message in str(e.value)


def test_call_order_errors_say_the_fix():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    with pytest.raises(
        RuntimeError, match=r"before scale\(\): call scaler.scale\(loss\).backward\(\) first"
    ):
        scaler.step(opt)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(
        RuntimeError, match=r"already called for this optimizer in this step: call it once per step"
    ):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(
        RuntimeError, match=r"step\(\) was already called .* call update\(\) after step\(\)"
    ):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) was called after step\(\)"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match=r"update\(\) was called before step\(\)"):
        scaler.update()


def test_fp16_parameters_are_refused_with_the_fix():
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler()
    x, y = _batches(1)[0]
    scaler.scale((model(x.half()).float() - y).pow(2).mean()).backward()
    with pytest.raises(ValueError, match="precision=fp16-pure"):
        scaler.step(opt)


def test_gradient_accumulation_ors_the_loss_flag():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=64.0)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y) * float("nan")).backward()
    scaler.scale(_loss(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    # the NaN micro-batch makes the step's loss NaN: one forward overflow for the whole step,
    # which keeps the scale
    assert scaler.last_step_skipped and scaler.forward_overflows == 1 and scaler.get_scale() == 64.0


def test_gradscaler_can_be_swapped_out_in_a_user_loop():
    """The README's claim: replace GradScaler(...) by LossScaler() and change nothing else --
    the same loop gives bit-identical weights, scales and optimizer state (no overflow, the scale
    within LossScaler's default bounds)."""
    start = _model()
    results = []
    for scaler in (torch.amp.GradScaler("cpu"), LossScaler()):
        model = copy.deepcopy(start)
        opt = torch.optim.AdamW(model.parameters())
        scales = []
        for x, y in _batches(5):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        results.append((scales, model.state_dict(), opt.state_dict()["state"]))
    (s_gs, w_gs, o_gs), (s_ls, w_ls, o_ls) = results
    assert s_gs == s_ls
    assert all(torch.equal(w_gs[k], w_ls[k]) for k in w_gs)
    assert all(torch.equal(o_gs[i][k], o_ls[i][k]) for i in o_gs for k in ("exp_avg", "exp_avg_sq"))


# ------------------------------------------------------------ GradScaler subclass, ampctl extras
def test_no_gradscaler_method_runs_on_state_of_its_own():
    """LossScaler subclasses GradScaler without calling its __init__; every GradScaler method
    must be LossScaler's own, or it would run on attributes LossScaler does not keep."""
    gs = torch.amp.GradScaler
    methods = [n for n, v in vars(gs).items() if inspect.isfunction(v)]
    assert {"scale", "step", "update", "_unscale_grads_", "__getstate__"} <= set(methods)
    # defined by LossScaler or its GradScaler-attributes mixin, never taken from GradScaler
    owner = {n: next(c for c in LossScaler.__mro__ if n in vars(c)) for n in methods}
    inherited = [n for n in methods if owner[n] is gs]
    assert inherited == [], f"GradScaler methods not overridden by LossScaler: {inherited}"
    scaler = LossScaler()
    for attr in (  # what GradScaler.__init__ sets, readable with GradScaler's meaning
        "_device",
        "_enabled",
        "_init_scale",
        "_scale",
        "_growth_factor",
        "_backoff_factor",
        "_growth_interval",
        "_init_growth_tracker",
        "_growth_tracker",
        "_per_optimizer_states",
    ):
        assert hasattr(scaler, attr), attr


def test_like_gradscaler_sets_the_documented_arguments():
    s = LossScaler.like_gradscaler("cpu", init_scale=512.0, growth_interval=7)
    assert (s.hysteresis, s.min_scale, s.max_scale) == (1, 0.0, float("inf"))
    assert (s._check_loss, s._check_finite) == (False, True)  # enabled: gradients checked
    assert s.get_scale() == 512.0 and s.get_growth_interval() == 7 and s._device == "cpu"
    off = LossScaler.like_gradscaler("cpu", enabled=False)
    assert off._check_finite is False  # a disabled one is a pure pass-through
    if not torch.cuda.is_available():  # GradScaler("cuda") without CUDA disables itself
        with pytest.warns(UserWarning, match="CUDA is not available"):
            assert not LossScaler.like_gradscaler().is_enabled()


def test_defaults_keep_ampctls_bounds_and_forward_overflow_rule():
    s = LossScaler()
    assert (s.min_scale, s.max_scale, s.hysteresis) == (1.0, 2.0**24, 1)
    assert s._check_loss and s._check_finite


def test_gradscalers_positional_device_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"device='cuda'.*like_gradscaler\('cuda'"):
        LossScaler("cuda")


def test_unbounded_arguments_are_accepted_and_nan_is_not():
    s = LossScaler(min_scale=0.0, max_scale=float("inf"))
    assert s.min_scale == 0.0 and s.max_scale == float("inf")
    with pytest.raises(ValueError, match="max_scale must be a number > 0"):
        LossScaler(max_scale=float("nan"))
    with pytest.raises(ValueError, match="min_scale must be a finite number >= 0"):
        LossScaler(min_scale=float("inf"), max_scale=float("inf"))


def _train(scaler, steps, plant_at=(), model=None):
    model = model or _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = _batches(1)[0]
    for i in range(steps):
        opt.zero_grad()
        scaler.scale(_loss(model, x, y)).backward()
        if i in plant_at:
            _plant(model, float("inf"))
        scaler.step(opt)
        scaler.update()
    return model, opt


def test_check_loss_false_backs_off_on_a_nonfinite_loss_like_gradscaler():
    """check_loss=False (and like_gradscaler) backs off on a NaN loss and records a gradient
    overflow, as GradScaler; the default keeps the scale and records a forward overflow."""
    results = {}
    for name, scaler in (
        ("default", LossScaler(init_scale=1024.0)),
        ("check_loss=False", LossScaler(init_scale=1024.0, check_loss=False)),
        ("GradScaler", torch.amp.GradScaler("cpu", init_scale=1024.0)),
    ):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _batches(1)[0]
        scaler.scale(_loss(model, x, y) * float("nan")).backward()
        scaler.step(opt)
        scaler.update()
        results[name] = (scaler.get_scale(), getattr(scaler, "forward_overflows", None))
    assert results == {
        "default": (1024.0, 1),
        "check_loss=False": (512.0, 0),
        "GradScaler": (512.0, None),
    }


def test_lowered_growth_interval_grows_where_gradscaler_never_would():
    """The one deliberate difference: GradScaler grows only when its tracker *equals* the
    interval, so after lowering the interval below the tracker it stops growing."""
    ours = LossScaler.like_gradscaler("cpu", init_scale=8.0, growth_interval=10)
    ref = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10)
    for s in (ours, ref):
        _train(s, 5)
        s.set_growth_interval(3)
        _train(s, 4)
    assert ref.get_scale() == 8.0 and ref._get_growth_tracker() == 9
    assert ours.get_scale() == 32.0 and ours._get_growth_tracker() == 0  # grew at 6 and 3


def test_writing_scale_works_with_ampctls_bounds_and_the_next_update_clamps():
    scaler = LossScaler(init_scale=64.0, growth_interval=1000, min_scale=4.0, max_scale=128.0)
    _train(scaler, 1)
    scaler._scale = 1024.0  # a number is accepted too
    assert scaler.get_scale() == 1024.0 and scaler.stats()["scale"] == 1024.0
    _train(scaler, 1)
    assert scaler.get_scale() == 128.0  # the update applies the bounds
    scaler._scale.fill_(1.0)
    _train(scaler, 1, plant_at=(0,))
    assert scaler.get_scale() == 4.0
    assert [h[1] for h in scaler.history()] == [64.0, 1024.0, 1.0]  # the scale each step used
    with pytest.raises(ValueError, match="cannot be set to None"):
        scaler._scale = None


def test_scale_and_tracker_assigned_before_the_first_step():
    s = LossScaler(init_scale=64.0, growth_interval=2)
    s._scale = 16.0
    s._growth_tracker = 1
    assert s._scale is None and s.get_scale() == 16.0  # still lazy, the start values changed
    _train(s, 1)
    assert s.get_scale() == 32.0
    t = LossScaler(init_scale=64.0)
    t._scale = torch.tensor(8.0)  # a tensor creates the state on its device, as GradScaler's
    assert t.device == torch.device("cpu") and t._scale.item() == 8.0


def test_load_state_dict_keeps_the_live_scale_tensor():
    s = LossScaler(init_scale=64.0)
    _train(s, 2)
    held = s._scale
    s.load_state_dict(LossScaler(init_scale=1024.0).state_dict())
    assert s._scale is held and held.item() == 1024.0


def test_lazy_init_on_the_same_device_is_a_no_op_and_another_is_refused():
    s = LossScaler(init_scale=64.0)
    _train(s, 1)
    held = s._scale
    s._lazy_init_scale_growth_tracker("cpu")
    assert s._scale is held
    with pytest.raises(CallOrderError, match="already lives on cpu, not meta"):
        s._lazy_init_scale_growth_tracker("meta")


def test_pickle_keeps_ampctls_counters_and_history_but_not_the_reduce_hook():
    s = LossScaler(init_scale=64.0, hysteresis=2, history_size=8)
    s.reduce_flags = lambda flags: flags  # a process-local hook (closures do not pickle)
    _train(s, 4, plant_at=(1, 2))
    t = pickle.loads(pickle.dumps(s))
    assert t.reduce_flags is None and t.device is None  # re-created at the next scale()
    assert t.history() == s.history() and t.skipped_steps == 2 and t.num_updates == 4
    assert t.hysteresis == 2 and t.state_dict()["_hysteresis_tracker"] == 0
    for scaler in (s, t):
        _train(scaler, 1, plant_at=(0,))
    assert t.history() == s.history() and t.get_scale() == s.get_scale() == 16.0


def test_update_new_scale_refuses_a_tensor_that_requires_grad():
    s = LossScaler()
    _train(s, 1)
    with pytest.raises(ValueError, match="does not require grad"):
        s.update(new_scale=torch.tensor(2.0, requires_grad=True))
    with pytest.raises(ValueError, match="one-element tensor"):
        s.update(new_scale=torch.ones(2))


def test_call_order_errors_are_runtime_and_assertion_errors():
    s = LossScaler()
    with pytest.raises(CallOrderError) as e:
        s.update()
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, AssertionError)


def test_update_after_unscale_without_step_records_the_skip_without_host_reads():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=64.0)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    _plant(model, float("inf"))
    with count_host_reads() as reads:
        scaler.unscale_(opt)
        scaler.update()
    assert reads.total == 0
    assert scaler.get_scale() == 32.0 and scaler.skipped_steps == 1 and scaler.num_updates == 1


def test_disabled_scaler_with_checks_passes_a_closure_through_and_records_the_step():
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    scaler = LossScaler(enabled=False)
    x, y = _batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = scaler.scale((model(x) - y).pow(2).mean())
        loss.backward()
        return loss

    assert torch.isfinite(scaler.step(opt, closure=closure))
    scaler.update()
    assert scaler.num_updates == 1 and scaler.skipped_steps == 0
    with pytest.raises(RuntimeError, match="closures are not supported"):
        LossScaler().step(opt, closure=closure)


def test_found_inf_reduced_in_place_before_a_fused_step_skips_on_the_device():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = LossScaler(init_scale=64.0)
    x, y = _batches(1)[0]
    scaler.scale(_loss(model, x, y)).backward()
    scaler.unscale_(opt)
    for v in scaler._found_inf_per_device(opt).values():
        v.fill_(1.0)  # another rank overflowed
    before = [p.detach().clone() for p in model.parameters()]
    with count_host_reads() as reads:
        scaler.step(opt)
        scaler.update()
    assert reads.total == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 32.0 and scaler.skipped_steps == 1


# ================================================================================ 2. piece by piece
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
def _linear() -> nn.Module:
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
    model = _linear()
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

    model = _linear()
    s = LossScaler(init_scale=8.0)
    assert _step(s, model, Returns(model.parameters(), lr=0.1)) == "stepped"
    assert _step(s, model, Returns(model.parameters(), lr=0.1), plant=INF) is None


def test_skipped_steps_are_counted_by_kind_and_in_a_row():
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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
    opt = torch.optim.SGD(_linear().parameters(), lr=0.1)
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
    model = _linear()
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
    model = _linear().half()
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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
    a, b = _linear(), _linear()
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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


class _UnscalesThroughScaler(torch.optim.SGD):
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
    model = _linear()
    opt = _UnscalesThroughScaler(model.parameters(), lr=0.1)
    s = LossScaler(init_scale=4.0)
    _backward(s, model, plant=INF)
    with pytest.warns(FutureWarning, match="LossScaler passes itself as grad_scaler="):
        assert s.step(opt) == "done"
    assert opt.got is s and s._skip_read is None
    assert s._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    s.update()
    assert s.skipped_steps == 1 and s.get_scale() == 2.0


def test_amp_aware_optimizer_gets_the_scale_and_the_flag():
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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

    class TakesScalerArgs(_UnscalesThroughScaler):
        def step(self, closure=None, grad_scaler=None, *, extra=None):
            self.args = (closure, extra)
            return super().step(grad_scaler=grad_scaler)

    model = _linear()
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
    model = _linear()
    s = LossScaler(init_scale=4.0)
    calls = []
    s.reduce_flags = lambda flags: calls.append(1) or flags
    for opt in (
        torch.optim.SGD(model.parameters(), lr=0.1),
        _UnscalesThroughScaler(model.parameters(), lr=0.1),
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
    model = _linear()
    opt = _UnscalesThroughScaler(model.parameters(), lr=0.1)
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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
    model = _linear()
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

    opt = Args(_linear().parameters(), lr=0.1)
    s = LossScaler(enabled=False, check_finite=False)
    assert s.step(opt, "pos", key=1) == "stepped" and opt.got == (("pos",), {"key": 1})


def test_maybe_opt_step_reached_into_directly_decides_from_the_recorded_flags():
    """GradScaler's internal, as training code calls it after unscale_: it computes the flags
    itself when step() has not."""
    model = _linear()
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
    a, b = _linear(), _linear()
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
    model = _linear()
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
    model = _linear()
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


# ===================================================================================== ScalerConfig
def test_scaler_config_defaults_are_the_scalers():
    c = ScalerConfig()
    assert dataclasses.asdict(c) == {
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "hysteresis": 1,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
        "history_size": 1024,
    }
    s = LossScaler(**dataclasses.asdict(c))
    assert (s.get_scale(), s.history_size, s.min_scale, s.max_scale) == (
        2.0**16,
        1024,
        1.0,
        2.0**24,
    )


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("init_scale", -1.0, "a finite number > 0"),
        ("history_size", 0, "an integer >= 1"),
        ("growth_interval", 0, None),
        ("hysteresis", 0, None),
        ("growth_factor", 1.0, None),
        ("backoff_factor", 1.0, None),
        ("min_scale", 4.0, None),
    ],
)
def test_scaler_config_refuses_what_the_scaler_refuses_naming_itself(field, value, allowed):
    kw = {field: value, **({"max_scale": 2.0} if field == "min_scale" else {})}
    with pytest.raises(FieldError) as theirs:
        LossScaler(**kw)
    with pytest.raises(FieldError) as e:
        ScalerConfig(**kw)
    err = e.value
    assert (err.owner, err.field, err.value) == ("ScalerConfig", theirs.value.field, value)
    assert err.allowed == theirs.value.allowed and (allowed is None or err.allowed == allowed)
    assert str(err) == str(theirs.value).replace("LossScaler:", "ScalerConfig:", 1)
    assert err.__cause__ is None and err.__suppress_context__


# ================================================= 3. the corners the mutation run found (issue 31)
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


class _SumsFlags(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None):  # noqa: ARG002 (the fused kernels' protocol)
        self.seen = (self.grad_scale, self.found_inf)


def test_an_amp_aware_optimizer_gets_the_sum_of_every_devices_flag():
    s = LossScaler()
    opt = _SumsFlags([nn.Parameter(torch.ones(1))], lr=0.0)
    s.scale(torch.tensor(1.0))
    opt.param_groups[0]["params"][0].grad = torch.ones(1)
    s.unscale_(opt)
    flags = s._found_inf_per_device(opt)
    flags["other"] = torch.ones(())  # a planted second device's flag: it overflowed
    s.step(opt)
    assert opt.seen[0] is None and opt.seen[1].item() == 1.0


def test_an_amp_aware_optimizer_gets_the_one_flag_itself():
    s = LossScaler()
    opt = _SumsFlags([nn.Parameter(torch.ones(1))], lr=0.0)
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


# ========================================================== 4. LossScaler as a torch.amp.GradScaler
CPU = torch.device("cpu")
GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _grad_scaler(**kw) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kw)


def _loss_scaler(**kw) -> torch.amp.GradScaler:
    return LossScaler.like_gradscaler("cpu", **kw)


FACTORIES = {"GradScaler": _grad_scaler, "LossScaler": _loss_scaler}


@pytest.fixture(params=sorted(FACTORIES))
def make(request):
    return FACTORIES[request.param]


# ---------------------------------------------------------------------------------- helpers
def _same(a, b, path: str = "result") -> None:
    """Bitwise equality of nested results (NaN equals NaN, sparse compared dense)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        a = a.to_dense() if a.is_sparse else a
        b = b.to_dense() if b.is_sparse else b
        assert a.dtype == b.dtype and a.shape == b.shape, path
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _matches_reference(make, scenario, *args, **kwargs):
    """Run ``scenario(make, ...)``; for LossScaler also run it with GradScaler and require the
    two results to be equal bit for bit."""
    got = scenario(make, *args, **kwargs)
    if make is not _grad_scaler:
        _same(got, scenario(_grad_scaler, *args, **kwargs))
    return got


def _saved(scaler) -> dict:
    """GradScaler's five state_dict entries (LossScaler saves more)."""
    sd = scaler.state_dict()
    return {k: sd[k] for k in GRADSCALER_KEYS}


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    def state(p):
        return {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in optimizer.state[p].items()
        }

    params = list(model.parameters())
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "state": [state(p) for p in params],
    }


def _models(optimizer_ctor, optimizer_kwargs):
    control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    scaling = copy.deepcopy(control)
    kw = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        control,
        scaling,
        optimizer_ctor(control.parameters(), **kw),
        optimizer_ctor(scaling.parameters(), **kw),
    )


def _case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None, seed: int = 0):
    """Upstream's scaling case: a control model trained without scaling and a copy trained with
    it, four (8, 8) batches, an inf planted at iteration 2 (the penultimate one)."""
    torch.manual_seed(seed)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
    return (*_models(optimizer_ctor, optimizer_kwargs), data, nn.MSELoss(), 2)


def _scaling_case(
    make,
    run,
    unskipped: int,
    skipped: int,
    *,
    atol: float = 1e-7,
    optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
    compare_control: bool = True,
):
    """Upstream's ``_run_scaling_case``: enabled and disabled, the scale after the run is
    128 * 2**unskipped * 0.5**skipped, and the scaled run matches the unscaled control."""
    out = []
    for enabled in (True, False):
        control, scaling, opt_c, opt_s, data, loss_fn, skip_iter = _case(
            optimizer_ctor, optimizer_kwargs
        )
        scaler = make(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, control, opt_c, scaler, loss_fn, skip_iter, False)
        scaler = run(data, scaling, opt_s, scaler, loss_fn, skip_iter, True) or scaler
        expected = 128.0 * 2.0**unskipped * 0.5**skipped if enabled else 1.0
        assert scaler.get_scale() == expected
        if compare_control:
            for c, s in zip(control.parameters(), scaling.parameters(), strict=True):
                torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
                for k, v in opt_c.state[c].items():
                    torch.testing.assert_close(v, opt_s.state[s][k], atol=atol, rtol=1e-5)
                torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)
        out.append((scaler.get_scale(), _snapshot(scaling, opt_s)))
    return out


def _plant_inf(model: nn.Module) -> None:
    with torch.no_grad():
        model[1].weight.grad.fill_(INF)


def _step_all(scaler, model, opt, x, y, plant=None):
    """One iteration of the plain loop; returns whether the weights were left untouched."""
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    if plant is not None:
        with torch.no_grad():
            next(iter(model.parameters())).grad.view(-1)[0] = plant
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    return all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def _small(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(3, 4), torch.randn(3, 2)


# ------------------------------------------------------------------ test_torch / test_cuda
def _autocast_run(try_pickle: bool):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                loss = loss_fn(model(x), y)
            if try_scaling_api:
                scaler.scale(loss).backward()
                if i == skip_iter and scaler.is_enabled():
                    _plant_inf(model)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not scaler.is_enabled() or i != skip_iter:
                    optimizer.step()
        return scaler

    return run


@pytest.mark.parametrize("optimizer_ctor", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("variant", ["for-loop", "foreach", "fused", "pickled every step"])
def test_autocast_scaled_run_matches_unscaled_control(make, optimizer_ctor, variant):
    kwargs = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}}.get(variant, {})
    if variant == "fused":
        kwargs = {"fused": True}
    # Upstream compares Adam(W) to the fp32 control only loosely (it expects a mismatch at
    # atol=1e-3); the scale and the GradScaler reference are compared for all.
    _matches_reference(
        make,
        _scaling_case,
        _autocast_run(try_pickle=variant == "pickled every step"),
        unskipped=3,
        skipped=1,
        atol=1e-3,
        optimizer_ctor=optimizer_ctor,
        optimizer_kwargs=kwargs,
        compare_control=optimizer_ctor is torch.optim.SGD,
    )


def _clipping_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            if i == skip_iter and scaler.is_enabled():
                _plant_inf(model)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


def _clipping_separate_unscale_run(
    data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api
):
    max_norm = 0.2
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                _plant_inf(model)
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


def _penalty_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if try_scaling_api:
            grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
            inv_scale = 1.0 / scaler.get_scale()
            grads = [g * inv_scale for g in grads]
        else:
            grads = torch.autograd.grad(loss, model.parameters(), create_graph=True)
        loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
        if try_scaling_api:
            scaler.scale(loss).backward()
            if i == skip_iter and scaler.is_enabled():
                _plant_inf(model)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            if not scaler.is_enabled() or i != skip_iter:
                optimizer.step()


def _accumulation_run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
    every = 2
    for i, (x, y) in enumerate(data):
        loss = loss_fn(model(x), y) / every
        (scaler.scale(loss) if try_scaling_api else loss).backward()
        if (i + 1) % every == 0:
            if try_scaling_api:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()


@pytest.mark.parametrize(
    "run, unskipped, skipped, atol",
    [
        (_clipping_run, 3, 1, 1e-5),
        (_clipping_separate_unscale_run, 3, 1, 1e-7),
        (_penalty_run, 3, 1, 1e-7),
        (_accumulation_run, 2, 0, 1e-7),
    ],
    ids=["clipping", "clipping-separate-unscale", "gradient-penalty", "accumulation"],
)
def test_fp32_scaled_run_matches_unscaled_control(make, run, unskipped, skipped, atol):
    _matches_reference(make, _scaling_case, run, unskipped=unskipped, skipped=skipped, atol=atol)


def _multiple(make, enabled: bool):
    """Two models, two optimizers, two losses; one optimizer unscaled separately; the inf lands
    in the second model only. Upstream's multi-GPU version also checks found_inf per optimizer."""
    control0, scaling0, opt_c0, opt_s0, data, loss_fn, skip_iter = _case()
    control1, scaling1, opt_c1, opt_s1 = _models(torch.optim.SGD, None)
    scaler = make(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
    found_seen = []

    def run(model0, model1, opt0, opt1, try_scaling_api):
        for i, (x, y) in enumerate(data):
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == skip_iter and scaler.is_enabled():
                    _plant_inf(model1)
                scaler.unscale_(opt0)
                scaler.step(opt0)
                scaler.step(opt1)
                if scaler.is_enabled():
                    f0, f1 = scaler._found_inf_per_device(opt0), scaler._found_inf_per_device(opt1)
                    assert list(f0) == [CPU] and list(f1) == [CPU]
                    assert f0[CPU].item() == 0.0
                    assert f1[CPU].item() == float(i == skip_iter)
                    found_seen.append(f1[CPU].item())
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()
                if not scaler.is_enabled() or i != skip_iter:
                    opt1.step()

    run(control0, control1, opt_c0, opt_c1, False)
    run(scaling0, scaling1, opt_s0, opt_s1, True)
    assert scaler.get_scale() == (128.0 * 2.0**3 * 0.5 if enabled else 1.0)
    for c, s in zip(
        [*control0.parameters(), *control1.parameters()],
        [*scaling0.parameters(), *scaling1.parameters()],
        strict=True,
    ):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)
    return scaler.get_scale(), found_seen, _snapshot(scaling0, opt_s0), _snapshot(scaling1, opt_s1)


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_multiple_models_optimizers_and_losses(make, enabled):
    _matches_reference(make, _multiple, enabled)


def _fused_against_forloop(make, optimizer_ctor, kwargs, separate_unscale):
    """test_optim's fused-optimizer case: a fused optimizer with the scaler (which hands the
    scale to the kernel) tracks the for-loop one with the scaler (which unscales first)."""
    _, _, _, _, data, loss_fn, _ = _case()
    torch.manual_seed(20)
    control, scaling, _, opt_s = _models(optimizer_ctor, {**kwargs, "fused": True})
    opt_c = optimizer_ctor(control.parameters(), lr=1.0, **{**kwargs, "fused": False})
    scaler_c, scaler_s = make(init_scale=128.0), make(init_scale=128.0)
    trace = []
    for x, y in data:
        for model, opt, scaler, unscale in (
            (control, opt_c, scaler_c, False),
            (scaling, opt_s, scaler_s, separate_unscale),
        ):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        for pc, ps in zip(control.parameters(), scaling.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, ps.grad)
            torch.testing.assert_close(pc, ps, atol=2e-5, rtol=2e-5)
            for k, v in opt_c.state[pc].items():
                torch.testing.assert_close(
                    v, opt_s.state[ps][k].reshape(v.shape), atol=2e-5, rtol=2e-5
                )
        trace.append((scaler_s.get_scale(), _snapshot(scaling, opt_s)))
    return trace


@pytest.mark.parametrize(
    "optimizer_ctor, kwargs",
    [
        (torch.optim.Adam, {"amsgrad": False}),
        (torch.optim.Adam, {"amsgrad": True}),
        (torch.optim.AdamW, {"amsgrad": False}),
        (torch.optim.SGD, {"momentum": 0.9}),
    ],
    ids=["Adam", "Adam-amsgrad", "AdamW", "SGD-momentum"],
)
@pytest.mark.parametrize("separate_unscale", [False, True], ids=["in-step", "separate-unscale"])
def test_fused_optimizer_matches_for_loop_optimizer(make, optimizer_ctor, kwargs, separate_unscale):
    _matches_reference(make, _fused_against_forloop, optimizer_ctor, kwargs, separate_unscale)


def _invalidated(make, optimizer_ctor, kwargs):
    model, _, opt, _, data, loss_fn, _ = _case(optimizer_ctor, kwargs)
    scaler = make(init_scale=128.0)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):  # broken after the check: too late to skip
            p.grad.copy_(torch.tensor(INF if j % 2 else float("nan")))
        scaler.step(opt)
        scaler.update()
    assert all(bool((p.isnan() | p.isinf()).any()) for p in model.parameters())
    return scaler.get_scale(), _snapshot(model, opt)


@pytest.mark.parametrize("optimizer_ctor", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize(
    "kwargs",
    [{"foreach": False}, {"foreach": True}, {"fused": True}],
    ids=["for-loop", "foreach", "fused"],
)
def test_grads_broken_between_unscale_and_step_reach_the_weights(make, optimizer_ctor, kwargs):
    _matches_reference(make, _invalidated, optimizer_ctor, kwargs)


def test_growth_that_would_overflow_keeps_the_scale(make):
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    scaler = make(growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler._scale.item())
    assert scaler.get_scale() == torch.tensor(1e38).item()


class _AmpAware(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.seen: dict = {}


class _TakesScaler(_AmpAware):
    """The deprecated protocol: the scaler passes itself as ``grad_scaler=``."""

    def step(self, closure=None, *, grad_scaler=None):
        self.seen = {
            "is_gradscaler": isinstance(grad_scaler, torch.amp.GradScaler),
            "has_grad_scale": hasattr(self, "grad_scale"),
            "has_found_inf": hasattr(self, "found_inf"),
        }


class _ReadsAttributes(_AmpAware):
    """The current protocol: ``grad_scale`` and ``found_inf`` tensors set on the optimizer."""

    def step(self, closure=None):
        self.seen = {"grad_scale": self.grad_scale.clone(), "found_inf": self.found_inf.clone()}


def test_scaler_passes_itself_or_its_tensors_to_amp_aware_optimizers(make):
    m = nn.Linear(4, 1)
    o1, o2 = _TakesScaler(m.parameters()), _ReadsAttributes(m.parameters())
    scaler = make(init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(4, 4)).float().mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert o1.seen == {"is_gradscaler": True, "has_grad_scale": False, "has_found_inf": False}
    assert o2.seen["grad_scale"].item() == 2.0 and o2.seen["found_inf"].item() == 0.0
    assert not hasattr(o2, "grad_scale") and not hasattr(o2, "found_inf")


class _SelfUnscalingSGD(torch.optim.SGD):
    """An optimizer of the ``grad_scaler=`` protocol that unscales itself, reads the found_inf
    record and skips on overflow (what such optimizers, e.g. Apex-style ones, do)."""

    _step_supports_amp_scaling = True

    def step(self, closure=None, *, grad_scaler=None):
        grad_scaler.unscale_(self)
        found = sum(v.item() for v in grad_scaler._found_inf_per_device(self).values())
        if not found:
            super().step()


def _grad_scaler_protocol(make):
    model, _, x, y = _small()
    opt = _SelfUnscalingSGD(model.parameters(), lr=0.1)
    scaler = make(init_scale=64.0, growth_interval=2)
    out = []
    for i in range(5):
        with pytest.warns(FutureWarning):
            untouched = _step_all(scaler, model, opt, x, y, plant=INF if i == 2 else None)
        out.append((untouched, scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    assert [u for u, _, _ in out] == [False, False, True, False, False]
    return out, _snapshot(model, opt)


def test_grad_scaler_protocol_optimizer_that_unscales_itself(make):
    _matches_reference(make, _grad_scaler_protocol)


def test_scale_nested_outputs(make):
    scaler = make(init_scale=2.0)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 4.0)
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    out = scaler.scale(outputs)
    assert isinstance(out, tuple) and isinstance(out[1], tuple) and isinstance(out[2], list)
    flat = [out[0], out[1][0], out[1][1], out[2][0], out[2][1][0], out[2][1][1]]
    assert all(t.item() == 8.0 for t in flat)
    assert scaler._scale.device == t1.device
    assert [t.item() for t in scaler.scale(iter([t0, t1]))] == [8.0, 8.0]
    with pytest.raises(ValueError):
        scaler.scale(3)


def test_unscale_grads_finds_an_inf_in_any_device_dtype_group(make):
    g = torch.full((20, 20), 4.0)

    def storm(inject: int) -> list[torch.Tensor]:
        grads = [g.clone(), g.clone()[:, :5], g.to(torch.float16), g.to(torch.float16)]
        if inject >= 0:
            grads[inject][2, 2] = INF
        return grads

    scaler = make()
    params = [torch.empty_like(t) for t in storm(-1)]
    opt = torch.optim.SGD(params, lr=1.0)
    inv_scale = torch.full((1,), 0.25)
    for inject in range(-1, len(params)):
        grads = storm(inject)
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        per_device = scaler._unscale_grads_(opt, inv_scale, torch.zeros(1), True)
        total = sum(v.item() for v in per_device.values())
        if inject < 0:
            assert total == 0
            for gr in grads:
                torch.testing.assert_close(gr, torch.ones_like(gr), rtol=1e-5, atol=1e-7)
        else:
            assert total == 1
    with pytest.raises(ValueError):  # fp16 gradients are refused unless allowed
        scaler._unscale_grads_(opt, inv_scale, torch.zeros(1), False)


def _coo(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(indices, values, (2, 3), check_invariants=True)


def test_unscale_sparse_gradients(make):
    scaler = make()
    inv_scale = torch.full((1,), 0.25)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = _coo(i, torch.tensor([16.0, 32.0, 64.0]))
    p = s.clone()
    opt = torch.optim.SGD([p], lr=1.0)

    def found(grad, allow_fp16):
        p.grad = grad
        return scaler._unscale_grads_(opt, inv_scale, torch.zeros(1), allow_fp16)[CPU].item()

    assert found(s.clone(), False) == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense())
    assert found(_coo(i, torch.tensor([16.0, 32.0, INF])), False) == 1
    assert found(_coo(i, torch.tensor([16.0, 32.0, math.nan])), False)
    p = s.clone().half()
    opt = torch.optim.SGD([p], lr=1.0)
    assert found(s.clone().half(), True) == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s.half() / 4).to_dense())
    # uncoalesced fp16: each value fits, their sum at the duplicated index does not
    dup = torch.tensor([[0, 1, 0], [2, 0, 2]])
    v = torch.tensor([64000.0, 32.0, 64000.0])
    assert found(_coo(dup, v.half()), True) == 1.0


def _sparse_training(make):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = make(init_scale=256.0, growth_interval=2)
    out = []
    for i in range(5):
        opt.zero_grad()
        loss = emb(torch.tensor([[1, 2, 2], [3, 1, 9]])).pow(2).sum()
        scaler.scale(loss).backward()
        if i == 2:
            with torch.no_grad():
                emb.weight.grad._values()[0, 0] = INF
        scaler.step(opt)
        scaler.update()
        out.append((scaler.get_scale(), emb.weight.detach().clone()))
    assert out[2][1].equal(out[1][1])  # the overflow step was skipped
    return out


def test_sparse_gradients_train_and_skip(make):
    _matches_reference(make, _sparse_training)


@pytest.mark.parametrize("lazy_init_scale", [True, False], ids=["initialized", "lazy"])
def test_state_dict_round_trip(make, lazy_init_scale):
    s0 = make(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
        assert s1._scale.dtype == torch.float32 and s1._scale.device == CPU
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


def _trained(make, steps: int, plant_at=(), **kw):
    model, opt, x, y = _small()
    scaler = make(**kw)
    for i in range(steps):
        _step_all(scaler, model, opt, x, y, plant=INF if i in plant_at else None)
    return scaler, model, opt, x, y


def _continue_from_other(make):
    other = _loss_scaler if make is _grad_scaler else _grad_scaler
    src, model, opt, x, y = _trained(other, 5, plant_at=(3,), init_scale=512.0, growth_interval=3)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = make()
    dst.load_state_dict(torch.load(buf, weights_only=True))
    assert dst.get_scale() == src.get_scale() and dst.get_growth_interval() == 3
    trace = []
    for i in range(6):
        for scaler in (src, dst):
            m = copy.deepcopy(model)
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            _step_all(scaler, m, o, x, y, plant=INF if i == 4 else None)
        assert dst.get_scale() == src.get_scale()
        assert dst.state_dict()["_growth_tracker"] == src.state_dict()["_growth_tracker"]
        trace.append((dst.get_scale(), dst.state_dict()["_growth_tracker"]))
    return trace


def test_state_dict_from_the_other_implementation_continues_alike(make):
    _matches_reference(make, _continue_from_other)


@pytest.mark.parametrize("lazy_init_scale", [True, False], ids=["initialized", "lazy"])
def test_pickle(make, lazy_init_scale):
    a = make(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    if lazy_init_scale:
        a.scale(torch.tensor([4.0]))
    b = pickle.loads(pickle.dumps(a))
    assert b.is_enabled() == a.is_enabled()
    assert b.get_scale() == 3.0
    assert b.get_growth_factor() == 4.0 and b.get_backoff_factor() == 0.5
    assert b.get_growth_interval() == 2
    assert b._init_growth_tracker == 0
    assert b._per_optimizer_states["fdsa"] == {
        "stage": OptState.READY,
        "found_inf_per_device": {},
    }
    if lazy_init_scale:
        assert b.scale(torch.tensor([4.0])).item() == 12.0


def _copied_midway(make):
    scaler, model, opt, x, y = _trained(make, 4, plant_at=(1,), init_scale=64.0, growth_interval=2)
    twin = copy.deepcopy(scaler)
    assert _saved(twin) == _saved(scaler)
    _step_all(twin, model, opt, x, y, plant=INF)  # the copy is independent
    assert twin.get_scale() == scaler.get_scale() / 2
    return _saved(scaler), _saved(twin)


def test_deepcopy_is_an_independent_scaler(make):
    _matches_reference(make, _copied_midway)


def test_pickling_mid_iteration_is_refused(make):
    model, opt, x, y = _small()
    scaler = make()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    with pytest.raises(AssertionError):
        pickle.dumps(scaler)


def _penultimate(make):
    """growth_interval=2: grow at step 1, an inf at step 2 (the penultimate), clean step 3."""
    scaler = make(init_scale=128.0, growth_interval=2)
    model, opt, x, y = _small()
    trace = []
    for i in range(4):
        untouched = _step_all(scaler, model, opt, x, y, plant=INF if i == 2 else None)
        trace.append((untouched, scaler.get_scale(), int(scaler._growth_tracker)))
    assert trace == [(False, 128.0, 1), (False, 256.0, 0), (True, 128.0, 0), (False, 128.0, 1)]
    return trace


def test_overflow_at_the_penultimate_step(make):
    _matches_reference(make, _penultimate)


def _planted_trajectory(make, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    scaler = make(init_scale=2.0**10, growth_interval=3)
    trace = []
    for _ in range(40):
        x, y = torch.randn(8, 16), torch.randn(8, 8)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        r = rng.random()
        if r < 0.1:
            loss = loss * math.nan  # a non-finite loss: its gradients are NaN too
        scaler.scale(loss).backward()
        if 0.1 <= r < 0.3:
            with torch.no_grad():
                model[2].weight.grad.view(-1)[rng.randrange(256)] = rng.choice(
                    [INF, -INF, math.nan]
                )
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        untouched = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        trace.append((untouched, scaler.get_scale(), int(scaler._growth_tracker)))
    assert sum(u for u, _, _ in trace) >= 5
    return trace, _snapshot(model, opt)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_growth_and_backoff_trajectory_with_planted_overflows(make, seed):
    _matches_reference(make, _planted_trajectory, seed)


def _unbounded(make):
    scaler, model, opt, x, y = _trained(make, 4, init_scale=2.0**23, growth_interval=1)
    assert scaler.get_scale() == 2.0**27  # past ampctl's default ceiling 2**24
    for _ in range(40):
        _step_all(scaler, model, opt, x, y, plant=INF)
    assert scaler.get_scale() == 2.0**-13  # below ampctl's default floor 1
    return scaler.get_scale()


def test_no_floor_and_no_ceiling(make):
    _matches_reference(make, _unbounded)


def _amp_loop(make, fused):
    """The README loop: fp16 autocast, unscale_, clip, step, update; an inf at step 5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = make(init_scale=2.0**12, growth_interval=3)
    trace = []
    for step in range(10):
        x, y = torch.randn(8, 16), torch.randn(8, 8)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 5:
            with torch.no_grad():
                model[2].weight.grad.fill_(INF)
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        trace.append((norm, scaler.get_scale()))
    return trace, _snapshot(model, opt)


@pytest.mark.parametrize("fused", [False, True], ids=["AdamW", "AdamW-fused"])
def test_autocast_clip_loop(make, fused):
    _matches_reference(make, _amp_loop, fused)


def _new_scale(make, kind):
    scaler, model, opt, x, y = _trained(make, 1, init_scale=128.0, growth_interval=3)
    assert int(scaler._growth_tracker) == 1
    new = 32.0 if kind == "float" else torch.tensor(32.0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update(new)
    assert scaler.get_scale() == 32.0
    assert int(scaler._growth_tracker) == 1  # new_scale leaves the tracker alone
    if isinstance(new, torch.Tensor):
        new.fill_(1.0)  # the scaler copied the value, not the tensor
        assert scaler.get_scale() == 32.0
    trace = []
    for _ in range(3):
        _step_all(scaler, model, opt, x, y)
        trace.append((scaler.get_scale(), int(scaler._growth_tracker)))
    assert trace == [(32.0, 2), (64.0, 0), (64.0, 1)]
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=8.0)  # allowed without a step in between
    assert scaler.get_scale() == 8.0
    return trace


@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_update_with_new_scale(make, kind):
    _matches_reference(make, _new_scale, kind)


def test_call_order_errors(make):
    model, opt, x, y = _small()
    scaler = make()
    for call in (lambda: scaler.step(opt), lambda: scaler.unscale_(opt), scaler.update):
        with pytest.raises(AssertionError):  # before scale()
            call()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    with pytest.raises(RuntimeError):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError):
        scaler.step(opt)
    with pytest.raises(RuntimeError):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(AssertionError):  # nothing recorded since the last update
        scaler.update()


def test_disabled_scaler_is_a_pass_through(make):
    model, opt, x, y = _small()
    scaler = make(enabled=False)
    loss = nn.functional.mse_loss(model(x), y)
    outputs = [loss]
    assert scaler.scale(loss) is loss and scaler.scale(outputs) is outputs
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert not hasattr(scaler, "_scale")  # the `hasattr(scaler, "_scale")` idiom then logs 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 5.0})  # a no-op
    loss.backward()
    with torch.no_grad():
        model[0].weight.grad[0, 0] = INF
    scaler.unscale_(opt)
    scaler.unscale_(opt)  # no call-order checks when disabled
    scaler.step(opt)
    scaler.update()
    assert torch.isinf(model[0].weight).any()  # the update was applied, as without a scaler
    assert scaler.step(opt, closure=lambda: 3.0) == 3.0  # closures pass through
    assert scaler.get_scale() == 1.0


# --------------------------------------------------------- private attributes real code uses
def test_isinstance_gradscaler(make):
    assert isinstance(make(), torch.amp.GradScaler)


def test_a_loss_scaler_is_also_the_deprecated_cuda_gradscaler():
    """Code that checks ``torch.cuda.amp.GradScaler`` (the class older code and libraries test
    for) recognises a LossScaler, without the deprecated class's constructor warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler = LossScaler()
    assert isinstance(scaler, torch.cuda.amp.GradScaler)


def _scale_reads(make):
    scaler, model, opt, x, y = _trained(make, 0, init_scale=1024.0, growth_interval=2)
    assert scaler._scale is None and scaler._growth_tracker is None  # lazily created
    logged = []
    for i in range(5):
        _step_all(scaler, model, opt, x, y, plant=INF if i == 3 else None)
        with count_host_reads() as reads:
            live = scaler._scale if hasattr(scaler, "_scale") else 1.0
        assert reads.total == 0  # reading _scale does not sync
        assert isinstance(live, torch.Tensor) and live.dtype == torch.float32
        assert live.item() == scaler.get_scale()
        logged.append(live.item())
    assert logged == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0]
    assert scaler._get_scale_async() is scaler._scale
    return logged


def test_reading_scale_gives_the_live_scale(make):
    _matches_reference(make, _scale_reads)


def _scale_writes(make, how):
    scaler, model, opt, x, y = _trained(make, 3, plant_at=(0, 1, 2), init_scale=4.0)
    assert scaler.get_scale() == 0.5
    min_scale = 2.0
    if how == "assign":
        scaler._scale = torch.tensor(min_scale).to(scaler._scale)
    elif how == "fill_":
        scaler._scale.fill_(max(scaler._scale.item(), min_scale))
    else:
        scaler._scale.clamp_(min=min_scale)
    assert scaler.get_scale() == 2.0
    assert scaler.scale(torch.ones(())).item() == 2.0  # the next loss is scaled by it
    trace = []
    for i in range(3):
        _step_all(scaler, model, opt, x, y, plant=INF if i == 0 else None)
        trace.append(scaler.get_scale())
    assert trace == [1.0, 1.0, 1.0]
    return trace, _saved(scaler)


@pytest.mark.parametrize("how", ["assign", "fill_", "clamp_"])
def test_writing_scale_sets_the_live_scale(make, how):
    _matches_reference(make, _scale_writes, how)


def _tracker(make):
    scaler, model, opt, x, y = _trained(make, 2, init_scale=8.0, growth_interval=4)
    assert int(scaler._growth_tracker) == 2 and scaler._growth_tracker.dtype == torch.int32
    assert scaler._get_growth_tracker() == 2
    scaler._growth_tracker.fill_(3)
    _step_all(scaler, model, opt, x, y)
    assert scaler.get_scale() == 16.0 and int(scaler._growth_tracker) == 0
    scaler._growth_tracker = torch.tensor(3, dtype=torch.int32)
    _step_all(scaler, model, opt, x, y)
    assert scaler.get_scale() == 32.0 and int(scaler._growth_tracker) == 0
    return _saved(scaler)


def test_growth_tracker_read_and_write(make):
    _matches_reference(make, _tracker)


def _accelerate_fsdp2_load(make):
    src, *_ = _trained(make, 3, init_scale=1024.0, growth_interval=5)
    dst = make()
    dst.load_state_dict(src.state_dict())
    assert dst._scale is None
    dst._lazy_init_scale_growth_tracker(dst._device)  # what Accelerate's FSDP2 load path does
    assert dst._scale.item() == 1024.0 and int(dst._growth_tracker) == 3
    assert dst._scale.device.type == dst._device
    model, opt, x, y = _small()
    trace = []
    for _ in range(3):
        _step_all(dst, model, opt, x, y)
        trace.append((dst.get_scale(), int(dst._growth_tracker)))
    assert trace == [(1024.0, 4), (2048.0, 0), (2048.0, 1)]
    return trace


def test_lazy_init_after_load_state_dict(make):
    _matches_reference(make, _accelerate_fsdp2_load)


def _all_reduced(make):
    model, opt, x, y = _small()
    scaler = make(init_scale=256.0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    found = scaler._found_inf_per_device(opt)
    assert list(found) == [CPU] and found[CPU].item() == 0.0
    for v in found.values():  # what dist.all_reduce(v, MAX) does when another rank overflowed
        v.fill_(1.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert sum(v.item() for v in scaler._found_inf_per_device(opt).values()) == 1.0
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 128.0
    return _saved(scaler)


def test_found_inf_per_device_reduced_in_place_decides_the_step(make):
    _matches_reference(make, _all_reduced)


def test_per_optimizer_states_follow_gradscalers_stages(make):
    model, opt, x, y = _small()
    scaler = make()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    st = scaler._per_optimizer_states[id(opt)]
    assert st == {"stage": OptState.READY, "found_inf_per_device": {}}
    scaler.unscale_(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    assert st["found_inf_per_device"] is scaler._found_inf_per_device(opt)
    scaler.step(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    scaler.update()
    assert len(scaler._per_optimizer_states) == 0


def _checked_not_unscaled(make):
    model, opt, x, y = _small()
    scaler = make(init_scale=16.0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    with torch.no_grad():
        model[1].weight.grad[0, 0] = INF
    grads = [p.grad.clone() for p in model.parameters()]
    found = scaler._check_inf_per_device(opt)
    assert sum(v.item() for v in found.values()) == 1.0
    for g, p in zip(grads, model.parameters(), strict=True):  # checked, not unscaled
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale(), _snapshot(model, opt)


def test_check_inf_per_device(make):
    _matches_reference(make, _checked_not_unscaled)


def _unscaled_then_update(make):
    """User code that unscales, sees the overflow itself and calls update() without step()."""
    model, opt, x, y = _small()
    scaler = make(init_scale=16.0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    with torch.no_grad():
        model[1].weight.grad[0, 0] = INF
    scaler.unscale_(opt)
    scaler.update()
    return scaler.get_scale(), scaler.state_dict()["_growth_tracker"]


def test_update_after_unscale_without_step_uses_the_recorded_overflow(make):
    assert _matches_reference(make, _unscaled_then_update) == (8.0, 0)


def _configuration(make):
    s = make(init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    return {
        name: getattr(s, name)
        for name in (
            "_enabled",
            "_init_scale",
            "_growth_factor",
            "_backoff_factor",
            "_growth_interval",
            "_device",
            "_init_growth_tracker",
        )
    }


def test_configuration_attributes(make):
    assert _matches_reference(make, _configuration)["_device"] == "cpu"
