"""The precision package's factory and config (ampctl.amp.precision): make_precision (autocast
dtypes, fp32 modules, fp16-pure master weights, attribution), the plugin and scaler it builds,
the PrecisionPolicy alias, and ``precision.*`` (PrecisionConfig): the checks that run before
anything is built, word for word, and what it hands to the plugin.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler, Precision, make_precision, match_modules, nonfinite_grad_names
from ampctl.amp.checks import FieldError
from ampctl.amp.fp8 import DEFAULT_EXCLUDE
from ampctl.amp.precision import (
    BF16Precision,
    FP16Precision,
    FP16PurePrecision,
    FP32Precision,
    PrecisionConfig,
    PrecisionPolicy,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Linear(8, 16)
        self.LayerNorm = nn.LayerNorm(16)
        self.dense = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.dense(self.LayerNorm(self.embeddings(x))))


def _outputs(model: nn.Module, policy: Precision, x: torch.Tensor) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out.dtype))
        for n, m in model.named_modules()
        if n
    ]
    with policy.autocast():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_fp32_module_outputs_fp32_others_fp16():
    model = Block()
    policy = make_precision("fp16", fp32_modules=["*embeddings*"])
    policy.prepare(model)
    dtypes = _outputs(model, policy, torch.randn(2, 8))
    assert dtypes["embeddings"] == torch.float32
    assert dtypes["dense"] == torch.float16
    assert dtypes["head"] == torch.float16
    assert policy.in_fp32 == ["embeddings"]


def test_to_fp32_casts_fp16_inputs_up_and_can_be_undone():
    model = Block()
    policy = make_precision("fp16")
    policy.prepare(model)
    assert _outputs(model, policy, torch.randn(2, 8))["dense"] == torch.float16
    assert policy.to_fp32(model, "dense")
    assert not policy.to_fp32(model, "dense")
    assert _outputs(model, policy, torch.randn(2, 8))["dense"] == torch.float32
    policy.undo_fp32(model, "dense")
    assert _outputs(model, policy, torch.randn(2, 8))["dense"] == torch.float16


def test_match_modules_keeps_outermost_only():
    outer = nn.Module()
    outer.embeddings = nn.Module()
    outer.embeddings.word_embeddings = nn.Embedding(4, 4)
    outer.embeddings.LayerNorm = nn.LayerNorm(4)
    outer.LayerNorm = nn.LayerNorm(4)
    assert match_modules(outer, ["*embeddings*"]) == ["embeddings"]
    assert match_modules(outer, ["*LayerNorm*"]) == ["embeddings.LayerNorm", "LayerNorm"]


@pytest.mark.parametrize(
    "name, dtype, scaler",
    [
        ("fp32", torch.float32, False),
        ("bf16", torch.bfloat16, False),
        ("fp16", torch.float16, True),
        ("fp16-pure", torch.float16, True),
    ],
)
def test_policy_properties(name, dtype, scaler):
    p = make_precision(name)
    assert p.compute_dtype == dtype and p.needs_scaler == scaler
    assert p.param_dtype == (torch.float16 if name == "fp16-pure" else torch.float32)


def test_unknown_precision_is_refused():
    with pytest.raises(
        ValueError, match="precision: 'fp4' is not one of fp32, bf16, fp16, fp16-pure, fp8"
    ):
        make_precision("fp4")


def test_fp16_pure_trains_with_fp32_masters_and_skips_overflow():
    torch.manual_seed(0)
    model = Block()
    policy = make_precision("fp16-pure", fp32_modules=["LayerNorm"])
    policy.prepare(model)
    assert model.dense.weight.dtype == torch.float16
    assert model.LayerNorm.weight.dtype == torch.float32
    params = policy.optimizer_params(model)
    assert all(p.dtype == torch.float32 for p in params)
    opt = torch.optim.AdamW(params, lr=1e-2)
    scaler = LossScaler(init_scale=256.0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    losses = []
    for step in range(30):
        opt.zero_grad()
        with policy.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        policy.after_backward()
        if step == 10:
            params[0].grad.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        policy.after_step()
        if step == 10:
            assert scaler.last_step_skipped
            assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    # the fp16 model holds the rounded masters
    torch.testing.assert_close(
        model.dense.weight.float(),
        dict(policy.master.named_params())["dense.weight"].detach(),
        atol=1e-3,
        rtol=1e-3,
    )


def test_fp16_pure_promotion_turns_module_to_fp32():
    model = Block()
    policy = make_precision("fp16-pure")
    policy.prepare(model)
    policy.to_fp32(model, "dense")
    assert model.dense.weight.dtype == torch.float32
    with policy.autocast():
        out = model(torch.randn(2, 8))
    assert out.dtype == torch.float16


def test_attribution_names_only_the_bad_parameters():
    model = Block()
    model(torch.randn(2, 8)).sum().backward()
    assert nonfinite_grad_names(model) == []
    model.dense.weight.grad[0, 0] = float("nan")
    model.head.bias.grad[1] = float("-inf")
    assert nonfinite_grad_names(model) == ["dense.weight", "head.bias"]
    assert nonfinite_grad_names(model, limit=1) == ["dense.weight"]


# ------------------------------------------------------------------ the plugin it builds
@pytest.mark.parametrize(
    "name, cls",
    [("fp32", FP32Precision), ("bf16", BF16Precision), ("fp16-pure", FP16PurePrecision)],
)
def test_make_precision_builds_the_plugin_with_its_scaler(name, cls):
    p = make_precision(name, fp32_modules=["x"], device_type="cpu", scaler_args={"init_scale": 8})
    assert type(p) is cls and p.fp32_modules == ["x"] and p.device_type == "cpu"
    assert p.scaler.is_enabled() is cls.needs_scaler
    assert p.scaler.get_scale() == (8.0 if cls.needs_scaler else 1.0)
    assert make_precision(name).scaler.get_scale() == (2.0**16 if cls.needs_scaler else 1.0)
    own = LossScaler()
    assert make_precision(name, scaler=own).scaler is own


def test_make_precision_refuses_an_unknown_name():
    with pytest.raises(ValueError) as e:
        make_precision("fp12")
    assert str(e.value) == "precision: 'fp12' is not one of fp32, bf16, fp16, fp16-pure, fp8"


def test_precision_policy_is_make_precision():
    p = PrecisionPolicy(name="bf16", fp32_modules=["a"], device_type="cuda")
    assert type(p) is BF16Precision and p.fp32_modules == ["a"] and p.device_type == "cuda"
    assert PrecisionPolicy().device_type == "cpu"
    assert type(PrecisionPolicy()) is FP16Precision


def test_precision_config_names_the_allowed_precisions():
    assert PrecisionConfig(name="bf16").name == "bf16"
    with pytest.raises(FieldError) as e:
        PrecisionConfig(name="fp12")
    assert str(e.value) == (
        "PrecisionConfig: name='fp12' is not allowed: name must be one of fp32, bf16, fp16, "
        "fp16-pure, fp8 (select with precision=NAME)"
    )


def test_the_policy_alias_keeps_the_options_for_a_fallback():
    p = PrecisionPolicy(name="fp16", options={"recipe": "rowwise", "exclude": ["head"]})
    assert p.options == {"recipe": "rowwise", "exclude": ["head"]}


# ------------------------------------------------------------------ PrecisionConfig
def test_precision_config_defaults_and_its_options():
    c = PrecisionConfig()
    assert (c.name, c.fp32_modules, c.fp8_recipe) == ("fp16", [], "tensorwise")
    assert c.fp8_exclude == list(DEFAULT_EXCLUDE) and type(c.fp8_exclude) is list
    assert PrecisionConfig().fp8_exclude is not c.fp8_exclude
    c = PrecisionConfig(name="fp8", fp8_recipe="rowwise", fp8_exclude=("*head*",))
    assert c.fp8_exclude == ["*head*"] and type(c.fp8_exclude) is list
    opts = c.options()
    assert opts == {"recipe": "rowwise", "exclude": ["*head*"]}
    opts["exclude"].append("x")
    assert c.fp8_exclude == ["*head*"]  # a copy
    assert PrecisionConfig(fp8_exclude=[]).options() == {"recipe": "tensorwise", "exclude": []}


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"fp8_recipe": "delayed"},
            "PrecisionConfig: fp8_recipe='delayed' is not allowed: fp8_recipe must be one of "
            "tensorwise, rowwise",
        ),
        (
            {"fp8_exclude": ["ok", ""]},
            "PrecisionConfig: fp8_exclude=['ok', ''] is not allowed: fp8_exclude must be a list of "
            "non-empty fnmatch patterns over module names, e.g. ['*lm_head*']",
        ),
        (
            {"fp8_exclude": [3]},
            "PrecisionConfig: fp8_exclude=[3] is not allowed: fp8_exclude must be a list of "
            "non-empty fnmatch patterns over module names, e.g. ['*lm_head*']",
        ),
        (
            {"name": "fp4"},
            "PrecisionConfig: name='fp4' is not allowed: name must be one of fp32, bf16, fp16, "
            "fp16-pure, fp8 (select with precision=NAME)",
        ),
    ],
)
def test_precision_config_refuses_a_bad_value_in_one_line(kw, message):
    with pytest.raises(FieldError) as e:
        PrecisionConfig(**kw)
    assert str(e.value) == message
