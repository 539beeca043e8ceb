"""The precision plugin interface (ampctl.amp.precision.base, and the plugins that only set its
class attributes: fp32, bf16, fp16): fp32 modules, casts, hooks, state, errors; the plugin's
defaults and the CUDA bf16 check (issue #31: mutants the plugin tests left alive).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from ampctl.amp.precision import (
    BF16Precision,
    FP16Precision,
    FP32Precision,
    make_precision,
)
from ampctl.amp.precision.base import (
    Precision,
    _cast_floats,
    _fp32_forward,
    _module_device_type,
    bf16_supported,
    match_modules,
)
from ampctl.amp.scaler import LossScaler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.embx = nn.Linear(8, 2)

    def forward(self, x):
        return self.embx(self.body(self.emb(x)))


def _dtypes(model: nn.Module, precision: Precision, x: torch.Tensor) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out.dtype))
        for n, m in model.named_modules()
        if n
    ]
    with precision.autocast():
        model(x)
    for h in hooks:
        h.remove()
    return seen


# ------------------------------------------------------------------ helpers of the base module
def test_bf16_supported_on_cpu_only_without_cuda():
    assert bf16_supported("cpu") is True
    assert bf16_supported(torch.device("cpu")) is True
    assert bf16_supported("meta") is False
    if not torch.cuda.is_available():
        assert bf16_supported("cuda") is False


def test_match_modules_outermost_matches_and_never_the_root():
    net = Net()
    assert match_modules(net, ["*"]) == ["emb", "body", "embx"]
    assert match_modules(net, ["emb*"]) == ["emb", "embx"]  # embx is not inside emb
    assert match_modules(net, ["body.*"]) == ["body.0", "body.1"]
    assert match_modules(net, ("body.1", "emb")) == ["emb", "body.1"]
    assert match_modules(net, []) == []


def test_cast_floats_walks_containers_and_leaves_the_rest():
    h = torch.ones(2, dtype=torch.float16)
    f = torch.ones(2)
    i = torch.ones(2, dtype=torch.int64)
    out = _cast_floats({"a": (h, [f, i]), "b": "text", "c": 3}, torch.float32)
    assert out["a"][0].dtype == torch.float32 and isinstance(out["a"], tuple)
    assert out["a"][1][0] is f  # already fp32: the same tensor
    assert out["a"][1][1] is i and isinstance(out["a"][1], list)
    assert out["b"] == "text" and out["c"] == 3
    assert _cast_floats(h, torch.float16) is h


def test_fp32_forward_casts_inputs_up_and_turns_autocast_off():
    seen = {}

    def forward(a, *, b):
        seen["in"] = (a.dtype, b.dtype)
        return a @ b

    a = torch.ones(2, 2, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert (a.float() @ a.float()).dtype == torch.float16  # autocast is on out here
        out = _fp32_forward(forward, "cpu", a, b=a)
    assert seen["in"] == (torch.float32, torch.float32)
    assert out.dtype == torch.float32


def test_module_device_type_from_parameters_then_buffers_else_cpu():
    assert _module_device_type(nn.Linear(2, 2, device="meta")) == "meta"
    m = nn.Module()
    m.register_buffer("b", torch.zeros(1, device="meta"))
    assert _module_device_type(m) == "meta"
    assert _module_device_type(nn.ReLU()) == "cpu"


# ------------------------------------------------------------------ the plugin
def test_fp32_modules_must_be_a_list():
    with pytest.raises(ValueError) as e:
        FP16Precision(fp32_modules="*emb*")
    assert (
        str(e.value) == "precision.fp32_modules must be a list of patterns, e.g. ['*embeddings*']"
    )


@pytest.mark.parametrize(
    "cls, enabled, autocast",
    [(FP32Precision, False, False), (BF16Precision, False, True), (FP16Precision, True, True)],
)
def test_a_plugin_owns_a_scaler_enabled_when_its_precision_scales(cls, enabled, autocast):
    p = cls(fp32_modules=("a", "b"), device_type="cpu")
    assert p.fp32_modules == ["a", "b"] and p.device_type == "cpu"
    assert isinstance(p.scaler, LossScaler) and p.scaler.is_enabled() is enabled
    assert p.autocast_enabled is autocast
    assert p.in_fp32 == [] and p.master is None
    own = LossScaler(init_scale=8.0)
    assert cls(scaler=own).scaler is own
    assert repr(p) == f"{cls.__name__}(in_fp32=[])"


def test_autocast_context_per_precision():
    assert isinstance(FP32Precision().autocast(), contextlib.nullcontext)
    x = torch.ones(2, 2)
    for cls, dtype in ((BF16Precision, torch.bfloat16), (FP16Precision, torch.float16)):
        with cls(device_type="cpu").autocast():
            assert (x @ x).dtype == dtype


def test_prepare_moves_the_matches_to_fp32_and_release_undoes_it():
    net = Net()
    p = FP16Precision(fp32_modules=["emb"])
    assert p.prepare(net) is net
    assert p.in_fp32 == ["emb"]
    x = torch.randn(3, 4)
    d = _dtypes(net, p, x)
    assert d["emb"] == torch.float32 and d["body.0"] == torch.float16
    assert repr(p) == "FP16Precision(in_fp32=['emb'])"
    assert p.state_dict() == {"name": "fp16", "in_fp32": ["emb"]}
    net.body.half()
    assert p.release(net) == ["emb"]
    assert p.in_fp32 == [] and "forward" not in net.emb.__dict__
    assert all(q.dtype == torch.float32 for q in net.parameters())  # released models are fp32
    assert _dtypes(net, p, x)["emb"] == torch.float16


def test_to_fp32_refuses_twice_and_inside_a_module_in_fp32():
    net = Net()
    p = FP16Precision()
    assert p.to_fp32(net, "body") is True
    assert p.to_fp32(net, "body") is False
    assert p.to_fp32(net, "body.0") is False
    assert p.to_fp32(net, "emb") is True  # a name that starts like another is not inside it
    assert p.in_fp32 == ["body", "emb"]
    assert net.body.forward.__wrapped__ == Net().body.__class__.forward.__get__(net.body)
    assert net.body.forward.__name__ == "forward"


def test_undo_fp32_restores_an_instance_forward():
    net = Net()
    mine = net.emb.forward

    def custom(x):
        return mine(x) * 2

    net.emb.forward = custom
    p = FP16Precision()
    p.to_fp32(net, "emb")
    assert net.emb.forward is not custom
    x = torch.randn(1, 4)
    with p.autocast():
        assert net.emb(x).dtype == torch.float32
    p.undo_fp32(net, "emb")
    assert net.emb.forward is custom and p.in_fp32 == []
    p.to_fp32(net, "body")
    p.undo_fp32(net, "body")
    assert "forward" not in net.body.__dict__


def test_optimizer_params_are_the_trainable_ones():
    net = Net()
    net.emb.weight.requires_grad_(False)
    p = FP32Precision()
    names = [n for n, _ in p.named_optimizer_params(net)]
    assert names == [n for n, q in net.named_parameters() if n != "emb.weight"]
    assert p.optimizer_params(net)[0] is net.emb.bias


def test_hooks_scale_unscale_and_step_through_the_scaler():
    torch.manual_seed(0)
    net = nn.Linear(3, 1)
    ref = nn.Linear(3, 1)
    ref.load_state_dict(net.state_dict())
    p = FP16Precision(scaler=LossScaler(init_scale=64.0))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    p.backward(net(x).sum())
    ref(x).sum().backward()
    torch.testing.assert_close(net.weight.grad, ref.weight.grad * 64.0)
    p.after_backward()  # pass-through
    p.unscale_(opt)
    torch.testing.assert_close(net.weight.grad, ref.weight.grad)
    assert p.optimizer_step(opt) is False
    assert not torch.equal(net.weight, ref.weight)
    assert p.scaler.num_updates == 1
    p.zero_grad()  # pass-through: the gradients stay
    assert net.weight.grad is not None
    opt.zero_grad()
    p.backward(net(x).sum())
    net.weight.grad[0, 0] = float("inf")
    before = net.weight.detach().clone()
    assert p.optimizer_step(opt) is True
    assert torch.equal(net.weight, before) and p.scaler.get_scale() == 32.0
    assert p.master_state() is None
    p.load_master_state([torch.ones(1)])  # pass-through


def test_optimizer_step_with_a_fused_optimizer_reads_nothing():
    net = nn.Linear(3, 1)
    p = FP16Precision()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1, fused=True)
    p.backward(net(torch.ones(2, 3)).sum())
    assert p.optimizer_step(opt) is None


def test_a_checkpoint_of_ampctl_0_2_names_its_fp32_modules_under_the_old_key():
    from ampctl.amp.precision import saved_in_fp32

    net = Net()
    p = FP16Precision()
    p.to_fp32(net, "emb")
    assert p.state_dict() == {"name": "fp16", "in_fp32": ["emb"]}
    assert saved_in_fp32(p.state_dict()) == ["emb"]
    assert saved_in_fp32({"name": "fp16", "exempted": ["emb", "body"]}) == ["emb", "body"]
    assert saved_in_fp32({"name": "fp16"}) == []


# ===================================================== defaults and the CUDA bf16 check (issue #31)
def test_a_plugin_built_directly_has_empty_options():
    assert FP32Precision().options == {}


def test_the_base_plugin_demotes_nothing():
    p = make_precision("fp32")
    model = nn.Sequential(nn.Linear(4, 4))
    assert p.demote(model, "0", "why") is False
    assert p.demotable(model) == []
    assert isinstance(model[0], nn.Linear)


def test_bf16_on_cuda_needs_a_cuda_device_that_supports_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_supported("cuda") is True
    assert bf16_supported(torch.device("cuda", 0)) is True
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert bf16_supported("cuda") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_supported("cuda") is False
    assert bf16_supported("cpu") is True
