"""The Hugging Face ``Trainer``: ampctl's LossScaler, overflow guard and run folder in one call::

    trainer = Trainer(model=model, args=TrainingArguments(..., fp16=True), train_dataset=ds)
    protect_trainer(trainer, run_dir="runs/hf")       # after Trainer(...), before train()
    trainer.train()                                   # resume: train(resume_from_checkpoint=...)

:func:`protect_trainer` installs a :class:`~ampctl.amp.LossScaler` in the Trainer's Accelerator
(:func:`ampctl.integrations.accelerate.install_scaler`: before ``train()`` prepares the model, on
the ``AcceleratedOptimizer`` too, and again whenever the Trainer re-creates its Accelerator) and
adds :class:`AmpctlTrainerCallback`, which runs a :class:`~ampctl.integrations.ProtectedRun` on the
model: the overflow event with the parameters whose gradients were non-finite, rollback (weights,
optimizer state, scale, lr scheduler), skip budget, floor policy, forward-overflow replay and fp32
promotion, and the run folder (``metrics.jsonl`` with scale, skipped, overflow rate, grad norm /
max / underflow before clipping, lr, loss; ``events.jsonl``; ``summary.json``; and the live table
with ``display=``). With ``report_to`` naming ``mlflow`` or ``wandb``, ampctl's figures, events
and summary join the Trainer's own MLflow / W&B run (``logging=`` chooses the sinks instead;
:mod:`ampctl.ui.sinks`). It installs itself in ``__init__``-time objects only, so call it for the
resumed Trainer too: ``train(resume_from_checkpoint=...)`` then loads the scaler's state into
the LossScaler and the guard's history from the checkpoint's ``ampctl_run.json``; the run folder
continues.

Checkpoints stay the user's: a plain ``Trainer`` (ampctl uninstalled) resumes them. The scaler's
state is ``scaler.pt`` where a plain Trainer has a GradScaler to load it into (fp16 on a GPU; it
reads GradScaler's keys of it) and ``ampctl_scaler.pt`` where it has none (fp16 on a CPU, bf16,
fp32), since transformers would call ``load_state_dict`` on a missing scaler.

fp16 on a CPU: ``TrainingArguments(fp16=True, use_cpu=True)`` alone trains in fp32 with no
scaler (Accelerate's choice); with ``protect_trainer`` the model really runs fp16 autocast and the
loss is scaled. The precision is the Trainer's (``fp16`` / ``bf16`` arguments, else fp32).

Skipped steps with the Trainer's default fused AdamW: the skip happens on the device, so the
Trainer never sees it (``optimizer_step_was_skipped`` is always false and the lr schedule
advances); here the skip counts, events and rows come from the LossScaler's on-device record, and
``optimizer_step_was_skipped`` reads the scaler's flag (one host read per step) so the lr
scheduler does not advance on a skipped step (``skip_aware_lr=False`` turns that read off).

What does not apply: precision fallback (Accelerate fixed the autocast when it prepared the
model: a fallback decision stops training with the reason); a rollback does not rewind the
Trainer's ``global_step``, epoch or data (``max_steps`` counts skipped and discarded steps); a
guard abort stops training at the end of that step (``control.should_training_stop``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from ampctl.amp import LossScaler
from ampctl.files import write_file, write_text
from ampctl.protect.protection import TrainAborted

from .common import IntegrationError, RunOptions, SchedulerProgress, require
from .protected_run import LoopInfo, ProtectedRun

require("transformers", "transformers", "ampctl.integrations.transformers")

from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint  # noqa: E402

from .accelerate import (  # noqa: E402
    ACCELERATE_AUTOCAST,
    RUN_STATE_NAME,
    install_scaler,
    precision_of,
)

__all__ = ["AmpctlTrainerCallback", "SCALER_FILE", "protect_trainer"]

#: Where a protected Trainer keeps the LossScaler's state when a plain Trainer would have no
#: scaler to load ``scaler.pt`` into.
SCALER_FILE = "ampctl_scaler.pt"

_MARK = "_ampctl_callback"


class AmpctlTrainerCallback(TrainerCallback):
    """The run folder and the guard for an HF Trainer; made by :func:`protect_trainer` (which
    also feeds it each micro-batch's loss and inputs). ``options``: :func:`protect_trainer`'s."""

    def __init__(
        self,
        trainer: Trainer,
        run_dir: str | Path,
        *,
        skip_aware_lr: bool = True,
        **options: Any,
    ) -> None:
        self.options = RunOptions.given("AmpctlTrainerCallback", options)
        self.trainer = trainer
        self.skip_aware_lr = skip_aware_lr
        self.run_dir = Path(run_dir)
        self.run: ProtectedRun | None = None
        self.status = "ok"
        self.resume_from: str | None = None
        self._clip_wrapped: Any = None

    # ------------------------------------------------------------------ start
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        acc = tr.accelerator
        scaler = acc.scaler
        if not isinstance(scaler, LossScaler):
            raise IntegrationError(
                "AmpctlTrainerCallback: the Trainer's Accelerator has no ampctl LossScaler; add "
                "the callback with protect_trainer(trainer), not callbacks=[...]"
            )
        self.status = "ok"
        opts = self.options
        self.run = ProtectedRun(
            tr.model,
            tr.optimizer,
            scaler,
            precision=precision_of(acc),
            run_dir=self.run_dir,
            max_steps=state.max_steps if state.max_steps and state.max_steps > 0 else None,
            progress=SchedulerProgress(lambda: [s for s in [tr.lr_scheduler] if s is not None]),
            **opts.keywords(
                log_every=opts.log_every or max(int(args.logging_steps), 1),
                logging=opts.logging if opts.logging is not None else _reported(args),
            ),
            loop=LoopInfo(
                framework="transformers",
                config={"transformers": {"optim": str(args.optim), "output_dir": args.output_dir}},
                fallback_unavailable=ACCELERATE_AUTOCAST,
                is_main=state.is_world_process_zero,
                # the skip-aware lr schedule reads each step's skip anyway: attribute it at once
                read_skips=self.skip_aware_lr,
            ),
        )
        saved = self._saved_state(self.resume_from)
        if saved is not None:
            self.run.load_state_dict(saved)
        self.run.start(state.global_step, resumed_from=self.resume_from)
        self._wrap_clip(acc)

    def _saved_state(self, checkpoint: str | None) -> dict[str, Any] | None:
        if checkpoint is None:
            return None
        path = Path(checkpoint, RUN_STATE_NAME)
        return json.loads(path.read_text()) if path.is_file() else None

    def _wrap_clip(self, acc: Any) -> None:
        """Take a log step's gradient statistics before the Trainer clips (its clip unscales
        first; the statistics work on the scaled gradients), and hand the norm the clip computes
        to the scaler (the spike rule's gradient-norm figure)."""
        if self._clip_wrapped is acc:
            return
        original = acc.clip_grad_norm_
        cb = self

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            if cb.run is not None and cb.run.summary is None:
                cb.run.before_step(cb.trainer.state.global_step + 1)
            norm = original(*args, **kwargs)
            if cb.run is not None and isinstance(norm, torch.Tensor):
                cb.run.scaler.report_grad_norm(norm)  # recorded; the spike rule's second figure
            return norm

        acc.clip_grad_norm_ = clip_grad_norm_
        self._clip_wrapped = acc

    def _unwrap_clip(self) -> None:
        acc, self._clip_wrapped = self._clip_wrapped, None
        if acc is not None:
            acc.__dict__.pop("clip_grad_norm_", None)

    # ------------------------------------------------------------------ per step
    def micro_batch(self, loss: Any, inputs: Any) -> None:
        """One micro-batch's loss (as ``training_step`` returned it) and inputs. No host read."""
        if self.run is not None and self.run.summary is None:
            self.run.add_batch(loss, inputs)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self.run.before_step(state.global_step + 1)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or self.run.summary is not None:
            return
        try:
            self.run.after_step(step=state.global_step + 1)
        except TrainAborted as e:
            self.status = e.status  # aborted | diverged
            control.should_training_stop = True

    # ------------------------------------------------------------------ checkpoints, end
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if folder.is_dir():
            write_text(folder / RUN_STATE_NAME, json.dumps(self.run.state_dict()) + "\n")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.finish(self.status)

    def finish(self, status: str) -> None:
        self._unwrap_clip()
        if self.run is not None and self.run.summary is None:
            self.run.finish(status)


def _reported(args: Any) -> dict[str, Any] | None:
    """ampctl's sinks for the trackers the Trainer reports to (``report_to``): its figures join
    the Trainer's MLflow / W&B run (:mod:`ampctl.ui.sinks`); None when it reports to neither."""
    reports = set(getattr(args, "report_to", None) or [])
    if not reports & {"mlflow", "wandb"}:
        return None
    return {"mlflow": "mlflow" in reports, "wandb": "wandb" in reports, "plot": False}


def _keep_checkpoints_plain(trainer: Trainer, native: dict[str, bool]) -> None:
    """Checkpoints a plain Trainer can resume: transformers loads ``scaler.pt`` into its own
    scaler, which it lacks where Accelerate makes none (fp16 on a CPU, bf16, fp32): there the
    LossScaler's state is saved as ``ampctl_scaler.pt`` instead, which only a protected Trainer
    reads. Where a plain Trainer has a GradScaler, ``scaler.pt`` stays (it reads GradScaler's
    keys of the LossScaler's state)."""
    save, load = trainer._save_scaler, trainer._load_scaler

    def _save_scaler(output_dir: str) -> None:
        scaler = trainer.accelerator.scaler
        if native["scaler"] or not isinstance(scaler, LossScaler):
            return save(output_dir)
        if trainer.args.should_save:
            with write_file(Path(output_dir, SCALER_FILE)) as f:
                torch.save(scaler.state_dict(), f)

    def _load_scaler(checkpoint: str | None) -> None:
        scaler = trainer.accelerator.scaler
        mine = Path(checkpoint, SCALER_FILE) if checkpoint is not None else None
        if mine is not None and mine.is_file() and isinstance(scaler, LossScaler):
            scaler.load_state_dict(torch.load(mine, weights_only=True))
            return None
        return load(checkpoint)

    trainer._save_scaler = _save_scaler
    trainer._load_scaler = _load_scaler


def protect_trainer(
    trainer: Trainer,
    run_dir: str | Path | None = None,
    *,
    scaler: LossScaler | None = None,
    skip_aware_lr: bool = True,
    **options: Any,
) -> AmpctlTrainerCallback:
    """Give ``trainer`` ampctl's LossScaler, guard and run folder (module docstring); returns the
    callback (its ``run`` is the :class:`~ampctl.integrations.ProtectedRun` once training starts).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass), before ``train()``.
        run_dir: the run folder; default ``<output_dir>/ampctl``.
        scaler: the LossScaler (default: ampctl's defaults with the Trainer's precision).
        skip_aware_lr: the lr scheduler does not advance on skipped steps, also with a fused
            optimizer (one host read per step there).
        options: :class:`~ampctl.integrations.common.RunOptions`: ``guard``, ``log_every``
            (default ``logging_steps``),
            ``display`` (pass ``disable_tqdm=True`` to the arguments to keep one display),
            ``fp32_modules``, ``overflow_window``, ``tensorboard``, ``logging`` (default: the
            trackers the Trainer reports to, ``report_to`` with ``mlflow`` / ``wandb``, where
            ampctl's figures join the Trainer's own run instead of opening a second one).
    """
    if not isinstance(trainer, Trainer):
        raise IntegrationError(
            f"protect_trainer: trainer is a {type(trainer).__name__}, not a transformers.Trainer"
        )
    if getattr(trainer, _MARK, None) is not None:
        raise IntegrationError("protect_trainer: this Trainer is protected already")
    opts = RunOptions.given("protect_trainer", options)  # checked before anything changes
    template = copy.deepcopy(scaler) if scaler is not None else None
    # whether a plain Trainer with these arguments has a scaler of its own (Accelerate's
    # GradScaler: fp16 on a GPU); it decides where the LossScaler's state is saved
    native = {"scaler": False}

    def install() -> None:
        acc = trainer.accelerator
        if not isinstance(acc.scaler, LossScaler):
            native["scaler"] = acc.scaler is not None
        sc = copy.deepcopy(template) if template is not None else None
        install_scaler(acc, sc, skip_aware_lr=skip_aware_lr)

    install()
    _keep_checkpoints_plain(trainer, native)
    cb = AmpctlTrainerCallback(
        trainer,
        run_dir if run_dir is not None else Path(trainer.args.output_dir, "ampctl"),
        skip_aware_lr=skip_aware_lr,
        **opts.keywords(),
    )
    trainer.add_callback(cb)
    setattr(trainer, _MARK, cb)

    # the Trainer re-creates its Accelerator for some retries (auto_find_batch_size): again
    create = trainer.create_accelerator_and_postprocess

    def create_accelerator_and_postprocess(*args: Any, **kwargs: Any) -> Any:
        out = create(*args, **kwargs)
        install()
        return out

    trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess

    # each micro-batch's loss and inputs (for the rows and the forward-overflow replay)
    step = trainer.training_step

    def training_step(*args: Any, **kwargs: Any) -> Any:
        inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
        loss = step(*args, **kwargs)
        cb.micro_batch(loss, inputs)
        return loss

    trainer.training_step = training_step

    # the checkpoint a resume starts from (the guard's history is next to it), and the status
    train = trainer.train

    def train_(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        ckpt = resume_from_checkpoint
        if ckpt is True:
            ckpt = get_last_checkpoint(trainer.args.output_dir)
        cb.resume_from = str(ckpt) if ckpt else None
        try:
            return train(resume_from_checkpoint, *args, **kwargs)
        except KeyboardInterrupt:
            cb.finish("interrupted")
            raise
        except BaseException:
            cb.finish("failed")
            raise

    trainer.train = train_
    return cb
