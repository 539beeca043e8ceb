"""Every shipped config composes; --config-dir adds presets and group options, searched first."""

from __future__ import annotations

from pathlib import Path

import pytest

from ampctl.config import RunConfig, load_config, packaged_conf_dir

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
