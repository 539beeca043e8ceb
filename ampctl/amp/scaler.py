"""LossScaler: a drop-in for ``torch.amp.GradScaler`` with hysteresis, bounds and observed skips.

Call order (the same as GradScaler)::

    with torch.autocast(device_type, dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()      # once per micro-batch
    scaler.unscale_(optimizer)         # optional, e.g. before clipping
    scaler.step(optimizer)             # skips optimizer.step() on inf/NaN
    scaler.update()                    # scale update, on the device

What it adds to GradScaler:

* ``hysteresis`` (DeepSpeed / Megatron): the scale backs off only on the ``hysteresis``-th
  gradient overflow. The counter refills to ``hysteresis`` whenever the scale grows (after
  ``growth_interval`` consecutive clean steps), exactly as Megatron's ``DynamicGradScaler``.
  With ``hysteresis=1`` every gradient overflow backs off, as in GradScaler.
* ``min_scale`` / ``max_scale`` clamp the scale (Apex's ceiling 2**24 by default).
* Forward overflow is told apart from gradient overflow: a non-finite loss skips the step and is
  counted, but the scale is not backed off (a smaller scale cannot cure it).
* With scaling disabled (``enabled=False``, for bf16 / fp32) non-finite gradients are still
  detected and the step skipped (``check_finite=True``), so a bf16 run never applies a NaN
  update. ``check_finite=False`` makes a disabled scaler a pure pass-through, like GradScaler's.
* Skips are *observed* (what ``step`` did), not inferred from a change of scale, and kept on the
  device: total skipped, forward overflows, consecutive overflows, last-step flag and a bounded
  (update, scale used, kind) history -- kind 0 clean, 1 gradient overflow, 2 forward overflow --
  all in ``state_dict()``.

Host reads: ``step`` reads one flag per optimizer per step (to decide whether to call
``optimizer.step()``); with an optimizer that handles scaling itself
(``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``) it reads nothing. ``scale``,
``unscale_`` and ``update`` never read the device.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from .overflow import check_and_unscale_

__all__ = ["LossScaler", "OptState", "next_scale"]


class OptState(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


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
    ``_amp_update_scale_`` bit for bit (factors applied in float64, stored in float32).
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


def _check_range(name: str, value: float, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LossScaler: {name}={value!r} is not allowed; {name} must be {allowed}")


class LossScaler:
    """Dynamic loss scaler, drop-in for ``torch.amp.GradScaler`` (see the module docstring).

    Args:
        init_scale: initial scale, > 0 (default 2**16).
        growth_factor: multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: multiplier on a gradient overflow, in (0, 1).
        growth_interval: consecutive clean steps before growing, >= 1.
        hysteresis: gradient overflows tolerated before backing off, >= 1 (refilled on growth).
        min_scale / max_scale: bounds of the scale, 0 < min_scale <= max_scale.
        enabled: scale the loss. When False the scale is 1 and never changes.
        check_finite: detect non-finite gradients and skip those steps even when ``enabled`` is
            False (bf16 / fp32). Always on when enabled.
        history_size: how many (step, scale, skipped) records to keep, >= 1.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        enabled: bool = True,
        *,
        check_finite: bool = True,
        history_size: int = 1024,
    ) -> None:
        _check_range("init_scale", init_scale, _finite_pos(init_scale), "a finite number > 0")
        # the setters validate (one place for each rule, shared with later changes)
        self.set_growth_factor(growth_factor)
        self.set_backoff_factor(backoff_factor)
        self.set_growth_interval(growth_interval)
        self.set_hysteresis(hysteresis)
        self.set_bounds(min_scale, max_scale)
        _check_range(
            "history_size",
            history_size,
            _is_int(history_size) and history_size >= 1,
            "an integer >= 1",
        )
        self._enabled = bool(enabled)
        self._check_finite = bool(check_finite) or self._enabled
        self._history_size = int(history_size)
        # Values the device tensors start from (lazily created on the first scale(), on the
        # loss's device, as GradScaler does); load_state_dict before that lands here.
        self._init: dict[str, Any] = {
            "scale": float(min(max(init_scale, min_scale), max_scale)) if self._enabled else 1.0,
            "growth_tracker": 0,
            "hysteresis_tracker": self._hysteresis,
            "skipped_total": 0,
            "forward_overflows": 0,
            "consecutive_overflows": 0,
            "last_skipped": 0,
            "history": torch.zeros(0, 3, dtype=torch.float64),
        }
        self._num_updates = 0
        self._last_read: bool | None = None
        self._t: dict[str, torch.Tensor] | None = None  # device state
        self._loss_nonfinite: torch.Tensor | None = None  # this step, OR over scale() calls
        self._per_opt: dict[int, dict[str, Any]] = defaultdict(_fresh_opt_state)
        # What step() read on the host for the last step: True/False (skipped or not), or None
        # when no read was made (fused optimizer). Free to use: the read already happened.
        self.last_skip_read: bool | None = None
        # Distributed hook: given this step's flags (float32 [grad overflow, forward overflow] on
        # the device), return the flags all ranks agree on (an all-reduce MAX). It runs inside
        # step(), before the one host read, so every rank skips the same steps and keeps the
        # same scale. None = single process.
        self.reduce_flags: Callable[[torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ device state
    def _lazy_init(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._t is None:
            i = self._init
            self._t = {
                "scale": torch.full((), i["scale"], dtype=torch.float32, device=device),
                "growth_tracker": torch.full(
                    (), i["growth_tracker"], dtype=torch.int32, device=device
                ),
                "hysteresis_tracker": torch.full(
                    (), i["hysteresis_tracker"], dtype=torch.int32, device=device
                ),
                "skipped_total": torch.full(
                    (), i["skipped_total"], dtype=torch.int64, device=device
                ),
                "forward_overflows": torch.full(
                    (), i["forward_overflows"], dtype=torch.int64, device=device
                ),
                "consecutive_overflows": torch.full(
                    (), i["consecutive_overflows"], dtype=torch.int64, device=device
                ),
                "last_skipped": torch.full((), i["last_skipped"], dtype=torch.int64, device=device),
                "history": torch.zeros(self._history_size, 3, dtype=torch.float64, device=device),
            }
            old = i["history"][-self._history_size :]
            n = old.shape[0]
            # ring buffer: record k lives at row k % history_size
            for k in range(n):
                self._t["history"][(self._num_updates - n + k) % self._history_size] = old[k]
        return self._t

    def init_state(self, device: torch.device | str) -> None:
        """Create the device state now (otherwise the first ``scale()`` does, on the loss's
        device). No host read."""
        self._lazy_init(torch.device(device))

    @property
    def device(self) -> torch.device | None:
        """Device of the scaler's state (None before the first ``scale()``)."""
        return None if self._t is None else self._t["scale"].device

    # ------------------------------------------------------------------ GradScaler API
    def scale(self, outputs):
        """Multiply a loss (or a tensor / iterable of tensors) by the scale.

        Also records, on the device, whether the loss is finite (forward-overflow detection).
        Does not read the device on the host.
        """
        if isinstance(outputs, torch.Tensor):
            t = self._lazy_init(outputs.device)
            if self._check_finite:
                nonfinite = ~torch.isfinite(outputs.detach()).all()
                self._loss_nonfinite = (
                    nonfinite if self._loss_nonfinite is None else self._loss_nonfinite | nonfinite
                )
            if not self._enabled:
                return outputs
            return outputs * t["scale"].to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, list | tuple):
            scaled = [self.scale(o) for o in outputs]
            return type(outputs)(scaled) if isinstance(outputs, tuple) else scaled
        if hasattr(outputs, "__iter__"):
            return map(self.scale, outputs)
        raise ValueError("LossScaler.scale: outputs must be a Tensor or an iterable of Tensors")

    def _require_init(self, fn: str) -> dict[str, torch.Tensor]:
        if self._t is None:
            raise RuntimeError(
                f"LossScaler.{fn}() was called before scale(): call scaler.scale(loss).backward() "
                f"first in each iteration, then unscale_/step/update."
            )
        return self._t

    def _grads(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> list[torch.Tensor]:
        grads: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError(
                        "LossScaler: attempting to unscale FP16 gradients (the parameters are fp16). "
                        "Keep parameters in fp32 and run the forward under autocast, or use "
                        "precision=fp16-pure, which gives the optimizer an fp32 master copy."
                    )
                if p.grad.is_sparse:
                    if p.grad.dtype == torch.float16:
                        p.grad = p.grad.coalesce()
                    grads.append(p.grad._values())
                else:
                    grads.append(p.grad)
        return grads

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and check them for inf/NaN (fused).

        Call it at most once per optimizer per step, after all backward passes (e.g. before
        clipping). Does not read the device on the host.
        """
        if not self._check_finite:
            return
        t = self._require_init("unscale_")
        st = self._per_opt[id(optimizer)]
        if st["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "LossScaler.unscale_() was already called for this optimizer in this step: call it "
                "once per step, after all backward passes, and call update() before the next step."
            )
        if st["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "LossScaler.unscale_() was called after step(): call unscale_ before step(), "
                "or call update() to start the next step."
            )
        inv = t["scale"].double().reciprocal().float()
        found = torch.zeros((), dtype=torch.float32, device=t["scale"].device)
        st["found_inf_per_device"] = check_and_unscale_(
            self._grads(optimizer, allow_fp16=not self._enabled), inv, found
        )
        st["stage"] = OptState.UNSCALED

    def _flags(self, found_per_device: dict[torch.device, torch.Tensor]) -> torch.Tensor:
        """``[gradient overflow, forward overflow]`` for one optimizer as a float32 2-vector on
        the scale's device, agreed across ranks by ``reduce_flags`` when set. No host read."""
        t = self._t
        assert t is not None
        dev = t["scale"].device
        grad = torch.zeros((), dtype=torch.float32, device=dev)
        for f in found_per_device.values():
            grad = grad + f.to(dev, non_blocking=True)
        fwd = (
            self._loss_nonfinite.to(dev).float()
            if self._loss_nonfinite is not None
            else torch.zeros((), dtype=torch.float32, device=dev)
        )
        flags = (torch.stack([grad, fwd]) > 0).float()
        if self.reduce_flags is not None:
            flags = self.reduce_flags(flags)
        return flags

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Unscale (if not done yet) and run ``optimizer.step()`` unless the step overflowed.

        A skipped step leaves weights and optimizer state untouched; gradients stay unscaled.
        **Syncs once** (reads the skip flag) -- except with an optimizer that supports AMP
        scaling natively (``_step_supports_amp_scaling``, e.g. fused AdamW), which receives
        ``grad_scale`` / ``found_inf`` tensors and skips on the device: no host read.
        """
        if not self._check_finite:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError(
                "LossScaler.step: closures are not supported; compute the loss before step()."
            )
        t = self._require_init("step")
        st = self._per_opt[id(optimizer)]
        if st["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "LossScaler.step() was already called for this optimizer in this step: call "
                "update() after step(), once per iteration."
            )
        if (
            getattr(optimizer, "_step_supports_amp_scaling", False)
            and "grad_scaler" not in inspect.signature(optimizer.step).parameters
        ):
            if st["stage"] is OptState.READY:
                one = torch.ones((), dtype=torch.float32, device=t["scale"].device)
                found = torch.zeros((), dtype=torch.float32, device=t["scale"].device)
                st["found_inf_per_device"] = check_and_unscale_(
                    self._grads(optimizer, allow_fp16=True), one, found
                )
                optimizer.grad_scale = t["scale"] if self._enabled else None  # type: ignore[attr-defined]
            else:
                optimizer.grad_scale = None  # type: ignore[attr-defined]
            st["flags"] = self._flags(st["found_inf_per_device"])
            self.last_skip_read = None
            optimizer.found_inf = st["flags"].amax()  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            st["stage"] = OptState.STEPPED
            return retval
        if st["stage"] is OptState.READY:
            self.unscale_(optimizer)
        st["flags"] = self._flags(st["found_inf_per_device"])
        retval = None
        skip = bool(st["flags"].amax().item())  # the one host read of the step
        self.last_skip_read = skip if self.last_skip_read is None else (self.last_skip_read or skip)
        if not skip:
            retval = optimizer.step(*args, **kwargs)
        st["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Record the step (skipped or not) and update the scale, all on the device.

        ``new_scale`` sets the scale by hand (clamped to the bounds). Does not read the device.
        """
        if not self._check_finite:
            return
        t = self._require_init("update")
        self._last_read = self.last_skip_read
        self.last_skip_read = None
        stepped = [s["flags"] for s in self._per_opt.values() if "flags" in s]
        if not stepped and new_scale is None:
            raise RuntimeError(
                "LossScaler.update() was called before step(): call scaler.step(optimizer) for "
                "every optimizer, then update() once per iteration."
            )
        dev = t["scale"].device
        flags = torch.stack(stepped).amax(0) if stepped else torch.zeros(2, device=dev)
        fwd = flags[1] > 0
        grad_overflow = (flags[0] > 0) & ~fwd
        skipped_b = (flags[0] > 0) | fwd
        used_scale = t["scale"].clone()
        if new_scale is not None and self._enabled:
            value = (
                new_scale if isinstance(new_scale, torch.Tensor) else torch.tensor(float(new_scale))
            )
            t["scale"].copy_(value.to(dev, torch.float32).clamp(self._min_scale, self._max_scale))
        elif self._enabled:
            s, g, h = next_scale(
                t["scale"],
                t["growth_tracker"],
                t["hysteresis_tracker"],
                grad_overflow,
                fwd,
                growth_factor=self._growth_factor,
                backoff_factor=self._backoff_factor,
                growth_interval=self._growth_interval,
                hysteresis=self._hysteresis,
                min_scale=self._min_scale,
                max_scale=self._max_scale,
            )
            t["scale"].copy_(s)
            t["growth_tracker"].copy_(g)
            t["hysteresis_tracker"].copy_(h)
        if stepped:
            sk = skipped_b.long()
            t["skipped_total"].add_(sk)
            t["forward_overflows"].add_(fwd.long())
            t["consecutive_overflows"].mul_(sk).add_(sk)
            t["last_skipped"].copy_(sk)
            row = torch.stack(
                [
                    torch.full((), float(self._num_updates + 1), dtype=torch.float64, device=dev),
                    used_scale.double(),
                    (sk + fwd.long()).double(),  # 0 clean, 1 gradient overflow, 2 forward
                ]
            )
            t["history"][self._num_updates % self._history_size].copy_(row)
            self._num_updates += 1
        self._loss_nonfinite = None
        self._per_opt = defaultdict(_fresh_opt_state)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when scaling is disabled). **Syncs.**"""
        if not self._enabled:
            return 1.0
        return float(self._t["scale"].item()) if self._t is not None else float(self._init["scale"])

    def get_scale_tensor(self) -> torch.Tensor | None:
        """The scale as a 0-dim device tensor (None before the first ``scale()``). No host read."""
        return None if self._t is None else self._t["scale"]

    def is_enabled(self) -> bool:
        """Whether the loss is scaled (detection may still be on; see ``check_finite``)."""
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        _check_range("growth_factor", new_factor, _finite(new_factor) and new_factor > 1, "> 1")
        self._growth_factor = float(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        _check_range(
            "backoff_factor", new_factor, _finite(new_factor) and 0 < new_factor < 1, "in (0, 1)"
        )
        self._backoff_factor = float(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        _check_range(
            "growth_interval",
            new_interval,
            _is_int(new_interval) and new_interval >= 1,
            "an integer >= 1",
        )
        self._growth_interval = int(new_interval)

    def set_hysteresis(self, hysteresis: int) -> None:
        """Change the hysteresis (takes effect when the counter next refills)."""
        _check_range(
            "hysteresis", hysteresis, _is_int(hysteresis) and hysteresis >= 1, "an integer >= 1"
        )
        self._hysteresis = int(hysteresis)

    def set_bounds(self, min_scale: float, max_scale: float) -> None:
        """Change the scale bounds (applied at the next update)."""
        _check_range("min_scale", min_scale, _finite_pos(min_scale), "a finite number > 0")
        _check_range("max_scale", max_scale, _finite_pos(max_scale), "a finite number > 0")
        _check_range(
            "min_scale", min_scale, min_scale <= max_scale, f"<= max_scale ({max_scale!r})"
        )
        self._min_scale, self._max_scale = float(min_scale), float(max_scale)

    @property
    def min_scale(self) -> float:
        return self._min_scale

    @property
    def max_scale(self) -> float:
        return self._max_scale

    @property
    def hysteresis(self) -> int:
        return self._hysteresis

    @property
    def history_size(self) -> int:
        return self._history_size

    @property
    def last_step_skipped_host(self) -> bool | None:
        """Whether the last step was skipped, as ``step()`` read it (no new read); None when
        ``step()`` made no read (fused optimizer) -- then use ``last_step_skipped`` (syncs)."""
        return self._last_read

    def device_counters(self) -> dict[str, torch.Tensor]:
        """The device tensors behind the counters (scale, skipped_total, forward_overflows,
        consecutive_overflows, last_skipped). No host read; do not modify them."""
        t = self._require_init("device_counters")
        return {
            k: t[k]
            for k in (
                "scale",
                "skipped_total",
                "forward_overflows",
                "consecutive_overflows",
                "last_skipped",
            )
        }

    def recent_skips(self, window: int) -> torch.Tensor:
        """Number of skipped steps among the last ``window`` recorded ones (device tensor, no
        host read); at most ``history_size`` steps are remembered."""
        t = self._require_init("recent_skips")
        n = min(window, self._num_updates, self._history_size)
        if n == 0:
            return torch.zeros((), dtype=torch.float64, device=t["scale"].device)
        dev = t["history"].device
        idx = (
            torch.arange(self._num_updates - n, self._num_updates, device=dev) % self._history_size
        )
        return (t["history"][idx, 2] > 0).sum().double()

    def recent_history(self, n: int) -> torch.Tensor:
        """The last ``n`` records (at most ``history_size``) as a device tensor of rows
        ``(update number, scale used, kind)``, kind 0 clean, 1 gradient overflow, 2 forward
        overflow (non-finite loss). No host read."""
        t = self._require_init("recent_history")
        n = min(n, self._num_updates, self._history_size)
        idx = torch.arange(self._num_updates - n, self._num_updates, device=t["history"].device)
        return t["history"][idx % self._history_size]

    # ------------------------------------------------------------------ observed skips
    def _read(self, key: str) -> int:
        return int(self._t[key].item()) if self._t is not None else int(self._init[key])

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step (at ``update()``) was skipped. **Syncs.**"""
        return bool(self._read("last_skipped"))

    @property
    def skipped_steps(self) -> int:
        """Total skipped steps since the start (kept across checkpoints). **Syncs.**"""
        return self._read("skipped_total")

    @property
    def forward_overflows(self) -> int:
        """Steps skipped because the loss itself was non-finite. **Syncs.**"""
        return self._read("forward_overflows")

    @property
    def consecutive_overflows(self) -> int:
        """Skipped steps in a row up to the last one (0 after a clean step). **Syncs.**"""
        return self._read("consecutive_overflows")

    @property
    def num_steps(self) -> int:
        """Number of ``update()`` calls that recorded a step (host counter, no read)."""
        return self._num_updates

    def history(self) -> list[tuple[int, float, bool]]:
        """The last ``history_size`` records ``(step, scale used, skipped)``, oldest first. **Syncs.**"""
        return [(int(s), float(sc), bool(k)) for s, sc, k in self._history_tensor().tolist()]

    def _history_tensor(self) -> torch.Tensor:
        if self._t is None:
            return self._init["history"].clone()
        n = min(self._num_updates, self._history_size)
        idx = [(self._num_updates - n + k) % self._history_size for k in range(n)]
        return self._t["history"][idx].cpu() if idx else torch.zeros(0, 3, dtype=torch.float64)

    def stats(self) -> dict[str, Any]:
        """Scale and skip counters as Python values, read in one transfer. **Syncs.**"""
        if self._t is None:
            vals = [float(self._init["scale"])] + [
                float(self._init[k])
                for k in (
                    "skipped_total",
                    "forward_overflows",
                    "consecutive_overflows",
                    "last_skipped",
                )
            ]
        else:
            t = self._t
            vals = torch.stack(
                [
                    t["scale"].double(),
                    t["skipped_total"].double(),
                    t["forward_overflows"].double(),
                    t["consecutive_overflows"].double(),
                    t["last_skipped"].double(),
                ]
            ).tolist()
        return {
            "scale": vals[0] if self._enabled else 1.0,
            "skipped_total": int(vals[1]),
            "forward_overflows": int(vals[2]),
            "consecutive_overflows": int(vals[3]),
            "last_skipped": bool(vals[4]),
            "steps": self._num_updates,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus hysteresis, bounds, counters and history. **Syncs.**

        Only plain numbers and CPU tensors: loadable with ``torch.load(weights_only=True)``.
        """
        if self._t is None:
            vals = {k: v for k, v in self._init.items() if k != "history"}
        else:
            names = [
                "scale",
                "growth_tracker",
                "hysteresis_tracker",
                "skipped_total",
                "forward_overflows",
                "consecutive_overflows",
                "last_skipped",
            ]
            read = torch.stack([self._t[k].double() for k in names]).tolist()
            vals = dict(zip(names, read, strict=True))
        return {
            "scale": float(vals["scale"]),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(vals["growth_tracker"]),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": int(vals["hysteresis_tracker"]),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "enabled": self._enabled,
            "skipped_total": int(vals["skipped_total"]),
            "forward_overflows": int(vals["forward_overflows"]),
            "consecutive_overflows": int(vals["consecutive_overflows"]),
            "last_skipped": int(vals["last_skipped"]),
            "num_updates": self._num_updates,
            "history": self._history_tensor(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()`` (a GradScaler state dict is accepted too)."""
        if not state_dict:
            raise RuntimeError(
                "LossScaler.load_state_dict: the state dict is empty (saved from a disabled "
                "GradScaler?); nothing to restore."
            )
        missing = [
            k
            for k in (
                "scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "_growth_tracker",
            )
            if k not in state_dict
        ]
        if missing:
            raise KeyError(f"LossScaler.load_state_dict: missing keys {missing}")
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        self._min_scale = float(state_dict.get("min_scale", self._min_scale))
        self._max_scale = float(state_dict.get("max_scale", self._max_scale))
        self._num_updates = int(state_dict.get("num_updates", 0))
        hist = state_dict.get("history")
        init = {
            "scale": float(state_dict["scale"]) if self._enabled else 1.0,
            "growth_tracker": int(state_dict["_growth_tracker"]),
            "hysteresis_tracker": int(state_dict.get("_hysteresis_tracker", self._hysteresis)),
            "skipped_total": int(state_dict.get("skipped_total", 0)),
            "forward_overflows": int(state_dict.get("forward_overflows", 0)),
            "consecutive_overflows": int(state_dict.get("consecutive_overflows", 0)),
            "last_skipped": int(state_dict.get("last_skipped", 0)),
            "history": (
                torch.as_tensor(hist, dtype=torch.float64).reshape(-1, 3)
                if hist is not None
                else torch.zeros(0, 3, dtype=torch.float64)
            ),
        }
        device = self.device
        self._init = init
        self._t = None
        self._loss_nonfinite = None
        self._per_opt = defaultdict(_fresh_opt_state)
        if device is not None:
            self._lazy_init(device)


def _fresh_opt_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _finite_pos(x: Any) -> bool:
    return _finite(x) and x > 0


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
