"""fp16-pure: fp16 weights, fp32 masters owned by the optimizer, exact copies both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.amp.precision import FP16PurePrecision, MasterWeights


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight  # shared: one master
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.b(self.a(x)) + self.frozen(x))


def _half(model: nn.Module) -> nn.Module:
    model.half()
    model.norm.float()
    return model


def test_masters_pair_each_trainable_parameter_once():
    model = _half(Tied())
    mw = MasterWeights(model)
    assert mw.names == ["a.weight", "a.bias", "b.bias", "norm.weight", "norm.bias"]
    assert [n for n, _ in mw.named_params()] == mw.names
    for (p, m), name in zip(mw.pairs, mw.names, strict=True):
        assert p is model.get_parameter(name)
        assert m.dtype == torch.float32 and isinstance(m, nn.Parameter)
        assert torch.equal(m.detach(), p.detach().float())
        if p.dtype == torch.float32:
            assert m is p  # fp32 parameters are their own master
        else:
            assert m is not p
    assert mw.params == [m for _, m in mw.pairs]
    assert [p for p, _ in mw._low()] == [model.a.weight, model.a.bias, model.b.bias]


def test_grads_go_to_the_masters_and_updates_come_back_bit_for_bit():
    model = _half(Tied())
    mw = MasterWeights(model)
    mw.grads_to_master()  # no gradient yet: nothing to do
    assert all(m.grad is None for m in mw.params)
    model(torch.ones(2, 3, dtype=torch.float16)).float().sum().backward()
    fp16_grads = {n: model.get_parameter(n).grad.clone() for n in ("a.weight", "a.bias")}
    model.b.bias.grad = None  # a parameter without a gradient keeps its master's as it is
    mw.grads_to_master()
    masters = dict(mw.named_params())
    assert torch.equal(masters["a.weight"].grad, fp16_grads["a.weight"].float())
    assert masters["a.weight"].grad.dtype == torch.float32
    assert torch.equal(masters["a.bias"].grad, fp16_grads["a.bias"].float())
    assert masters["b.bias"].grad is None
    assert model.a.weight.grad is None and model.a.bias.grad is None  # moved, not copied
    assert model.norm.weight.grad is not None  # fp32: the optimizer reads it in place
    # a second backward reuses the master grad buffers
    buf = masters["a.weight"].grad
    model(torch.ones(2, 3, dtype=torch.float16)).float().sum().backward()
    mw.grads_to_master()
    assert masters["a.weight"].grad is buf
    with torch.no_grad():
        for m in mw.params:
            m.add_(0.001)
    mw.master_to_model()
    for p, m in mw.pairs:
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
    mw.zero_grad()
    assert all(p.grad is None and m.grad is None for p, m in mw.pairs)


def test_to_model_makes_the_masters_the_weights():
    model = _half(Tied())
    mw = MasterWeights(model)
    with torch.no_grad():
        mw.params[0].add_(1e-4)  # below fp16's resolution near 1: only the master sees it
    mw.to_model()
    assert model.a.weight.dtype == torch.float32
    assert torch.equal(model.a.weight.detach(), mw.params[0].detach())
    assert model.a.weight.data_ptr() != mw.params[0].data_ptr()  # a copy, not the master


def test_prepare_halves_the_model_but_not_the_fp32_modules():
    model = Tied()
    p = FP16PurePrecision(fp32_modules=["norm"])
    assert p.master is None
    assert [n for n, _ in p.named_optimizer_params(model)] == [
        n for n, q in model.named_parameters() if q.requires_grad
    ]
    assert p.prepare(model) is model
    assert model.a.weight.dtype == torch.float16 and model.norm.weight.dtype == torch.float32
    assert isinstance(p.master, MasterWeights)
    assert p.named_optimizer_params(model) == list(p.master.named_params())
    assert all(q.dtype == torch.float32 for q in p.optimizer_params(model))


def test_hooks_move_grads_and_weights_and_promotion_keeps_the_pairs():
    model = Tied()
    p = FP16PurePrecision()
    p.prepare(model)
    x = torch.ones(2, 3)
    with p.autocast():
        loss = model(x).float().sum()
    loss.backward()
    p.after_backward()
    masters = dict(p.master.named_params())
    assert model.a.weight.grad is None and masters["a.weight"].grad is not None
    with torch.no_grad():
        masters["a.weight"].sub_(0.5)
    p.after_step()
    assert torch.equal(model.a.weight.detach(), masters["a.weight"].detach().half())
    p.zero_grad()
    assert masters["a.weight"].grad is None
    # promotion after prepare: the module turns fp32 in place, its master stays paired
    assert p.to_fp32(model, "a") is True
    assert model.a.weight.dtype == torch.float32
    assert p.master.pairs[0][0] is model.a.weight


def test_to_fp32_before_prepare_leaves_parameters_alone():
    model = Tied()
    p = FP16PurePrecision()
    p.to_fp32(model, "a")
    assert model.a.weight.dtype == torch.float32 and p.master is None
    p.zero_grad()
    p.after_backward()
    p.after_step()  # no masters yet: all pass-through


def test_master_state_round_trip_and_release():
    model = Tied()
    p = FP16PurePrecision()
    assert p.master_state() is None
    p.load_master_state([torch.zeros(1)])  # no masters: ignored
    p.prepare(model)
    saved = p.master_state()
    assert [s.dtype for s in saved] == [torch.float32] * 5
    assert all(torch.equal(s, m.detach()) for s, m in zip(saved, p.master.params, strict=True))
    assert all(s.device.type == "cpu" and not s.requires_grad for s in saved)
    saved = [s.clone() for s in saved]  # on a CPU run the host "copies" share the masters' memory
    with torch.no_grad():
        for m in p.master.params:
            m.mul_(3.0)
    p.load_master_state(None)
    assert not torch.equal(saved[0], p.master.params[0].detach())
    with pytest.raises(ValueError):
        p.load_master_state(saved[:-1])  # from another model: refused
    p.load_master_state(saved)
    assert all(torch.equal(s, m.detach()) for s, m in zip(saved, p.master.params, strict=True))
    with torch.no_grad():
        p.master.params[0].add_(1e-4)
    want = p.master.params[0].detach().clone()
    assert p.release(model) == []
    assert p.master is None
    assert torch.equal(model.a.weight.detach(), want)  # the masters became the weights
    assert all(q.dtype == torch.float32 for q in model.parameters())
    p.release(model)  # twice: nothing left to release
