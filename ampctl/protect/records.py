"""What a run writes, one writer each, for every loop: the metrics row, the summary and
``config.yaml``.

ampctl's :class:`~ampctl.train.trainer.Trainer` and :class:`~ampctl.integrations.ProtectedRun`
(with the Lightning, Accelerate and HF Trainer integrations on it) call these functions and keep no
copy, so a row or a summary has the same keys whichever loop wrote it. The row's figures come from
:func:`~ampctl.protect.figures.gather_log_figures`, read in the log step's one transfer; nothing here
reads the device.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from ampctl.amp.actgrad import ROW_KEYS as ACT_GRAD_KEYS
from ampctl.amp.precision import Precision, match_modules
from ampctl.amp.scaler import LossScaler
from ampctl.runlog import RunWriter

__all__ = ["GRAD_KEYS", "ROW_KEYS", "SUMMARY_KEYS", "metrics_row", "run_summary", "write_config"]

#: The gradient figures of a row (None on a row without gradient statistics).
GRAD_KEYS = ("grad_norm", "grad_amax", "grad_underflow_frac", "nonfinite_grads")

#: The keys of every metrics.jsonl row, in order (probes may add their own after these).
ROW_KEYS = (
    "step",
    "loss",
    "scale",
    "skipped",
    "forward_overflows",
    "spikes",
    "consecutive_overflows",
    "overflow_rate",
    "lr",
    "precision",
    "tokens_per_s",
    "elapsed_s",
    "max_steps",
    *GRAD_KEYS,
    *ACT_GRAD_KEYS,
)

#: The keys of every summary.json (a precision plugin may add its own, e.g. fp8's demotions).
SUMMARY_KEYS = (
    "status",
    "framework",
    "final_loss",
    "steps",
    "max_steps",
    "skipped",
    "forward_overflows",
    "spikes",
    "overflow_rate",
    "final_scale",
    "precision",
    "promoted_modules",
    "fp32_modules",
    "events",
    "wall_time_s",
    "tokens_per_s",
    "run_dir",
)


def metrics_row(
    values: Mapping[str, Any],
    *,
    step: int,
    scaler: LossScaler,
    precision: str,
    overflow_window: int,
    max_steps: int | None,
    tokens: int,
    seconds: float,
    elapsed_s: float,
    probes: Sequence[Any] = (),
) -> dict[str, Any]:
    """One metrics.jsonl row from the host ``values`` of the log read (the names
    :func:`~ampctl.protect.figures.gather_log_figures` gave them). ``tokens`` and ``seconds``:
    the interval's tokens and wall time; ``tokens_per_s`` is None when no tokens were counted.
    Gradient figures are None on a row without gradient statistics; the activation-gradient
    fractions are None unless a probe measured them."""
    n = scaler.num_updates
    v = values
    row: dict[str, Any] = {
        "step": step,
        "loss": v["loss_sum"] / v["loss_n"] if v["loss_n"] > 0 else math.nan,
        "scale": v["scale"] if scaler.is_enabled() else 1.0,
        "skipped": int(v["skipped_total"]),
        "forward_overflows": int(v["forward_overflows"]),
        "spikes": int(v.get("spikes", 0)),  # steps the spike rule skipped (guard.spike)
        "consecutive_overflows": int(v["consecutive_overflows"]),
        "overflow_rate": v["recent_skips"] / max(min(overflow_window, n), 1),
        "lr": v["lr"],
        "precision": precision,
        "tokens_per_s": tokens / max(seconds, 1e-9) if tokens else None,
        "elapsed_s": elapsed_s,
        "max_steps": max_steps,
        **dict.fromkeys((*GRAD_KEYS, *ACT_GRAD_KEYS)),
    }
    if "grad_norm_sq" in v:
        row.update(
            grad_norm=math.sqrt(max(v["grad_norm_sq"], 0.0)),
            grad_amax=v["grad_amax"],
            grad_underflow_frac=v["grad_underflow"] / max(v["grad_elems"], 1),
            nonfinite_grads=int(v["nonfinite_grads"]),
        )
    for probe in probes:
        row.update(probe.row(v))
    return row


def run_summary(
    status: str,
    *,
    framework: str,
    model: nn.Module,
    precision: Precision,
    final_loss: float | None,
    steps: int,
    max_steps: int | None,
    events: Mapping[str, int],
    wall_s: float,
    tokens: int,
    run_dir: str | Path,
) -> dict[str, Any]:
    """summary.json: the run's outcome, its scaler's counters, the modules kept in fp32 (those
    the guard promoted apart) and the precision's own keys. **Syncs** once (the scaler's
    counters)."""
    st = precision.scaler.stats()
    configured = set(match_modules(model, precision.fp32_modules))
    return {
        "status": status,
        "framework": framework,
        "final_loss": final_loss,
        "steps": steps,
        "max_steps": max_steps,
        "skipped": st["skipped_total"],
        "forward_overflows": st["forward_overflows"],
        "spikes": st.get("spikes", 0),
        "overflow_rate": st["skipped_total"] / max(st["steps"], 1),
        "final_scale": st["scale"],
        "precision": precision.name,
        "promoted_modules": [m for m in precision.in_fp32 if m not in configured],
        "fp32_modules": list(precision.in_fp32),
        "events": dict(events),
        "wall_time_s": wall_s,
        "tokens_per_s": tokens / max(wall_s, 1e-9) if tokens else None,
        "run_dir": str(run_dir),
        **precision.summary(model),
    }


def write_config(run_dir: str | Path, config: Mapping[str, Any]) -> None:
    """Write the run's ``config.yaml`` atomically from a plain mapping of resolved values (a
    reader sees the old file or the new one, never half of one)."""
    RunWriter(run_dir).write_config(OmegaConf.to_yaml(OmegaConf.create(dict(config))))
