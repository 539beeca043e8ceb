"""GradScaler's private attributes on :class:`~ampctl.amp.LossScaler`'s live state.

Training code reaches into ``torch.amp.GradScaler``: it reads and writes ``_scale`` (loss-scale
logging, clamping a minimum), ``_growth_tracker``, all-reduces ``_found_inf_per_device(opt)``
across ranks, and Accelerate's FSDP2 load path calls ``_lazy_init_scale_growth_tracker``. The
mixin here gives those names GradScaler's meaning on LossScaler's device state (``self._t``),
so such code keeps working after the swap. It holds no state of its own; everything it touches
is created by :class:`~ampctl.amp.scaler.LossScaler`.

A GradScaler in every sense: ``isinstance(scaler, torch.amp.GradScaler)`` is true, and the
GradScaler internals that training code reaches into act on the live state: ``_scale`` (the
scale as a 0-dim float32 device tensor; reading it does not sync, assigning it or changing it in
place sets the scale), ``_growth_tracker``, ``_init_scale``, ``_init_growth_tracker``,
``_growth_factor``, ``_backoff_factor``, ``_growth_interval``, ``_enabled``, ``_device``,
``_per_optimizer_states`` (keyed by ``id(optimizer)``, with GradScaler's ``OptState`` stages),
``_found_inf_per_device(optimizer)`` (the flags ``step`` reads: all-reducing them in place between
``unscale_`` and ``step`` makes every rank skip alike), ``_check_inf_per_device``,
``_unscale_grads_``, ``_lazy_init_scale_growth_tracker``, ``_get_scale_async``, pickling and
``copy.deepcopy`` (as GradScaler: only between iterations, the state re-created lazily), the
optimizer ``grad_scaler=`` protocol and the ``grad_scale`` / ``found_inf`` one. GradScaler's own
``__init__`` is not called and every GradScaler method is overridden (a test checks this), so no
GradScaler code runs on state of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from .overflow import check_and_unscale_

__all__ = ["CallOrderError", "GradScalerPrivates"]


class CallOrderError(RuntimeError, AssertionError):
    """The scaler's methods were called out of order (the message says the fix).

    GradScaler raises ``RuntimeError`` for some of these and ``AssertionError`` for others (a
    call before ``scale()``, ``update()`` with nothing recorded); this is both, so code that
    catches either keeps working.
    """


class GradScalerPrivates:
    """GradScaler's private attributes and helpers, for :class:`~ampctl.amp.LossScaler` (a
    mixin: it uses the scaler's ``_t``, ``_init``, ``_enabled``, ``_device_type``,
    ``_per_optimizer_states``, ``_lazy_init``, ``_assign`` and ``_grads``)."""

    _t: dict[str, torch.Tensor] | None
    _init: dict[str, Any]
    _enabled: bool
    _device_type: str | None

    def _absent_when_disabled(self, name: str) -> None:
        """GradScaler's state attributes do not exist on a disabled scaler."""
        if not self._enabled:
            raise AttributeError(f"'LossScaler' object has no attribute '{name}' (disabled)")

    @property
    def _scale(self) -> torch.Tensor | None:
        """GradScaler's scale tensor: the live 0-dim float32 scale on the device (None before
        the first ``scale()``); assigning it or changing it in place sets the scale. Absent
        when disabled, as in GradScaler (``hasattr(scaler, "_scale")`` is False). No host read."""
        self._absent_when_disabled("_scale")
        return None if self._t is None else self._t["scale"]

    @_scale.setter
    def _scale(self, value: Any) -> None:
        self._assign("scale", value)

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        """GradScaler's growth tracker: the live int32 count of consecutive clean steps (None
        before the first ``scale()``; absent when disabled). No host read."""
        self._absent_when_disabled("_growth_tracker")
        return None if self._t is None else self._t["growth_tracker"]

    @_growth_tracker.setter
    def _growth_tracker(self, value: Any) -> None:
        self._assign("growth_tracker", value)

    @property
    def _init_scale(self) -> float:
        """The scale the device state starts from (GradScaler's meaning: set by the
        constructor, ``load_state_dict`` and unpickling). Absent when disabled."""
        self._absent_when_disabled("_init_scale")
        return self._init["scale"]

    @_init_scale.setter
    def _init_scale(self, value: float) -> None:
        self._init["scale"] = float(value)

    @property
    def _init_growth_tracker(self) -> int:
        """The growth tracker the device state starts from. Absent when disabled."""
        self._absent_when_disabled("_init_growth_tracker")
        return self._init["growth_tracker"]

    @_init_growth_tracker.setter
    def _init_growth_tracker(self, value: int) -> None:
        self._init["growth_tracker"] = int(value)

    @property
    def _device(self) -> str:
        """GradScaler's device type string: the state's once it exists, else the ``device``
        argument, else ``"cuda"`` when available, else ``"cpu"``."""
        if self._t is not None:
            return self._t["scale"].device.type
        if self._device_type is not None:
            return self._device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @_device.setter
    def _device(self, value: str | torch.device) -> None:
        self._device_type = torch.device(value).type

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the device state on ``dev`` now, from ``_init_scale`` / the loaded state
        (Accelerate's FSDP2 load path calls this after ``load_state_dict``). Already created on
        that device: nothing to do (GradScaler would raise). No host read."""
        dev = torch.device(dev)
        if self._t is not None:
            cur = self._t["scale"].device
            if cur.type == dev.type and dev.index in (None, cur.index):
                return
            raise CallOrderError(
                f"LossScaler: the state already lives on {cur}, not {dev}; assign "
                f"scaler._scale = scaler._scale.to({str(dev)!r}) to move it"
            )
        self._lazy_init(dev)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, growth_tracker)`` device tensors; raises before the first ``scale()``."""
        t = self._require_init(funcname)
        return t["scale"], t["growth_tracker"]

    def _require_init(self, fn: str) -> dict[str, torch.Tensor]:
        if self._t is None:
            raise CallOrderError(
                f"LossScaler.{fn}() was called before scale(): call scaler.scale(loss).backward() "
                f"first in each iteration, then unscale_/step/update."
            )
        return self._t

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a host read (GradScaler's name for ``_scale``)."""
        return self._scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (0 when disabled). **Syncs.**"""
        if not self._enabled:
            return 0
        if self._t is None:
            return int(self._init["growth_tracker"])
        return int(self._t["growth_tracker"].item())

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """``{device: float32 0-dim flag}`` recorded for ``optimizer`` by ``unscale_`` / ``step``
        this iteration: 1.0 where a gradient was inf/NaN. ``step`` reads these very tensors, so
        reducing them in place (``dist.all_reduce(v, MAX)``) before ``step`` decides for all
        ranks. No host read."""
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """Check ``optimizer``'s gradients for inf/NaN without unscaling them; record and return
        the per-device flags (the stage stays as it is). No host read."""
        t = self._require_init("_check_inf_per_device")
        st = self._per_optimizer_states[id(optimizer)]
        st["found_inf_per_device"] = self._unscale_grads_(
            optimizer, t["one"], self._fresh_found(t), True
        )
        return st["found_inf_per_device"]

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply ``optimizer``'s gradients by ``inv_scale`` and flag inf/NaN, fused per
        (device, dtype); returns ``{device: flag}``. No host read."""
        return check_and_unscale_(self._grads(optimizer, allow_fp16), inv_scale, found_inf)
