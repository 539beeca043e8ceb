"""LossScaler: parity with torch.amp.GradScaler, hysteresis, bounds, planted faults, host reads."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler, next_scale
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


def test_forward_overflow_skips_without_backing_off():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(init_scale=1024.0, growth_interval=1000)
    x, y = _batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, x, y) * torch.tensor(float("inf"))
    scaler.scale(loss).backward()
    with count_host_reads() as reads:
        scaler.step(opt)
        scaler.update()
    assert reads.total == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    st = scaler.stats()
    assert st["scale"] == 1024.0 and st["skipped_total"] == 1 and st["forward_overflows"] == 1
    # a following gradient overflow does back off
    opt.zero_grad()
    scaler.scale(_loss(model, x, y)).backward()
    _plant(model, float("inf"))
    scaler.step(opt)
    scaler.update()
    assert (
        scaler.get_scale() == 512.0 and scaler.forward_overflows == 1 and scaler.skipped_steps == 2
    )


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
            assert torch.equal(v, other.state_dict()[k])
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
            "init_scale=0.0 is not allowed; init_scale must be a finite number > 0",
        ),
        ({"init_scale": float("inf")}, "init_scale must be a finite number > 0"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1)"),
        ({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1)"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
        ({"growth_interval": 2.5}, "growth_interval must be an integer >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "min_scale must be <= max_scale (4.0)"),
        ({"min_scale": -1.0}, "min_scale must be a finite number > 0"),
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
    assert scaler.last_step_skipped and scaler.forward_overflows == 1 and scaler.get_scale() == 64.0


def test_gradscaler_can_be_swapped_out_in_a_user_loop():
    """The README's claim: replace GradScaler(...) by LossScaler() and change nothing else."""
    model = copy.deepcopy(_model())
    opt = torch.optim.AdamW(model.parameters())
    for scaler in (torch.amp.GradScaler("cpu"), LossScaler()):
        for x, y in _batches(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        assert scaler.is_enabled() and scaler.get_scale() > 0
        assert set(scaler.state_dict()) >= {
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker",
        }
