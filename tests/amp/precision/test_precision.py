"""make_precision: autocast dtypes, fp32 modules, fp16-pure master weights, attribution."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler, Precision, make_precision, match_modules, nonfinite_grad_names


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
