"""Compose a run's config with Hydra and validate it into typed dataclasses.

``load_config(overrides, config_dir=None)`` is the one entry point: it takes the trailing
``key=value`` tokens of a command line (Hydra override syntax, plus ``conf=NAME`` to pick a
preset ``conf/NAME.yaml``), composes them over the packaged ``conf/`` (and the user's
``--config-dir``, searched first), checks every key and type against the schema below and
every value against its allowed range. Any problem raises :class:`ConfigError` whose message is
one line naming the key and what is allowed.

Each component owns its config: the dataclasses mirror the constructor arguments of the
things they build (``ScalerConfig`` <-> ``LossScaler``), hold the one copy of each default
(composed first, from Hydra's ConfigStore: the YAML files list only what they change) and check
their rule tables in ``__post_init__``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ampctl.amp.checks import FieldError, need, show
from ampctl.amp.precision import PrecisionConfig
from ampctl.amp.scaler import ScalerConfig
from ampctl.compose import (
    OVERRIDE_FORMS,
    available_presets,
    group_options,
    packaged_conf_dir,
    parse_overrides,
)
from ampctl.errors import ConfigError, UsageError, first_line
from ampctl.protect.settings import GuardConfig, LoggingConfig
from ampctl.train.settings import DataConfig, DistConfig, OptimConfig, TrainerConfig

__all__ = [
    "ConfigError",
    "RunConfig",
    "load_config",
    "config_from_dict",
    "to_yaml",
    "packaged_conf_dir",
    "available_presets",
    "split_overrides",
]


# ---------------------------------------------------------------------------- schema
@dataclass(kw_only=True)
class RunConfig:
    """A whole run: the groups, each owned and validated by its component."""

    name: str | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: dict[str, Any] = field(default_factory=dict)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self) -> None:
        target = self.model.get("_target_") if isinstance(self.model, dict) else None
        need(
            isinstance(target, str) and bool(target),
            "model",
            "_target_",
            target,
            "the import path of a torch.nn.Module class or factory, e.g. ampctl.train.models.BertForMaskedLM",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- composing
_GROUPS = ("model", "data", "optim", "precision", "scaler", "guard")


def split_overrides(tokens: list[str]) -> tuple[str, list[str]]:
    """Take ``conf=NAME`` out of the override tokens: ``(preset name, other overrides)``."""
    preset = "config"
    rest: list[str] = []
    for tok in tokens:
        if tok.startswith("conf="):
            preset = tok.split("=", 1)[1].strip()
            if not preset:
                raise ConfigError("conf= needs a preset name, e.g. conf=bert_large")
        else:
            rest.append(tok)
    return preset, rest


def _compose(preset: str, overrides: list[str], config_dir: str | Path | None) -> DictConfig:
    from ampctl.compose import compose_preset, hydra_errors

    if config_dir is not None:
        cdir = Path(config_dir).expanduser()
        if not cdir.is_dir():
            raise ConfigError(
                f"--config-dir {str(config_dir)!r} is not a folder: give a folder of YAML configs"
            )
    if preset not in available_presets(config_dir):
        raise ConfigError(
            f"conf={preset}: no such preset; available: {', '.join(available_presets(config_dir))}"
            + ("" if config_dir else " (add your own with --config-dir DIR)")
        )
    dirs = ([Path(config_dir)] if config_dir is not None else []) + [packaged_conf_dir()]
    err = hydra_errors()
    try:
        return compose_preset(preset, overrides, dirs, defaults())
    except err["parse"] as e:
        raise ConfigError(f"cannot parse override: {first_line(e)}; {OVERRIDE_FORMS}") from None
    except err["missing"] as e:
        raise ConfigError(_missing_option_message(e, overrides, config_dir)) from None
    except err["composition"] as e:
        raise ConfigError(_composition_message(e)) from None
    except (err["hydra"], OmegaConfBaseException) as e:
        raise ConfigError(first_line(e)) from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        if isinstance(e, UsageError):
            raise
        # Hydra raises plain exceptions for some malformed overrides (e.g. model=0)
        raise ConfigError(f"cannot apply the overrides {overrides}: {first_line(e)}") from None


def _missing_option_message(e: Exception, overrides: list[str], config_dir) -> str:
    text = str(e)
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        return f"{group}={option}: no such option; {group} can be one of {', '.join(group_options(group, config_dir))}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return f"{m.group(1)}: not a config group; to set a value use {m.group(1)}.KEY=VALUE"
    return first_line(e)


def _composition_message(e: Exception) -> str:
    text = str(e)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        return f"unknown key '{key}'{_did_you_mean(key)} (to add a new key use +{key}=VALUE)"
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m:
        return f"+{m.group(1)}: the key exists already; set it with {m.group(1)}=VALUE"
    m = (
        re.search(r"Could not delete from config\. The value of '([^']+)'", text)
        or re.search(r"Could not delete from config\. '([^']+)' does not exist", text)
        or re.search(r"Key '([^']+)' not found", text)
    )
    if m:
        return f"~{m.group(1)}: no such key to delete{_did_you_mean(m.group(1))}"
    return first_line(e)


def _all_keys() -> list[str]:
    keys: list[str] = []

    def walk(cls, prefix):
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
            else:
                keys.append(f"{prefix}{f.name}")

    walk(RunConfig, "")
    return keys


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _allowed_keys(prefix: str) -> list[str]:
    p = prefix + "." if prefix else ""
    return sorted({k[len(p) :].split(".")[0] for k in _all_keys() if k.startswith(p)})


def _group_of(owner: str) -> str:
    """The config group (``guard``, ``trainer`` ...) whose dataclass is named ``owner`` (or the
    group ``owner`` itself, e.g. ``model``)."""
    for f in fields(RunConfig):
        if f.name == owner:
            return owner
        default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
        if default is not None and type(default).__name__ == owner:
            return f.name
    return ""


def defaults() -> dict[str, Any]:
    """Every key at its default, as the dataclasses declare it: the config Hydra composes the
    YAML files onto (:data:`ampctl.compose.DEFAULTS`). Plain data: the types and rules are
    checked once, by :func:`config_from_dict`, so ``+key=``, ``~key`` and the errors of a
    composition are those of plain YAML."""
    return OmegaConf.to_container(OmegaConf.structured(RunConfig))  # type: ignore[return-value]


def config_from_dict(raw: dict[str, Any] | DictConfig) -> RunConfig:
    """Validate a plain (composed or saved) config into a :class:`RunConfig`."""
    schema = OmegaConf.structured(RunConfig)
    try:
        raw_cfg = raw if isinstance(raw, DictConfig) else OmegaConf.create(raw)
        for key in ("trainer", "data", "optim", "precision", "scaler", "guard", "logging", "dist"):
            if key in raw_cfg and not isinstance(raw_cfg[key], DictConfig | dict):
                raise ConfigError(
                    f"{key}: expected a group of keys, got {show(OmegaConf.to_container(raw_cfg)[key])}"
                )
        merged = OmegaConf.merge(schema, raw_cfg)
        OmegaConf.resolve(merged)
        obj = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    except FieldError as e:  # a component's own check: name the group too
        raise ConfigError(e.named(_group_of(e.owner))) from None
    except ValueError as e:  # __post_init__ checks
        raise ConfigError(first_line(e)) from None
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        raise ConfigError(f"invalid config: {first_line(e)}") from None
    assert isinstance(obj, RunConfig)
    return obj


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    text = getattr(e, "msg", None) or str(e)
    text = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if (
        "not in struct" in text
        or "Key '" in text
        and "not found" in text
        or "ConfigKeyError" in type(e).__name__
    ):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        where = f" under {parent}" if parent else ""
        allowed = ", ".join(_allowed_keys(parent))
        return f"unknown key '{key}'{_did_you_mean(key)}; allowed keys{where}: {allowed}"
    m = re.search(r"Value '([^']*)' (?:of type '[^']*' )?could not be converted to (\w+)", text)
    if m:
        kind = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false"}.get(
            m.group(2), m.group(2)
        )
        return f"{key}={m.group(1)}: wrong type, {key} must be {kind}"
    if "Interpolation" in text or "interpolation" in text:
        return f"{key}: {text}"
    return f"{key}: {text}" if key else text


def with_changes(cfg: RunConfig, **groups: dict[str, Any]) -> RunConfig:
    """A copy of ``cfg`` with some keys of some groups replaced, re-validated (a bad value is a
    :class:`ConfigError` naming ``group.key``)."""
    import copy
    import dataclasses

    try:
        changes = {g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in groups.items()}
    except FieldError as e:
        raise ConfigError(e.named(_group_of(e.owner))) from None
    return dataclasses.replace(copy.deepcopy(cfg), **changes)


def load_config(
    overrides: list[str] | None = None, config_dir: str | Path | None = None
) -> RunConfig:
    """Compose ``conf/`` with Hydra overrides and validate. Raises :class:`ConfigError`."""
    preset, rest = split_overrides(list(overrides or []))
    composed = _compose(preset, rest, config_dir)
    return config_from_dict(composed)


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML (what goes into ``runs/<name>/config.yaml``)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))


def _compose_free_overrides(base: DictConfig, overrides: list[str]) -> DictConfig:
    """Apply Hydra-syntax overrides (``key=value``, ``+key=value``, ``~key``) to a saved config
    (a resumed run's). Config groups cannot be switched here."""
    parsed = parse_overrides(overrides)
    cfg = copy_cfg(base)
    for o in parsed:
        key = o.key_or_group
        if o.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is None or leaf not in node:
                raise ConfigError(f"~{key}: no such key to delete{_did_you_mean(key)}")
            with open_dict(node):
                del node[leaf]
            continue
        if o.is_sweep_override():
            raise ConfigError(
                f"{key}: a sweep ({o.input_line}) is only allowed in `ampctl sweep-scale`"
            )
        value = o.value()
        if key == "precision" and isinstance(value, str):
            key = "precision.name"  # the one group whose choice is a single key
        elif key in _GROUPS and not isinstance(value, dict):
            raise ConfigError(
                f"{key}={value}: config groups cannot be switched on --resume (the run keeps its "
                f"{key}); set single keys instead, e.g. {key}.KEY=VALUE"
            )
        if OmegaConf.select(cfg, key) is None and not o.is_add() and "." in key:
            parent = key.rpartition(".")[0]
            node = OmegaConf.select(cfg, parent)
            if node is None or key.rpartition(".")[2] not in node:
                raise ConfigError(
                    f"unknown key '{key}'{_did_you_mean(key)} (to add a new key use +{key}=VALUE)"
                )
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


def copy_cfg(cfg: DictConfig) -> DictConfig:
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))


def config_from_saved(
    saved: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source: str,
    trust_code: bool = False,
) -> RunConfig:
    """A config read from a checkpoint or a run folder, with the user's ``key=value`` overrides
    on top, validated. The saved part is data (see :mod:`ampctl.trust`): an interpolation in it
    is refused, and a ``_target_`` that does not ship with ampctl is refused unless
    ``trust_code`` or the user gave the same target as an override. Raises
    :class:`~ampctl.trust.UntrustedConfigError` or :class:`ConfigError`."""
    from ampctl.trust import check_targets, refuse_interpolations

    if not isinstance(saved, dict):
        raise ConfigError(f"{source}: holds no config (expected a mapping of keys)")
    overrides = list(overrides or [])
    refuse_interpolations(saved, source=source)
    merged = _compose_free_overrides(OmegaConf.create(saved), overrides)
    check_targets(
        OmegaConf.to_container(merged, resolve=False),
        source=source,
        trust_code=trust_code,
        overrides=overrides,
    )
    return config_from_dict(merged)
