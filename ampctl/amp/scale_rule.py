"""The loss scale's update rule as a pure function of device tensors, and the check of a scale
given to ``update(new_scale=...)`` (used by :class:`~ampctl.amp.LossScaler`; no host read)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["next_scale"]


def next_scale(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    grad_overflow: torch.Tensor,
    forward_overflow: torch.Tensor,
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
    max_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scale update rule, as a pure function of 0-dim tensors (no host read).

    Returns ``(scale, growth_tracker, hysteresis_tracker)`` for the next step.
    With ``hysteresis=1`` and bounds that are not reached it is GradScaler's
    ``_amp_update_scale_`` bit for bit (factors applied in float64, stored in float32), except
    that it grows once the tracker *reaches* ``growth_interval`` where GradScaler needs equality.
    """
    grad_overflow = grad_overflow.bool()
    forward_overflow = forward_overflow.bool()
    clean = ~(grad_overflow | forward_overflow)

    # 1) gradient overflow: use up one unit of hysteresis; back off once it is spent.
    hyst_after = torch.where(
        grad_overflow, (hysteresis_tracker - 1).clamp_min(0), hysteresis_tracker
    )
    backed_off = (scale.double() * backoff_factor).float()
    scale_1 = torch.where(grad_overflow & (hyst_after <= 0), backed_off, scale)
    # 2) forward overflow (non-finite loss): skipped, but the scale and both trackers stay.
    # 3) clean step: count it; after growth_interval clean steps grow (if the result is finite)
    #    and refill the hysteresis counter.
    successful = growth_tracker + 1
    grow = clean & (successful >= growth_interval)
    grown = (scale.double() * growth_factor).float()
    scale_2 = torch.where(grow & torch.isfinite(grown), grown, scale_1)
    new_tracker = torch.where(
        grad_overflow | grow,
        torch.zeros_like(growth_tracker),
        torch.where(clean, successful, growth_tracker),
    )
    new_hyst = torch.where(grow, torch.full_like(hysteresis_tracker, hysteresis), hyst_after)
    # 4) bounds.
    new_scale = scale_2.clamp(min=min_scale, max=max_scale)
    return new_scale, new_tracker, new_hyst


def _new_scale_tensor(new_scale: Any) -> torch.Tensor:
    """``update(new_scale=...)``'s value as a detached float32 0-dim tensor (copied)."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise ValueError(
                "LossScaler.update: new_scale must be a number or a one-element tensor that does "
                f"not require grad (got shape {tuple(new_scale.shape)}, "
                f"requires_grad={new_scale.requires_grad})"
            )
        return new_scale.detach().to(torch.float32).reshape(())
    if not _number(new_scale):
        raise ValueError(
            f"LossScaler.update: new_scale={new_scale!r} is not allowed: give a number or a "
            f"one-element tensor"
        )
    return torch.tensor(float(new_scale), dtype=torch.float32)


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
