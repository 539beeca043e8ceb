"""Fused non-finite detection and per-tensor attribution.

The check runs as one ``torch._amp_foreach_non_finite_check_and_unscale_`` pass per
(device, dtype) group of gradients -- the kernel torch's own GradScaler uses -- instead of a
Python loop over parameters with ``isnan(g).any()`` (which launches two kernels and, written the
usual way, reads the device once per parameter).

Nothing in this module reads a device value on the host unless its docstring says so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

__all__ = [
    "group_by_device_and_dtype",
    "check_and_unscale_",
    "nonfinite_flags",
    "names_flagged",
    "nonfinite_tensor_names",
    "nonfinite_grad_names",
    "naive_overflow_check",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (FSDP2 gradients), a view sharing its storage; other
    tensors unchanged. Cross-rank agreement is the caller's job (the scaler reduces its flags)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def group_by_device_and_dtype(
    tensors: Iterable[torch.Tensor],
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """Split tensors (DTensors: their local shards) into (device, dtype) groups for the foreach
    kernels. No host read."""
    groups: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for t in tensors:
        t = local_tensor(t)
        groups[t.device][t.dtype].append(t)
    return groups


def check_and_unscale_(
    tensors: Iterable[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> dict[torch.device, torch.Tensor]:
    """Multiply ``tensors`` in place by ``inv_scale`` and flag non-finite values, fused.

    One foreach kernel per (device, dtype) group. ``found_inf`` (a 0-dim float32 tensor) is
    set to 1.0 when any element of any tensor is inf or NaN; a copy is made for every other
    device the tensors live on. Returns ``{device: found_inf_on_that_device}``.

    Does not read the device on the host (no CPU-GPU sync).
    """
    per_device_found: dict[torch.device, torch.Tensor] = {}
    per_device_inv: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in group_by_device_and_dtype(tensors).items():
            if device not in per_device_found:
                per_device_found[device] = (
                    found_inf if found_inf.device == device else found_inf.to(device, copy=True)
                )
                per_device_inv[device] = (
                    inv_scale if inv_scale.device == device else inv_scale.to(device)
                )
            for group in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(
                    group, per_device_found[device], per_device_inv[device]
                )
    return per_device_found


def nonfinite_flags(
    named_tensors: Iterable[tuple[str, torch.Tensor | None]],
) -> tuple[list[str], torch.Tensor | None]:
    """``(names, flags)``: the names of the floating tensors given and, on the first one's
    device, a float tensor with 1.0 where that tensor holds an inf or NaN (one
    ``_foreach_norm(inf)`` per device/dtype group). No host read: read ``flags`` together with
    whatever else you need."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, t in named_tensors:
        if t is None or t.numel() == 0:
            continue
        t = local_tensor(t)
        if t.is_sparse:
            t = t.coalesce()._values()
        if not t.is_floating_point():
            continue
        names.append(name)
        tensors.append(t.detach())
    if not tensors:
        return [], None
    home = tensors[0].device
    flags: list[torch.Tensor] = []
    order: list[int] = []
    index_of = {id(t): i for i, t in enumerate(tensors)}
    for per_dtype in group_by_device_and_dtype(tensors).values():
        for group in per_dtype.values():
            norms = torch._foreach_norm(group, float("inf"))
            flags.append((~torch.isfinite(torch.stack(norms))).float().to(home))
            order.extend(index_of[id(t)] for t in group)
    perm = torch.empty(len(order), dtype=torch.long)
    perm[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return names, torch.cat(flags)[perm.to(home)]


def nonfinite_tensor_names(
    named_tensors: Iterable[tuple[str, torch.Tensor | None]], limit: int | None = None
) -> list[str]:
    """Names of the tensors that hold at least one inf or NaN, in the given order.

    The per-tensor flags are computed on the device (:func:`nonfinite_flags`) and read on the
    host in a single transfer: **this syncs**. Call it on overflow steps only.
    """
    names, flags = nonfinite_flags(named_tensors)
    if flags is None:
        return []
    return names_flagged(names, flags.tolist(), limit)  # the one host read


def names_flagged(names: list[str], flags: list[float], limit: int | None = None) -> list[str]:
    """The names whose flag (as read from :func:`nonfinite_flags`) is set, at most ``limit``."""
    out = [n for n, f in zip(names, flags, strict=True) if f]
    return out if limit is None else out[:limit]


def nonfinite_grad_names(module_or_named_params, limit: int | None = None) -> list[str]:
    """Names of parameters whose ``.grad`` holds inf or NaN (attribution of an overflow step).

    Accepts a module or an iterable of ``(name, parameter)``. **Syncs** once; call it only on
    steps that were skipped.
    """
    named = (
        module_or_named_params.named_parameters()
        if isinstance(module_or_named_params, torch.nn.Module)
        else module_or_named_params
    )
    return nonfinite_tensor_names(((n, p.grad) for n, p in named), limit=limit)


def naive_overflow_check(parameters: Iterable[torch.nn.Parameter]) -> bool:
    """The per-parameter checker from the seeds (``isnan(g).any()`` / ``isinf(g).any()``).

    Kept only as the baseline for ``ampctl bench``: it reads the device on the host up to twice
    per parameter.
    """
    for p in parameters:
        if p.grad is not None:
            if torch.isnan(p.grad).any():
                return True
            if torch.isinf(p.grad).any():
                return True
    return False
