"""The spike rule: skip a step whose loss (or gradient norm) is far above its recent course.

After OLMo-core's ``SkipStepOptimizer``: a step is skipped when its loss is more than ``z``
standard deviations above the mean of the last ``window`` clean steps (and so for the gradient
norm, where the loop reports one: ampctl's loop does, from clipping). The comparison is made on
the device, for every step, by the loss scaler (:meth:`~ampctl.amp.LossScaler.
set_spike_thresholds`): the step's ``found_inf`` flag is set as for an overflow, so the optimizer
skips it without a host read, fused optimizers included. The thresholds are computed here, on
the host, from the records that ride on each log step's one read (the window's losses and
norms), and written back to the device: they lag at most one log interval.

Why these defaults (``guard.spike_z=6``, ``guard.spike_window=128``, the rule active once the
window is full): a finite bad batch that multiplies the loss by 10^4 is hundreds of standard
deviations out, while a healthy run's step-to-step noise stays within a few; six is OLMo-core's
factor and keeps false skips of a healthy run at zero in practice (a Gaussian 6-sigma tail is
1e-9 per step). Skipped steps and non-finite values are left out of the window, so a spike does
not raise the threshold that judges the next one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from . import records as rec

__all__ = ["SpikeRule", "WindowStats"]


@dataclass(frozen=True)
class WindowStats:
    """Mean and standard deviation of one figure over the window's clean steps."""

    mean: float
    std: float
    n: int

    def threshold(self, z: float) -> float:
        return self.mean + z * self.std

    def z(self, value: float) -> float:
        if not math.isfinite(value):
            return math.nan
        return (value - self.mean) / self.std if self.std > 0 else math.inf


def _stats(values: list[float]) -> WindowStats | None:
    if len(values) < 2:
        return None
    return WindowStats(statistics.fmean(values), statistics.pstdev(values), len(values))


class SpikeRule:
    """Thresholds from the recent record (see the module docstring).

    Args:
        z: standard deviations above the window's mean that make a spike.
        window: clean steps the mean and deviation are taken over.
        min_steps: clean steps in the window before the rule acts (default: ``window``).
        grad_norm: also judge the gradient norm the loop reports.
        enabled: False keeps the thresholds off (``inf``).
    """

    def __init__(
        self,
        *,
        z: float = 6.0,
        window: int = 128,
        min_steps: int | None = None,
        grad_norm: bool = True,
        enabled: bool = True,
    ) -> None:
        self.z = float(z)
        self.window = int(window)
        self.min_steps = int(min_steps if min_steps is not None else window)
        self.grad_norm = bool(grad_norm)
        self.enabled = bool(enabled)
        self.loss: WindowStats | None = None
        self.norm: WindowStats | None = None

    def figures(self, fig: Any, scaler: Any) -> None:
        """Add the window's records (skipped flag, loss, gradient norm per step) to the log
        step's read. No host read."""
        if not self.enabled or scaler.num_updates == 0:
            return
        rows = scaler.recent_records(self.window)
        fig.add("spike_window", rows[:, [rec.SKIPPED, rec.LOSS, rec.GNORM]], vector=True)

    def on_read(self, values: dict[str, Any], scaler: Any) -> None:
        """Recompute the thresholds from the window read and hand them to the scaler (two fills
        on the device when they change). No host read."""
        flat = values.get("spike_window")
        if not self.enabled or flat is None:
            return
        rows = [flat[i : i + 3] for i in range(0, len(flat), 3)]
        clean = [r for r in rows if r[0] <= 0]
        losses = [r[1] for r in clean if math.isfinite(r[1])]
        norms = [r[2] for r in clean if math.isfinite(r[2])]
        self.loss = _stats(losses) if len(losses) >= self.min_steps else None
        self.norm = _stats(norms) if self.grad_norm and len(norms) >= self.min_steps else None
        scaler.set_spike_thresholds(
            loss=self.loss.threshold(self.z) if self.loss is not None else math.inf,
            grad_norm=self.norm.threshold(self.z) if self.norm is not None else math.inf,
        )

    def z_scores(self, loss: float, grad_norm: float) -> dict[str, float]:
        """The z-scores of a step's loss and gradient norm against the window in force."""
        out: dict[str, float] = {}
        if self.loss is not None:
            out["loss_z"] = self.loss.z(loss)
        if self.norm is not None and math.isfinite(grad_norm):
            out["grad_norm_z"] = self.norm.z(grad_norm)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The window statistics in force (a resume keeps judging spikes from the first step)."""
        return {
            k: None if v is None else [v.mean, v.std, v.n]
            for k, v in (("loss", self.loss), ("norm", self.norm))
        }

    def load_state_dict(self, state: dict[str, Any], scaler: Any) -> None:
        for k in ("loss", "norm"):
            v = (state or {}).get(k)
            setattr(self, k, WindowStats(float(v[0]), float(v[1]), int(v[2])) if v else None)
        if self.enabled:
            scaler.set_spike_thresholds(
                loss=self.loss.threshold(self.z) if self.loss is not None else math.inf,
                grad_norm=self.norm.threshold(self.z) if self.norm is not None else math.inf,
            )
