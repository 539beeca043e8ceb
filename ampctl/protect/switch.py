"""The precision switch, in one place: move a model from one precision plugin to another in place.

A fallback (:meth:`~ampctl.protect.protection.Protection.switch_precision`) and a resumed
Lightning run whose checkpoint had fallen back (:class:`~ampctl.integrations.lightning.
AmpctlPrecision`) both call :func:`switch_precision`; neither keeps a copy.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ampctl.amp.precision import PLUGINS, Precision, make_precision
from ampctl.amp.scaler import LossScaler

__all__ = ["switch_precision"]


def switch_precision(
    old: Precision,
    name: str,
    model: nn.Module | None,
    *,
    device: torch.device | str | None = None,
    scale: float | None = None,
) -> Precision:
    """A new plugin for precision ``name`` that takes over from ``old``: the same fp32 patterns,
    device type and options (e.g. fp8's recipe), the modules ``old`` kept in fp32, and the
    scaler's counters and history (a run's skips stay counted); the scale restarts at ``scale``
    when the new precision scales the loss and ``scale`` is finite. ``model`` is released from
    ``old`` and prepared for the new one (None: not attached to a model yet). ``device``: create
    the new scaler's state there now (None: at its first ``scale()``). Weights and optimizer
    state are left as they are: the caller rebuilds the optimizer when the parameters it steps
    change (fp16-pure's masters). **Syncs** once (the old scaler's state)."""
    counters = old.scaler.state_dict()
    kept = old.release(model) if model is not None else list(old.in_fp32)
    new = make_precision(
        name,
        fp32_modules=old.fp32_modules,
        device_type=old.device_type,
        scaler=LossScaler(enabled=PLUGINS[name].needs_scaler, history_size=old.scaler.history_size),
        options=old.options,
    )
    if model is not None:
        new.prepare(model)
        for n in kept:
            if n not in new.in_fp32:
                new.to_fp32(model, n)
    if counters:
        if new.scaler.is_enabled() and scale is not None and math.isfinite(scale):
            counters["scale"] = scale
        new.scaler.load_state_dict(counters)
    new.scaler.reduce_flags = old.scaler.reduce_flags
    if device is not None:
        new.scaler.init_state(device)
    return new
