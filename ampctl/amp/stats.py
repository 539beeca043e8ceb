"""Gradient health statistics, computed on the device.

``grad_stats`` returns 0-dim device tensors; nothing is read on the host here. The loop stacks
them with its other figures and reads everything in one transfer at the log interval.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ampctl.amp.formats import FP16_SUBNORMAL
from ampctl.amp.overflow import group_by_device_and_dtype

__all__ = ["grad_stats", "STAT_KEYS"]

STAT_KEYS = ("grad_norm", "grad_amax", "grad_underflow", "grad_elems", "nonfinite_grads")


def grad_stats(
    grads: Iterable[torch.Tensor], scale: torch.Tensor | float, device: torch.device
) -> dict[str, torch.Tensor]:
    """Global L2 norm, max |g|, underflow count, element count and non-finite count.

    ``grads`` are *unscaled* gradients. An element counts as underflowed when it is zero or when,
    multiplied back by ``scale``, it is below fp16's smallest subnormal (2**-24): the fp16
    backward could not represent it. Tensors holding inf/NaN are left out of norm and max (they
    are counted in the non-finite figure). No host read.
    """
    zero = torch.zeros((), dtype=torch.float32, device=device)
    norm_sq, amax, under, elems, bad = (
        zero.clone(),
        zero.clone(),
        zero.clone(),
        zero.clone(),
        zero.clone(),
    )
    scale_t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    for dev, per_dtype in group_by_device_and_dtype([g for g in grads if g is not None]).items():
        threshold = FP16_SUBNORMAL / scale_t.to(dev, torch.float32)
        for group in per_dtype.values():
            group = [g.detach() for g in group]
            # per-tensor reductions (foreach where torch has them): no concatenated copy of all
            # gradients, so the temporary memory is one tensor's worth at most
            l2 = torch.stack(torch._foreach_norm(group, 2.0)).float()
            linf = torch.stack(torch._foreach_norm(group, float("inf"))).float()
            ok = torch.isfinite(l2)
            norm_sq += torch.where(ok, l2, 0.0).pow(2).sum().to(device)
            amax = torch.maximum(
                amax, torch.where(torch.isfinite(linf), linf, 0.0).max().to(device)
            )
            under += (
                torch.stack([(g.abs() < threshold).sum() for g in group]).sum().float().to(device)
            )
            bad += torch.stack([(~torch.isfinite(g)).sum() for g in group]).sum().float().to(device)
            elems += float(sum(g.numel() for g in group))
    return {
        "grad_norm": norm_sq.sqrt(),
        "grad_amax": amax,
        "grad_underflow": under,
        "grad_elems": elems,
        "nonfinite_grads": bad,
    }
