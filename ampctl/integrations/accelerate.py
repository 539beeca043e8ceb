"""Hugging Face Accelerate: ampctl's LossScaler inside an ``Accelerator``, and the guard and run
folder for an Accelerate loop::

    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    install_scaler(accelerator)                       # before accelerator.prepare(...)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    run = protected_run(accelerator, model, optimizer, run_dir="runs/acc", max_steps=100)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)                    # scaler.scale(loss).backward()
        optimizer.step()                              # scaler.step + update (skips on inf/NaN)
        run.after_step(loss, batch)                   # guard + run folder, before zero_grad()
        optimizer.zero_grad()
    run.finish()

:func:`install_scaler` sets ``accelerator.scaler`` to a :class:`~ampctl.amp.LossScaler` (with the
``GradScalerKwargs`` the Accelerator was given) and makes every ``AcceleratedOptimizer`` -- those
already prepared and those :meth:`prepare` makes later -- step through it and report its skips.
With ``mixed_precision="fp16"`` on a CPU, Accelerate itself runs fp32 with no scaler ("fp16
needs a GPU"); after ``install_scaler`` the model prepared afterwards runs real fp16 autocast
(CPU autocast supports float16). bf16 and no mixed precision get a LossScaler with scaling off,
which still skips non-finite steps. ``accelerator.save_state`` / ``load_state`` keep the scaler
(``scaler.pt``, the LossScaler's full state), so install it in the resumed process too, before
``load_state``. Accelerate's FSDP2 load path (``scaler._lazy_init_scale_growth_tracker(
scaler._device)``) works on a LossScaler.

Skip-aware lr: an ``AcceleratedOptimizer``'s ``step_was_skipped`` (what the HF Trainer asks before
stepping its lr scheduler) tells the LossScaler's observed skip; with a fused optimizer, whose
skips Accelerate never sees, that reads the scaler's device flag (one host read per step; turn
it off with ``skip_aware_lr=False``).

:func:`protected_run` is a :class:`~ampctl.integrations.ProtectedRun` on the unwrapped model
with the Accelerator's precision; ``accelerator.save_state`` writes its state (step, guard
history) as ``ampctl_run.json`` next to Accelerate's files and ``load_state`` reads it back.

What does not apply: precision fallback (Accelerate fixes the autocast when it prepares the model;
the guard aborts instead, with the reason); DeepSpeed, Megatron-LM and FSDP1 (their own loss
scaling) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ampctl.amp import LossScaler
from ampctl.files import write_text

from .common import IntegrationError, require, share_flags
from .protected_run import LoopInfo, ProtectedRun

require("accelerate", "accelerate", "ampctl.integrations.accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer, patch_optimizer_step  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = [
    "AmpctlAcceleratedOptimizer",
    "ACCELERATE_AUTOCAST",
    "install_scaler",
    "protected_run",
    "RUN_STATE_NAME",
]

#: Where ``accelerator.save_state`` keeps a protected run's state.
RUN_STATE_NAME = "ampctl_run.json"

#: Why an Accelerate (or HF Trainer) loop cannot fall back to another precision.
ACCELERATE_AUTOCAST = (
    "Accelerate fixes the model's autocast when it prepares the model, so ampctl cannot switch "
    "its precision (set the guard's floor_policy to 'warn' or 'abort', or restart the run in "
    "bf16)"
)

_MARK = "_ampctl_prepare_optimizer"
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


class AmpctlAcceleratedOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` whose ``step_was_skipped`` is the LossScaler's observed skip
    (:func:`install_scaler` gives prepared optimizers this class)."""

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped: what the scaler read, or with a fused optimizer
        (nothing read) the scaler's device flag, which **syncs**."""
        sc = self.scaler
        if isinstance(sc, LossScaler) and sc.num_updates > 0:
            read = sc.last_skip_read
            return read if read is not None else sc.last_step_skipped
        return self._is_overflow


def _attach(opt: Any, scaler: LossScaler, skip_aware_lr: bool) -> None:
    """Make a prepared optimizer step through ``scaler`` (as ``AcceleratedOptimizer.__init__``
    does when it is given a scaler) and, with ``skip_aware_lr``, report its skips."""
    opt.scaler = scaler
    if not hasattr(opt, "_optimizer_patched_step_method"):
        opt._accelerate_step_called = False
        opt._optimizer_original_step_method = opt.optimizer.step
        opt._optimizer_patched_step_method = patch_optimizer_step(opt, opt.optimizer.step)
    if skip_aware_lr and type(opt) is AcceleratedOptimizer:
        opt.__class__ = AmpctlAcceleratedOptimizer


def install_scaler(
    accelerator: Accelerator, scaler: LossScaler | None = None, *, skip_aware_lr: bool = True
) -> LossScaler:
    """Install an ampctl LossScaler in ``accelerator`` (see the module docstring) and return it.

    Call it before ``accelerator.prepare(model)`` (on a CPU with fp16 the prepared model's
    forward must get the autocast); optimizers prepared before get the scaler too. ``scaler``:
    the LossScaler to use (default: a new one with the Accelerator's ``GradScalerKwargs``;
    scaling on exactly when ``mixed_precision="fp16"``). Calling it again keeps the installed
    scaler. No host read.
    """
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise IntegrationError(
            f"install_scaler: scaler is a {type(scaler).__name__}, not an ampctl LossScaler "
            "(LossScaler.like_gradscaler(...) behaves as GradScaler bit for bit)"
        )
    dt = accelerator.distributed_type
    if dt in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        raise IntegrationError(
            f"install_scaler: distributed_type={dt.value} scales the loss itself; ampctl's "
            "scaler works with no distribution, DDP and FSDP2"
        )
    if dt == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise IntegrationError(
            "install_scaler: FSDP1 needs a ShardedGradScaler; use FSDP2 (fsdp_version=2), whose "
            "gradients a LossScaler checks"
        )
    mp = accelerator.mixed_precision
    if mp not in ("no", "fp16", "bf16"):
        raise IntegrationError(
            f"install_scaler: mixed_precision={mp!r} is not supported; use 'fp16', 'bf16' or 'no'"
        )
    if scaler is None:
        if isinstance(accelerator.scaler, LossScaler):
            scaler = accelerator.scaler
        else:
            given = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler else {}
            enabled = bool(given.get("enabled", True)) and mp == "fp16"
            scaler = LossScaler(
                **{k: given[k] for k in _SCALER_KEYS if k in given},
                enabled=enabled,
                device=accelerator.device.type,
            )
    if mp == "fp16" and not accelerator.native_amp:
        # Accelerate runs fp32 here (a CPU); the autocast is wrapped around a model's forward
        # when it is prepared, so models prepared before would silently stay fp32.
        if accelerator._models:
            raise IntegrationError(
                "install_scaler: call it before accelerator.prepare(model): with "
                f"mixed_precision='fp16' on {accelerator.device.type} Accelerate prepared the "
                "model without autocast"
            )
        accelerator.native_amp = True
    accelerator.scaler = scaler
    share_flags(scaler)  # ranks skip the same steps
    for opt in accelerator._optimizers:
        if isinstance(opt, AcceleratedOptimizer):
            _attach(opt, scaler, skip_aware_lr)
    if not getattr(accelerator, _MARK, False):
        original = accelerator.prepare_optimizer

        def prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
            opt = original(optimizer, device_placement=device_placement)
            sc = accelerator.scaler
            if isinstance(sc, LossScaler) and isinstance(opt, AcceleratedOptimizer):
                _attach(opt, sc, getattr(accelerator, "_ampctl_skip_aware_lr", True))
            return opt

        accelerator.prepare_optimizer = prepare_optimizer
        setattr(accelerator, _MARK, True)
    accelerator._ampctl_skip_aware_lr = skip_aware_lr
    return scaler


def precision_of(accelerator: Accelerator) -> str:
    """ampctl's name for the Accelerator's mixed precision (``fp16``, ``bf16`` or ``fp32``)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(accelerator.mixed_precision, "fp32")


def protected_run(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    run_dir: str | Path,
    **kwargs: Any,
) -> ProtectedRun:
    """A :class:`~ampctl.integrations.ProtectedRun` for an Accelerate loop: the unwrapped model,
    the prepared optimizer, the installed LossScaler and the Accelerator's precision; its state
    travels with ``accelerator.save_state`` / ``load_state`` (``ampctl_run.json``). ``kwargs``
    go to ProtectedRun (``guard``, ``log_every``, ``max_steps``, ``display``, ...)."""
    scaler = accelerator.scaler
    if not isinstance(scaler, LossScaler):
        raise IntegrationError(
            "protected_run: the Accelerator has no ampctl LossScaler; call "
            "install_scaler(accelerator) before accelerator.prepare(...)"
        )
    kwargs.setdefault(
        "loop",
        LoopInfo(
            framework="accelerate",
            config={"accelerate": {"project_dir": accelerator.project_dir}},
            fallback_unavailable=ACCELERATE_AUTOCAST,
            is_main=accelerator.is_main_process,
        ),
    )
    run = ProtectedRun(
        accelerator.unwrap_model(model),
        optimizer,
        scaler,
        precision=precision_of(accelerator),
        run_dir=run_dir,
        **kwargs,
    )

    def save_hook(models: Any, weights: Any, output_dir: str) -> None:
        if accelerator.is_main_process:
            write_text(Path(output_dir, RUN_STATE_NAME), json.dumps(run.state_dict()) + "\n")

    def load_hook(models: Any, input_dir: str) -> None:
        path = Path(input_dir, RUN_STATE_NAME)
        if path.is_file():
            run.load_state_dict(json.loads(path.read_text()), resumed_from=input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return run
