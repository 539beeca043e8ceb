"""ProtectedRun: ampctl's overflow guard and run folder for a loop that ampctl does not own.

Add it to any loop that steps a :class:`~ampctl.amp.LossScaler` (a hand-written loop, an
Accelerate loop; the Lightning and HF Trainer integrations are built on it)::

    scaler = LossScaler()                                   # instead of torch.amp.GradScaler()
    with ProtectedRun(model, optimizer, scaler, run_dir="runs/my-loop", max_steps=100) as run:
        for batch in loader:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            run.after_step(loss, batch)    # after update(), before the next zero_grad()

Per optimizer step it hands the step to :class:`~ampctl.protect.protection.Protection` -- the
overflow event (with the parameters whose gradients were non-finite), rollback to the last good
state after ``rollback_after`` overflows in a row, the skip budget, the floor policy, the
forward-overflow replay that moves the overflowing module to fp32 -- and every ``log_every``
steps it writes a ``metrics.jsonl`` row with the keys ``ampctl train`` writes (loss, scale,
skipped, overflow rate, grad norm / max / underflow, lr ...), so ``ampctl plot`` works on the run.
``summary.json`` is written by :meth:`ProtectedRun.finish` (or leaving the ``with`` block).

Micro-batches: ``after_step`` may be called after every micro-batch; a call after which the
scaler recorded no new ``update()`` only adds the micro-batch's loss (the loss you backpropagate,
i.e. already divided by the number of micro-batches) and batch to the step. It must also be
called after ``update()``: a loop that calls it only per micro-batch, before ``step()``, would
report each optimizer step during the next one, after ``zero_grad()`` -- the step's gradients
(the overflow attribution, the rollback's decision) gone and the next step's micro-batch in
them -- so the first such call raises :class:`~ampctl.integrations.IntegrationError` with the
fix (one line) instead of guarding the wrong gradients. A last step whose ``after_step`` never
came (the loop ended between ``update()`` and the call) is taken by :meth:`ProtectedRun.finish`.

What does not apply in a loop that owns its autocast: precision fallback (a fallback decision
aborts with the reason; the Lightning callback, whose plugin owns autocast, does fall back), and
a rollback does not rewind the loop's own step counter or data loader (pass ``progress=`` to
rewind more, e.g. the lr scheduler).

Host reads: none on a clean step that is not a log step (with a fused optimizer and
``read_skips``, one per step: the skip flag); one per log step (every figure of the interval,
and the guard's waiting decisions with a fused optimizer); one more on a skipped step whose skip
was read (attribution). Everything else stays on the device.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler, make_precision
from ampctl.amp.precision import PLUGINS, PRECISIONS, Precision, saved_in_fp32
from ampctl.amp.scaler import OptState
from ampctl.amp.stats import grad_stats
from ampctl.protect.figures import DeviceFigures, LogWindow
from ampctl.protect.logger import RunLogger
from ampctl.protect.loss import ForwardLoss
from ampctl.protect.protection import Protection, Rewind, TrainAborted
from ampctl.protect.shell import RunShell, Shelled, write_config
from ampctl.runlog import RunLayout, is_finite_number, is_run_dir, prepare_resume, read_jsonl
from ampctl.runlog.lock import RunLock, lock_run

from .common import (
    IntegrationError,
    Ranks,
    RunOptions,
    check_counts,
    count_tokens,
    inner_optimizer,
    is_rank0,
    param_device,
    share_flags,
    world_size,
)

__all__ = ["LoopInfo", "ProtectedRun", "TrainAborted"]

#: Why a loop with its own autocast cannot fall back to another precision.
OWN_AUTOCAST = (
    "the loop runs its own autocast and scaler, so ampctl cannot switch its precision (set the "
    "guard's floor_policy to 'warn' or 'abort', or train with ampctl train or the Lightning "
    "callback, which fall back)"
)

#: Precisions a loop with its own autocast can declare (fp16-pure and fp8 change the model and
#: the optimizer: only ``ampctl train`` builds them).
LOOP_PRECISIONS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class LoopInfo:
    """How the loop around a :class:`ProtectedRun` behaves: set by an integration (Lightning,
    HF Trainer ...), left at its defaults by a hand-written loop.

    Args:
        framework: the name written to ``config.yaml``, the summary and the display title.
        config: extra entries for ``config.yaml`` (the framework's own settings).
        fallback_unavailable: why this loop cannot switch precision (None when it can: the
            caller then follows :attr:`ProtectedRun.precision`'s autocast and scaler after a
            fallback).
        is_main: whether this process writes the run folder (default: rank 0).
        read_skips: with a fused optimizer, read each step's skip flag (one host read per step)
            so overflows are attributed and decided at once, as on the standard path; for loops
            that read it anyway (a skip-aware lr schedule). False: decide at the log step.
    """

    framework: str = "loop"
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fallback_unavailable: str | None = OWN_AUTOCAST
    is_main: bool | None = None
    read_skips: bool = False


class _Step:
    """What the calls of one optimizer step brought: the micro-batches (for the replays), the
    losses handed to :meth:`ProtectedRun.after_step` / :meth:`~ProtectedRun.add_batch` (used when
    the scaler recorded none), the tokens, and the gradient statistics and lr that
    :meth:`~ProtectedRun.before_step` took."""

    def __init__(self) -> None:
        self.batches: list[Any] = []
        self.loss: torch.Tensor | None = None
        self.tokens = 0
        self.stats: dict[str, torch.Tensor] | None = None
        self.stats_step: int | None = None
        self.lr: Any = None


class ProtectedRun(Shelled):
    """The guard and the run folder for a loop that steps a LossScaler (module docstring).

    Args:
        model: the model whose weights a rollback restores and whose gradients attribution
            names (unwrapped: ``accelerator.unwrap_model(model)``, the LightningModule ...).
        optimizer: the optimizer the scaler steps (a framework's wrapper is fine: its
            ``state_dict`` / ``load_state_dict`` are what a rollback uses).
        scaler: the :class:`~ampctl.amp.LossScaler` the loop steps; None builds one (scaling on
            for fp16, detection only for bf16/fp32), available as :attr:`scaler`.
        run_dir: the run folder (created; a folder that already holds a run is refused unless
            this is a resume, see :meth:`start`).
        precision: ``fp16``, ``bf16`` or ``fp32`` -- what the loop's autocast runs (used for the
            forward-overflow replay, the fp32 modules and the records) -- or an ampctl
            :class:`~ampctl.amp.precision.Precision` plugin that owns the scaler.
        max_steps: the planned number of optimizer steps (rows, display), or None.
        forward: ``forward(model, batch) -> loss`` for the forward-overflow replay; default
            ``model(**batch)`` and its ``.loss``.
        progress: what a rollback rewinds besides weights, optimizer state and scale (an object
            with ``state_dict`` / ``load_state_dict``, e.g. the lr scheduler).
        loop: how the loop around the run behaves (:class:`LoopInfo`; integrations set it).
        options: the fields of :class:`~ampctl.integrations.common.RunOptions`: ``guard``,
            ``log_every`` (default 10), ``overflow_window``, ``display``, ``fp32_modules``,
            ``tensorboard``, ``logging`` (``plot`` true by default there: ``plot.png`` at
            :meth:`finish`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        scaler: LossScaler | None = None,
        *,
        run_dir: str | Path,
        precision: str | Precision = "fp16",
        max_steps: int | None = None,
        forward: ForwardLoss | None = None,
        progress: Any = None,
        loop: LoopInfo | None = None,
        **options: Any,
    ) -> None:
        check_counts("ProtectedRun", max_steps=max_steps)
        self.options = opts = RunOptions.given("ProtectedRun", options)
        self.model = model
        self.run_dir = Path(run_dir)
        self.loop = loop or LoopInfo()
        self.log_every, self.max_steps = opts.log_every or 10, max_steps
        self.overflow_window, self.framework = opts.overflow_window, self.loop.framework
        self._progress = progress
        amp = _loop_precision(precision, scaler, opts.fp32_modules, model)
        self.protection = Protection(
            model,
            optimizer,
            amp,
            config=opts.guard,
            emit=self._emit,
            progress_state=progress.state_dict if progress is not None else None,
            forward=forward,
            fallback_unavailable=self.loop.fallback_unavailable,
            dist=Ranks() if world_size() > 1 else None,
        )
        self.shell = RunShell(
            self.protection,
            self.run_dir,
            framework=self.loop.framework,
            max_steps=max_steps,
            overflow_window=opts.overflow_window,
            on_rewind=self._rewound,
        )
        share_flags(amp.scaler)
        self.is_main = is_rank0() if self.loop.is_main is None else bool(self.loop.is_main)
        self._own_display = False
        self.display: Any = None
        self.status: str | None = None
        self.summary: dict[str, Any] | None = None
        self._early_events: list[dict[str, Any]] = []
        self._step = 0
        self._started = False
        # the scaler's update count at the last step seen: a call after which it did not change
        # is a micro-batch of gradient accumulation
        self._updates_seen = self.scaler.num_updates
        self._cur = _Step()
        self._resumed_from: str | Path | None = None
        self._exit_hooks: Any = None
        self._lock: RunLock | None = None  # the run folder's, from start() to finish()

    # ------------------------------------------------------------------ views
    log = property(lambda self: self.shell.log, doc="The run's logger (from :meth:`start` on).")
    step = property(lambda self: self._step, doc="The last optimizer step seen.")
    events = property(
        lambda self: self.protection.events,
        doc="The guard's events of this process (also in ``events.jsonl``).",
    )

    @property
    def fused(self) -> bool:
        """Whether the optimizer skips on the device (``scaler.step`` reads nothing)."""
        return bool(getattr(inner_optimizer(self.optimizer), "_step_supports_amp_scaling", False))

    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped: what ``scaler.step`` read, or (fused
        optimizer, nothing read) the scaler's device flag, which **syncs**."""
        read = self.scaler.last_skip_read
        return read if read is not None else self.scaler.last_step_skipped

    def _device(self) -> torch.device:
        return self.scaler.device or param_device(self.model)

    def _is_log(self, step: int) -> bool:
        return step % self.log_every == 0 or (self.max_steps is not None and step == self.max_steps)

    # ------------------------------------------------------------------ lifecycle
    def start(self, step: int | None = None, *, resumed_from: str | Path | None = None) -> None:
        """Open the run folder and keep the starting state as the first snapshot. ``step``: the
        loop's optimizer step count now (default: 0, or the one :meth:`load_state_dict` gave);
        above 0 (or with ``resumed_from``, the checkpoint) this is a resume: rows and events
        logged after ``step`` by the interrupted run are dropped, a ``resume`` event is written,
        and a scaler that was not restored (a fresh one: the loop's checkpoint had none) takes
        the scale and skip counters the run folder recorded at ``step``. Called by the first
        :meth:`after_step` when not called before (with the step that call names, minus one).
        No host read."""
        self._start(step, resumed_from=resumed_from)
        # everything is loaded and no step of this run has been taken: the scaler's count now
        self._updates_seen = self.scaler.num_updates

    def attach(self, step: int | None = None, *, resumed_from: str | Path | None = None):
        """:meth:`start` for a loop without a ``with`` block (``while True:``); :meth:`detach`
        ends the run. If the process exits first, the summary is still written: ``failed``
        after an uncaught exception or ``sys.exit(code)`` with a code other than 0 / None,
        ``interrupted`` after Ctrl-C, else ``ok`` (a ``raise SystemExit(code)`` that does not go
        through ``sys.exit`` is not seen: Python hands it to no hook). Returns the run."""
        self.start(step, resumed_from=resumed_from)
        self._exit_hooks = _ExitHooks(self)
        return self

    def detach(self, status: str | None = None) -> dict[str, Any]:
        """End a run started with :meth:`attach`: :meth:`finish` (returns the summary)."""
        return self.finish(status)

    def _start(self, step: int | None = None, *, resumed_from: str | Path | None = None) -> None:
        if self._started:
            return
        step = self._step if step is None else int(step)
        if resumed_from is None:
            resumed_from = self._resumed_from
        resumed = step > 0 or resumed_from is not None
        layout = RunLayout(self.run_dir)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # one owner per folder: a second ProtectedRun (this process or another) is refused
            self._lock = lock_run(self.run_dir, hint=" (one ProtectedRun per run_dir)")
            try:
                self._open_folder(layout, step, resumed, resumed_from)
            except BaseException:
                self._release()
                raise
        restored = resumed and self._restore_scaler(layout, step)
        self.display = self._make_display()
        self.shell.log = log = RunLogger(
            self.run_dir,
            is_main=self.is_main,
            display=self.display,
            tensorboard=self.options.tensorboard,
            logging=self.options.logging,
        )
        self.shell.open(step, self._config())
        if resumed:
            where = f" from {resumed_from}" if resumed_from is not None else ""
            scale = f"; the scale {restored:g} from the run folder" if restored else ""
            log.event(
                {
                    "step": step,
                    "kind": "resume",
                    "message": f"resumed{where} at step {step} ({self.framework}){scale}",
                }
            )
        for ev in self._early_events:
            log.event(ev)
        self._early_events.clear()
        self._step = step
        self.shell.t0 = time.perf_counter()
        self.shell.window = LogWindow(first_update=self.scaler.num_updates - self._updates_taken())
        self.protection.start(step)
        self._started = True

    def _open_folder(
        self, layout: RunLayout, step: int, resumed: bool, resumed_from: str | Path | None
    ) -> None:
        """The main rank's first writes to the run folder (it holds the folder's lock)."""
        if self._lock is not None and self._lock.took_over is not None:
            self._early_events.append(
                {"step": step, "kind": "warning", "message": self._lock.message()}
            )
        if not resumed and is_run_dir(self.run_dir):
            raise IntegrationError(
                f"run_dir {str(self.run_dir)!r} holds a run already: pick another run_dir "
                "(ampctl never mixes two runs in one folder), or resume it: "
                "start(step=N) / attach(step=N), or after_step(step=N+1) on the first step, "
                "with the loop's step"
            )
        if resumed:
            prepare_resume(layout, Path(resumed_from or self.run_dir), step)
        if not layout.config.is_file():
            write_config(self.run_dir, self._config())

    def _release(self) -> None:
        """Let the run folder go (the end of the run, or a start that failed)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def _updates_taken(self) -> int:
        """Updates of this run the scaler recorded before :meth:`start` ran (0, or 1 when the
        first ``after_step`` started the run)."""
        return self.scaler.num_updates - self._updates_seen

    def _restore_scaler(self, layout: RunLayout, step: int) -> float | None:
        """A resume whose scaler was not restored (it recorded no step before this run's: the
        loop's checkpoint kept no scaler, e.g. nanoGPT's): the scale of the last row the run
        folder wrote at or before ``step``, and its skip counters added to this run's. The
        growth tracker starts again from 0. Returns the scale taken, or None."""
        sc = self.scaler
        taken = self._updates_taken()  # steps of this run already recorded (0 or 1)
        if sc.num_updates != taken or not sc.is_enabled():
            return None
        rows = [r for r in read_jsonl(layout.metrics) if isinstance(r.get("step"), int)]
        rows = [r for r in rows if r["step"] <= step and is_finite_number(r.get("scale"))]
        if not rows:
            return None
        last = rows[-1]
        state = sc.state_dict()
        state["scale"], state["_growth_tracker"] = float(last["scale"]), 0
        for key, row_key in (
            ("skipped_total", "skipped"),
            ("forward_overflows", "forward_overflows"),
        ):
            state[key] = int(state.get(key, 0)) + int(last.get(row_key) or 0)
        sc.load_state_dict(state)
        return float(last["scale"])

    def _make_display(self) -> Any:
        d = self.options.display
        if d is None or not self.is_main:
            return None
        if isinstance(d, str):
            from ampctl.ui.display import Display

            disp = Display(self.max_steps, mode=d, title=f"ampctl - {self.framework}")
            disp.__enter__()
            self._own_display = True
            return disp
        return d

    def _config(self) -> dict[str, Any]:
        """What config.yaml records of a loop ampctl did not build: the precision, the
        scaler's settings, the guard's, the logging cadence and the loop's own entries."""
        sc = self.scaler
        return {
            "integration": self.framework,
            "precision": {"name": self.precision.name, "fp32_modules": self.precision.fp32_modules},
            "scaler": {**sc.config(), "enabled": sc.is_enabled()},
            "guard": dataclasses.asdict(self.protection.config),
            "trainer": {
                "max_steps": self.max_steps,
                "log_every": self.log_every,
                "overflow_window": self.overflow_window,
            },
            **self.loop.config,
        }

    def __enter__(self) -> ProtectedRun:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(_status_of(exc_type, exc))

    # ------------------------------------------------------------------ per step
    def add_batch(self, loss: Any = None, batch: Any = None, *, tokens: int | None = None) -> None:
        """Record one micro-batch of the current step: its loss contribution (the loss you
        backpropagate; used for the row only when the scaler recorded none, see
        :meth:`after_step`), the batch (for the forward-overflow replay) and its tokens (default:
        ``batch["input_ids"].numel()``). No host read."""
        cur = self._cur
        if loss is not None:
            t = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            t = t.detach().float()
            t = t.mean() if t.numel() != 1 else t.reshape(())
            cur.loss = t if cur.loss is None else cur.loss + t
        if batch is not None:
            cur.batches.append(batch)
        cur.tokens += int(tokens) if tokens is not None else count_tokens(batch)

    def before_step(self, step: int | None = None) -> None:
        """Optional: call between the last backward and the optimizer step (before clipping) to
        take a log step's gradient statistics there and the lr the step uses. Without it,
        :meth:`after_step` takes the statistics from the gradients the step left behind
        (unscaled by ``scaler.step``, after any clipping; none with a fused optimizer). Works on
        scaled or unscaled gradients (the scaler's stage for the optimizer says which). No host
        read."""
        upcoming = self._step + 1 if step is None else int(step)
        cur = self._cur
        cur.lr = _copy(self.optimizer.param_groups[0]["lr"])
        if not self._is_log(upcoming) or cur.stats_step == upcoming:
            return
        sc = self.scaler
        st = sc._per_optimizer_states.get(id(inner_optimizer(self.optimizer)))
        stage = st["stage"] if st is not None else OptState.READY
        scaled = sc.is_enabled() and stage is OptState.READY and sc.get_scale_tensor() is not None
        grads = [p.grad for p in self.precision.optimizer_params(self.model)]
        dev = self._device()
        if scaled:
            scale = sc.get_scale_tensor()
            stats = grad_stats(grads, 1.0, dev)  # the underflow test on scaled values is direct
            stats["grad_norm"] = stats["grad_norm"] / scale.to(dev)
            stats["grad_amax"] = stats["grad_amax"] / scale.to(dev)
        else:
            scale = sc.get_scale_tensor() if sc.is_enabled() else 1.0
            stats = grad_stats(grads, scale if scale is not None else 1.0, dev)
        cur.stats, cur.stats_step = stats, upcoming

    def _post_step_stats(self) -> dict[str, torch.Tensor] | None:
        """Gradient statistics from what the step left: unscaled unless the optimizer is fused
        (then unknown: none). No host read."""
        if self.fused:
            return None
        sc = self.scaler
        scale = sc.recent_records(1)[0, 0] if sc.is_enabled() else 1.0
        grads = [p.grad for p in self.precision.optimizer_params(self.model)]
        return grad_stats(grads, scale, self._device())

    def after_step(
        self,
        loss: Any = None,
        batch: Any = None,
        *,
        step: int | None = None,
        tokens: int | None = None,
    ) -> dict[str, Any] | None:
        """Call after ``scaler.update()`` (before the next ``zero_grad()``: attribution reads
        the step's gradients), with the loss and the batch (see :meth:`add_batch`); calling it
        after every micro-batch as well is fine. ``step``: the loop's optimizer step count after
        this step (default: one more than the last; on the first call of a run folder that holds
        a run, ``step=N+1`` resumes it at N).

        The step is the scaler's: a call after which the scaler recorded no new ``update()``
        only adds its micro-batch. The row's loss is what the scaler saw: the sum of the losses
        ``scaler.scale()`` was given during the step (every micro-batch's ``loss / accum``), so
        gradient accumulation needs no extra call; only when the scaler recorded none are the
        losses handed here summed instead. Returns the metrics row on a log step, else None.

        Host reads: see the module docstring. May raise
        :class:`~ampctl.protect.protection.TrainAborted` (the guard gave up)."""
        if not self._started:
            # the scaler's count was taken when the run was built (or loaded): this call may
            # follow the run's first update already
            self._start(None if step is None or self._step else max(int(step) - 1, 0))
        n = self.scaler.num_updates
        if n != self._updates_seen and self.scaler.step_under_way:
            raise IntegrationError(_LATE_CALL.format(step=self._step + 1))
        self.add_batch(loss, batch, tokens=tokens)
        if n == self._updates_seen:
            return None
        self._updates_seen = n
        self._step = self._step + 1 if step is None else int(step)
        step = self._step
        skipped = self.scaler.last_skip_read
        if skipped is None and self.loop.read_skips:
            skipped = self.scaler.last_step_skipped  # syncs (the caller reads it anyway)
        cur, self._cur = self._cur, _Step()
        self.shell.add_tokens(cur.tokens)
        if self.scaler.last_step_loss is None and cur.loss is not None:
            self.shell.window.add(cur.loss)  # the scaler saw no loss: the ones handed over
        log = self._is_log(step)
        stats = cur.stats if cur.stats_step == step else None
        if log and stats is None:
            stats = self._post_step_stats()
        try:
            self._apply(
                self.protection.after_step(step, skipped=skipped, batches=cur.batches or None)
            )
            row = self._log_row(step, stats, cur.lr) if log else None
            self.protection.mark_step_start()  # the next step starts here (guard.rerun)
            return row
        except TrainAborted as e:
            self.status = e.status  # aborted | diverged
            raise

    def _log_row(self, step: int, stats: dict[str, torch.Tensor] | None, lr: Any) -> dict[str, Any]:
        """The log step (:meth:`RunShell.log_step`); a rewind decided there restores the state
        and the row is written all the same (the loop goes on). **Syncs** once."""
        if lr is None:
            lr = _copy(self.optimizer.param_groups[0]["lr"])
        row = self.shell.log_step(step, DeviceFigures(self._device()), stats=stats, lr=lr)
        assert row is not None
        return row

    def _rewound(self, rewind: Rewind) -> bool:
        self._apply(rewind)
        return False  # the loop's own position goes on: the interval's row is written

    def _apply(self, rewind: Rewind | None) -> None:
        """A rollback or fallback restored weights, optimizer state and scale: put the caller's
        ``progress`` (e.g. the lr scheduler) back too, and cut the lr by a divergence rollback's
        factor (the optimizer's groups, and the ``base_lrs`` of a torch lr scheduler passed as
        ``progress``). The loop's own step counter and data go on (this run does not own
        them)."""
        if rewind is None:
            return
        if self._progress is not None and rewind.progress is not None:
            self._progress.load_state_dict(rewind.progress)
        if rewind.lr_factor != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] = g["lr"] * rewind.lr_factor
            base = getattr(self._progress, "base_lrs", None)
            if isinstance(base, list):
                self._progress.base_lrs = [b * rewind.lr_factor for b in base]

    # ------------------------------------------------------------------ events
    def _emit(self, ev: dict[str, Any]) -> None:
        if self.log is None:
            self._early_events.append(ev)
        else:
            self.log.event(ev)

    def event(self, step: int, kind: str, message: str, **extra: Any) -> None:
        """Record an event of the caller's own (events.jsonl, display)."""
        self.protection.emit(step, kind, message, **extra)

    # ------------------------------------------------------------------ the end
    def finish(self, status: str | None = None) -> dict[str, Any]:
        """Take the guard's last waiting decisions (fused optimizer: **syncs** once), write
        ``summary.json`` and show the summary. ``status``: ``ok`` (default), ``aborted``,
        ``interrupted`` or ``failed``. A second call returns the same summary."""
        if self.summary is not None:
            return self.summary
        if self._exit_hooks is not None:
            self._exit_hooks.remove()
            self._exit_hooks = None
        if not self._started:  # nothing ran (or start() refused the folder): nothing to write
            self._release()
            self.summary = {"status": status or self.status or "failed", "steps": self._step}
            return self.summary
        status = status or self.status or "ok"
        if status == "ok":
            try:
                if self.scaler.num_updates != self._updates_seen and not (
                    self.scaler.step_under_way
                ):
                    # the last optimizer step had no after_step (the loop ended between update()
                    # and its call): it is taken now, not dropped from the steps and the rows
                    self.after_step()
                self._apply(self.protection.sync())
            except TrainAborted as e:
                status = e.status
        self.status = status
        summary = self.shell.summary(status, self._step)
        self.shell.write_summary(summary)
        logging = self.options.logging
        if logging is not None and logging.plot and self.is_main:
            self.shell.plot()
        self.shell.log.close(status)
        self._release()
        if self.display is not None and callable(getattr(self.display, "summary", None)):
            self.display.summary(summary)
        if self._own_display and self.display is not None:
            self.display.__exit__(None, None, None)
        self.summary = summary
        return summary

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of the loop should keep so a resume continues the run: the step,
        the scaler's update count, the protection's history, tokens, wall time, the precision
        and the modules kept in fp32. Plain numbers, strings and lists (JSON and
        ``weights_only`` safe). No host read."""
        return {
            "step": self._step,
            "updates": self.scaler.num_updates,
            "protection": self.protection.state_dict(),
            **self.shell.accounts(),
            "precision": self.precision.name,
            "in_fp32": list(self.precision.in_fp32),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, resumed_from: str | Path | None = None
    ) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`): the step, the protection's
        history (``"guard"`` in checkpoints of ampctl 0.2 and older), and the modules the guard
        had kept in fp32. ``resumed_from``: the checkpoint, named in the ``resume`` event when
        :meth:`start` is not given one."""
        if self._started:
            raise IntegrationError(
                "ProtectedRun.load_state_dict: call it before the first step (before start())"
            )
        self._step = int(state.get("step", 0))
        # the scaler restored from the same checkpoint has this count
        self._updates_seen = int(state.get("updates", self.scaler.num_updates))
        self._resumed_from = resumed_from
        self.protection.load_state_dict(dict(state.get("protection", state.get("guard", {}))))
        self.shell.load_accounts(state)
        for name in saved_in_fp32(state):
            try:
                self.precision.to_fp32(self.model, name)
            except AttributeError:  # the module is gone (another model): nothing to keep
                continue


class _ExitHooks:
    """A run started with :meth:`ProtectedRun.attach` writes its summary even if the process
    exits without :meth:`~ProtectedRun.detach`: ``failed`` after an uncaught exception (seen
    through ``sys.excepthook``), else ``ok``."""

    def __init__(self, run: ProtectedRun) -> None:
        self.run = run
        self.failed: str | None = None
        self._previous = sys.excepthook
        self._previous_exit = sys.exit
        sys.excepthook = self._excepthook
        sys.exit = self._exit  # SystemExit never reaches sys.excepthook: its code is seen here
        atexit.register(self._at_exit)

    def _excepthook(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.failed = _status_of(exc_type, exc)
        self._previous(exc_type, exc, tb)

    def _exit(self, code: Any = None) -> None:
        self.failed = _status_of(SystemExit, SystemExit(code))
        self._previous_exit(code)

    def _at_exit(self) -> None:
        if self.run.summary is None:
            self.run.finish(self.failed)

    def remove(self) -> None:
        atexit.unregister(self._at_exit)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._previous
        if sys.exit == self._exit:
            sys.exit = self._previous_exit


def _status_of(exc_type: Any, exc: Any = None) -> str | None:
    """The run's status after ``exc_type`` (None: no exception, the default status):
    ``SystemExit`` with code 0 or None is a normal end (None), with any other code ``failed``;
    Ctrl-C ``interrupted``; the guard's own stop its status; any other exception ``failed``."""
    if exc_type is None:
        return None
    if issubclass(exc_type, TrainAborted):
        return exc_type.status  # aborted | diverged
    if issubclass(exc_type, KeyboardInterrupt):
        return "interrupted"
    if issubclass(exc_type, SystemExit):
        code = getattr(exc, "code", None)
        return None if code is None or code == 0 else "failed"
    return "failed"


#: after_step saw an update only after the next step's scale() (a loop that calls it per
#: micro-batch, before step()/update(), and never after update()).
_LATE_CALL = (
    "ProtectedRun.after_step: optimizer step {step} was not reported before the next step began "
    "(scaler.scale() was called again first): call run.after_step(loss, batch) after "
    "scaler.update() and before the next zero_grad(), once per optimizer step (calls after "
    "each micro-batch as well are fine); its gradients, for the overflow attribution and the "
    "rollback, are gone by the next step"
)


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _loop_precision(
    precision: str | Precision,
    scaler: LossScaler | None,
    fp32_modules: Iterable[str],
    model: nn.Module,
) -> Precision:
    """The ampctl precision plugin for the loop, checked before anything is changed."""
    if isinstance(precision, Precision):
        if scaler is not None and scaler is not precision.scaler:
            raise IntegrationError(
                "ProtectedRun: scaler= differs from the precision plugin's scaler; pass one "
                "of them (the plugin owns its scaler)"
            )
        scaler = precision.scaler
    elif precision not in LOOP_PRECISIONS:
        raise IntegrationError(
            f"ProtectedRun: precision={precision!r} is not allowed: precision must be one "
            f"of {', '.join(LOOP_PRECISIONS)} (what the loop's autocast runs)"
            + ("; fp16-pure and fp8 need ampctl train" if precision in PRECISIONS else "")
        )
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise IntegrationError(
            f"ProtectedRun: scaler is a {type(scaler).__name__}, not an ampctl LossScaler: "
            "a GradScaler does not record its skips; use ampctl.amp.LossScaler "
            "(LossScaler.like_gradscaler(...) behaves as GradScaler bit for bit)"
        )
    if scaler is not None and not scaler._check_finite:
        raise IntegrationError(
            "ProtectedRun: the scaler is a pure pass-through (enabled=False, "
            "check_finite=False) and records nothing; use LossScaler(enabled=False), which "
            "still detects and skips non-finite steps"
        )
    if isinstance(precision, Precision):
        return precision
    amp = make_precision(
        precision,
        fp32_modules=list(fp32_modules),
        device_type=param_device(model).type,
        scaler=scaler or LossScaler(enabled=PLUGINS[precision].needs_scaler),
    )
    amp.prepare(model)
    return amp
