"""What every integration shares: the error type, the lazy import of a framework with its install
hint, the torch optimizer inside a framework's wrapper, and the rank helpers (skip flags agreed
across ranks, rank 0 writes)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler
from ampctl.errors import UsageError

__all__ = [
    "IntegrationError",
    "inner_optimizer",
    "reduce_max",
    "require",
    "share_flags",
    "world_size",
    "is_rank0",
    "Ranks",
    "count_tokens",
    "param_device",
]


class IntegrationError(UsageError):
    """Bad use of an integration: the message names the argument and what is allowed."""


def require(module: str, extra: str, user: str) -> Any:
    """Import ``module`` for ``user`` (an ampctl module), or raise ImportError with the one-line
    install hint ``pip install "ampctl[extra]"`` when its package is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise ModuleNotFoundError(
            f"{user} needs the {top!r} package, which is not installed: "
            f'pip install "ampctl[{extra}]"',
            name=e.name,
        ) from None


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the object a scaler unscales and steps."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def reduce_max(flags: torch.Tensor) -> torch.Tensor:
    """All-reduce MAX of a scaler's overflow flags over the ranks (a collective, no host read):
    the ``LossScaler.reduce_flags`` that makes every rank skip the same steps."""
    out = flags.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out


def share_flags(scaler: LossScaler) -> None:
    """Under ``torch.distributed`` with several ranks, make ``scaler``'s skip decisions agree
    across ranks (a forward overflow is seen by one rank only) unless a hook is set already."""
    if world_size() > 1 and scaler.reduce_flags is None:
        scaler.reduce_flags = reduce_max


class Ranks:
    """What Protection needs of the process group: the ranks agree on the module a
    forward-overflow replay located."""

    enabled = True

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * world_size()
        torch.distributed.all_gather_object(out, obj)
        return out


def count_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of its ``input_ids`` (0 when it has none)."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


def param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
