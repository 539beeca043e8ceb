"""``scaler.*`` (ScalerConfig) and ``precision.*`` (PrecisionConfig): the config checks that run
before anything is built, word for word, and what they hand to the component."""

from __future__ import annotations

import dataclasses

import pytest

from ampctl.amp.checks import FieldError
from ampctl.amp.fp8 import DEFAULT_EXCLUDE
from ampctl.amp.precision import PrecisionConfig
from ampctl.amp.scaler import LossScaler, ScalerConfig


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


def test_check_names_the_first_field_that_breaks_its_row():
    """A rule table is checked in order; a list field is shown as a list; the allowed text may
    be a function of the config (a bound that is another field)."""
    from ampctl.amp.checks import check, integer

    @dataclasses.dataclass
    class C:
        a: int = 1
        b: list = dataclasses.field(default_factory=list)

    rules = (
        ("a", integer(ge=1), "an integer >= 1"),
        ("b", lambda v, c: len(v) <= c.a, lambda c: f"at most a={c.a} items"),
    )
    check(C(), rules)
    with pytest.raises(FieldError) as e:
        check(C(a=0, b=(1, 2)), rules)
    assert str(e.value) == "C: a=0 is not allowed: a must be an integer >= 1"
    with pytest.raises(FieldError) as e:
        check(C(a=1, b=(1, 2)), rules)
    assert str(e.value) == "C: b=[1, 2] is not allowed: b must be at most a=1 items"
    assert (e.value.field, e.value.value) == ("b", [1, 2])
