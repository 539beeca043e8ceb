"""The fp8 precision plugin (ampctl.amp.precision.fp8) and its config, without the loop."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from typer.testing import CliRunner  # noqa: E402

from ampctl.amp import fp8, make_precision  # noqa: E402
from ampctl.amp.guard import next_precision  # noqa: E402
from ampctl.amp.precision.fp8 import FP8Precision, worst_layer  # noqa: E402
from ampctl.cli import app  # noqa: E402
from ampctl.config import ConfigError, load_config  # noqa: E402
from ampctl.protect.protection import Protection  # noqa: E402
from tests.conftest import FAST  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 32)
        self.a = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))
        self.lm_head = nn.Linear(24, 16)

    def forward(self, ids, labels):
        logits = self.lm_head(self.b(self.a(self.embed(ids))))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


BATCH = {"ids": torch.randint(0, 16, (4, 16)), "labels": torch.randint(0, 16, (4, 16))}


def _plugin(**kw) -> FP8Precision:
    return make_precision("fp8", options={"recipe": "tensorwise", "exclude": ["*lm_head*"]}, **kw)


def test_prepare_converts_the_plan_and_keeps_the_reasons_for_the_rest():
    model = Net()
    p = _plugin(fp32_modules=["b"])
    p.prepare(model)
    assert p.converted == ["a.0", "a.2"] == fp8.converted_layers(model)
    assert p.skipped == {
        "b.0": "inside 'b', kept in fp32 by precision.fp32_modules",
        "b.1": "dims 32x24 are not multiples of 16",
        "lm_head": "excluded by pattern '*lm_head*'",
    }
    assert p.in_fp32 == ["b"] and p.demoted == {}
    assert p.compute_dtype == torch.bfloat16 and not p.scaler.is_enabled()
    s = p.summary(model)
    assert s == {
        "fp8_recipe": "tensorwise",
        "fp8_layers": ["a.0", "a.2"],
        "fp8_excluded": p.skipped,
        "fp8_demoted": {},
    }
    with p.autocast():
        loss = model(**BATCH)
    loss.backward()
    assert torch.isfinite(loss) and model.a[0].weight.grad is not None


def test_moving_a_module_to_fp32_demotes_its_fp8_layers_first():
    model = Net()
    p = _plugin()
    p.prepare(model)
    params = {n: q for n, q in model.named_parameters()}
    assert p.demotable(model) == ["a.0", "a.2", "b.0"]
    assert p.demotable(model, "a") == ["a.0", "a.2"] and p.demotable(model, "a.2") == ["a.2"]
    assert p.to_fp32(model, "a")
    assert fp8.converted_layers(model) == ["b.0"]
    assert p.demoted == {n: "inside 'a', which now runs in fp32" for n in ("a.0", "a.2")}
    assert all(q is params[n] for n, q in model.named_parameters())  # same Parameters
    assert not p.to_fp32(model, "a.0")  # already covered by 'a'
    with p.autocast():
        out = model.a(torch.randn(2, 32))
    assert out.dtype == torch.float32  # the fp32 module is in fp32 on the demoted layers
    assert not p.demote(model, "a.0", "again") and not p.demote(model, "nope", "x")


def test_fallback_to_bf16_demotes_every_layer_and_keeps_the_optimizer_state():
    model = Net()
    p = _plugin()
    p.prepare(model)
    opt = torch.optim.AdamW(p.optimizer_params(model), lr=1e-3)
    with p.autocast():
        model(**BATCH).backward()
    opt.step()
    before = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    prot = Protection(model, opt, p, rebuild_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    prot.switch_precision("bf16")
    assert prot.precision.name == "bf16" and fp8.converted_layers(model) == []
    assert prot.precision.options == p.options  # handed on to the next plugin
    after = prot.optimizer.state_dict()["state"]
    assert all(torch.equal(after[k]["exp_avg"], v) for k, v in before.items())
    assert [id(q) for q in prot.optimizer.param_groups[0]["params"]] == [
        id(q) for q in model.parameters()
    ]


def test_state_dict_and_restore_bring_the_demotions_back():
    model = Net()
    p = _plugin()
    p.prepare(model)
    p.demote(model, "a.2", "saturation above 10.0% in 3 samples in a row (last 40.0%)")
    sd = p.state_dict()
    assert sd["fp8"] == {
        "recipe": "tensorwise",
        "converted": ["a.0", "a.2", "b.0"],
        "demoted": {"a.2": "saturation above 10.0% in 3 samples in a row (last 40.0%)"},
    }
    fresh, q = Net(), _plugin()
    q.prepare(fresh)
    q.restore(fresh, sd)
    assert fp8.converted_layers(fresh) == ["a.0", "b.0"] and q.demoted == p.demoted
    other = _plugin()
    other.prepare(m := Net())
    other.restore(m, {**sd, "name": "bf16"})  # another precision's state: nothing to redo
    assert fp8.converted_layers(m) == ["a.0", "a.2", "b.0"]


def test_without_torchao_prepare_raises_the_hint_and_leaves_the_model_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = Net()
    with pytest.raises(
        fp8.Fp8Unavailable, match=r'^fp8 needs torchao: pip install "ampctl\[fp8\]"$'
    ):
        _plugin().prepare(model)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_train_without_torchao_is_one_line_exit_2_and_leaves_no_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # the import fails as if absent
    runs = tmp_path / "runs"
    res = CliRunner().invoke(
        app, ["train", *FAST, "precision=fp8", f"trainer.runs_dir={runs}", "--name", "x"]
    )
    assert res.exit_code == 2
    assert res.stderr == 'ampctl: error: fp8 needs torchao: pip install "ampctl[fp8]"\n'
    assert not (runs / "x").exists()


def test_fp8_with_fsdp_is_refused_before_anything_is_built(fast_cfg, tmp_path):
    from ampctl.errors import UsageError
    from ampctl.train.dist import DistContext
    from ampctl.train.trainer import Trainer

    ctx = DistContext(rank=0, world_size=2, strategy="fsdp")
    with pytest.raises(UsageError) as e:
        Trainer(fast_cfg("precision=fp8"), tmp_path, dist_ctx=ctx)
    assert str(e.value).startswith(
        "precision=fp8 cannot be combined with dist.strategy=fsdp yet"
    ) and str(e.value).endswith("use dist.strategy=ddp")


def test_worst_layer_names_the_layers_with_the_largest_figures():
    row = [0.0] * len(fp8.FIELDS)
    a = dict(zip(fp8.FIELDS, row, strict=True)) | {"in_amax": 1.0, "w_sat": 0.2, "go_under": 0.01}
    b = dict(zip(fp8.FIELDS, row, strict=True)) | {"go_amax": float("inf"), "in_sat": 0.3}
    out = worst_layer(["x", "y"], [list(a.values()), list(b.values())])
    assert out == {
        "fp8_layers": 2,
        "fp8_sat": 0.3,
        "fp8_sat_layer": "y",
        "fp8_under": 0.01,
        "fp8_under_layer": "x",
        "fp8_nonfinite_layers": 1,
    }
    assert worst_layer([], []) == dict.fromkeys(out) | {"fp8_layers": 0}


def test_fallback_chain_from_fp8_skips_fp16():
    chain = ["fp16", "bf16", "fp32"]  # the default guard.fallback_chain
    assert next_precision("fp8", chain) == "bf16"
    assert next_precision("fp8", chain, bf16_ok=False) == "fp32"
    assert next_precision("fp8", ["fp16"]) is None
    assert next_precision("fp8", ["fp8", "fp16", "fp32"]) == "fp16"  # an explicit chain rules
    assert next_precision("fp16-pure", chain) == "fp16"


def test_config_keys_compose_and_bad_values_are_one_line(tmp_path):
    cfg = load_config(["precision=fp8"])
    assert cfg.precision.name == "fp8" and cfg.precision.fp8_recipe == "tensorwise"
    assert cfg.precision.fp8_exclude == list(fp8.DEFAULT_EXCLUDE)
    assert cfg.precision.options() == {"recipe": "tensorwise", "exclude": cfg.precision.fp8_exclude}
    cfg = load_config(["precision=fp8", "precision.fp8_recipe=rowwise", "precision.fp8_exclude=[]"])
    assert cfg.precision.fp8_recipe == "rowwise" and cfg.precision.fp8_exclude == []
    for bad, msg in (
        (
            "precision.fp8_recipe=delayed",
            "precision.fp8_recipe='delayed' is not allowed: precision.fp8_recipe must be one of "
            "tensorwise, rowwise",
        ),
        ("precision.fp8_exclude=['']", "precision.fp8_exclude=[''] is not allowed"),
        ("guard.fp8_patience=0", "guard.fp8_patience=0 is not allowed"),
        ("guard.fp8_sat_threshold=2", "guard.fp8_sat_threshold=2.0 is not allowed: guard.fp8_sat"),
    ):
        with pytest.raises(ConfigError) as e:
            load_config(["precision=fp8", bad])
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
