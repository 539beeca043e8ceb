"""Build the parts of a run from a validated :class:`~ampctl.config.RunConfig`."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampctl.amp.checks import is_finite, is_int, need
from ampctl.errors import UsageError
from ampctl.train.data import DataError, MLMSource, build_data

if TYPE_CHECKING:
    from ampctl.config import RunConfig

__all__ = [
    "BuildError",
    "resolve_device",
    "build_model",
    "build_data_source",
    "data_objective",
    "build_optimizer",
    "OptimConfig",
    "extract_loss",
]


OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(kw_only=True)
class OptimConfig:
    """``optim.*``: the optimizer and its learning-rate schedule."""

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
        need(self.name in OPTIMIZERS, self, "name", self.name, f"one of {', '.join(OPTIMIZERS)}")
        need(is_finite(self.lr) and self.lr > 0, self, "lr", self.lr, "a number > 0")
        need(
            is_finite(self.weight_decay) and self.weight_decay >= 0,
            self,
            "weight_decay",
            self.weight_decay,
            "a number >= 0",
        )
        need(
            len(self.betas) == 2 and all(is_finite(b) and 0 <= b < 1 for b in self.betas),
            self,
            "betas",
            list(self.betas),
            "two numbers in [0, 1), e.g. [0.9,0.999]",
        )
        need(is_finite(self.eps) and self.eps > 0, self, "eps", self.eps, "a number > 0")
        need(
            self.clip_grad_norm is None
            or (is_finite(self.clip_grad_norm) and self.clip_grad_norm > 0),
            self,
            "clip_grad_norm",
            self.clip_grad_norm,
            "a number > 0, or null to disable clipping",
        )
        need(
            self.schedule in SCHEDULES,
            self,
            "schedule",
            self.schedule,
            f"one of {', '.join(SCHEDULES)}",
        )
        need(
            is_int(self.warmup_steps) and self.warmup_steps >= 0,
            self,
            "warmup_steps",
            self.warmup_steps,
            "an integer >= 0",
        )
        need(
            is_finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            self,
            "min_lr_ratio",
            self.min_lr_ratio,
            "in [0, 1]",
        )
        need(
            not self.fused or self.name in ("adamw", "adam"),
            self,
            "fused",
            self.fused,
            "false unless optim.name is adamw or adam (fused SGD cannot skip on the device)",
        )


class BuildError(UsageError):
    """The config names something that cannot be built (bad _target_, bad data path...)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BuildError(
            f"trainer.device={name}: CUDA is not available on this machine; use trainer.device=cpu or auto"
        )
    return dev


def _import_target(path: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise BuildError(
            f"model._target_={path!r}: give a dotted import path, e.g. my_pkg.models.MyModel"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise BuildError(
            f"model._target_={path!r}: cannot import module {module_name!r} ({e})"
        ) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise BuildError(
            f"model._target_={path!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None


def build_model(cfg: RunConfig) -> nn.Module:
    """Instantiate ``model._target_`` with the other ``model.*`` keys as keyword arguments."""
    spec = dict(cfg.model)
    target = _import_target(spec.pop("_target_"))
    if not callable(target):
        raise BuildError(f"model._target_={cfg.model['_target_']!r} is not callable")
    try:
        model = target(**spec)
    except (TypeError, ValueError) as e:
        raise BuildError(
            f"model: building {cfg.model['_target_']} failed: {str(e).splitlines()[0]}"
        ) from None
    if not isinstance(model, nn.Module):
        raise BuildError(
            f"model._target_={cfg.model['_target_']!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def data_objective(cfg: RunConfig) -> str:
    """``data.objective``, with ``auto`` resolved from the model's name (no import):
    ``causal`` when ``model._target_`` ends in ``ForCausalLM`` or ``LMHeadModel`` (ampctl's
    GPT-2 and Llama, and Hugging Face's causal-LM classes), else ``mlm``."""
    if cfg.data.objective != "auto":
        return cfg.data.objective
    name = str(cfg.model.get("_target_", "")).rsplit(".", 1)[-1]
    return "causal" if name.endswith(("ForCausalLM", "LMHeadModel")) else "mlm"


def build_data_source(cfg: RunConfig, rank: int = 0, world_size: int = 1) -> MLMSource:
    d = cfg.data
    kw: dict[str, Any] = dict(
        seq_len=d.seq_len,
        batch_size=d.batch_size,
        seed=cfg.trainer.seed,
        mask_prob=d.mask_prob,
        rank=rank,
        world_size=world_size,
        objective=data_objective(cfg),
    )
    if d.kind == "synthetic":
        kw.update(vocab_size=d.vocab_size, branching=d.branching)
    elif d.kind == "hf":
        kw.update(
            path=d.path,
            tokenizer=d.tokenizer,
            vocab_size=d.vocab_size,
            text_field=d.text_field,
            format=d.format,
            split=d.split,
            cache_dir=d.cache_dir,
        )
    else:
        kw.update(path=d.path)
    try:
        source = build_data(d.kind, **kw)
    except DataError as e:
        raise BuildError(str(e).splitlines()[0]) from None
    except ValueError as e:
        raise BuildError(f"data: {str(e).splitlines()[0]}") from None
    model_vocab = cfg.model.get("vocab_size")
    tok_vocab = getattr(getattr(source, "tokenizer", None), "vocab_size", None)
    if isinstance(model_vocab, int) and isinstance(tok_vocab, int) and tok_vocab > model_vocab:
        raise BuildError(
            f"data.tokenizer '{d.tokenizer}' has {tok_vocab} tokens, more than "
            f"model.vocab_size={model_vocab}: set model.vocab_size={tok_vocab} or larger"
        )
    return source


def build_optimizer(
    o: OptimConfig, params: list[nn.Parameter], device: torch.device
) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD over ``params``. With ``fused`` the lr is a device tensor, so the
    schedule can be applied on the device (no host read)."""
    lr: float | torch.Tensor = torch.tensor(o.lr, device=device) if o.fused else o.lr
    if o.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
        kw: dict[str, Any] = dict(
            lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay
        )
        if o.fused:
            kw["fused"] = True
        return cls(params, **kw)
    return torch.optim.SGD(params, lr=lr, momentum=o.betas[0], weight_decay=o.weight_decay)


def extract_loss(out: Any) -> torch.Tensor:
    """The loss from a model output: a tensor, ``.loss`` or ``["loss"]`` (Hugging Face style)."""
    loss = out
    if not isinstance(loss, torch.Tensor):
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise BuildError(
            f"the model returned {type(out).__name__} with no scalar loss: model(**batch) must return a loss "
            "tensor, an object with .loss, or a dict with 'loss' (pass labels= through to the loss)"
        )
    return loss.reshape(())


def accepts_batch_keys(model: nn.Module, keys: list[str]) -> list[str]:
    """Batch keys the model's forward does not accept (empty when it takes **kwargs)."""
    sig = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [k for k in keys if k not in sig.parameters]
