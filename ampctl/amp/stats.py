"""Gradient health statistics, computed on the device with foreach reductions.

``grad_stats`` returns 0-dim device tensors; nothing is read on the host here. The loop stacks
them with its other figures and reads everything in one transfer at the log interval.

Cost: a fixed number of ops per (device, dtype) group of gradients -- about thirty, whatever the
number of tensors in it -- and one temporary as large as the group, taken in chunks of at most
``CHUNK`` elements (a group larger than that costs a dozen ops per further chunk). A gradient norm
the loop already has (clipping's) is used instead of computing one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ampctl.amp.formats import FP16_SUBNORMAL
from ampctl.amp.overflow import group_by_device_and_dtype

__all__ = ["CHUNK", "STAT_KEYS", "grad_stats"]

STAT_KEYS = ("grad_norm", "grad_amax", "grad_underflow", "grad_elems", "nonfinite_grads")

#: Elements per pass of the underflow and non-finite counts (bounds their temporary).
CHUNK = 1 << 26


def _chunks(group: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    part: list[torch.Tensor] = []
    size = 0
    for g in group:
        if part and size + g.numel() > CHUNK:
            yield part
            part, size = [], 0
        part.append(g)
        size += g.numel()
    if part:
        yield part


def _counts(part: list[torch.Tensor], inv_thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tensor of ``part``: elements that are not finite, and elements whose magnitude
    times ``inv_thr`` is below 1 (the underflowed ones; a NaN counts there too, which the caller
    masks out with the tensor's finiteness). One temporary of ``part``'s size. No host read."""
    t = torch._foreach_mul(part, 0.0)  # 0 where finite, NaN where not
    bad = torch.stack(torch._foreach_norm(t, 0))
    torch._foreach_copy_(t, part)
    torch._foreach_abs_(t)
    torch._foreach_mul_(t, inv_thr)
    torch._foreach_clamp_max_(t, 1.0)
    torch._foreach_sub_(t, 1.0)  # < 0 exactly where |g| * inv_thr < 1
    return bad, torch.stack(torch._foreach_norm(t, 0))


def grad_stats(
    grads: Iterable[torch.Tensor | None],
    scale: torch.Tensor | float,
    device: torch.device,
    *,
    norm: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Global L2 norm, max |g|, underflow count, element count and non-finite count.

    ``grads`` are *unscaled* gradients. An element counts as underflowed when it is zero or when,
    multiplied back by ``scale``, it is below fp16's smallest subnormal (2**-24): the fp16
    backward could not represent it. Tensors holding inf/NaN are left out of norm, max and
    underflow (their non-finite elements are counted). ``norm``: the gradients' global norm when
    the caller has it (e.g. ``clip_grad_norm_``'s result), used as it is. No host read.
    """
    zero = torch.zeros((), dtype=torch.float32, device=device)
    norm_sq, amax, under, bad = zero, zero, zero, zero
    elems = 0
    scale_t = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    for dev, per_dtype in group_by_device_and_dtype([g for g in grads if g is not None]).items():
        inv_thr = scale_t.to(dev, torch.float32) * (1.0 / FP16_SUBNORMAL)
        for group in per_dtype.values():
            group = [g.detach() for g in group]
            elems += sum(g.numel() for g in group)
            linf = torch.stack(torch._foreach_norm(group, math.inf)).float()
            ok = linf < math.inf  # the tensor holds no inf/NaN
            amax = torch.maximum(amax, torch.where(ok, linf, 0.0).max().to(device))
            if norm is None:
                l2 = torch.stack(torch._foreach_norm(group, 2.0)).float()
                norm_sq = norm_sq + torch.where(ok, l2, 0.0).pow(2).sum().to(device)
            chunks = [_counts(part, inv_thr) for part in _chunks(group)]
            nonfinite = torch.cat([c[0] for c in chunks]).float()
            small = torch.cat([c[1] for c in chunks]).float()
            bad = bad + nonfinite.sum().to(device)
            under = under + torch.where(ok, small, 0.0).sum().to(device)
    grad_norm = norm.detach().float().reshape(()).to(device) if norm is not None else norm_sq.sqrt()
    return {
        "grad_norm": grad_norm,
        "grad_amax": amax,
        "grad_underflow": under,
        "grad_elems": torch.full((), float(elems), device=device),
        "nonfinite_grads": bad,
    }
