"""ampctl.amp.fp8 piece by piece: every refusal word for word, the plan's reasons, demotion's
checks, the cast record's figures on hand-made tensors and the pure demotion rule's edges -- tiny
``nn.Linear`` stacks, real torchao on the CPU, milliseconds each."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from ampctl.amp import fp8  # noqa: E402

INF, NAN = math.inf, math.nan
ROW = {f: i for i, f in enumerate(fp8.FIELDS)}


def stack(*dims: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(dims, dims[1:], strict=False)))


# ------------------------------------------------------------------ torchao and the checks
def test_require_torchao_hands_out_what_the_plugin_uses_and_restores_the_log_levels():
    quiet = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    quiet[0].setLevel(logging.INFO)
    quiet[1].setLevel(logging.DEBUG)
    try:
        ao = fp8.require_torchao()
        assert [lg.level for lg in quiet] == [logging.INFO, logging.DEBUG]
    finally:
        for lg in quiet:
            lg.setLevel(logging.NOTSET)
    import torchao.float8 as float8
    from torchao.float8.float8_linear import Float8Linear

    assert ao.float8 is float8 and ao.Float8Linear is Float8Linear
    assert callable(ao.hp_tensor_to_float8_dynamic) and callable(ao.get_maybe_axiswise_dim)
    assert ao.GemmInputRole.INPUT.name == "INPUT"


def test_bad_recipes_and_patterns_are_one_exact_line():
    with pytest.raises(fp8.Fp8Error) as e:
        fp8._check_recipe("delayed")
    assert str(e.value) == "fp8 recipe 'delayed' is not one of tensorwise, rowwise"
    fp8._check_recipe("rowwise")
    with pytest.raises(fp8.Fp8Error) as e:
        fp8._check_patterns("*head*")
    assert str(e.value) == (
        "fp8 exclude must be a list of fnmatch patterns over module names, e.g. ['*lm_head*'], "
        "got the string '*head*'"
    )
    for bad in ("", 3, None):
        with pytest.raises(fp8.Fp8Error) as e:
            fp8._check_patterns(["ok", bad])
        assert str(e.value) == f"fp8 exclude patterns must be non-empty strings, got {bad!r}"
    assert fp8._check_patterns(("a", "b")) == ["a", "b"] and fp8._check_patterns([]) == []
    assert fp8.RECIPES == ("tensorwise", "rowwise") and fp8.HINT.startswith("fp8 needs torchao")


# ------------------------------------------------------------------ eligibility and the plan
class Sub(nn.Linear):
    pass


class Fake(nn.Module):
    """Named like torchao's layer, without its linear_mm_config."""


Fake.__name__ = "Float8Linear"


def test_is_fp8_layer_needs_torchaos_class_and_its_mm_config():
    model = stack(16, 16)
    assert not fp8.is_fp8_layer(model[0])
    fp8.convert(model)
    assert fp8.is_fp8_layer(model[0])
    assert not fp8.is_fp8_layer(Fake())
    fake = Fake()
    fake.linear_mm_config = object()
    assert fp8.is_fp8_layer(fake)  # the class name and the config are what is checked


def test_eligible_gives_the_reason_a_layer_stays_out():
    assert fp8.eligible(nn.Linear(16, 32)) is None
    assert fp8.eligible(nn.Linear(16, 24)) == "dims 16x24 are not multiples of 16"
    assert fp8.eligible(nn.Linear(8, 16)) == "dims 8x16 are not multiples of 16"
    assert fp8.eligible(Sub(16, 16)) == "a Sub, not a plain nn.Linear"
    model = stack(16, 16)
    fp8.convert(model)
    assert fp8.eligible(model[0]) == "already fp8"
    assert fp8.DIM_MULTIPLE == 16


def test_plan_reasons_for_a_model_that_is_a_linear_and_for_nested_patterns():
    p = fp8.plan(nn.Linear(16, 16))
    assert p == fp8.Plan(convert=[], skip={"": "the model itself is a Linear: convert a model "
                                                "that contains it"})  # fmt: skip
    model = nn.Sequential()
    model.add_module("enc", nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    model.add_module("embed_proj", nn.Linear(16, 16))
    model.add_module("head", nn.Linear(16, 16))
    model.add_module("odd", nn.Linear(16, 8))
    model.add_module("relu", nn.ReLU())
    p = fp8.plan(model, exclude=["enc.1", "*embed*"])
    assert p.convert == ["enc.0", "head"]
    assert p.skip == {
        "enc.1": "excluded by pattern 'enc.1'",
        "embed_proj": "excluded by pattern '*embed*'",
        "odd": "dims 16x8 are not multiples of 16",
    }
    # the first pattern that matches the outermost scope names the reason
    p = fp8.plan(model, exclude=["*.1", "enc"])
    assert p.skip["enc.1"] == "excluded by pattern 'enc'" and p.skip["enc.0"] == (
        "excluded by pattern 'enc'"
    )
    assert fp8.plan(model, exclude=[]).convert == ["enc.0", "enc.1", "embed_proj", "head"]
    assert fp8.plan(model).skip["embed_proj"] == "excluded by pattern '*embed*'"  # the default
    with pytest.raises(fp8.Fp8Error):
        fp8.plan(model, exclude="enc")


def test_fnmatch_is_case_sensitive():
    model = nn.Sequential()
    model.add_module("Head", nn.Linear(16, 16))
    assert fp8.plan(model, exclude=["head"]).convert == ["Head"]


def test_convert_needs_no_torchao_when_nothing_is_eligible(monkeypatch):
    def missing():
        raise fp8.Fp8Unavailable(fp8.HINT)

    monkeypatch.setattr(fp8, "require_torchao", missing)
    assert fp8.convert(stack(16, 8)) == []
    with pytest.raises(fp8.Fp8Unavailable):
        fp8.convert(stack(16, 16))
    with pytest.raises(fp8.Fp8Error):
        fp8.convert(stack(16, 8), recipe="x")  # the recipe is checked first


def test_convert_takes_exactly_the_planned_layers_with_the_recipe():
    model = stack(16, 16, 16, 8)
    assert fp8.convert(model, recipe="rowwise", exclude=["1"]) == ["0"]
    assert fp8.converted_layers(model) == ["0"] and type(model[1]) is nn.Linear
    assert fp8.cast_formats(model[0]) == {"in": "e4m3", "w": "e4m3", "go": "e4m3"}
    other = stack(16, 16)
    fp8.convert(other)
    assert fp8.cast_formats(other[0]) == {"in": "e4m3", "w": "e4m3", "go": "e5m2"}


def test_cast_formats_of_a_cast_that_is_off_is_high_precision():
    model = stack(16, 16)
    fp8.convert(model)
    c = model[0].config
    off = type(c.cast_config_input)(scaling_type=type(c.cast_config_input.scaling_type)("disabled"))
    layer = SimpleNamespace(config=SimpleNamespace(
        cast_config_input=off, cast_config_weight=c.cast_config_weight,
        cast_config_grad_output=c.cast_config_grad_output,
    ))  # fmt: skip
    assert fp8.cast_formats(layer) == {"in": "hp", "w": "e4m3", "go": "e5m2"}
    assert fp8._fmt(torch.float8_e5m2) == "e5m2" and fp8._fmt(torch.float8_e4m3fn) == "e4m3"


# ------------------------------------------------------------------ demote
def test_demote_refuses_what_it_cannot_demote_in_one_line():
    model = stack(16, 16, 16)
    fp8.convert(model, exclude=["1"])
    with pytest.raises(fp8.Fp8Error) as e:
        fp8.demote(model, "nope")
    assert str(e.value) == "fp8: no module named 'nope' in the model"
    with pytest.raises(fp8.Fp8Error) as e:
        fp8.demote(model, "1")
    assert str(e.value) == "fp8: '1' is a Linear, not an fp8 layer to demote"
    solo = nn.Sequential(nn.Linear(16, 16))
    fp8.convert(solo)
    with pytest.raises(fp8.Fp8Error) as e:
        fp8.demote(solo[0], "")
    assert str(e.value) == "fp8: the model itself is the fp8 layer; demote a layer inside a model"
    wrapped = model[0]
    wrapped.weight = nn.Parameter(wrapped.weight.detach().clone())
    w = wrapped.weight
    wrapped._parameters["weight"] = w.as_subclass(Wrapped)
    with pytest.raises(fp8.Fp8Error) as e:
        fp8.demote(model, "0")
    assert str(e.value) == "fp8: '0' holds a wrapped weight (Wrapped)"


class Wrapped(nn.Parameter):
    pass


def test_demote_keeps_the_mode_the_bias_and_a_nested_parent():
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16, bias=False)))
    fp8.convert(model)
    model.eval()
    old = model[0][1]
    new = fp8.demote(model, "0.1")
    assert model[0][1] is new and type(new) is nn.Linear and new.bias is None
    assert new.weight is old.weight and new.training is False
    assert (new.in_features, new.out_features) == (16, 16)
    assert new.weight.device.type == "cpu"  # the meta-device layer got the real weight
    model.train()
    first = fp8.demote(model, "0.0")
    assert first.training is True and first.bias is not None
    assert first(torch.ones(2, 16)).shape == (2, 16)


# ------------------------------------------------------------------ the cast record
def test_the_record_of_no_call_is_empty_and_its_hooks_go_on_exit():
    model = stack(16, 16)
    fp8.convert(model)
    with fp8.record_casts(model) as p:
        assert p.names == [] and len(model[0]._forward_hooks) == 1
    assert p.rows().shape == (0, len(fp8.FIELDS)) and p.rows().dtype == torch.float32
    assert not model[0]._forward_hooks and p._handles == []
    with fp8.record_casts(model, enabled=False) as off:
        assert off is None and not model[0]._forward_hooks


def test_the_record_refuses_a_compiled_wrapper_unless_disabled():
    model = stack(16, 16)
    model._orig_mod = stack(16, 16)  # what torch.compile's wrapper has
    with pytest.raises(fp8.Fp8Error) as e:
        with fp8.record_casts(model):
            pass
    assert str(e.value) == (
        "fp8 probe: pass the eager module (compiled._orig_mod) and run the sampled step "
        "through it; a torch.compile graph does not run hooks added after compiling"
    )
    with fp8.record_casts(model, enabled=False) as p:
        assert p is None


def test_the_record_removes_its_hooks_when_the_step_fails():
    model = stack(16, 16)
    fp8.convert(model)
    with pytest.raises(RuntimeError, match="the step failed"), fp8.record_casts(model):
        raise RuntimeError("the step failed")
    assert not model[0]._forward_hooks


def test_exact_figures_of_planted_inputs_in_call_order():
    model = stack(16, 16, 16)
    fp8.convert(model)
    x = torch.zeros(4, 16)
    x[0, 0] = 448.0  # the amax: at the max after the cast
    x[1, :] = 1e-6  # far below amax * 2**-10 / 448: flushed to zero
    x[2, 0] = -2.0
    with fp8.record_casts(model) as p:
        out = model(x)
        out.sum().backward()
    assert p.names == ["0", "1"]
    rows = p.rows()
    r = dict(zip(fp8.FIELDS, rows[0].tolist(), strict=True))
    assert r["in_amax"] == 448.0
    assert r["in_sat"] == pytest.approx(1 / 64)  # 1 of 64 values at the max
    assert r["in_under"] == pytest.approx(16 / 18)  # 16 of the 18 nonzero values flushed
    assert r["w_amax"] == pytest.approx(model[0].weight.abs().max().item())
    assert r["go_amax"] == pytest.approx(model[1].weight.sum(0).abs().max().item(), rel=0.1)
    assert rows[1, ROW["go_amax"]].item() == 1.0  # d(sum)/d(output) of the last layer
    assert 0 < r["w_sat"] < 1 and r["go_sat"] > 0


def test_a_non_tensor_call_or_an_output_without_grad_adds_only_the_forward():
    model = stack(16, 16)
    fp8.convert(model)
    with fp8.record_casts(model) as p, torch.no_grad():
        model(torch.ones(2, 16))
    rows = p.rows()
    assert p.names == ["0"] and rows[0, ROW["go_amax"]].item() == 0.0
    assert rows[0, ROW["in_amax"]].item() == 1.0
    rec = fp8.CastRecord(model)
    hook = rec._forward_hook("0")
    hook(model[0], (), torch.ones(1))  # no positional input: nothing recorded
    hook(model[0], (torch.ones(2, 16),), (torch.ones(1),))  # a tuple output: nothing either
    assert rec.names == [] and rec.rows().shape == (0, len(fp8.FIELDS))


def test_rows_handed_out_keep_their_values_and_a_nan_is_kept():
    model = stack(16, 16)
    fp8.convert(model)
    with fp8.record_casts(model) as p:
        model(torch.ones(2, 16))
        first = p.rows()
        model(torch.full((2, 16), 5.0))
        bad = torch.ones(2, 16)
        bad[0, 0] = NAN
        model(bad)
        model(torch.full((2, 16), 9.0))
    assert first[0, ROW["in_amax"]].item() == 1.0  # a fresh tensor each time
    assert math.isnan(p.rows()[0, ROW["in_amax"]].item())  # NaN, seen once, stays


def test_a_cast_that_is_off_has_an_amax_but_no_sat_or_under():
    model = stack(16, 16)
    fp8.convert(model)
    rec = fp8.CastRecord(model)
    cc = model[0].config.cast_config_input
    off = type(cc)(scaling_type=type(cc.scaling_type)("disabled"))
    got = rec._stats(torch.tensor([[3.0, -5.0]]), off, model[0].config, model[0], "INPUT", -1)
    assert got.tolist() == [5.0, 0.0, 0.0]


def test_the_record_finds_the_layers_of_the_model_in_module_order():
    model = stack(16, 16, 16, 8)
    fp8.convert(model)
    rec = fp8.CastRecord(model)
    assert [n for n, _ in rec._layers] == ["0", "1"] and rec._handles == []
    assert rec._ao.Float8Linear is type(model[0])


# ------------------------------------------------------------------ summarize
def test_summarize_of_one_layer_takes_each_cast_group_apart():
    rows = torch.zeros(2, len(fp8.FIELDS))
    rows[0, ROW["w_sat"]] = 0.4
    rows[1, ROW["in_under"]] = 0.6
    rows[1, ROW["go_under"]] = 0.7
    rows[0, ROW["go_sat"]] = 0.05
    rows[0, ROW["w_amax"]] = NAN
    rows[1, ROW["in_amax"]] = INF
    got = dict(zip(fp8.SUMMARY_FIELDS, fp8.summarize(rows).tolist(), strict=True))
    assert got == {
        "fwd_sat": pytest.approx(0.4),
        "fwd_under": pytest.approx(0.6),
        "grad_sat": pytest.approx(0.05),
        "grad_under": pytest.approx(0.7),
        "nonfinite_layers": 2.0,
        "worst_sat_layer": 0.0,
        "worst_under_layer": 1.0,
    }
    empty = fp8.summarize(torch.zeros(0, len(fp8.FIELDS)))
    assert empty.tolist() == [0.0] * 5 + [-1.0, -1.0] and empty.shape == (7,)


# ------------------------------------------------------------------ decisions
def test_a_layer_sample_from_a_row_and_its_figures():
    s = fp8.LayerSample.from_row([1, 0.1, 0.2, 2, 0.3, 0.05, 3, 0.2, 0.4])
    assert (s.in_amax, s.w_amax, s.go_amax) == (1.0, 2.0, 3.0) and type(s.in_amax) is float
    assert s.sat == 0.3 and s.under == 0.4 and s.forward_finite and s.grad_finite
    with pytest.raises(ValueError) as e:
        fp8.LayerSample.from_row([1.0] * 8)
    assert str(e.value) == f"a layer row has 9 figures ({fp8.FIELDS}), got 8"
    assert not fp8.LayerSample(w_amax=INF).forward_finite
    assert not fp8.LayerSample(in_amax=NAN).forward_finite
    assert fp8.LayerSample(go_amax=INF).forward_finite
    assert not fp8.LayerSample(go_amax=NAN).grad_finite
    assert fp8.LayerSample(in_sat=0.5).sat == 0.5 and fp8.LayerSample(go_sat=0.6).sat == 0.6
    assert fp8.LayerSample(in_under=0.5).under == 0.5 and fp8.LayerSample(w_under=0.7).under == 0.7
    assert fp8.LayerSample() == fp8.LayerSample.from_row([0.0] * 9)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"sat_threshold": 1.5}, "fp8 sat_threshold must be a fraction in [0, 1], got 1.5"),
        ({"sat_threshold": -0.1}, "fp8 sat_threshold must be a fraction in [0, 1], got -0.1"),
        ({"sat_threshold": True}, "fp8 sat_threshold must be a fraction in [0, 1], got True"),
        ({"under_threshold": "0.1"}, "fp8 under_threshold must be a fraction in [0, 1], got '0.1'"),
        ({"patience": 0}, "fp8 patience must be an integer >= 1, got 0"),
        ({"patience": 2.0}, "fp8 patience must be an integer >= 1, got 2.0"),
        ({"patience": True}, "fp8 patience must be an integer >= 1, got True"),
    ],
)
def test_demote_rules_refuse_a_bad_value_in_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        fp8.DemoteRules(**kw)
    assert str(e.value) == message


def test_demote_rules_accept_their_boundaries():
    r = fp8.DemoteRules(sat_threshold=0, under_threshold=1.0, patience=1)
    assert (r.sat_threshold, r.under_threshold, r.patience) == (0, 1.0, 1)
    assert fp8.DemoteRules(sat_threshold=1, under_threshold=0.0).patience == 3
    d = fp8.DemoteRules()
    assert (d.sat_threshold, d.under_threshold, d.patience) == (0.10, 0.01, 3)


def _s(**kw) -> fp8.LayerSample:
    return fp8.LayerSample(**{"in_amax": 1.0, "w_amax": 1.0, "go_amax": 1.0, **kw})


RULES = fp8.DemoteRules(sat_threshold=0.1, under_threshold=0.01, patience=2)


def test_a_non_finite_forward_cast_wins_over_gradient_and_persistent_figures():
    h = {
        "a": [_s(go_amax=INF)],
        "b": [_s(w_amax=INF)],
        "c": [_s(in_sat=0.5), _s(in_sat=0.5)],
        "d": [_s(in_amax=NAN)],
    }
    got = fp8.decide_demotions(h, RULES)
    assert got == {
        "b": "non-finite weight (amax inf)",
        "c": "saturation above 10.0% in 2 samples in a row (last 50.0%)",
    }


def test_only_the_latest_sample_decides_a_non_finite_cast():
    h = {"a": [_s(in_amax=INF), _s()], "b": [_s(go_amax=NAN), _s()], "c": []}
    assert fp8.decide_demotions(h, RULES) == {}


def test_a_layer_named_by_a_non_finite_rule_is_not_judged_again():
    h = {"a": [_s(in_sat=0.5), _s(in_sat=0.5, go_amax=INF)]}
    assert fp8.decide_demotions(h, RULES) == {"a": "non-finite output gradient (amax inf)"}


def test_thresholds_are_strict_and_saturation_is_judged_before_underflow():
    at = [_s(in_sat=0.1), _s(in_sat=0.1)]
    assert fp8.decide_demotions({"a": at}, RULES) == {}
    both = [_s(in_sat=0.2, w_under=0.02), _s(in_sat=0.3, w_under=0.03)]
    assert fp8.decide_demotions({"a": both}, RULES) == {
        "a": "saturation above 10.0% in 2 samples in a row (last 30.0%)"
    }
    under = [_s(go_under=0.02), _s(go_under=0.04)]
    assert fp8.decide_demotions({"a": under}, RULES) == {
        "a": "underflow above 1.0% in 2 samples in a row (last 4.0%)"
    }
    edge = [_s(go_under=0.01), _s(go_under=0.04)]
    assert fp8.decide_demotions({"a": edge}, RULES) == {}
    long = [_s(in_sat=0.9), _s(), _s(in_sat=0.2), _s(in_sat=0.2)]  # the last `patience` only
    assert list(fp8.decide_demotions({"a": long}, RULES)) == ["a"]


def test_fp8_health_keeps_patience_samples_in_the_order_of_the_names():
    health = fp8.Fp8Health(RULES)
    assert health.rules is RULES and health.history == {}
    hot = [1.0, 0.5] + [0.0] * 7
    calm = [1.0] + [0.0] * 8
    assert health.observe(["x", "y"], [hot, calm]) == {}
    assert len(health.history["x"]) == 1 and health.history["x"].maxlen == 2
    assert health.observe(["y", "x"], [calm, hot]) == {
        "x": "saturation above 10.0% in 2 samples in a row (last 50.0%)"
    }
    health.observe(["x"], [calm])
    assert len(health.history["x"]) == 2 and health.history["x"][-1] == fp8.LayerSample(in_amax=1.0)
    bad = [INF] + [0.0] * 8
    assert list(health.observe(["y", "x"], [bad, bad])) == ["y"]  # the first in call order
    with pytest.raises(ValueError) as e:
        health.observe(["x", "y"], [calm])
    assert str(e.value) == "2 layer names for 1 rows"
    health.forget("x")
    health.forget("never")
    assert list(health.history) == ["y"]
    assert fp8.Fp8Health().rules == fp8.DemoteRules()


def test_the_reason_names_the_last_sample_of_the_run():
    rules = fp8.DemoteRules(patience=3)
    under = [_s(w_under=0.02), _s(w_under=0.03), _s(w_under=0.05)]
    assert fp8.decide_demotions({"a": under}, rules) == {
        "a": "underflow above 1.0% in 3 samples in a row (last 5.0%)"
    }
    sat = [_s(in_sat=0.2), _s(in_sat=0.3), _s(in_sat=0.4)]
    assert fp8.decide_demotions({"a": sat}, rules) == {
        "a": "saturation above 10.0% in 3 samples in a row (last 40.0%)"
    }
