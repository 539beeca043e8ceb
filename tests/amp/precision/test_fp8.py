"""The fp8 precision plugin (ampctl.amp.precision.fp8) and its config, without the loop: its parts
one by one -- which layers ``prepare`` takes and why it leaves the others, ``demote`` /
``restore`` / ``release``, the cast probe on a sampled step and on hand-made log-read values, and
the worst layer of a row -- on tiny ``nn.Linear`` stacks, then the plugin make_precision builds
on a small model, its config and its refusals. Real torchao on the CPU.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampctl.amp import fp8, make_precision
from ampctl.amp.guard import next_precision
from ampctl.amp.precision.fp8 import ROW_KEYS, Fp8CastProbe, FP8Precision, worst_layer
from ampctl.cli import app
from ampctl.config import ConfigError, load_config
from ampctl.protect.figures import DeviceFigures
from ampctl.protect.protection import Protection
from tests.conftest import FAST

pytest.importorskip("torchao.float8")


INF, NAN = math.inf, math.nan
W = len(fp8.FIELDS)


class Stack(nn.Module):
    """``a`` and ``ab`` (a name that starts like ``a``), each two fp8-able linears, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.ab = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.lm_head = nn.Linear(16, 16)

    def forward(self, x):
        return self.lm_head(self.ab(self.a(x))).float().pow(2).mean()


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def _plugin(**kw) -> FP8Precision:
    return FP8Precision(exclude=kw.pop("exclude", ["*lm_head*"]), **kw)


def _prepared(**kw) -> tuple[Stack, FP8Precision]:
    model, p = Stack(), _plugin(**kw)
    assert p.prepare(model) is model
    return model, p


# ------------------------------------------------------------------ construction
def test_the_plugin_checks_its_recipe_and_patterns_and_starts_empty():
    p = FP8Precision()
    assert (p.name, p.compute_dtype, p.option_keys) == (
        "fp8",
        torch.bfloat16,
        ("recipe", "exclude"),
    )
    assert p.recipe == "tensorwise" and p.exclude == list(fp8.DEFAULT_EXCLUDE)
    assert (p.converted, p.skipped, p.demoted) == ([], {}, {})
    assert isinstance(p.probe, Fp8CastProbe) and p.probes() == [p.probe]
    assert FP8Precision(recipe="rowwise", exclude=("x",)).exclude == ["x"]
    with pytest.raises(
        fp8.Fp8Error, match="fp8 recipe 'delayed' is not one of tensorwise, rowwise"
    ):
        FP8Precision(recipe="delayed")
    with pytest.raises(fp8.Fp8Error, match="got the string '\\*head\\*'"):
        FP8Precision(exclude="*head*")
    assert not p.scaler.is_enabled()


def test_repr_names_the_recipe_the_layers_and_the_fp32_modules():
    model, p = _prepared(fp32_modules=["ab"])
    p.demote(model, "a.1", "why")
    assert (
        repr(p) == "FP8Precision(recipe=tensorwise, converted=2, demoted=['a.1'], in_fp32=['ab'])"
    )


# ------------------------------------------------------------------ prepare
def test_prepare_keeps_the_layers_of_an_fp32_module_out_but_not_a_name_that_only_starts_alike():
    model, p = _prepared(fp32_modules=["a"])
    assert p.converted == ["ab.0", "ab.1"] == fp8.converted_layers(model)
    assert p.skipped == {
        "a.0": "inside 'a', kept in fp32 by precision.fp32_modules",
        "a.1": "inside 'a', kept in fp32 by precision.fp32_modules",
        "lm_head": "excluded by pattern '*lm_head*'",
    }
    assert p.in_fp32 == ["a"]
    model, p = _prepared(fp32_modules=["a.1"])  # the layer itself
    assert p.converted == ["a.0", "ab.0", "ab.1"]
    assert p.skipped["a.1"] == "inside 'a.1', kept in fp32 by precision.fp32_modules"
    assert type(model.a[1]) is nn.Linear and p.in_fp32 == ["a.1"]


def test_prepare_without_exclusions_converts_every_eligible_layer():
    model, p = Stack(), FP8Precision(exclude=[])
    p.prepare(model)
    assert p.converted == ["a.0", "a.1", "ab.0", "ab.1", "lm_head"] and p.skipped == {}


def test_prepare_checks_that_the_conversion_took_exactly_the_plan(monkeypatch):
    model, p = Stack(), _plugin()
    monkeypatch.setattr(fp8, "convert", lambda m, recipe, exclude: ["a.0"])
    with pytest.raises(RuntimeError) as e:
        p.prepare(model)
    assert str(e.value) == "fp8: converted ['a.0'], planned ['a.0', 'a.1', 'ab.0', 'ab.1']"


def test_prepare_hands_the_recipe_and_the_exclusions_to_the_conversion(monkeypatch):
    seen = {}
    real = fp8.convert

    def spy(model, *, recipe, exclude):
        seen.update(recipe=recipe, exclude=list(exclude))
        return real(model, recipe=recipe, exclude=exclude)

    monkeypatch.setattr(fp8, "convert", spy)
    model, p = Stack(), FP8Precision(recipe="rowwise", exclude=["*head*"], fp32_modules=["ab"])
    p.prepare(model)
    assert seen == {"recipe": "rowwise", "exclude": ["ab.0", "ab.1", "*head*"]}
    assert fp8.cast_formats(model.a[0])["go"] == "e4m3"  # rowwise: e4m3 everywhere


# ------------------------------------------------------------------ demote, to_fp32, release
def test_demotable_takes_the_layer_and_what_is_inside_it_only():
    model, p = _prepared()
    assert p.demotable(model) == ["a.0", "a.1", "ab.0", "ab.1"]
    assert p.demotable(model, "a") == ["a.0", "a.1"]  # not ab.*
    assert p.demotable(model, "a.1") == ["a.1"] and p.demotable(model, "lm_head") == []


def test_demote_replaces_one_layer_and_keeps_its_reason():
    model, p = _prepared()
    w = model.ab[1].weight
    assert p.demote(model, "ab.1", "because") is True
    assert type(model.ab[1]) is nn.Linear and model.ab[1].weight is w
    assert p.demoted == {"ab.1": "because"}
    assert p.demote(model, "ab.1", "again") is False and p.demoted == {"ab.1": "because"}
    assert p.demote(model, "nope", "x") is False and p.demote(model, "lm_head", "x") is False
    assert p.demoted == {"ab.1": "because"}


def test_to_fp32_demotes_the_layers_inside_first_and_refuses_what_is_covered():
    model, p = _prepared()
    assert p.to_fp32(model, "ab") is True
    assert p.demoted == {n: "inside 'ab', which now runs in fp32" for n in ("ab.0", "ab.1")}
    assert fp8.converted_layers(model) == ["a.0", "a.1"] and p.in_fp32 == ["ab"]
    assert p.to_fp32(model, "ab") is False and p.to_fp32(model, "ab.0") is False
    assert p.to_fp32(model, "a.0") is True  # 'a.0' does not start with 'ab.'
    assert p.demoted["a.0"] == "inside 'a.0', which now runs in fp32"
    assert p.in_fp32 == ["ab", "a.0"] and fp8.converted_layers(model) == ["a.1"]


def test_release_demotes_every_layer_and_returns_the_fp32_modules():
    model, p = _prepared(fp32_modules=["lm_head"])
    params = list(model.parameters())
    assert p.release(model) == ["lm_head"]
    assert fp8.converted_layers(model) == [] and p.in_fp32 == []
    assert all(type(m) is nn.Linear for m in (*model.a, *model.ab))
    assert [id(q) for q in model.parameters()] == [id(q) for q in params]


# ------------------------------------------------------------------ state
def test_restore_redoes_the_demotions_and_keeps_those_it_cannot_redo():
    model, p = _prepared()
    p.demote(model, "a.0", "sat")
    sd = p.state_dict()
    assert sd == {
        "name": "fp8",
        "in_fp32": [],
        "fp8": {
            "recipe": "tensorwise",
            "converted": ["a.0", "a.1", "ab.0", "ab.1"],
            "demoted": {"a.0": "sat"},
        },
    }
    sd["fp8"]["demoted"]["gone"] = "old layer"  # no such layer now: still recorded
    sd["fp8"]["demoted"]["gone2"] = "older"
    fresh, q = _prepared()
    q.demoted["gone2"] = "kept"  # a reason already there for a layer it cannot demote stays
    q.restore(fresh, sd)
    assert fp8.converted_layers(fresh) == ["a.1", "ab.0", "ab.1"]
    assert q.demoted == {"gone2": "kept", "a.0": "sat", "gone": "old layer"}
    other, r = _prepared()
    r.restore(other, {"name": "fp8"})  # an fp8 state without demotions
    r.restore(other, {"name": "fp8", "fp8": None})
    r.restore(other, {**sd, "name": "bf16"})
    assert fp8.converted_layers(other) == ["a.0", "a.1", "ab.0", "ab.1"] and r.demoted == {}


def test_restore_of_a_layer_excluded_now_records_it_without_demoting():
    model, p = _prepared()
    p.restore(model, {"name": "fp8", "fp8": {"demoted": {"lm_head": "sat"}}})
    assert p.demoted == {"lm_head": "sat"} and type(model.lm_head) is nn.Linear


def test_summary_names_the_recipe_the_layers_the_exclusions_and_the_demotions():
    model, p = _prepared()
    p.demote(model, "ab.0", "under")
    s = p.summary(model)
    assert s == {
        "fp8_recipe": "tensorwise",
        "fp8_layers": ["a.0", "a.1", "ab.1"],
        "fp8_excluded": {"lm_head": "excluded by pattern '*lm_head*'"},
        "fp8_demoted": {"ab.0": "under"},
    }
    s["fp8_demoted"]["x"] = "y"
    s["fp8_excluded"].clear()
    assert p.demoted == {"ab.0": "under"} and p.skipped  # copies


# ------------------------------------------------------------------ replay and the probe
def test_replay_casts_runs_the_step_with_the_probe_open():
    model, p = _prepared()
    calls = []

    def run():
        calls.append(1)
        with p.autocast():
            loss = model(X)
        loss.backward()

    names, rows = p.replay_casts(model, run)
    assert calls == [1] and names == ["a.0", "a.1", "ab.0", "ab.1"]
    assert rows.shape == (4, W) and bool((rows[:, fp8.FIELDS.index("go_amax")] > 0).all())
    assert all(not m._forward_hooks for m in model.modules())
    p.release(model)
    assert p.replay_casts(model, run) is None and calls == [1]  # no fp8 layer: not run


def _sampled(p: FP8Precision, model: nn.Module, x=X) -> dict:
    with p.probe.sampling(model, True):
        with p.autocast():
            loss = model(x)
        loss.backward()
    fig = DeviceFigures(torch.device("cpu"))
    p.probe.figures(fig)
    return fig.read()


def test_the_probe_adds_its_rows_as_a_max_over_ranks_and_reads_the_worst_layer():
    model, p = _prepared()
    values = _sampled(p, model)
    assert list(values) == ["fp8_rows"] and len(values["fp8_rows"]) == 4 * W
    got = p.probe.row(values)
    assert set(got) == set(ROW_KEYS) and got["fp8_layers"] == 4
    assert got["fp8_nonfinite_layers"] == 0 and got["fp8_sat_layer"] in p.converted
    names, rows = p.probe.take_sample()
    assert names == ["a.0", "a.1", "ab.0", "ab.1"] and len(rows) == 4
    assert rows[2] == values["fp8_rows"][2 * W : 3 * W]
    assert p.probe.take_sample() is None  # once
    assert p.probe.row(values) == {}  # nothing sampled since


def test_the_probes_figures_are_reduced_with_max():
    model, p = _prepared()
    with p.probe.sampling(model, True), p.autocast():
        model(X).backward()
    fig = DeviceFigures(torch.device("cpu"))
    p.probe.figures(fig)
    assert [(n, r) for n, _, r in fig._items] == [("fp8_rows", "max")]
    assert "fp8_rows" in fig._vectors


def test_a_nan_cast_is_read_as_inf_so_a_max_over_ranks_keeps_it():
    model, p = _prepared()
    bad = X.clone()
    bad[0, 0] = NAN
    values = _sampled(p, model, bad)
    in_amax = values["fp8_rows"][0]
    assert in_amax == INF  # NaN on the device, inf after the probe's figures
    assert not any(math.isnan(v) for v in values["fp8_rows"])
    assert p.probe.row(values)["fp8_nonfinite_layers"] == 4


def test_the_probe_installs_nothing_on_other_steps_and_keeps_the_last_sample():
    model, p = _prepared()
    p.probe.row(_sampled(p, model))
    with p.probe.sampling(model, False):
        assert all(not m._forward_hooks for m in model.modules())
        with p.autocast():
            model(X).backward()
    fig = DeviceFigures(torch.device("cpu"))
    p.probe.figures(fig)
    assert fig.read() == {} and p.probe.row({}) == {}
    assert p.probe.take_sample() is not None  # a plain step does not drop the log step's sample


def test_a_new_sampled_step_drops_an_untaken_sample():
    model, p = _prepared()
    p.probe.row(_sampled(p, model))
    with p.probe.sampling(model, True):
        assert p.probe.take_sample() is None


def test_row_reads_hand_made_values_and_truncates_to_the_rows_read():
    model, p = _prepared()
    _sampled(p, model)
    a = [1.0, 0.5, 0.0, 1.0, 0.1, 0.0, 1.0, 0.0, 0.02]
    b = [1.0, 0.0, 0.3, 1.0, 0.0, 0.0, INF, 0.0, 0.0]
    got = p.probe.row({"fp8_rows": a + b})
    assert got == {
        "fp8_layers": 2,
        "fp8_sat": 0.5,
        "fp8_sat_layer": "a.0",
        "fp8_under": 0.3,
        "fp8_under_layer": "a.1",
        "fp8_nonfinite_layers": 1,
    }
    assert p.probe.take_sample() == (["a.0", "a.1"], [a, b])
    with p.probe.sampling(model, True), p.autocast():
        model(X).backward()
    assert p.probe.row({}) == {**dict.fromkeys(ROW_KEYS), "fp8_layers": 0}
    assert p.probe.take_sample() == ([], [])


# ------------------------------------------------------------------ worst_layer
def test_worst_layer_of_no_rows_is_empty():
    assert worst_layer([], []) == {**dict.fromkeys(ROW_KEYS), "fp8_layers": 0}


def test_worst_layer_ranks_a_non_finite_figure_highest_and_counts_non_finite_layers():
    rows = [
        [1.0, 0.2, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.4],
        [1.0, NAN, 0.0, INF, 0.0, 0.0, 1.0, 0.0, 0.0],  # NaN sat: ranked as the worst
        [NAN, 0.1, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        [1.0, 0.0, NAN, 1.0, 0.0, 0.0, NAN, 0.0, 0.0],  # NaN under: the worst
    ]
    got = worst_layer(["l0", "l1", "l2", "l3"], rows)
    assert got["fp8_layers"] == 4 and got["fp8_sat_layer"] == "l1"
    assert math.isnan(got["fp8_sat"])
    assert got["fp8_under_layer"] == "l3" and math.isnan(got["fp8_under"])
    assert got["fp8_nonfinite_layers"] == 3  # l1 (weight), l2 (input), l3 (gradient)
    ok = worst_layer(["x", "y"], [[1.0, 0.1, 0, 1.0, 0.3, 0, 1.0, 0, 0.2],
                                  [1.0, 0.25, 0, 1.0, 0, 0.05, 1.0, 0.01, 0]])  # fmt: skip
    assert (ok["fp8_sat"], ok["fp8_sat_layer"], ok["fp8_under"], ok["fp8_under_layer"]) == (
        0.3,
        "x",
        0.2,
        "x",
    )
    assert ok["fp8_nonfinite_layers"] == 0
    tie = worst_layer(["p", "q"], [[1.0] + [0.0] * 8, [1.0] + [0.0] * 8])
    assert tie["fp8_sat_layer"] == "p" and tie["fp8_under_layer"] == "p"  # the first of equals


def test_make_precision_hands_the_fp8_options_to_the_plugin():
    p = make_precision("fp8", options={"recipe": "rowwise", "exclude": ["*x*"], "other": 1})
    assert isinstance(p, FP8Precision) and (p.recipe, p.exclude) == ("rowwise", ["*x*"])
    assert p.options == {"recipe": "rowwise", "exclude": ["*x*"], "other": 1}


def test_a_fresh_probe_has_nothing_to_add_read_or_hand_over():
    probe = Fp8CastProbe()
    fig = DeviceFigures(torch.device("cpu"))
    probe.figures(fig)
    assert fig.read() == {} and probe.row({"fp8_rows": [1.0] * W}) == {}
    assert probe.take_sample() is None


# ===================================================== the plugin make_precision builds, its config
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


def _made(**kw) -> FP8Precision:
    return make_precision("fp8", options={"recipe": "tensorwise", "exclude": ["*lm_head*"]}, **kw)


def test_prepare_converts_the_plan_and_keeps_the_reasons_for_the_rest():
    model = Net()
    p = _made(fp32_modules=["b"])
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
    p = _made()
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
    p = _made()
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
    p = _made()
    p.prepare(model)
    p.demote(model, "a.2", "saturation above 10.0% in 3 samples in a row (last 40.0%)")
    sd = p.state_dict()
    assert sd["fp8"] == {
        "recipe": "tensorwise",
        "converted": ["a.0", "a.2", "b.0"],
        "demoted": {"a.2": "saturation above 10.0% in 3 samples in a row (last 40.0%)"},
    }
    fresh, q = Net(), _made()
    q.prepare(fresh)
    q.restore(fresh, sd)
    assert fp8.converted_layers(fresh) == ["a.0", "b.0"] and q.demoted == p.demoted
    other = _made()
    other.prepare(m := Net())
    other.restore(m, {**sd, "name": "bf16"})  # another precision's state: nothing to redo
    assert fp8.converted_layers(m) == ["a.0", "a.2", "b.0"]


def test_without_torchao_prepare_raises_the_hint_and_leaves_the_model_alone(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = Net()
    with pytest.raises(
        fp8.Fp8Unavailable, match=r'^fp8 needs torchao: pip install "ampctl\[fp8\]"$'
    ):
        _made().prepare(model)
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
