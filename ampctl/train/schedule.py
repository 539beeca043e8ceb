"""Learning-rate schedule: linear warmup, then cosine / linear decay / constant.

The schedule is a function of the number of *applied* optimizer steps, so a skipped step does
not advance it. ``lr_factor`` evaluates a host counter (a Python int: plain float math) or a
device counter (a 0-dim tensor: torch ops on its device, for the fused-optimizer path) with the
same formula; neither reads the device.
"""

from __future__ import annotations

import math

import torch

__all__ = ["lr_factor"]


def lr_factor(
    applied: int | torch.Tensor,
    *,
    max_steps: int,
    warmup_steps: int,
    schedule: str,
    min_lr_ratio: float,
) -> float | torch.Tensor:
    """Multiplier of the base learning rate after ``applied`` optimizer steps.

    A Python int gives a float (host math); a tensor gives a tensor on its device. No host read.
    """
    tensor = isinstance(applied, torch.Tensor)
    n = applied.double() if tensor else float(applied)
    cos = torch.cos if tensor else math.cos

    def clamp01(x):
        return x.clamp(0.0, 1.0) if tensor else min(max(x, 0.0), 1.0)

    # 1) warmup: linear from 1/warmup to 1
    warm = (n + 1) / max(warmup_steps, 1)
    # 2) decay over the remaining steps, from 1 to min_lr_ratio
    progress = clamp01((n - warmup_steps) / max(max_steps - warmup_steps, 1))
    if schedule == "cosine":
        decay = min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(math.pi * progress))
    elif schedule == "linear":
        decay = 1 - (1 - min_lr_ratio) * progress
    elif schedule == "constant":
        decay = progress * 0 + 1.0
    else:
        raise ValueError(f"optim.schedule={schedule!r}: must be one of cosine, linear, constant")
    if tensor:
        return torch.where(n < warmup_steps, warm, decay).float()
    return warm if n < warmup_steps else decay
