"""LossScaler: a ``torch.amp.GradScaler`` with hysteresis, bounds, observed skips and a record of
every step, at GradScaler's cost.

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
  With ``hysteresis=1`` every overflow backs off, as in GradScaler.
* ``min_scale`` / ``max_scale`` clamp the scale (defaults 1 and Apex's ceiling 2**24;
  ``min_scale=0`` and ``max_scale=inf`` remove the bounds, as in GradScaler).
* A record of every step on the device (:mod:`.records`): the scale used, whether it was
  skipped, the loss ``scale()`` saw (summed over the micro-batches) and the gradient norm the
  loop reported. A skipped step whose loss was not finite is a *forward* overflow
  (``check_loss=True``, the default): counted, but the scale is not backed off at any hysteresis
  (a smaller scale cannot cure it; ampctl's guard locates the module); ``check_loss=False`` calls
  every skip a gradient overflow and backs off, as GradScaler would. At hysteresis 1 under
  ``torch.distributed`` (``reduce_flags`` set) the agreed skip backs off on every rank, as
  GradScaler: one rank's loss says nothing of the others', and the ranks' scales must agree. Counters -- skipped, forward overflows, spikes, overflows in a
  row -- are reductions over the record, so a clean step pays no op for them.
* With scaling disabled (``enabled=False``, for bf16 / fp32) non-finite gradients are still
  detected and the step skipped (``check_finite=True``), so a bf16 run never applies a NaN
  update. ``check_finite=False`` makes a disabled scaler a pure pass-through, like GradScaler's.
* A spike veto (:meth:`set_spike_thresholds`, used by the guard's spike rule): a step whose loss
  (or reported gradient norm) is above the threshold in force is skipped on the device, with
  the same flag the overflow check sets: no host read, fused optimizers included.
* Skips are *observed* (what ``step`` did), not inferred from a change of scale.

A GradScaler in every sense: ``isinstance(scaler, torch.amp.GradScaler)`` is true (and so is
``isinstance(scaler, torch.cuda.amp.GradScaler)``, the deprecated class older code checks) and the
GradScaler internals training code reaches into act on the live state (:mod:`.scaler_compat`).

Bit for bit: with ``hysteresis=1`` the scale is updated by GradScaler's own fused kernel
(``torch._amp_update_scale_``) on GradScaler's found-inf flag, so ``LossScaler.like_gradscaler(
device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)`` (``hysteresis=1,
min_scale=0, max_scale=inf, check_loss=False, check_finite=False``) gives GradScaler's scale
trajectory, skipped steps and weights bit for bit, and any LossScaler with ``hysteresis=1`` does so
while the scale stays within [min_scale, max_scale], no step's loss is NaN or +inf (a forward
overflow keeps the scale; or ``check_loss=False``) and, when disabled, no gradient is non-finite
(or ``check_finite=False``). At hysteresis 1 a loss of -inf (not an overflow of a loss that is
bounded below) is told apart from a gradient overflow only in the record, not by the scale
rule: the rule's test is one comparison, ``loss < inf``. One deliberate difference remains: GradScaler grows only when its
growth tracker *equals* ``growth_interval``, so after the interval is lowered below the tracker
it never grows again until an overflow; LossScaler clamps the tracker when the interval is
lowered and grows at the next clean step.

Cost per step, counted in device ops (kernel launches on a GPU) by ``tests/protect/test_cost.py``:
GradScaler's, plus one copy for the record row, one clamp for the bounds (none without bounds)
and, with ``check_loss``, a comparison and a ``where`` that keep the scale on a forward overflow
(GradScaler's + 2 for the default scaler, one op fewer than GradScaler for
``like_gradscaler``); the skip flag ``step`` reads is GradScaler's found-inf flag as it is. ``hysteresis > 1``
runs the rule of :func:`~.scale_rule.next_scale` instead (about 25 ops). Host reads: ``step``
reads the flag once per step (to decide whether to call ``optimizer.step()``); with an optimizer
that handles scaling itself (``_step_supports_amp_scaling``, e.g. ``AdamW(fused=True)``) it reads
nothing. ``scale``, ``unscale_``, ``update`` and reading ``_scale`` never read the device.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from . import records as rec
from .checks import FieldError, need
from .checks import is_finite as _finite
from .checks import is_int as _is_int
from .scale_rule import _new_scale_tensor, _number, next_scale
from .scaler_compat import CallOrderError, GradScalerPrivates
from .scaler_record import _BASE, StepRecord

__all__ = ["CallOrderError", "LossScaler", "OptState", "ScalerConfig", "next_scale"]

# The packed per-step vector: its first four entries are also the first four columns of a record
# row (one copy writes them), ONE is the unit "scale" of a disabled scaler, NAN the missing
# gradient norm of a row.
SCALE, FOUND, LOSS_THR, GNORM_THR, ONE, NAN = range(6)


def _check_range(name: str, value: float, ok: bool, allowed: str) -> None:
    need(ok, "LossScaler", name, value, allowed)


@dataclass(kw_only=True)
class ScalerConfig:
    """``scaler.*``: the arguments of :class:`LossScaler`, checked by LossScaler's own rules
    (one place for each rule)."""

    init_scale: float = 2.0**16  # the starting loss scale
    growth_factor: float = 2.0  # the scale grows by this after growth_interval clean steps
    backoff_factor: float = 0.5  # ... and is multiplied by this on a (counted) overflow
    growth_interval: int = 2000
    hysteresis: int = 1  # overflows tolerated before backing off; refilled when the scale grows
    min_scale: float = 1.0  # the floor (guard.floor_policy acts there)
    max_scale: float = 2.0**24  # the ceiling
    history_size: int = 1024  # step records kept on the device

    def __post_init__(self) -> None:
        try:
            LossScaler(**dataclasses.asdict(self))  # no device state: nothing is allocated
        except FieldError as e:
            raise FieldError(type(self).__name__, e.field, e.value, e.allowed) from None


class LossScaler(StepRecord, GradScalerPrivates, torch.cuda.amp.GradScaler):
    """Dynamic loss scaler and ``torch.amp.GradScaler`` (see the module docstring).

    Args:
        init_scale: initial scale, > 0 (default 2**16).
        growth_factor: multiplier after ``growth_interval`` clean steps, > 1.
        backoff_factor: multiplier on an overflow, in (0, 1).
        growth_interval: consecutive clean steps before growing, >= 1.
        hysteresis: overflows tolerated before backing off, >= 1 (refilled on growth).
        min_scale / max_scale: bounds of the scale, 0 <= min_scale <= max_scale <= inf
            (defaults 1 and 2**24; 0 and inf: no bounds).
        enabled: scale the loss. When False the scale is 1 and never changes.
        check_finite: detect non-finite gradients and skip those steps even when ``enabled`` is
            False (bf16 / fp32). Always on when enabled. False with ``enabled=False``: a pure
            pass-through, as a disabled GradScaler (empty ``state_dict()``).
        check_loss: a skipped step whose loss was not finite is recorded as a forward overflow
            (kind 2). False: every skip is a gradient overflow, as GradScaler sees it.
        history_size: how many step records to keep on the device, >= 1 (the counters cover
            every step: older records are folded into them).
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
        self._growth_interval = 1
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
        self._init_scale_given = float(init_scale)  # the configured one (config())
        # Values the device tensors start from (lazily created on the first scale(), on the
        # loss's device, as GradScaler does); load_state_dict before that lands here.
        self._init: dict[str, Any] = {
            "scale": float(min(max(init_scale, min_scale), max_scale)) if self._enabled else 1.0,
            "growth_tracker": 0,
            "hysteresis_tracker": self._hysteresis,
            **dict.fromkeys(_BASE, 0),
            "rows": torch.zeros(0, len(rec.COLUMNS)),  # the newest records, oldest first
        }
        self._spike = (math.inf, math.inf)  # the thresholds in force (host copy)
        self._num_updates = 0
        self._folded = 0  # records before this update number are in the base counters
        self._kept = 0  # records in the ring (fewer than history_size after a short load)
        self._found_taken = False  # an optimizer of this step has the packed found-inf flag
        self._last_skip_read: bool | None = None  # the last recorded step's _skip_read
        self._t: dict[str, torch.Tensor] | None = None  # device state
        self._loss_sum: torch.Tensor | None = None  # this step: the losses scale() was given
        self._gnorm: torch.Tensor | None = None  # this step: the gradient norm reported
        self._last_loss: torch.Tensor | None = None  # the last recorded step's _loss_sum
        # GradScaler's per-optimizer record: {"stage": OptState, "found_inf_per_device": {...}}.
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_opt_state)
        # What step() read on the host in this iteration: True/False (skipped or not), or None
        # when no read was made (fused optimizer); update() hands it to last_skip_read.
        self._skip_read: bool | None = None
        # Distributed hook: given this step's found-inf flag (a float32 0-dim device tensor),
        # return the flag all ranks agree on (an all-reduce MAX). It runs inside step(), before
        # the one host read, so every rank skips the same steps and keeps the same scale. None =
        # single process. Not pickled (it holds process-local handles).
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
            vec = torch.tensor(
                [i["scale"], 0.0, self._spike[0], self._spike[1], 1.0, math.nan],
                dtype=torch.float32,
                device=device,
            )
            history = torch.full(
                (self._history_size, len(rec.COLUMNS)), math.nan, dtype=torch.float32, device=device
            )
            rows = i["rows"][-self._history_size :]
            n = rows.shape[0]
            if n:  # ring buffer: record k lives at row k % history_size
                idx = torch.arange(self._num_updates - n, self._num_updates) % self._history_size
                history[idx.to(device)] = rows.to(device, torch.float32)
            self._t = self._views(
                {
                    "vec": vec,
                    "growth_tracker": torch.full(
                        (), i["growth_tracker"], dtype=torch.int32, device=device
                    ),
                    "hysteresis_tracker": torch.full(
                        (), i["hysteresis_tracker"], dtype=torch.int32, device=device
                    ),
                    "history": history,
                    "base": torch.tensor(
                        i.get("base") or [i[k] for k in _BASE], dtype=torch.float64, device=device
                    ),
                }
            )
            self._folded = self._num_updates - n
            self._kept = n
        return self._t

    @staticmethod
    def _views(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The named views into the packed vector (no copy: writing one writes the vector)."""
        v = t["vec"]
        t.update(scale=v[SCALE], found=v[FOUND], one=v[ONE], nan=v[NAN : NAN + 1])
        return t

    def init_state(self, device: torch.device | str) -> None:
        """Create the device state now (otherwise the first ``scale()`` does, on the loss's
        device). No host read."""
        self._lazy_init(torch.device(device))

    @property
    def device(self) -> torch.device | None:
        """Device of the scaler's state (None before the first ``scale()``)."""
        return None if self._t is None else self._t["vec"].device

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
            moved = {k: self._t[k].to(v.device) for k in ("vec", "growth_tracker",
                     "hysteresis_tracker", "history", "base")}  # fmt: skip
            self._t = self._views(moved)
        with torch.no_grad():
            self._t[key].copy_(v.reshape(()))

    # ------------------------------------------------------------------ GradScaler API
    def scale(self, outputs):
        """Multiply a loss (or a tensor / nested iterable of tensors) by the scale.

        Records the loss for the step's record (the sum over the micro-batches' ``scale()``
        calls; no op for the first). Disabled: returns ``outputs`` itself. Does not read the
        device on the host.
        """
        if not self._check_finite:
            return outputs
        if isinstance(outputs, torch.Tensor):
            t = self._lazy_init(outputs.device)
            loss = outputs.detach()
            if loss.numel() != 1:
                loss = loss.float().sum()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
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

    def _fresh_found(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """This step's found-inf flag for the next optimizer checked: the first gets the packed
        flag, reset by the spike veto of the step's loss (``loss > threshold``, which writes 0 or
        1: the reset and the veto in one op); another optimizer of the same step gets a flag of
        its own, combined in ``update()``. No host read."""
        if self._found_taken:
            return torch.zeros((), dtype=torch.float32, device=t["vec"].device)
        self._found_taken = True
        if self._loss_sum is not None and self._spike[0] < math.inf:
            torch.gt(self._loss_sum, t["vec"][LOSS_THR], out=t["found"])
        else:
            t["found"].zero_()
        return t["found"]

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
        if not self._enabled:
            inv = t["one"]  # nothing to divide: the check alone
        else:  # the reciprocal in float64, as GradScaler (MPS has no float64)
            inv = (
                scale.reciprocal()
                if scale.device.type == "mps"
                else scale.double().reciprocal().float()
            )
        st["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inv, self._fresh_found(t), allow_fp16=not self._enabled
        )
        st["stage"] = OptState.UNSCALED

    def report_grad_norm(self, norm: torch.Tensor) -> None:
        """The loop's gradient norm for this step (``clip_grad_norm_``'s result: after
        ``unscale_``, before ``step``): kept in the step's record, and with a gradient-norm
        threshold in force (:meth:`set_spike_thresholds`) a norm above it vetoes the step, on
        the device (two ops). No host read."""
        if not self._check_finite or self._t is None:
            return
        full = getattr(norm, "full_tensor", None)  # FSDP2: a replicated DTensor
        norm = full() if callable(full) else norm
        self._gnorm = norm.detach().float().reshape(())
        if self._spike[1] < math.inf:
            t = self._t
            torch.maximum(t["found"], torch.gt(self._gnorm, t["vec"][GNORM_THR]), out=t["found"])

    def set_spike_thresholds(self, loss: float = math.inf, grad_norm: float = math.inf) -> None:
        """Veto (skip, on the device) a step whose loss is above ``loss`` or whose reported
        gradient norm is above ``grad_norm``; ``inf`` turns a rule off. The guard's spike rule
        sets them at each log read from the recent record. Thresholds are recorded with every
        step, so a vetoed step reads as a spike. No host read."""
        for name, v in (("loss", loss), ("grad_norm", grad_norm)):
            if not _number(v) or math.isnan(v):
                raise ValueError(f"LossScaler.set_spike_thresholds: {name}={v!r} is not a number")
        new = (float(loss), float(grad_norm))
        if new == self._spike:
            return
        self._spike = new
        if self._t is not None:
            vec = self._t["vec"]
            vec[LOSS_THR].fill_(new[0])
            vec[GNORM_THR].fill_(new[1])

    @property
    def spike_thresholds(self) -> tuple[float, float]:
        """``(loss, grad_norm)`` thresholds in force (``inf``: off)."""
        return self._spike

    def _agree(self, found_per_device: dict[Any, torch.Tensor]) -> None:
        """Across ranks (``reduce_flags`` set): every flag becomes the one all ranks agree on,
        in place, before it is read or handed to the optimizer. No host read (a collective)."""
        if self.reduce_flags is None:
            return
        for v in found_per_device.values():
            agreed = self.reduce_flags(v)
            if agreed is not v:
                v.copy_(agreed.reshape(v.shape))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Unscale (if not done yet) and run ``optimizer.step()`` unless the step overflowed.

        A skipped step leaves weights and optimizer state untouched; gradients stay unscaled.
        **Syncs once** (reads the found-inf flag, as GradScaler) -- except with an optimizer that
        supports AMP scaling natively (``_step_supports_amp_scaling``): one whose ``step`` takes
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
        self._agree(st["found_inf_per_device"])
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
        """Call ``optimizer.step()`` unless a found-inf flag of the step is set. **Syncs once**
        per device (one on a single device), as GradScaler."""
        skip = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self._skip_read = skip if self._skip_read is None else (self._skip_read or skip)
        return None if skip else optimizer.step(*args, **kwargs)

    def _unchecked_step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """A disabled scaler's step with a closure: run it and record a clean step."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        t = self._lazy_init(params[0].device if params else torch.device("cpu"))
        st = self._per_optimizer_states[id(optimizer)]
        found = self._fresh_found(t)
        found.zero_()  # unchecked: clean whatever the loss was
        st["found_inf_per_device"] = {found.device: found}
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
            self._agree(st["found_inf_per_device"])
            st["stage"] = OptState.STEPPED
            return retval
        user_scale = getattr(optimizer, "grad_scale", None)
        if st["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            if self._enabled:  # the kernel unscales: hand it the scale (times the user's own)
                scale = self._t["scale"]
                user_scale = scale if user_scale is None else scale * user_scale
        found = st["found_inf_per_device"]
        self._agree(found)
        flags = list(found.values())
        optimizer.grad_scale = user_scale  # type: ignore[attr-defined]
        optimizer.found_inf = (  # type: ignore[attr-defined]
            flags[0] if len(flags) == 1 else sum(f.to(flags[0].device) for f in flags)
        )
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        st["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Record the step (skipped or not) and update the scale, all on the device.

        The found-inf flags of every optimizer stepped -- or only unscaled / checked -- this
        iteration count. With ``hysteresis=1`` the scale follows GradScaler's own kernel (one
        op), then the bounds (one clamp); ``new_scale`` (a number or a one-element tensor,
        copied) sets the scale by hand, clamped to the bounds, leaving the growth tracker as it
        is (as in GradScaler). Does not read the device.
        """
        if not self._check_finite:
            return
        t = self._require_init("update")
        self._last_skip_read, self._skip_read = self._skip_read, None
        flags = [
            v
            for s in self._per_optimizer_states.values()
            for v in s["found_inf_per_device"].values()
        ]
        if not flags and new_scale is None:
            raise CallOrderError(
                "LossScaler.update() was called before step(): call scaler.step(optimizer) for "
                "every optimizer, then update() once per iteration."
            )
        found = t["found"]
        if flags:
            for v in flags:  # other optimizers and devices: one flag for the step
                if v is not found:
                    torch.maximum(found, v.to(found.device), out=found)
            self._record(t)
        if new_scale is not None:
            value = _new_scale_tensor(new_scale)
            if self._enabled:
                t["scale"].copy_(value.to(found.device).clamp(self._min_scale, self._max_scale))
        elif self._enabled and flags:
            self._update_scale(t)
        self._reset_step()

    def _reset_step(self) -> None:
        """Forget the step under way (its losses, norm, flags, per-optimizer stages)."""
        self._loss_sum = self._gnorm = None
        self._found_taken = False
        self._per_optimizer_states = defaultdict(_fresh_opt_state)

    def _record(self, t: dict[str, torch.Tensor]) -> None:
        """Write the step's record row (one copy: the packed vector's first four entries, the
        loss, the gradient norm), folding the oldest records into the counters first when the
        ring is full (every ``history_size`` steps). No host read."""
        if self._num_updates - self._folded >= self._history_size:
            self._fold(t)
        loss = self._loss_sum.reshape(1) if self._loss_sum is not None else t["nan"]
        gnorm = self._gnorm.reshape(1) if self._gnorm is not None else t["nan"]
        row = t["history"][self._num_updates % self._history_size]
        torch.cat([t["vec"][:4], loss, gnorm], out=row)
        self._num_updates += 1
        self._kept = min(self._kept + 1, self._history_size)
        self._last_loss = self._loss_sum

    def _fold(self, t: dict[str, torch.Tensor]) -> None:
        """Add every unfolded record to the base counters (the ring is about to wrap)."""
        c = rec.counts(self._rows(self._num_updates - self._folded), check_loss=self._check_loss)
        base = t["base"]
        run = c[3] + c[4] * base[3]  # a run of skips that began before these records goes on
        base[:3] += c[:3]
        base[3] = run
        self._folded = self._num_updates

    def _update_scale(self, t: dict[str, torch.Tensor]) -> None:
        """The scale rule. ``hysteresis=1``: GradScaler's fused kernel, then (``check_loss``) the
        scale the step used is put back when its loss was NaN or +inf (a forward overflow: two
        ops, a comparison and a ``where``), then the bounds (one clamp; none without bounds): every other skipped
        step backs off, as in GradScaler; the growth tracker restarts after any skipped step, as
        GradScaler's. Otherwise :func:`~.scale_rule.next_scale`, which keeps the scale and both
        trackers on a forward overflow or a spike (read from the step's record). No host
        read."""
        found = t["found"]
        if self._hysteresis == 1:
            torch._amp_update_scale_(
                t["scale"],
                t["growth_tracker"],
                found,
                self._growth_factor,
                self._backoff_factor,
                self._growth_interval,
            )
            if self._check_loss and self._loss_sum is not None and self.reduce_flags is None:
                # a forward overflow (the step's loss was NaN or +inf) keeps the scale it used
                # (the record row's): a smaller scale cannot cure it. Two ops, no host read: one
                # comparison (isfinite would be four) and one where. Not across ranks: the loss
                # is this rank's own, and every rank must keep the same scale (the agreed flag
                # backs off on all of them, as GradScaler).
                row = t["history"][(self._num_updates - 1) % self._history_size]
                below_inf = torch.lt(row[rec.LOSS], math.inf)
                torch.where(below_inf, t["scale"], row[rec.SCALE], out=t["scale"])
            if self._min_scale > 0 or self._max_scale < math.inf:
                t["scale"].clamp_(self._min_scale, self._max_scale)
            return
        # the slow path tells the kinds apart on the device: a forward overflow (a loss that is
        # not finite) or a spike is skipped without touching the scale or the trackers
        row = t["history"][(self._num_updates - 1) % self._history_size]
        loss, gnorm = row[rec.LOSS], row[rec.GNORM]
        no_backoff = (
            ~torch.isfinite(loss) if self._check_loss else torch.zeros_like(found, dtype=torch.bool)
        )
        no_backoff = no_backoff | (loss > row[rec.LOSS_THR]) | (gnorm > row[rec.GNORM_THR])
        skipped = found > 0
        s, g, h = next_scale(
            t["scale"],
            t["growth_tracker"],
            t["hysteresis_tracker"],
            skipped & ~no_backoff,
            skipped & no_backoff,
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

    def restore_scale(self, factor: float) -> None:
        """Multiply the scale by ``factor``, within the bounds (the guard undoes a back-off that
        a forward overflow or a spike caused: a smaller scale cures neither). No host read."""
        if not self._enabled or self._t is None:
            return
        self._t["scale"].mul_(float(factor)).clamp_(self._min_scale, self._max_scale)

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when scaling is disabled). **Syncs.**"""
        if not self._enabled:
            return 1.0
        return float(self._t["scale"].item()) if self._t is not None else float(self._init["scale"])

    def get_scale_tensor(self) -> torch.Tensor | None:
        """The scale as a 0-dim device tensor (None before the first ``scale()``). No host read."""
        return None if self._t is None else self._t["scale"]

    def skip_flag(self) -> torch.Tensor | None:
        """This step's found-inf flag (1.0: skipped) as a 0-dim device tensor, valid from
        ``step()`` until the next step's ``unscale_``: what a loop with a fused optimizer uses to
        count applied updates without a host read. None before the first ``scale()``."""
        return None if self._t is None else self._t["found"]

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
        """Change the growth interval. A lower one clamps the growth tracker below it, so the
        scale grows at the next clean step (GradScaler's kernel grows only at equality)."""
        _check_range(
            "growth_interval",
            new_interval,
            _is_int(new_interval) and new_interval >= 1,
            "an integer >= 1",
        )
        lower = int(new_interval) < self._growth_interval
        self._growth_interval = int(new_interval)
        if not lower:
            return
        t = getattr(self, "_t", None)
        if t is not None:
            t["growth_tracker"].clamp_(max=self._growth_interval - 1)
        elif hasattr(self, "_init"):
            tr = self._init["growth_tracker"]
            self._init["growth_tracker"] = min(tr, self._growth_interval - 1)

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

    def config(self) -> dict[str, Any]:
        """The settings under :class:`ScalerConfig`'s names: the ``init_scale`` configured (not
        the scale now), the rules in force, ``history_size``. No host read."""
        names = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis")
        return {
            "init_scale": self._init_scale_given,
            **{k: getattr(self, f"_{k}") for k in (*names, "min_scale", "max_scale")},
            "history_size": self._history_size,
        }

    def reconfigure(self, config: Any, *, was: dict[str, Any] | None = None) -> None:
        """Take the rules of ``config`` (a :class:`ScalerConfig`: a resume's ``scaler.*``) over
        a loaded state (its scale, trackers and record stay); when ``was``, the settings the
        state was saved under, names another ``init_scale``, the scale is set to ``config``'s
        (scaling on). No host read."""
        for k in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis"):
            getattr(self, f"set_{k}")(getattr(config, k))
        self.set_bounds(config.min_scale, config.max_scale)
        if was is not None and self._enabled and config.init_scale != was["init_scale"]:
            self.update(new_scale=config.init_scale)
        self._init_scale_given = float(config.init_scale)

    # settings, read-only (set_bounds and set_hysteresis change the first three)
    min_scale = property(attrgetter("_min_scale"), doc="The scale's floor.")
    max_scale = property(attrgetter("_max_scale"), doc="The scale's ceiling.")
    hysteresis = property(attrgetter("_hysteresis"), doc="Overflows tolerated before backing off.")
    history_size = property(attrgetter("_history_size"), doc="Step records kept on the device.")
    check_loss = property(attrgetter("_check_loss"), doc="A non-finite loss: a forward overflow.")

    @property
    def last_step_loss(self) -> torch.Tensor | None:
        """The sum of the losses ``scale()`` was given in the last recorded step (one per
        micro-batch: with the usual ``loss / accumulation_steps`` that is the step's mean loss),
        as a device tensor; None before the first step or when ``scale()`` got no tensor. No
        host read."""
        return self._last_loss

    @property
    def step_under_way(self) -> bool:
        """Whether a step has begun since the last ``update()``: ``scale()`` was given a loss
        or an optimizer was unscaled, checked or stepped. No host read."""
        return self._loss_sum is not None or bool(self._per_optimizer_states)

    @property
    def last_skip_read(self) -> bool | None:
        """Whether the last recorded step was skipped, as ``step()`` read it on the host (no new
        read); None when ``step()`` made no read (fused optimizer) -- then use
        ``last_step_skipped`` (syncs)."""
        return self._last_skip_read

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
        state["_loss_sum"] = state["_gnorm"] = state["_last_loss"] = None
        state["reduce_flags"] = None
        state["_per_optimizer_states"] = defaultdict(_fresh_opt_state)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _fresh_opt_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _finite_pos(x: Any) -> bool:
    return _finite(x) and x > 0
