"""PyTorch Lightning: ampctl's LossScaler, overflow guard and run folder in a Lightning run.

One line::

    trainer = L.Trainer(max_steps=1000, callbacks=[AmpctlCallback("runs/lit", precision="fp16")])

:class:`AmpctlCallback` puts :class:`AmpctlPrecision` in place of Lightning's precision plugin
when the fit starts (pass ``plugins=[AmpctlPrecision(...)]`` yourself to configure it: the
callback then uses it). The plugin is Lightning's ``MixedPrecision`` with an ampctl
:class:`~ampctl.amp.LossScaler` and ampctl's autocast: fp16 runs fp16 autocast on every device,
the CPU included (Lightning itself turns ``16-mixed`` into ``bf16-mixed`` on a CPU), and modules
named in ``fp32_modules`` -- or moved there by the guard -- run in fp32. The callback runs a
:class:`~ampctl.integrations.ProtectedRun` on the LightningModule: per optimizer step the
overflow event with the parameters whose gradients were non-finite, rollback after
``rollback_after`` overflows in a row (weights, optimizer state, scale and the lr schedulers),
the skip budget, the floor policy including the precision fallback fp16 -> bf16 -> fp32 (the
plugin owns autocast, so it can switch), the forward-overflow replay (``training_step`` with
logging muted) and fp32 promotion; and the run folder (``metrics.jsonl``, ``events.jsonl``,
``config.yaml``, ``summary.json``). Checkpoints stay Lightning's: the plugin's state (the scaler's
``state_dict`` plus ``"ampctl": {"precision", "in_fp32"}``) and the callback's (the guard's
history) are in them, and ``trainer.fit(..., ckpt_path=...)`` resumes the run folder too.

Step-interval lr schedulers do not advance on a skipped step (the schedule follows the updates
applied), through a wrapper of the LightningModule's ``lr_scheduler_step`` while fitting.

What does not apply: a rollback does not rewind Lightning's ``global_step``, epoch or data loader
(the run continues from the next batch with the restored weights; ``max_steps`` counts skipped and
discarded steps); only automatic or manual optimization with one optimizer is guarded; strategies
with their own precision plugin (FSDP, DeepSpeed) and ``16-true`` / ``bf16-true`` precisions are
refused with the reason.

Host reads: those of :class:`~ampctl.integrations.ProtectedRun`; with a fused optimizer the
skip-aware lr schedule reads the skip flag once per step when a step-interval scheduler exists.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler, make_precision
from ampctl.amp.precision import PLUGINS, Precision, saved_in_fp32
from ampctl.protect.loss import ForwardLoss
from ampctl.protect.protection import TrainAborted
from ampctl.protect.switch import switch_precision

from .common import (
    IntegrationError,
    RunOptions,
    SchedulerProgress,
    param_device,
    require,
    share_flags,
)
from .protected_run import LoopInfo, ProtectedRun

require("lightning", "lightning", "ampctl.integrations.lightning")

from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import Precision as LightningPrecision  # noqa: E402

__all__ = ["AmpctlCallback", "AmpctlPrecision"]

# ampctl's precision names and Lightning's flags for them
_NAMES = {
    "fp16": "fp16",
    "16-mixed": "fp16",
    "16": "fp16",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "fp32": "fp32",
    "32-true": "fp32",
    "32": "fp32",
}
_FLAGS = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}


def _precision_name(precision: Any, who: str) -> str:
    name = _NAMES.get(str(precision))
    if name is None:
        raise IntegrationError(
            f"{who}: precision={precision!r} is not allowed: precision must be one of fp16, bf16, "
            "fp32 (or Lightning's 16-mixed, bf16-mixed, 32-true)"
        )
    return name


class AmpctlPrecision(MixedPrecision):
    """Lightning's ``MixedPrecision`` with ampctl's LossScaler and autocast (module docstring).

    Args:
        precision: ``fp16`` (default), ``bf16`` or ``fp32`` (Lightning's ``16-mixed``,
            ``bf16-mixed``, ``32-true`` are accepted too). bf16 and fp32 keep a LossScaler with
            scaling off: non-finite steps are still detected and skipped.
        scaler: the LossScaler (default: ampctl's defaults, scaling on for fp16).
        fp32_modules: fnmatch patterns of LightningModule submodule names kept in fp32.
        device: the autocast device type; default: the model's, when Lightning connects it.
    """

    def __init__(
        self,
        precision: str = "fp16",
        *,
        scaler: LossScaler | None = None,
        fp32_modules: Iterable[str] = (),
        device: str | None = None,
    ) -> None:
        # MixedPrecision.__init__ is not called: it would build a GradScaler and set ``scaler``,
        # which here follows the ampctl plugin (a precision fallback replaces it).
        name = _precision_name(precision, "AmpctlPrecision")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise IntegrationError(
                f"AmpctlPrecision: scaler is a {type(scaler).__name__}, not an ampctl LossScaler "
                "(LossScaler.like_gradscaler(...) behaves as GradScaler bit for bit)"
            )
        if scaler is None:
            scaler = LossScaler(enabled=PLUGINS[name].needs_scaler)
        amp = make_precision(
            name, fp32_modules=list(fp32_modules), device_type=device or "cpu", scaler=scaler
        )
        # the owner of the current ampctl plugin: this namespace, then the run's Protection
        # (which replaces ``.precision`` on a fallback)
        self._current: Any = types.SimpleNamespace(precision=amp)
        self._device_given = device is not None
        self.device = device or "cpu"
        self._module: nn.Module | None = None

    # ------------------------------------------------------------------ the ampctl plugin
    @property
    def amp(self) -> Precision:
        """The ampctl precision plugin in use (a fallback replaces it)."""
        return self._current.precision

    @property
    def scaler(self) -> LossScaler:  # type: ignore[override]
        return self.amp.scaler

    @property
    def precision(self) -> str:  # type: ignore[override]
        """Lightning's flag for the precision in use (``16-mixed``, ``bf16-mixed``, ``32-true``)."""
        return _FLAGS[self.amp.name]

    def follow(self, owner: Any) -> None:
        """Take the ampctl plugin from ``owner.precision`` from now on (the run's Protection)."""
        self._current = owner

    # ------------------------------------------------------------------ Lightning hooks
    def convert_module(self, module: nn.Module) -> nn.Module:
        self._module = module
        self.amp.prepare(module)  # the fp32 modules (idempotent)
        return module

    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]):
        if not self._device_given:
            self.device = param_device(model).type
            self.amp.device_type = self.device
        share_flags(self.scaler)  # ranks skip the same steps
        return super().connect(model, optimizers, lr_schedulers)

    def autocast_context_manager(self):  # type: ignore[override]
        return self.amp.autocast()

    @contextmanager
    def forward_context(self):
        with self.amp.autocast():
            yield

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The scaler's ``state_dict`` (GradScaler's keys first) plus ``"ampctl"``: the precision
        reached and the modules moved to fp32. **Syncs** (the scaler's state)."""
        return {
            **self.scaler.state_dict(),
            "ampctl": {"precision": self.amp.name, "in_fp32": list(self.amp.in_fp32)},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (a GradScaler's state dict is accepted): a run that had
        fallen back to another precision continues in it."""
        state = dict(state_dict)
        saved = state.pop("ampctl", None) or {}
        name = saved.get("precision", self.amp.name)
        if name != self.amp.name:
            self._switch(_precision_name(name, "AmpctlPrecision checkpoint"))
        if self._module is not None:
            for n in saved_in_fp32(saved):
                self.amp.to_fp32(self._module, n)
        self.scaler.load_state_dict(state)

    def _switch(self, name: str) -> None:
        self._current.precision = switch_precision(self.amp, name, self._module)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def lightning_forward(model: nn.Module, batch: Any) -> torch.Tensor:
    """The forward-overflow replay of a LightningModule: ``training_step(batch, 0)`` with
    ``self.log`` / ``self.log_dict`` muted; its loss (a tensor or ``["loss"]``)."""
    from ampctl.protect.loss import extract_loss

    muted = {"log": _no_log, "log_dict": _no_log}
    model.__dict__.update(muted)
    try:
        out = model.training_step(batch, 0)
    finally:
        for k in muted:
            model.__dict__.pop(k, None)
    return extract_loss(out).float()


class AmpctlCallback(Callback):
    """ampctl's scaler, overflow guard and run folder for a Lightning fit (module docstring).

    Args:
        run_dir: the run folder (``metrics.jsonl``, ``events.jsonl``, ``summary.json``).
        precision: ``fp16``, ``bf16`` or ``fp32``; None: the Trainer's (``16-mixed`` -> fp16,
            ``bf16-mixed`` -> bf16, ``32-true`` -> fp32). Given, the Trainer must run ``32-true``
            (the callback brings the mixed precision) or the same precision; a mismatch is
            refused with one line. Ignored when the Trainer already has an
            :class:`AmpctlPrecision`.
        scaler: the LossScaler for the plugin the callback puts in place.
        forward: ``forward(module, batch) -> loss`` for the forward-overflow replay (default:
            :func:`lightning_forward`).
        skip_aware_lr: step-interval lr schedulers do not advance on skipped steps.
        options: :class:`~ampctl.integrations.common.RunOptions`: ``guard``, ``log_every``
            (default: ``log_every_n_steps``), ``display`` (None: no display, Lightning's bar
            stays), ``fp32_modules`` (submodule names), ``overflow_window``, ``tensorboard``,
            ``logging``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        precision: str | None = None,
        scaler: LossScaler | None = None,
        forward: ForwardLoss | None = None,
        skip_aware_lr: bool = True,
        **options: Any,
    ) -> None:
        self.options = RunOptions.given("AmpctlCallback", options)
        self.run_dir = Path(run_dir)
        self.precision = None if precision is None else _precision_name(precision, "AmpctlCallback")
        self.scaler = scaler
        self.forward = forward or lightning_forward
        self.skip_aware_lr = skip_aware_lr
        self.run: ProtectedRun | None = None
        self.plugin: AmpctlPrecision | None = None
        self.status = "ok"
        self._saved: dict[str, Any] | None = None
        self._wrapped: nn.Module | None = None

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        current = strategy.precision_plugin
        if isinstance(current, AmpctlPrecision):
            self.plugin = current
            return
        if type(current) not in (LightningPrecision, MixedPrecision):
            raise IntegrationError(
                f"AmpctlCallback: this Trainer's precision plugin is {type(current).__name__} "
                f"(precision={trainer.precision!r}); ampctl replaces only Lightning's default and "
                "mixed-precision plugins: use precision '32-true', '16-mixed' or 'bf16-mixed' "
                "and a strategy without a precision plugin of its own"
            )
        name = self._follow(trainer, current)
        scaler = self.scaler
        if scaler is None and isinstance(getattr(current, "scaler", None), LossScaler):
            scaler = current.scaler
        self.plugin = AmpctlPrecision(name, scaler=scaler, fp32_modules=self.options.fp32_modules)
        strategy.precision_plugin = self.plugin

    def _follow(self, trainer: Any, current: Any) -> str:
        """The precision to run: the Trainer's, or the callback's when the Trainer runs
        ``32-true`` (the callback then brings the mixed precision); a callback precision that
        differs from the Trainer's mixed precision is refused with one line."""
        theirs = _NAMES[current.precision] if isinstance(current, MixedPrecision) else "fp32"
        if self.precision is None or theirs == "fp32":
            return self.precision or theirs
        if self.precision != theirs:
            cpu = (
                " (Lightning turns precision='16-mixed' into 'bf16-mixed' on a CPU: for fp16 there "
                "leave the Trainer at '32-true' and pass precision='fp16' here)"
                if theirs == "bf16" and self.precision == "fp16"
                else ""
            )
            raise IntegrationError(
                f"AmpctlCallback: precision={self.precision!r} but the Trainer runs "
                f"precision={current.precision!r}: give the precision once, to the Trainer or "
                f"to the callback (with the Trainer at '32-true'){cpu}"
            )
        return theirs

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = self.plugin
        if plugin is None or trainer.strategy.precision_plugin is not plugin:
            raise IntegrationError(
                "AmpctlCallback: the precision plugin was replaced after setup; pass "
                "plugins=[AmpctlPrecision(...)] to the Trainer instead of replacing it"
            )
        if len(trainer.optimizers) != 1:
            raise IntegrationError(
                f"AmpctlCallback: the LightningModule configures {len(trainer.optimizers)} "
                "optimizers; the guard protects exactly one"
            )
        max_steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        step_schedulers = self.skip_aware_lr and any(
            c.interval == "step" and not c.reduce_on_plateau for c in trainer.lr_scheduler_configs
        )
        self.run = ProtectedRun(
            pl_module,
            trainer.optimizers[0],
            precision=plugin.amp,
            run_dir=self.run_dir,
            max_steps=max_steps,
            forward=self.forward,
            progress=SchedulerProgress(lambda: [c.scheduler for c in trainer.lr_scheduler_configs]),
            **self.options.keywords(log_every=self.options.log_every or trainer.log_every_n_steps),
            loop=LoopInfo(
                framework="lightning",
                config={
                    "lightning": {
                        "precision_flag": plugin.precision,
                        "checkpoint_dir": getattr(trainer.checkpoint_callback, "dirpath", None),
                        # Lightning counts every optimizer step, skipped ones too
                        "global_step_counts_skipped_steps": True,
                    }
                },
                fallback_unavailable=None,  # the plugin owns autocast: it follows a fallback
                is_main=trainer.is_global_zero,
                # the skip-aware lr schedule reads each step's skip anyway: attribute it at once
                read_skips=step_schedulers,
            ),
        )
        plugin.follow(self.run.protection)
        if self._saved:
            self.run.load_state_dict(self._saved)
        self.status = "ok"
        self.run.start(trainer.global_step, resumed_from=getattr(trainer, "ckpt_path", None))
        if self.skip_aware_lr:
            self._wrap_lr_step(trainer, pl_module)

    def _wrap_lr_step(self, trainer: Any, pl_module: Any) -> None:
        """Step-interval schedulers skip the scheduler step of a skipped optimizer step."""
        step_ids = {
            id(c.scheduler)
            for c in trainer.lr_scheduler_configs
            if c.interval == "step" and not c.reduce_on_plateau
        }
        if not step_ids:
            return
        original = pl_module.lr_scheduler_step
        run = self.run
        assert run is not None

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if id(scheduler) in step_ids and run.last_step_skipped():
                return  # the schedule follows the updates applied
            return original(scheduler, metric)

        pl_module.__dict__["lr_scheduler_step"] = lr_scheduler_step
        self._wrapped = pl_module

    def _unwrap_lr_step(self) -> None:
        if self._wrapped is not None:
            self._wrapped.__dict__.pop("lr_scheduler_step", None)
            self._wrapped = None

    # ------------------------------------------------------------------ per step
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.run is not None:
            self.run.before_step(trainer.global_step + 1)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.run is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, torch.Tensor):
            loss = None
        try:
            self.run.after_step(loss, batch, step=trainer.global_step)
        except TrainAborted as e:
            self.status = e.status  # aborted | diverged
            trainer.should_stop = True  # Lightning stops after this batch; checkpoints stay

    # ------------------------------------------------------------------ the end
    def _finish(self, status: str) -> None:
        self._unwrap_lr_step()
        if self.run is not None and self.run.summary is None:
            self.run.finish(status)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(self.status)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish("interrupted" if isinstance(exception, KeyboardInterrupt) else "failed")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unwrap_lr_step()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The run's step, guard history and tokens (plain values), kept in the checkpoint."""
        if self.run is not None:
            return self.run.state_dict()
        return dict(self._saved or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = dict(state_dict)
