"""Build the parts of a run, each from its own config group (``model``, ``data``, ``optim``).

Errors are :class:`~ampctl.errors.BuildError` with one line naming the key."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ampctl.errors import BuildError
from ampctl.train.data import DataError, SyntheticSource, TextSource, TokenSource
from ampctl.train.settings import DATA_KINDS, DataConfig, OptimConfig

__all__ = [
    "BuildError",
    "resolve_device",
    "build_model",
    "build_data",
    "build_data_source",
    "source_class",
    "data_objective",
    "build_optimizer",
    "accepts_batch_keys",
]


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


def build_model(spec: Mapping[str, Any]) -> nn.Module:
    """Instantiate ``model._target_`` with the other ``model.*`` keys as keyword arguments
    (``spec``: the ``model`` group)."""
    kwargs = dict(spec)
    name = kwargs.pop("_target_")
    target = _import_target(name)
    if not callable(target):
        raise BuildError(f"model._target_={name!r} is not callable")
    try:
        model = target(**kwargs)
    except (TypeError, ValueError) as e:
        raise BuildError(f"model: building {name} failed: {str(e).splitlines()[0]}") from None
    if not isinstance(model, nn.Module):
        raise BuildError(
            f"model._target_={name!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def data_objective(data: DataConfig, model: Mapping[str, Any]) -> str:
    """``data.objective``, with ``auto`` resolved from the model's name (no import):
    ``causal`` when ``model._target_`` ends in ``ForCausalLM`` or ``LMHeadModel`` (ampctl's
    GPT-2 and Llama, and Hugging Face's causal-LM classes), else ``mlm``."""
    if data.objective != "auto":
        return data.objective
    name = str(model.get("_target_", "")).rsplit(".", 1)[-1]
    return "causal" if name.endswith(("ForCausalLM", "LMHeadModel")) else "mlm"


def source_class(kind: Any) -> type[TokenSource] | None:
    if kind == "synthetic":
        return SyntheticSource
    if kind == "text":
        return TextSource
    if kind == "hf":  # its module imports datasets/tokenizers only when a source is built
        from ampctl.train.hf_data import HFSource

        return HFSource
    return None


def build_data(kind: str, **kwargs: Any) -> TokenSource:
    """Build a data source: ``kind`` is ``"synthetic"`` (:class:`SyntheticSource`),
    ``"text"`` (:class:`TextSource`) or ``"hf"`` (:class:`ampctl.train.hf_data.HFSource`);
    ``kwargs`` go to its constructor.

    Raises:
        DataError: unknown ``kind``, an argument the kind does not take, a
            missing required argument, or any error from the constructor.
    """
    cls = source_class(kind) if isinstance(kind, str) else None
    if cls is None:
        allowed = ", ".join(repr(k) for k in DATA_KINDS)
        raise DataError(f"data.kind {kind!r} is not one of {allowed}")
    signature = inspect.signature(cls.__init__)
    accepted = [p for p in signature.parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise DataError(
            f"data.kind {kind!r} does not take {', '.join(unknown)}; it takes {', '.join(accepted)}"
        )
    missing = [
        name
        for name, p in signature.parameters.items()
        if name != "self" and p.default is inspect.Parameter.empty and name not in kwargs
    ]
    if missing:
        raise DataError(f"data.kind {kind!r} needs {', '.join(missing)}")
    return cls(**kwargs)


def build_data_source(
    d: DataConfig,
    *,
    model: Mapping[str, Any],
    seed: int,
    rank: int = 0,
    world_size: int = 1,
) -> TokenSource:
    """The data source of the ``data`` group, for the model group ``model`` (its objective and
    vocabulary) and the run's ``seed``; ``rank`` / ``world_size`` pick this process's share."""
    kw: dict[str, Any] = dict(
        seq_len=d.seq_len,
        batch_size=d.batch_size,
        seed=seed,
        mask_prob=d.mask_prob,
        rank=rank,
        world_size=world_size,
        objective=data_objective(d, model),
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
    model_vocab = model.get("vocab_size")
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


def accepts_batch_keys(model: nn.Module, keys: list[str]) -> list[str]:
    """Batch keys the model's forward does not accept (empty when it takes **kwargs)."""
    sig = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return []
    return [k for k in keys if k not in sig.parameters]
