"""ampctl.config: every shipped config composes; --config-dir adds presets and group options,
searched first; and property tests: arbitrary overrides and values give a valid config or a clean
ConfigError.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampctl.config import ConfigError, RunConfig, _all_keys, load_config, packaged_conf_dir

CONF = packaged_conf_dir()
PRESETS = sorted(p.stem for p in CONF.glob("*.yaml"))
GROUP_OPTIONS = sorted(
    (g.name, p.stem) for g in CONF.iterdir() if g.is_dir() for p in g.glob("*.yaml")
)


def _yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if k == "defaults":
            continue
        key = f"{prefix}{k}"
        out.update(_leaves(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes(preset):
    """Each preset composes, and every plain value it sets itself reaches the validated config."""
    cfg = load_config([f"conf={preset}"])
    assert isinstance(cfg, RunConfig) and cfg.model["_target_"]
    flat = _leaves(cfg.to_dict())
    for key, value in _leaves(_yaml(CONF / f"{preset}.yaml")).items():
        if isinstance(value, str) and "${" in value:
            continue
        assert flat[key] == value, (preset, key)


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option, tmp_path):
    """Each group option composes and its values land under the group's key."""
    extra = {
        ("data", "text"): [f"data.path={tmp_path}"],
        ("data", "hf"): [f"data.path={tmp_path}", f"data.tokenizer={tmp_path}"],
    }.get((group, option), [])
    cfg = load_config([f"{group}={option}", *extra])
    assert isinstance(cfg, RunConfig)
    flat = _leaves(cfg.to_dict())
    preset_sets = _leaves(_yaml(CONF / "config.yaml"))  # the default preset wins over its groups
    for key, value in _leaves(_yaml(CONF / group / f"{option}.yaml"), f"{group}.").items():
        if isinstance(value, str) and ("${" in value or value == "???") or key in preset_sets:
            continue  # interpolations resolve to other keys; ??? must be given (data.path)
        if key in {e.split("=", 1)[0] for e in extra}:
            continue
        assert flat[key] == value, (group, option, key)


def test_seed_settings_of_bert_large():
    cfg = load_config(["conf=bert_large"])
    m = cfg.model
    assert (m["num_layers"], m["hidden_size"], m["num_heads"], m["ffn_size"], m["vocab_size"]) == (
        24,
        1024,
        16,
        4096,
        30522,
    )
    assert (cfg.data.seq_len, cfg.data.batch_size) == (512, 64)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.clip_grad_norm) == ("adamw", 1e-4, 1.0)
    assert (cfg.scaler.init_scale, cfg.scaler.growth_interval) == (1024.0, 500)
    assert cfg.precision.fp32_modules == ["*embeddings*"]


def test_config_dir_adds_presets_and_overrides_packaged_options(tmp_path: Path):
    (tmp_path / "scaler").mkdir()
    (tmp_path / "scaler" / "dynamic.yaml").write_text(  # shadows the packaged option
        "init_scale: 8.0\ngrowth_factor: 2.0\nbackoff_factor: 0.5\ngrowth_interval: 3\n"
        "hysteresis: 2\nmin_scale: 1.0\nmax_scale: 1024.0\nhistory_size: 16\n"
    )
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - config\n  - _self_\n\ntrainer:\n  max_steps: 7\n"
    )
    cfg = load_config(["conf=mine"], config_dir=tmp_path)
    assert cfg.trainer.max_steps == 7
    assert cfg.scaler.init_scale == 8.0 and cfg.scaler.hysteresis == 2
    assert load_config([]).scaler.hysteresis == 1  # without --config-dir: the packaged one


def _group_defaults() -> dict:
    from ampctl.config import defaults

    return _leaves({k: v for k, v in defaults().items() if k != "model"})


#: the key that names an option (``precision=fp16`` is ``name: fp16`` even where that is the default)
_CHOICE_KEYS = {"data.kind", "optim.name", "precision.name"}


@pytest.mark.parametrize(
    "path", ["config.yaml"] + [f"{g}/{o}.yaml" for g, o in GROUP_OPTIONS if g != "model"]
)
def test_group_options_and_the_default_run_set_only_what_differs_from_the_dataclasses(path):
    """Each default is written once, in its dataclass: a group option (and the default run) sets
    a key only to change it. (Presets may pin a value against an option picked after them.)"""
    prefix = "" if path == "config.yaml" else path.split("/")[0] + "."
    dflt = _group_defaults()
    for key, value in _leaves(_yaml(CONF / path), prefix).items():
        assert key in dflt, (path, key)
        assert value != dflt[key] or key in _CHOICE_KEYS, (path, key, value)


def test_every_key_exists_before_validation_and_can_be_overridden(tmp_path: Path):
    """The dataclasses' defaults are composed first (``ampctl_defaults``), so a key no YAML file
    names is still a key: it takes ``key=value``, refuses ``+key=``; a preset of one's own that
    starts from ``ampctl_defaults`` gets them too."""
    from ampctl.config import ConfigError

    cfg = load_config(["data.format=json", "precision.fp8_recipe=rowwise", "scaler.hysteresis=3"])
    assert (cfg.data.format, cfg.precision.fp8_recipe, cfg.scaler.hysteresis) == (
        "json",
        "rowwise",
        3,
    )
    with pytest.raises(ConfigError, match=r"^\+data.format: the key exists already"):
        load_config(["+data.format=json"])
    (tmp_path / "bare.yaml").write_text(
        "defaults:\n  - ampctl_defaults\n  - model: bert_tiny\n  - _self_\n"
    )
    cfg = load_config(["conf=bare", "guard.spike_z=3"], config_dir=tmp_path)
    assert (cfg.guard.spike_z, cfg.trainer.max_steps, cfg.data.vocab_size) == (3.0, 200, 1024)


# ============================================================== property tests: arbitrary overrides
KEYS = _all_keys()
VALUES = st.one_of(
    st.integers(-10, 10**9).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "true",
            "false",
            "null",
            "[]",
            "[1,2]",
            "{}",
            "abc",
            "''",
            "???",
            "${oops}",
            "${data.seq_len}",
            "1e400",
            "-0",
        ]
    ),
    st.text(string.printable, max_size=12),
)


def _check(overrides: list[str]) -> None:
    try:
        cfg = load_config(overrides)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), msg
        return
    assert isinstance(cfg, RunConfig)


def _examples(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Each example composes a config (~0.2 s): the default suite draws a few dozen per property,
# `pytest -m slow` ten times as many (the same properties, the same strategies).
KNOWN_KEYS = st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3)
STRINGS = st.lists(st.text(string.printable, min_size=0, max_size=30), min_size=1, max_size=3)
FORMS = (
    st.sampled_from(["+", "~", ""]),
    st.sampled_from(KEYS + ["model.x", "nope", "trainer", "scaler"]),
    VALUES,
)


def _form(prefix: str, key: str, value: str) -> list[str]:
    return [f"{prefix}{key}" if prefix == "~" else f"{prefix}{key}={value}"]


@_examples(30)
@given(KNOWN_KEYS)
def test_known_keys_with_arbitrary_values(pairs):
    _check([f"{k}={v}" for k, v in pairs])


@_examples(80)  # most random strings fail at the parser, before any compose: cheap
@given(STRINGS)
def test_arbitrary_override_strings(tokens):
    _check(tokens)


@_examples(20)
@given(*FORMS)
def test_add_delete_forms(prefix, key, value):
    _check(_form(prefix, key, value))


@pytest.mark.slow
@_examples(300)
@given(KNOWN_KEYS)
def test_known_keys_with_arbitrary_values_long(pairs):
    _check([f"{k}={v}" for k, v in pairs])


@pytest.mark.slow
@_examples(200)
@given(*FORMS)
def test_add_delete_forms_long(prefix, key, value):
    _check(_form(prefix, key, value))
