"""Data-parallel training with torch.distributed: DDP or FSDP2 (``fully_shard``), via torchrun.

``torchrun --nproc_per_node N -m ampctl train ... dist.strategy=ddp|fsdp`` sets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous; :func:`init_distributed` reads them. Backend: nccl
on GPUs, gloo on CPU. The overflow decision is shared: the loss scaler's flags are all-reduced
(MAX) inside ``scaler.step()`` before its single host read, so every rank skips the same steps,
keeps the same scale, and the guard takes the same decisions everywhere.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DistContext", "init_distributed", "wrap_model", "full_state", "load_full_state"]


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | ddp | fsdp

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce MAX of a small tensor (no host read; a collective)."""
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return out

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()


def init_distributed(strategy: str, device_name: str) -> DistContext:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); else single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name != "cpu" and torch.cuda.is_available()
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30)
        )
    return DistContext(rank=rank, world_size=world, local_rank=local, strategy=strategy)


def wrap_model(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """The module to call for the forward pass: DDP wrapper, the FSDP2-sharded model (sharded in
    place: every block of every ``nn.ModuleList`` gets its own unit, then the root), or the
    model itself."""
    if not ctx.enabled:
        return model
    if ctx.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    for mod in list(model.modules()):
        if isinstance(mod, nn.ModuleList):
            for block in mod:
                fully_shard(block)
    fully_shard(model)
    return model


def no_sync(module: nn.Module, ctx: DistContext, last: bool):
    """Skip the gradient all-reduce on the non-last micro-batches of an accumulation (DDP)."""
    if ctx.enabled and ctx.strategy == "ddp" and not last:
        return module.no_sync()
    return contextlib.nullcontext()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext):
    """Model and optimizer state for a checkpoint. FSDP: full (unsharded) dicts gathered to
    rank 0 on the CPU (a collective: every rank must call it); else the plain state dicts."""
    if ctx.enabled and ctx.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts), get_optimizer_state_dict(
            model, optimizer, options=opts
        )
    return model.state_dict(), optimizer.state_dict()


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict,
    optim_sd: dict,
    ctx: DistContext,
) -> None:
    """Inverse of :func:`full_state` (every rank passes the full dicts it loaded)."""
    if ctx.enabled and ctx.strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_sd, options=opts)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)
        return
    model.load_state_dict(model_sd)
    optimizer.load_state_dict(optim_sd)
