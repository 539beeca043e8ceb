"""LossScaler: a ``torch.amp.GradScaler`` with hysteresis, bounds and observed skips.

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
* ``min_scale`` / ``max_scale`` clamp the scale (defaults 1 and Apex's ceiling 2**24;
  ``min_scale=0`` and ``max_scale=inf`` remove the bounds, as in GradScaler).
* Forward overflow is told apart from gradient overflow (``check_loss=True``): a non-finite loss
  skips the step and is counted, but the scale is not backed off (a smaller scale cannot cure
  it). ``check_loss=False`` decides from the gradients only, as GradScaler (a NaN loss gives NaN
  gradients: skipped and backed off).
* With scaling disabled (``enabled=False``, for bf16 / fp32) non-finite gradients are still
  detected and the step skipped (``check_finite=True``), so a bf16 run never applies a NaN
  update. ``check_finite=False`` makes a disabled scaler a pure pass-through, like GradScaler's.
* Skips are *observed* (what ``step`` did), not inferred from a change of scale, and kept on the
  device: total skipped, forward overflows, consecutive overflows, last-step flag and a bounded
  (update, scale used, kind) history -- kind 0 clean, 1 gradient overflow, 2 forward overflow --
  all in ``state_dict()``.

A GradScaler in every sense: ``isinstance(scaler, torch.amp.GradScaler)`` is true (and so is
``isinstance(scaler, torch.cuda.amp.GradScaler)``, the deprecated class older code checks) and the
GradScaler internals training code reaches into act on the live state (:mod:`.scaler_compat`).

Bit for bit: ``LossScaler.like_gradscaler(device, init_scale, growth_factor, backoff_factor,
growth_interval, enabled)`` takes GradScaler's arguments and sets ``hysteresis=1,
min_scale=0, max_scale=inf, check_loss=False, check_finite=False``; it then gives GradScaler's
scale trajectory, skipped steps and weights bit for bit. Any LossScaler with ``hysteresis=1``
does so while the scale stays within [min_scale, max_scale] (defaults 1 and 2**24), no loss is
non-finite (or ``check_loss=False``) and, when disabled, no gradient is (or
``check_finite=False``). One deliberate difference remains: GradScaler grows only when its
growth tracker *equals* ``growth_interval``, so after the interval is lowered below the tracker
it never grows again until an overflow; LossScaler grows at the next clean step.

Host reads: ``step`` reads one flag per optimizer per step (to decide whether to call
``optimizer.step()``); with an optimizer that handles scaling itself
(``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``) it reads nothing. ``scale``,
``unscale_``, ``update`` and reading ``_scale`` never read the device.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from .checks import FieldError, need
from .checks import is_finite as _finite
from .checks import is_int as _is_int
from .scale_rule import _new_scale_tensor, _number, next_scale
from .scaler_compat import CallOrderError, GradScalerPrivates

__all__ = ["CallOrderError", "LossScaler", "OptState", "ScalerConfig", "next_scale"]

# The device tensors besides the history, in the order state_dict() reads them.
_SCALARS = (
    "scale",
    "growth_tracker",
    "hysteresis_tracker",
    "skipped_total",
    "forward_overflows",
    "consecutive_overflows",
    "last_skipped",
)
_DTYPES = {"scale": torch.float32, "growth_tracker": torch.int32, "hysteresis_tracker": torch.int32}


def _check_range(name: str, value: float, ok: bool, allowed: str) -> None:
    need(ok, "LossScaler", name, value, allowed)


@dataclass(kw_only=True)
class ScalerConfig:
    """``scaler.*``: the arguments of :class:`LossScaler`, checked by LossScaler's own rules
    (one place for each rule)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    history_size: int = 1024

    def __post_init__(self) -> None:
        try:
            LossScaler(**dataclasses.asdict(self))  # no device state: nothing is allocated
        except FieldError as e:
            raise FieldError(type(self).__name__, e.field, e.value, e.allowed) from None


# torch.cuda.amp.GradScaler is torch.amp.GradScaler with a deprecated __init__ (never called here):
# deriving from it makes isinstance checks against either class true.
class LossScaler(GradScalerPrivates, torch.cuda.amp.GradScaler):
    """Dynamic loss scaler and ``torch.amp.GradScaler`` (see the module docstring).

    Args:
        init_scale: initial scale, > 0 (default 2**16).
        growth_factor: multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: multiplier on a gradient overflow, in (0, 1).
        growth_interval: consecutive clean steps before growing, >= 1.
        hysteresis: gradient overflows tolerated before backing off, >= 1 (refilled on growth).
        min_scale / max_scale: bounds of the scale, 0 <= min_scale <= max_scale <= inf
            (defaults 1 and 2**24; 0 and inf: no bounds).
        enabled: scale the loss. When False the scale is 1 and never changes.
        check_finite: detect non-finite gradients and skip those steps even when ``enabled`` is
            False (bf16 / fp32). Always on when enabled. False with ``enabled=False``: a pure
            pass-through, as a disabled GradScaler (empty ``state_dict()``).
        check_loss: check the loss in ``scale()``; a non-finite loss skips the step without
            backing off (forward overflow, counted). False: decide from the gradients only, as
            GradScaler.
        history_size: how many (step, scale, skipped) records to keep, >= 1.
        device: GradScaler's device type (``_device``), e.g. ``"cuda"``; only
            ``_lazy_init_scale_growth_tracker(scaler._device)`` callers use it. The state is
            created on the loss's device at the first ``scale()`` either way. Default: the
            state's device once it exists, else ``"cuda"`` when available, else ``"cpu"``.

    GradScaler's first positional argument is the device; here it is ``init_scale``. To swap
    ``GradScaler("cuda", ...)`` write ``LossScaler.like_gradscaler("cuda", ...)`` (GradScaler's
    behaviour bit for bit) or ``LossScaler(..., device="cuda")`` (ampctl's defaults).
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
        check_loss: bool = True,
        history_size: int = 1024,
        device: str | torch.device | None = None,
    ) -> None:
        # GradScaler.__init__ is deliberately not called: it would disable itself for
        # device="cuda" without CUDA and set plain attributes that are properties here.
        if isinstance(init_scale, str | torch.device):
            raise ValueError(
                f"LossScaler: init_scale={str(init_scale)!r} is not allowed: it looks like "
                f"GradScaler's device argument: write LossScaler(device={str(init_scale)!r}, ...) "
                f"or LossScaler.like_gradscaler({str(init_scale)!r}, ...)"
            )
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
        self._device_type: str | None = None if device is None else torch.device(device).type
        self._enabled = bool(enabled)
        self._check_finite = bool(check_finite) or self._enabled
        self._check_loss = bool(check_loss)
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
        self._last_skip_read: bool | None = None  # the last recorded step's _skip_read
        self._t: dict[str, torch.Tensor] | None = None  # device state
        self._loss_nonfinite: torch.Tensor | None = None  # this step, OR over scale() calls
        self._loss_sum: torch.Tensor | None = None  # this step: the losses scale() was given
        self._last_loss: torch.Tensor | None = None  # the last recorded step's _loss_sum
        # GradScaler's per-optimizer record: {"stage": OptState, "found_inf_per_device": {...}},
        # plus "flags" once step() has decided.
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_opt_state)
        # What step() read on the host in this iteration: True/False (skipped or not), or None
        # when no read was made (fused optimizer); update() hands it to last_skip_read.
        self._skip_read: bool | None = None
        # Distributed hook: given this step's flags (float32 [grad overflow, forward overflow] on
        # the device), return the flags all ranks agree on (an all-reduce MAX). It runs inside
        # step(), before the one host read, so every rank skips the same steps and keeps the
        # same scale. None = single process. Not pickled (it holds process-local handles).
        self.reduce_flags: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def like_gradscaler(
        cls,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        history_size: int = 1024,
    ) -> LossScaler:
        """A LossScaler that behaves as ``torch.amp.GradScaler(device, ...)`` bit for bit.

        Same arguments as GradScaler; sets ``hysteresis=1, min_scale=0, max_scale=inf,
        check_loss=False, check_finite=False``. The skip counters and history still work. Like
        GradScaler, ``device="cuda"`` without CUDA warns and disables scaling.
        """
        if enabled and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "LossScaler.like_gradscaler: device='cuda' but CUDA is not available; "
                "scaling is disabled (as torch.amp.GradScaler does).",
                stacklevel=2,
            )
            enabled = False
        return cls(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis=1,
            min_scale=0.0,
            max_scale=math.inf,
            enabled=enabled,
            check_finite=False,
            check_loss=False,
            history_size=history_size,
            device=device,
        )

    # ------------------------------------------------------------------ device state
    def _lazy_init(self, device: torch.device) -> dict[str, torch.Tensor]:
        if self._t is None:
            i = self._init
            t = {
                k: torch.full((), i[k], dtype=_DTYPES.get(k, torch.int64), device=device)
                for k in _SCALARS
            }
            t["history"] = torch.zeros(self._history_size, 3, dtype=torch.float64, device=device)
            old = i["history"][-self._history_size :]
            n = old.shape[0]
            # ring buffer: record k lives at row k % history_size
            for k in range(n):
                t["history"][(self._num_updates - n + k) % self._history_size] = old[k]
            self._t = t
        return self._t

    def init_state(self, device: torch.device | str) -> None:
        """Create the device state now (otherwise the first ``scale()`` does, on the loss's
        device). No host read."""
        self._lazy_init(torch.device(device))

    @property
    def device(self) -> torch.device | None:
        """Device of the scaler's state (None before the first ``scale()``)."""
        return None if self._t is None else self._t["scale"].device

    def _values(self, history: bool = True) -> dict[str, Any]:
        """The state as host values, in the form of ``_init`` (without ``history`` unless
        asked). **Syncs**: one transfer for the scalars, one for the history."""
        if self._t is None:
            vals = dict(self._init)
        else:
            read = torch.stack([self._t[k].double() for k in _SCALARS]).tolist()
            vals = {k: int(v) for k, v in zip(_SCALARS, read, strict=True)}
            vals["scale"] = float(read[0])
        if history:
            vals["history"] = self._history_tensor()
        else:
            vals.pop("history", None)
        return vals

    def _assign(self, key: str, value: Any) -> None:
        """``scaler._scale = v`` / ``scaler._growth_tracker = v``: write into the live tensor
        (moving the whole state if ``v`` is on another device), as GradScaler's attribute
        assignment would replace its tensor. A number assigned before the state exists changes
        the start value. No device read."""
        if value is None:
            raise ValueError(
                f"LossScaler: {key!r} cannot be set to None; to start over, load a state_dict"
            )
        v = torch.as_tensor(value).detach()
        if v.numel() != 1:
            raise ValueError(f"LossScaler: {key!r} takes one value, got shape {tuple(v.shape)}")
        if self._t is None:
            if not isinstance(value, torch.Tensor):
                self._init[key] = v.item()
                return
            self._lazy_init(v.device)
        assert self._t is not None
        if v.device != self._t[key].device:
            self._t = {k: t.to(v.device) for k, t in self._t.items()}
        with torch.no_grad():
            self._t[key].copy_(v.reshape(()))

    # ------------------------------------------------------------------ GradScaler API
    def scale(self, outputs):
        """Multiply a loss (or a tensor / nested iterable of tensors) by the scale.

        With ``check_loss`` also records, on the device, whether the loss is finite
        (forward-overflow detection). Disabled: returns ``outputs`` itself. Does not read the
        device on the host.
        """
        if not self._check_finite:
            return outputs
        if isinstance(outputs, torch.Tensor):
            t = self._lazy_init(outputs.device)
            loss = outputs.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            if self._check_loss:
                nonfinite = ~torch.isfinite(outputs.detach()).all()
                self._loss_nonfinite = (
                    nonfinite if self._loss_nonfinite is None else self._loss_nonfinite | nonfinite
                )
            if not self._enabled:
                return outputs
            return outputs * t["scale"].to(device=outputs.device, non_blocking=True)
        if not self._enabled:  # record the losses, hand back what was given
            if isinstance(outputs, list | tuple):
                for o in outputs:
                    self.scale(o)
                return outputs
            return map(self.scale, outputs) if isinstance(outputs, Iterable) else outputs
        if isinstance(outputs, list | tuple):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError(
            f"LossScaler.scale: outputs must be a Tensor or an iterable of Tensors, "
            f"got {type(outputs).__name__}"
        )

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
        st = self._per_optimizer_states[id(optimizer)]
        if st["stage"] is OptState.UNSCALED:
            raise CallOrderError(
                "LossScaler.unscale_() was already called for this optimizer in this step: call it "
                "once per step, after all backward passes, and call update() before the next step."
            )
        if st["stage"] is OptState.STEPPED:
            raise CallOrderError(
                "LossScaler.unscale_() was called after step(): call unscale_ before step(), "
                "or call update() to start the next step."
            )
        scale = t["scale"]
        # the reciprocal in float64, as GradScaler (MPS has no float64)
        inv = (
            scale.reciprocal()
            if scale.device.type == "mps"
            else scale.double().reciprocal().float()
        )
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        st["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv, found, allow_fp16=not self._enabled
        )
        st["stage"] = OptState.UNSCALED

    def _flags(self, found_per_device: dict[Any, torch.Tensor]) -> torch.Tensor:
        """``[gradient overflow, forward overflow]`` for one optimizer as a float32 2-vector on
        the scale's device, agreed across ranks by ``reduce_flags`` when set. No host read."""
        t = self._t
        assert t is not None
        dev = t["scale"].device
        grad = torch.zeros((), dtype=torch.float32, device=dev)
        for f in found_per_device.values():
            grad = grad + f.to(dev, non_blocking=True).reshape(())
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
        scaling natively (``_step_supports_amp_scaling``): one whose ``step`` takes
        ``grad_scaler`` gets this scaler (GradScaler's deprecated protocol, with its
        FutureWarning), any other (e.g. fused AdamW) gets ``grad_scale`` / ``found_inf`` tensors
        and skips on the device: no host read.
        """
        if not self._check_finite:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            if not self._enabled:  # as a disabled GradScaler: a closure passes through unchecked
                return self._unchecked_step(optimizer, *args, **kwargs)
            raise RuntimeError(
                "LossScaler.step: closures are not supported; compute the loss before step()."
            )
        self._require_init("step")
        st = self._per_optimizer_states[id(optimizer)]
        if st["stage"] is OptState.STEPPED:
            raise CallOrderError(
                "LossScaler.step() was already called for this optimizer in this step: call "
                "update() after step(), once per iteration."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._amp_aware_step(optimizer, st, args, kwargs)
        if st["stage"] is OptState.READY:
            self.unscale_(optimizer)
        st["flags"] = self._flags(st["found_inf_per_device"])
        retval = self._maybe_opt_step(optimizer, st, *args, **kwargs)
        st["stage"] = OptState.STEPPED
        return retval

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ):
        """Call ``optimizer.step()`` unless this step's flags say overflow. **Syncs once.**"""
        flags = optimizer_state.get("flags")
        if flags is None:
            flags = optimizer_state["flags"] = self._flags(optimizer_state["found_inf_per_device"])
        skip = bool(flags.amax().item())  # the one host read of the step
        self._skip_read = skip if self._skip_read is None else (self._skip_read or skip)
        return None if skip else optimizer.step(*args, **kwargs)

    def _unchecked_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """A disabled scaler's step with a closure: run it and record a clean step."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        t = self._lazy_init(params[0].device if params else torch.device("cpu"))
        st = self._per_optimizer_states[id(optimizer)]
        st["flags"] = torch.zeros(2, dtype=torch.float32, device=t["scale"].device)
        st["stage"] = OptState.STEPPED
        self._skip_read = None
        return optimizer.step(*args, **kwargs)

    def _amp_aware_step(
        self,
        optimizer: torch.optim.Optimizer,
        st: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ):
        """``step`` for an optimizer with ``_step_supports_amp_scaling``. No host read."""
        assert self._t is not None
        self._skip_read = None  # no read: the step's outcome is not known on the host
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "LossScaler passes itself as grad_scaler= to this optimizer, as GradScaler does; "
                "GradScaler is going to stop passing itself and set `grad_scale` and `found_inf` "
                "tensors on the optimizer instead.",
                FutureWarning,
                stacklevel=3,
            )
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            # what the optimizer recorded (via unscale_ / _check_inf_per_device) decides update()
            st["flags"] = self._flags(st["found_inf_per_device"])
            st["stage"] = OptState.STEPPED
            return retval
        user_scale = getattr(optimizer, "grad_scale", None)
        if st["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            if self._enabled:  # the kernel unscales: hand it the scale (times the user's own)
                scale = self._t["scale"]
                user_scale = scale if user_scale is None else scale * user_scale
        st["flags"] = self._flags(st["found_inf_per_device"])
        optimizer.grad_scale = user_scale  # type: ignore[attr-defined]
        optimizer.found_inf = st["flags"].amax()  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        st["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Record the step (skipped or not) and update the scale, all on the device.

        The overflow flags of every optimizer stepped -- or only unscaled / checked -- this
        iteration count. ``new_scale`` (a number or a one-element tensor, copied) sets the scale
        by hand, clamped to the bounds; the growth tracker is left as it is, as in GradScaler.
        Does not read the device.
        """
        if not self._check_finite:
            return
        t = self._require_init("update")
        self._last_skip_read, self._skip_read = self._skip_read, None
        recorded = [
            s["flags"] if "flags" in s else self._flags(s["found_inf_per_device"])
            for s in self._per_optimizer_states.values()
            if "flags" in s or s["found_inf_per_device"]
        ]
        if not recorded and new_scale is None:
            raise CallOrderError(
                "LossScaler.update() was called before step(): call scaler.step(optimizer) for "
                "every optimizer, then update() once per iteration."
            )
        dev = t["scale"].device
        flags = torch.stack(recorded).amax(0) if recorded else torch.zeros(2, device=dev)
        fwd = flags[1] > 0
        grad_overflow = (flags[0] > 0) & ~fwd
        skipped_b = (flags[0] > 0) | fwd
        used_scale = t["scale"].clone()
        if new_scale is not None:
            value = _new_scale_tensor(new_scale)
            if self._enabled:
                t["scale"].copy_(value.to(dev).clamp(self._min_scale, self._max_scale))
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
        if recorded:
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
            self._last_loss = self._loss_sum
        self._loss_nonfinite = None
        self._loss_sum = None
        self._per_optimizer_states = defaultdict(_fresh_opt_state)

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
        _check_range(
            "growth_factor", new_factor, _finite(new_factor) and new_factor > 1, "a number > 1"
        )
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
        """Change the scale bounds (applied at the next update); 0 and inf mean no bound."""
        _check_range(
            "min_scale", min_scale, _finite(min_scale) and min_scale >= 0, "a finite number >= 0"
        )
        _check_range(
            "max_scale",
            max_scale,
            _number(max_scale) and not math.isnan(max_scale) and max_scale > 0,
            "a number > 0 (inf for no ceiling)",
        )
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
    def last_step_loss(self) -> torch.Tensor | None:
        """The sum of the losses ``scale()`` was given in the last recorded step (one per
        micro-batch: with the usual ``loss / accumulation_steps`` that is the step's mean loss),
        as a device tensor; None before the first step or when ``scale()`` got no tensor. No
        host read."""
        return self._last_loss

    @property
    def last_skip_read(self) -> bool | None:
        """Whether the last recorded step was skipped, as ``step()`` read it on the host (no new
        read); None when ``step()`` made no read (fused optimizer) -- then use
        ``last_step_skipped`` (syncs)."""
        return self._last_skip_read

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
        if self._t is None:  # loaded from a longer ring: the newest history_size, as _lazy_init
            return self._init["history"][-self._history_size :].clone()
        n = min(self._num_updates, self._history_size)
        idx = [(self._num_updates - n + k) % self._history_size for k in range(n)]
        return self._t["history"][idx].cpu() if idx else torch.zeros(0, 3, dtype=torch.float64)

    def stats(self) -> dict[str, Any]:
        """Scale and skip counters as Python values, read in one transfer. **Syncs.**"""
        v = self._values(history=False)
        return {
            "scale": float(v["scale"]) if self._enabled else 1.0,
            "skipped_total": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "last_skipped": bool(v["last_skipped"]),
            "steps": self._num_updates,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys plus hysteresis, bounds, counters and history. **Syncs.**

        Only plain numbers and CPU tensors: loadable with ``torch.load(weights_only=True)``, and
        by a GradScaler (which reads its five keys). A pure pass-through (disabled,
        ``check_finite=False``) returns ``{}``, as a disabled GradScaler.
        """
        if not self._check_finite:
            return {}
        v = self._values()
        return {
            "scale": float(v["scale"]),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": int(v["growth_tracker"]),
            "hysteresis": self._hysteresis,
            "_hysteresis_tracker": int(v["hysteresis_tracker"]),
            "min_scale": self._min_scale,
            "max_scale": self._max_scale,
            "enabled": self._enabled,
            "skipped_total": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "last_skipped": int(v["last_skipped"]),
            "num_updates": self._num_updates,
            "history": v["history"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict()``; a GradScaler state dict is accepted too (counters and
        history then start from zero). Created device tensors are overwritten in place, so a
        held ``scaler._scale`` stays live. A disabled scaler ignores an empty dict (what a
        disabled GradScaler saves); a pure pass-through ignores any."""
        if not self._check_finite:
            return
        if not state_dict:
            if not self._enabled:
                return
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
        self._init = {
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
        old, self._t = self._t, None
        self._loss_nonfinite = self._loss_sum = self._last_loss = None
        self._per_optimizer_states = defaultdict(_fresh_opt_state)
        if old is not None:
            new = self._lazy_init(old["scale"].device)
            for k in _SCALARS:  # keep the live tensors, as GradScaler's fill_
                old[k].copy_(new[k])
                new[k] = old[k]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle / deepcopy between iterations only (as GradScaler): the device state goes as
        host values and is re-created lazily at the next ``scale()``; ``reduce_flags`` is not
        kept. **Syncs.**"""
        if self._enabled and len(self._per_optimizer_states) != 0:
            raise CallOrderError(
                "LossScaler can be pickled or copied only at the start of an iteration or after "
                "update(), not between scale() and update()."
            )
        state = self.__dict__.copy()
        state["_init"] = self._values()
        state["_t"] = None
        state["_loss_nonfinite"] = None
        state["_loss_sum"] = state["_last_loss"] = None
        state["reduce_flags"] = None
        state["_per_optimizer_states"] = defaultdict(_fresh_opt_state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _fresh_opt_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _finite_pos(x: Any) -> bool:
    return _finite(x) and x > 0
