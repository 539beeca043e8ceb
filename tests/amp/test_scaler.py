"""LossScaler: parity with torch.amp.GradScaler, hysteresis, bounds, planted faults, host reads."""

from __future__ import annotations

import copy
import inspect
import pickle
import random

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler, next_scale
from ampctl.amp.scaler import CallOrderError
from ampctl.hostreads import count_host_reads


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
