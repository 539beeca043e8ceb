"""Compose a run's config with Hydra and validate it into typed dataclasses.

``load_config(overrides, config_dir=None)`` is the one entry point: it takes the trailing
``key=value`` tokens of a command line (Hydra override syntax, plus ``conf=NAME`` to pick a
preset ``conf/NAME.yaml``), composes them over the packaged ``conf/`` (and the user's
``--config-dir``, searched first), checks every key and type against the schema below and
every value against its allowed range. Any problem raises :class:`ConfigError` whose message is
one line naming the key and what is allowed.

Each component owns its config: the dataclasses mirror the constructor arguments of the
things they build (``ScalerConfig`` <-> ``LossScaler``), and validate in ``__post_init__``.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ampctl.errors import UsageError

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


class ConfigError(UsageError):
    """Bad user input in the config: the message is one line meant for the user."""


def packaged_conf_dir() -> Path:
    """The ``conf/`` folder shipped with ampctl (repository root in an editable install)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "conf", here.parent / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError(
        f"ampctl's packaged configs were not found next to {here}; reinstall with `pip install -e .`"
    )


# ---------------------------------------------------------------------------- schema
def _need(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={_show(value)} is not allowed: {key} must be {allowed}")


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(kw_only=True)
class TrainerConfig:
    max_steps: int = 200
    log_every: int = 10
    ckpt_every: int = 100
    keep_last: int = 3
    grad_accum_steps: int = 1
    seed: int = 0
    device: str = "auto"
    runs_dir: str = "runs"
    overflow_window: int = 50

    def __post_init__(self) -> None:
        for k in (
            "max_steps",
            "log_every",
            "ckpt_every",
            "keep_last",
            "grad_accum_steps",
            "overflow_window",
        ):
            _need(getattr(self, k) >= 1, f"trainer.{k}", getattr(self, k), "an integer >= 1")
        _need(self.seed >= 0, "trainer.seed", self.seed, "an integer >= 0")
        _need(
            self.device in ("auto", "cpu", "cuda")
            or re.fullmatch(r"cuda:\d+", self.device) is not None,
            "trainer.device",
            self.device,
            "one of auto, cpu, cuda, cuda:N",
        )


@dataclass(kw_only=True)
class DataConfig:
    kind: str = "synthetic"
    vocab_size: int = 1024
    seq_len: int = 64
    batch_size: int = 16
    mask_prob: float = 0.15
    branching: int = 4
    path: str | None = None
    # masked-LM or next-token batches; auto: causal for a model whose class name ends in
    # ForCausalLM or LMHeadModel (GPT-2, Llama, their HF classes), mlm otherwise
    objective: str = "auto"
    # data=hf only (ampctl.train.hf_data)
    tokenizer: str | None = None
    text_field: str = "text"
    format: str = "auto"
    split: str = "train"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        _need(
            self.kind in ("synthetic", "text", "hf"),
            "data.kind",
            self.kind,
            "one of synthetic, text, hf (select with data=synthetic, data=text or data=hf)",
        )
        _need(self.vocab_size >= 8, "data.vocab_size", self.vocab_size, "an integer >= 8")
        _need(self.seq_len >= 4, "data.seq_len", self.seq_len, "an integer >= 4")
        _need(self.batch_size >= 1, "data.batch_size", self.batch_size, "an integer >= 1")
        _need(
            _finite(self.mask_prob) and 0 < self.mask_prob < 1,
            "data.mask_prob",
            self.mask_prob,
            "in (0, 1)",
        )
        _need(self.branching >= 1, "data.branching", self.branching, "an integer >= 1")
        _need(
            self.objective in ("auto", "mlm", "causal"),
            "data.objective",
            self.objective,
            "one of auto, mlm, causal",
        )
        _need(
            self.format in ("auto", "text", "json", "parquet", "arrow"),
            "data.format",
            self.format,
            "one of auto, text, json, parquet, arrow",
        )
        _need(bool(self.text_field), "data.text_field", self.text_field, "a column name")
        if self.kind == "text":
            if not self.path:
                raise ConfigError(
                    "data.path is missing: data=text needs data.path=FILE_OR_DIR (a UTF-8 text file or a folder of .txt files)"
                )
            _need(
                self.vocab_size == 260,
                "data.vocab_size",
                self.vocab_size,
                "260 with data=text (byte-level tokenizer)",
            )
        if self.kind == "hf":
            if not self.path:
                raise ConfigError(
                    "data.path is missing: data=hf needs data.path= (a save_to_disk folder, "
                    "text/json/parquet files, a folder or a glob of them)"
                )
            if not self.tokenizer:
                raise ConfigError(
                    "data.tokenizer is missing: data=hf needs data.tokenizer= (a tokenizer.json "
                    "or a tokenizer folder; make one with `ampctl tokenizer train`)"
                )


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused: bool = False
    clip_grad_norm: float | None = 1.0
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _need(
            self.name in ("adamw", "adam", "sgd"),
            "optim.name",
            self.name,
            "one of adamw, adam, sgd",
        )
        _need(_finite(self.lr) and self.lr > 0, "optim.lr", self.lr, "a number > 0")
        _need(
            _finite(self.weight_decay) and self.weight_decay >= 0,
            "optim.weight_decay",
            self.weight_decay,
            "a number >= 0",
        )
        _need(
            len(self.betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in self.betas),
            "optim.betas",
            list(self.betas),
            "two numbers in [0, 1), e.g. [0.9,0.999]",
        )
        _need(_finite(self.eps) and self.eps > 0, "optim.eps", self.eps, "a number > 0")
        _need(
            self.clip_grad_norm is None
            or (_finite(self.clip_grad_norm) and self.clip_grad_norm > 0),
            "optim.clip_grad_norm",
            self.clip_grad_norm,
            "a number > 0, or null to disable clipping",
        )
        _need(
            self.schedule in ("cosine", "linear", "constant"),
            "optim.schedule",
            self.schedule,
            "one of cosine, linear, constant",
        )
        _need(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        _need(
            _finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            "optim.min_lr_ratio",
            self.min_lr_ratio,
            "in [0, 1]",
        )


@dataclass(kw_only=True)
class PrecisionConfig:
    name: str = "fp16"
    fp32_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from ampctl.amp.precision import PRECISIONS

        _need(
            self.name in PRECISIONS,
            "precision.name",
            self.name,
            f"one of {', '.join(PRECISIONS)} (select with precision=NAME)",
        )


@dataclass(kw_only=True)
class ScalerConfig:
    """Arguments of :class:`ampctl.amp.LossScaler`."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    history_size: int = 1024

    def __post_init__(self) -> None:
        _need(
            _finite(self.init_scale) and self.init_scale > 0,
            "scaler.init_scale",
            self.init_scale,
            "a number > 0",
        )
        _need(
            _finite(self.growth_factor) and self.growth_factor > 1,
            "scaler.growth_factor",
            self.growth_factor,
            "a number > 1",
        )
        _need(
            _finite(self.backoff_factor) and 0 < self.backoff_factor < 1,
            "scaler.backoff_factor",
            self.backoff_factor,
            "in (0, 1)",
        )
        _need(
            self.growth_interval >= 1,
            "scaler.growth_interval",
            self.growth_interval,
            "an integer >= 1",
        )
        _need(self.hysteresis >= 1, "scaler.hysteresis", self.hysteresis, "an integer >= 1")
        _need(
            _finite(self.min_scale) and self.min_scale > 0,
            "scaler.min_scale",
            self.min_scale,
            "a number > 0",
        )
        _need(
            _finite(self.max_scale) and self.max_scale > 0,
            "scaler.max_scale",
            self.max_scale,
            "a number > 0",
        )
        _need(
            self.min_scale <= self.max_scale,
            "scaler.min_scale",
            self.min_scale,
            f"<= scaler.max_scale ({self.max_scale})",
        )
        _need(self.history_size >= 1, "scaler.history_size", self.history_size, "an integer >= 1")


@dataclass(kw_only=True)
class GuardConfig:
    """Rules of :class:`ampctl.amp.guard.OverflowGuard` (see its docstring)."""

    enabled: bool = True
    attribution: bool = True
    attribution_limit: int = 5
    locate_forward: bool = True
    promote: bool = True
    rollback_after: int = 3
    rollback_backoff: float = 0.25
    max_rollbacks: int = 5
    skip_budget: float = 0.5
    skip_window: int = 50
    skip_action: str = "rollback"
    floor_policy: str = "fallback"
    fallback_chain: list[str] = field(default_factory=lambda: ["fp16", "bf16", "fp32"])
    snapshot_every: int = 10

    def __post_init__(self) -> None:
        from ampctl.amp.precision import PRECISIONS

        _need(
            self.attribution_limit >= 1,
            "guard.attribution_limit",
            self.attribution_limit,
            "an integer >= 1",
        )
        _need(
            self.rollback_after >= 0,
            "guard.rollback_after",
            self.rollback_after,
            "an integer >= 0 (0 disables rollback)",
        )
        _need(
            _finite(self.rollback_backoff) and 0 < self.rollback_backoff <= 1,
            "guard.rollback_backoff",
            self.rollback_backoff,
            "in (0, 1]",
        )
        _need(self.max_rollbacks >= 0, "guard.max_rollbacks", self.max_rollbacks, "an integer >= 0")
        _need(
            _finite(self.skip_budget) and 0 < self.skip_budget <= 1,
            "guard.skip_budget",
            self.skip_budget,
            "in (0, 1]",
        )
        _need(self.skip_window >= 1, "guard.skip_window", self.skip_window, "an integer >= 1")
        _need(
            self.skip_action in ("rollback", "fallback", "abort", "warn"),
            "guard.skip_action",
            self.skip_action,
            "one of rollback, fallback, abort, warn",
        )
        _need(
            self.floor_policy in ("fallback", "abort", "warn"),
            "guard.floor_policy",
            self.floor_policy,
            "one of fallback, abort, warn",
        )
        bad = [p for p in self.fallback_chain if p not in PRECISIONS]
        _need(
            not bad,
            "guard.fallback_chain",
            list(self.fallback_chain),
            f"a list of {', '.join(PRECISIONS)}",
        )
        _need(
            self.snapshot_every >= 0,
            "guard.snapshot_every",
            self.snapshot_every,
            "an integer >= 0 (0: no snapshots)",
        )


@dataclass(kw_only=True)
class DistConfig:
    """Data parallelism under torchrun (ignored in a single process)."""

    strategy: str = "ddp"

    def __post_init__(self) -> None:
        _need(self.strategy in ("ddp", "fsdp"), "dist.strategy", self.strategy, "one of ddp, fsdp")


@dataclass(kw_only=True)
class LoggingConfig:
    tensorboard: bool = False
    plot: bool = True


@dataclass(kw_only=True)
class RunConfig:
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
        _need(
            isinstance(target, str) and bool(target),
            "model._target_",
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


def available_presets(config_dir: str | Path | None = None) -> list[str]:
    dirs = [packaged_conf_dir()] + ([Path(config_dir)] if config_dir else [])
    names = {p.stem for d in dirs for p in Path(d).glob("*.yaml")}
    return sorted(names)


def _group_options(group: str, config_dir: str | Path | None) -> list[str]:
    dirs = [packaged_conf_dir()] + ([Path(config_dir)] if config_dir else [])
    return sorted({p.stem for d in dirs for p in (Path(d) / group).glob("*.yaml")})


def _compose(preset: str, overrides: list[str], config_dir: str | Path | None) -> DictConfig:
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from hydra.types import RunMode

    if config_dir is not None:
        cdir = Path(config_dir).expanduser()
        if not cdir.is_dir():
            raise ConfigError(
                f"--config-dir {str(config_dir)!r} is not a folder: give a folder of YAML configs"
            )
    search = create_config_search_path(None)
    search.prepend("ampctl", f"file://{packaged_conf_dir()}")
    if config_dir is not None:
        search.prepend("ampctl-user", f"file://{Path(config_dir).expanduser().resolve()}")
    if preset not in available_presets(config_dir):
        raise ConfigError(
            f"conf={preset}: no such preset; available: {', '.join(available_presets(config_dir))}"
            + ("" if config_dir else " (add your own with --config-dir DIR)")
        )
    gh = GlobalHydra.instance()
    gh.clear()
    try:
        hydra = Hydra.create_main_hydra2(task_name="ampctl", config_search_path=search)
        cfg = hydra.compose_config(
            preset, overrides, run_mode=RunMode.RUN, with_log_configuration=False
        )
    except OverrideParseException as e:
        raise ConfigError(
            f"cannot parse override: {_first_line(e)} (use key=value, +key=value or ~key)"
        ) from None
    except MissingConfigException as e:
        raise ConfigError(_missing_option_message(e, overrides, config_dir)) from None
    except ConfigCompositionException as e:
        raise ConfigError(_composition_message(e)) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_first_line(e)) from None
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        # Hydra raises plain exceptions for some malformed overrides (e.g. model=0)
        raise ConfigError(f"cannot apply the overrides {overrides}: {_first_line(e)}") from None
    finally:
        gh.clear()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _missing_option_message(e: Exception, overrides: list[str], config_dir) -> str:
    text = str(e)
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        return f"{group}={option}: no such option; {group} can be one of {', '.join(_group_options(group, config_dir))}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return f"{m.group(1)}: not a config group; to set a value use {m.group(1)}.KEY=VALUE"
    return _first_line(e)


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
    return _first_line(e)


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


def config_from_dict(raw: dict[str, Any] | DictConfig) -> RunConfig:
    """Validate a plain (composed or saved) config into a :class:`RunConfig`."""
    schema = OmegaConf.structured(RunConfig)
    try:
        raw_cfg = raw if isinstance(raw, DictConfig) else OmegaConf.create(raw)
        for key in ("trainer", "data", "optim", "precision", "scaler", "guard", "logging", "dist"):
            if key in raw_cfg and not isinstance(raw_cfg[key], DictConfig | dict):
                raise ConfigError(
                    f"{key}: expected a group of keys, got {_show(OmegaConf.to_container(raw_cfg)[key])}"
                )
        merged = OmegaConf.merge(schema, raw_cfg)
        OmegaConf.resolve(merged)
        obj = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    except ValueError as e:  # __post_init__ checks
        raise ConfigError(_first_line(e)) from None
    except (TypeError, KeyError, AttributeError, IndexError, RecursionError) as e:
        raise ConfigError(f"invalid config: {_first_line(e)}") from None
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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        raise ConfigError(
            f"cannot parse override: {_first_line(e)} (use key=value, +key=value or ~key)"
        ) from None
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
