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

Per optimizer step it hands the step to :class:`~ampctl.train.protection.Protection` -- the
overflow event (with the parameters whose gradients were non-finite), rollback to the last good
state after ``rollback_after`` overflows in a row, the skip budget, the floor policy, the
forward-overflow replay that moves the overflowing module to fp32 -- and every ``log_every``
steps it writes a ``metrics.jsonl`` row with the keys ``ampctl train`` writes (loss, scale,
skipped, overflow rate, grad norm / max / underflow, lr ...), so ``ampctl plot`` works on the run.
``summary.json`` is written by :meth:`ProtectedRun.finish` (or leaving the ``with`` block).

Micro-batches: ``after_step`` may be called after every micro-batch; a call after which the
scaler recorded no new ``update()`` only adds the micro-batch's loss (the loss you backpropagate,
i.e. already divided by the number of micro-batches) and batch to the step.

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

import dataclasses
import importlib
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler, make_precision, match_modules
from ampctl.amp.checks import FieldError, is_int
from ampctl.amp.precision import PLUGINS, PRECISIONS, Precision
from ampctl.amp.scaler import OptState
from ampctl.amp.stats import grad_stats
from ampctl.errors import UsageError
from ampctl.runlog import RunLayout, is_run_dir, prepare_resume
from ampctl.runlog.writers import atomic_write_text
from ampctl.train.logger import LoggingConfig, RunLogger
from ampctl.train.metrics import DeviceFigures, LogWindow
from ampctl.train.protection import (
    ForwardLoss,
    GuardConfig,
    Progress,
    Protection,
    TrainAborted,
)

__all__ = [
    "IntegrationError",
    "ProtectedRun",
    "TrainAborted",
    "require",
    "inner_optimizer",
    "reduce_max",
    "share_flags",
]

#: Why a loop with its own autocast cannot fall back to another precision.
OWN_AUTOCAST = (
    "the loop runs its own autocast and scaler, so ampctl cannot switch its precision (set the "
    "guard's floor_policy to 'warn' or 'abort', or train with ampctl train or the Lightning "
    "callback, which fall back)"
)

#: Precisions a loop with its own autocast can declare (fp16-pure and fp8 change the model and
#: the optimizer: only ``ampctl train`` builds them).
LOOP_PRECISIONS = ("fp16", "bf16", "fp32")


class IntegrationError(UsageError):
    """Bad use of an integration: the message names the argument and what is allowed."""


def require(module: str, extra: str, user: str) -> Any:
    """Import ``module`` for ``user`` (an ampctl module), or raise ImportError with the one-line
    install hint ``pip install "ampctl[extra]"`` when its package is missing."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise
        raise ModuleNotFoundError(
            f"{user} needs the {top!r} package, which is not installed: "
            f'pip install "ampctl[{extra}]"',
            name=e.name,
        ) from None


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside framework wrappers (Accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): the object a scaler unscales and steps."""
    seen = 0
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def reduce_max(flags: torch.Tensor) -> torch.Tensor:
    """All-reduce MAX of a scaler's overflow flags over the ranks (a collective, no host read):
    the ``LossScaler.reduce_flags`` that makes every rank skip the same steps."""
    out = flags.clone()
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
    return out


def share_flags(scaler: LossScaler) -> None:
    """Under ``torch.distributed`` with several ranks, make ``scaler``'s skip decisions agree
    across ranks (a forward overflow is seen by one rank only) unless a hook is set already."""
    if _world_size() > 1 and scaler.reduce_flags is None:
        scaler.reduce_flags = reduce_max


class _Ranks:
    """What Protection needs of the process group: the ranks agree on the module a
    forward-overflow replay located."""

    enabled = True

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * _world_size()
        torch.distributed.all_gather_object(out, obj)
        return out


def _count_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of its ``input_ids`` (0 when it has none)."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


def _param_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


class ProtectedRun:
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
            forward-overflow replay, the fp32 exemptions and the records) -- or an ampctl
            :class:`~ampctl.amp.precision.Precision` plugin that owns the scaler.
        guard: a :class:`~ampctl.train.protection.GuardConfig` or a mapping of its fields.
        log_every: write a metrics row every this many optimizer steps (and at ``max_steps``).
        max_steps: the planned number of optimizer steps (rows, display), or None.
        overflow_window: the steps the row's ``overflow_rate`` covers.
        display: None, a :class:`~ampctl.ui.display.Display` mode (``auto``, ``live``,
            ``plain``, ``quiet``) for the live table, or an object with ``update`` / ``event``
            / ``summary``.
        forward: ``forward(model, batch) -> loss`` for the forward-overflow replay; default
            ``model(**batch)`` and its ``.loss``.
        progress: what a rollback rewinds besides weights, optimizer state and scale (an object
            with ``state_dict`` / ``load_state_dict``, e.g. the lr scheduler).
        fp32_modules: fnmatch patterns of module names kept in fp32 from the start.
        framework: the name written to ``config.yaml`` and the display title.
        config: extra entries for ``config.yaml``.
        fallback_unavailable: why this loop cannot switch precision (None when it can: the
            caller then follows :attr:`precision`'s autocast and scaler after a fallback).
        is_main: whether this process writes the run folder (default: rank 0).
        tensorboard: also write TensorBoard scalars (needs ``tensorboard``).
        logging: a :class:`~ampctl.train.logger.LoggingConfig` or a mapping of its fields: the
            sinks beside the run folder (``tensorboard``, ``mlflow``, ``wandb`` and their
            ``mlflow_uri``, ``wandb_mode`` ...; see ``ampctl train``'s ``logging.*``), and
            ``plot`` (default true: draw ``plot.png`` at :meth:`finish`, when matplotlib is
            installed, and send it to the sinks). Without it: only ``tensorboard=``, no plot.
        read_skips: with a fused optimizer, read each step's skip flag (one host read per step)
            so overflows are attributed and decided at once, as on the standard path; for loops
            that read it anyway (a skip-aware lr schedule). False: decide at the log step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        scaler: LossScaler | None = None,
        *,
        run_dir: str | Path,
        precision: str | Precision = "fp16",
        guard: GuardConfig | Mapping[str, Any] | None = None,
        log_every: int = 10,
        max_steps: int | None = None,
        overflow_window: int = 50,
        display: Any = None,
        forward: ForwardLoss | None = None,
        progress: Progress | None = None,
        fp32_modules: Iterable[str] = (),
        framework: str = "loop",
        config: Mapping[str, Any] | None = None,
        fallback_unavailable: str | None = OWN_AUTOCAST,
        is_main: bool | None = None,
        tensorboard: bool = False,
        logging: LoggingConfig | Mapping[str, Any] | None = None,
        read_skips: bool = False,
    ) -> None:
        for name, value, ok, allowed in (
            ("log_every", log_every, is_int(log_every) and log_every >= 1, "an integer >= 1"),
            (
                "max_steps",
                max_steps,
                max_steps is None or (is_int(max_steps) and max_steps >= 1),
                "None or an integer >= 1",
            ),
            (
                "overflow_window",
                overflow_window,
                is_int(overflow_window) and overflow_window >= 1,
                "an integer >= 1",
            ),
        ):
            if not ok:
                raise IntegrationError(
                    f"ProtectedRun: {name}={value!r} is not allowed: {name} must be {allowed}"
                )
        self._logging = (
            _fields_arg(LoggingConfig, logging, "logging") if logging is not None else None
        )
        self.model = model
        self.run_dir = Path(run_dir)
        self.framework = framework
        self.read_skips = bool(read_skips)
        self.log_every = log_every
        self.max_steps = max_steps
        self.overflow_window = overflow_window
        amp = self._precision(precision, scaler, fp32_modules, model)
        self.protection = Protection(
            model,
            optimizer,
            amp,
            config=_fields_arg(GuardConfig, guard, "guard") if guard is not None else GuardConfig(),
            emit=self._emit,
            progress=progress,
            forward=forward,
            fallback_unavailable=fallback_unavailable,
            dist=_Ranks() if _world_size() > 1 else None,
        )
        share_flags(amp.scaler)
        self.is_main = _rank0() if is_main is None else bool(is_main)
        self._display_arg = display
        self._own_display = False
        self.display: Any = None
        self._tensorboard = tensorboard
        self._plot = self._logging is not None and self._logging.plot
        self._extra_config = dict(config or {})
        self.log: RunLogger | None = None
        self.window = LogWindow()
        self.status: str | None = None
        self.summary: dict[str, Any] | None = None
        self.last_row: dict[str, Any] = {}
        self._early_events: list[dict[str, Any]] = []
        self._step = 0
        self._started = False
        # the scaler's update count at the last step seen: a call after which it did not change
        # is a micro-batch of gradient accumulation
        self._updates_seen = self.scaler.num_steps
        self._batches: list[Any] = []
        self._step_loss: torch.Tensor | None = None
        self._step_tokens = 0
        self._tokens_total = 0
        self._stats: dict[str, torch.Tensor] | None = None
        self._stats_step: int | None = None
        self._lr: Any = None
        self._wall_before = 0.0
        self._resumed_from: str | Path | None = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ building
    @staticmethod
    def _precision(
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
                + (
                    "; fp16-pure and fp8 need ampctl train"
                    if precision in PRECISIONS or precision == "fp8"
                    else ""
                )
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
            device_type=_param_device(model).type,
            scaler=scaler or LossScaler(enabled=PLUGINS[precision].needs_scaler),
        )
        amp.prepare(model)
        return amp

    # ------------------------------------------------------------------ views
    @property
    def precision(self) -> Precision:
        """The precision plugin in use (a fallback replaces it)."""
        return self.protection.precision

    @property
    def scaler(self) -> LossScaler:
        return self.precision.scaler

    @property
    def optimizer(self) -> Any:
        return self.protection.optimizer

    @property
    def step(self) -> int:
        """The last optimizer step seen."""
        return self._step

    @property
    def events(self) -> list[dict[str, Any]]:
        """The guard's events of this process (also in ``events.jsonl``)."""
        return self.protection.events

    @property
    def fused(self) -> bool:
        """Whether the optimizer skips on the device (``scaler.step`` reads nothing)."""
        return bool(getattr(inner_optimizer(self.optimizer), "_step_supports_amp_scaling", False))

    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped: what ``scaler.step`` read, or (fused
        optimizer, nothing read) the scaler's device flag, which **syncs**."""
        read = self.scaler.last_step_skipped_host
        return read if read is not None else self.scaler.last_step_skipped

    def _device(self) -> torch.device:
        return self.scaler.device or _param_device(self.model)

    def _elapsed(self) -> float:
        return self._wall_before + time.perf_counter() - self._t0

    def _is_log(self, step: int) -> bool:
        return step % self.log_every == 0 or (self.max_steps is not None and step == self.max_steps)

    # ------------------------------------------------------------------ lifecycle
    def start(self, step: int | None = None, *, resumed_from: str | Path | None = None) -> None:
        """Open the run folder and keep the starting state as the first snapshot. ``step``: the
        loop's optimizer step count now (default: 0, or the one :meth:`load_state_dict` gave);
        above 0 (or with ``resumed_from``, the checkpoint) this is a resume: rows and events
        logged after ``step`` by the interrupted run are dropped and a ``resume`` event is
        written. Called by the first :meth:`after_step` when not called before. No host read."""
        self._start(step, resumed_from=resumed_from)
        # everything is loaded and no step of this run has been taken: the scaler's count now
        self._updates_seen = self.scaler.num_steps

    def _start(self, step: int | None = None, *, resumed_from: str | Path | None = None) -> None:
        if self._started:
            return
        step = self._step if step is None else int(step)
        if resumed_from is None:
            resumed_from = self._resumed_from
        resumed = step > 0 or resumed_from is not None
        layout = RunLayout(self.run_dir)
        if self.is_main:
            if not resumed and is_run_dir(self.run_dir):
                raise IntegrationError(
                    f"run_dir {str(self.run_dir)!r} holds a run already: pick another run_dir "
                    "(ampctl never mixes two runs in one folder), or resume (start(step=...) "
                    "with the loop's step)"
                )
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if resumed:
                prepare_resume(layout, Path(resumed_from or self.run_dir), step)
            if not layout.config.is_file():
                atomic_write_text(layout.config, self._config_yaml())
        self.display = self._make_display()
        self.log = RunLogger(
            self.run_dir,
            is_main=self.is_main,
            display=self.display,
            tensorboard=self._tensorboard,
            logging=self._logging,
        )
        self.log.open(step, self._config())
        if resumed:
            where = f" from {resumed_from}" if resumed_from is not None else ""
            self.log.event(
                {
                    "step": step,
                    "kind": "resume",
                    "message": f"resumed{where} at step {step} ({self.framework})",
                }
            )
        for ev in self._early_events:
            self.log.event(ev)
        self._early_events.clear()
        self._step = step
        self._t0 = time.perf_counter()
        self.protection.start(step)
        self._started = True

    def _make_display(self) -> Any:
        d = self._display_arg
        if d is None or not self.is_main:
            return None
        if isinstance(d, str):
            from ampctl.ui.display import Display

            disp = Display(self.max_steps, mode=d, title=f"ampctl - {self.framework}")
            disp.__enter__()
            self._own_display = True
            return disp
        return d

    def _config_yaml(self) -> str:
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(self._config()))

    def _config(self) -> dict[str, Any]:
        """What ``config.yaml`` holds (and the sinks get as the run's parameters)."""
        sc = self.scaler
        guard = dataclasses.asdict(self.protection.config)
        return {
            "integration": self.framework,
            "precision": {"name": self.precision.name, "fp32_modules": self.precision.fp32_modules},
            "scaler": {
                "init_scale": sc.get_scale(),
                "growth_factor": sc.get_growth_factor(),
                "backoff_factor": sc.get_backoff_factor(),
                "growth_interval": sc.get_growth_interval(),
                "hysteresis": sc.hysteresis,
                "min_scale": sc.min_scale,
                "max_scale": sc.max_scale,
                "history_size": sc.history_size,
                "enabled": sc.is_enabled(),
            },
            "guard": guard,
            "trainer": {
                "max_steps": self.max_steps,
                "log_every": self.log_every,
                "overflow_window": self.overflow_window,
            },
            **self._extra_config,
        }

    def __enter__(self) -> ProtectedRun:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            status = None
        elif issubclass(exc_type, TrainAborted):
            status = "aborted"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        else:
            status = "failed"
        self.finish(status)

    # ------------------------------------------------------------------ per step
    def add_batch(self, loss: Any = None, batch: Any = None, *, tokens: int | None = None) -> None:
        """Record one micro-batch of the current step: its loss contribution (the loss you
        backpropagate, before scaling), the batch (for the forward-overflow replay) and its
        tokens (default: ``batch["input_ids"].numel()``). No host read."""
        if loss is not None:
            t = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            t = t.detach().float().mean()
            self._step_loss = t if self._step_loss is None else self._step_loss + t
        if batch is not None:
            self._batches.append(batch)
        self._step_tokens += int(tokens) if tokens is not None else _count_tokens(batch)

    def before_step(self, step: int | None = None) -> None:
        """Optional: call between the last backward and the optimizer step (before clipping) to
        take a log step's gradient statistics there and the lr the step uses. Without it,
        :meth:`after_step` takes the statistics from the gradients the step left behind
        (unscaled by ``scaler.step``, after any clipping; none with a fused optimizer). Works on
        scaled or unscaled gradients (the scaler's stage for the optimizer says which). No host
        read."""
        upcoming = self._step + 1 if step is None else int(step)
        self._lr = _copy(self.optimizer.param_groups[0]["lr"])
        if not self._is_log(upcoming) or self._stats_step == upcoming:
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
        self._stats, self._stats_step = stats, upcoming

    def _post_step_stats(self) -> dict[str, torch.Tensor] | None:
        """Gradient statistics from what the step left: unscaled unless the optimizer is fused
        (then unknown: none). No host read."""
        if self.fused:
            return None
        sc = self.scaler
        scale = sc.recent_history(1)[0, 1].float() if sc.is_enabled() else 1.0
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
        the step's gradients), with the micro-batch's loss and batch (see :meth:`add_batch`).
        ``step``: the loop's optimizer step count after this step (default: one more than the
        last). When the scaler recorded no new step since the last call (gradient accumulation)
        only the micro-batch is added. Returns the metrics row on a log step, else None.

        Host reads: see the module docstring. May raise
        :class:`~ampctl.train.protection.TrainAborted` (the guard gave up)."""
        if not self._started:
            # the scaler's count was taken when the run was built (or loaded): this call may
            # follow the run's first update already
            self._start()
        self.add_batch(loss, batch, tokens=tokens)
        n = self.scaler.num_steps
        if n == self._updates_seen:
            return None
        self._updates_seen = n
        self._step = self._step + 1 if step is None else int(step)
        step = self._step
        skipped = self.scaler.last_step_skipped_host
        if skipped is None and self.read_skips:
            skipped = self.scaler.last_step_skipped  # syncs (the caller reads it anyway)
        batches, self._batches = self._batches, []
        step_loss, self._step_loss = self._step_loss, None
        tokens_n, self._step_tokens = self._step_tokens, 0
        self._tokens_total += tokens_n
        if step_loss is not None:
            self.window.add(step_loss, tokens_n)
        else:
            self.window.tokens += tokens_n
        log = self._is_log(step)
        stats = self._stats if self._stats_step == step else None
        self._stats, self._stats_step = None, None
        if log and stats is None:
            stats = self._post_step_stats()
        lr, self._lr = self._lr, None
        try:
            self.protection.after_step(step, skipped=skipped, batches=batches or None)
            return self._log_row(step, stats, lr) if log else None
        except TrainAborted:
            self.status = "aborted"
            raise

    def _log_row(self, step: int, stats: dict[str, torch.Tensor] | None, lr: Any) -> dict[str, Any]:
        """Read the interval's figures in one transfer, write the row, then take the guard's
        waiting decisions (fused optimizer). **Syncs** once."""
        fig = DeviceFigures(self._device())
        w = self.window
        fig.add("loss_sum", w.loss_sum if w.loss_sum is not None else 0.0)
        fig.add("loss_n", w.loss_n if w.loss_n is not None else 0.0)
        if stats is not None:
            fig.add("grad_norm_sq", stats["grad_norm"] ** 2)
            fig.add("grad_underflow", stats["grad_underflow"])
            fig.add("grad_elems", stats["grad_elems"])
            fig.add("nonfinite_grads", stats["nonfinite_grads"])
            fig.add("grad_amax", stats["grad_amax"])
        for k, v in self.scaler.device_counters().items():
            fig.add(k, v)
        fig.add("recent_skips", self.scaler.recent_skips(self.overflow_window))
        fig.add("lr", lr if lr is not None else _copy(self.optimizer.param_groups[0]["lr"]))
        pending = self.protection.pending_reads()
        if pending is not None:
            fig.add("guard", pending, vector=True)
        v = fig.read()  # the log read
        window, self.window = self.window, LogWindow()
        dt = max(time.perf_counter() - window.t0, 1e-9)
        n = self.scaler.num_steps
        row: dict[str, Any] = {
            "step": step,
            "loss": v["loss_sum"] / v["loss_n"] if v["loss_n"] > 0 else float("nan"),
            "scale": v["scale"] if self.scaler.is_enabled() else 1.0,
            "skipped": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "overflow_rate": v["recent_skips"] / max(min(self.overflow_window, n), 1),
            "lr": v["lr"],
            "precision": self.precision.name,
            "tokens_per_s": window.tokens / dt if window.tokens else None,
            "elapsed_s": self._elapsed(),
            "max_steps": self.max_steps,
            "grad_norm": None,
            "grad_amax": None,
            "grad_underflow_frac": None,
            "nonfinite_grads": None,
        }
        if stats is not None:
            row.update(
                grad_norm=max(v["grad_norm_sq"], 0.0) ** 0.5,
                grad_amax=v["grad_amax"],
                grad_underflow_frac=v["grad_underflow"] / max(v["grad_elems"], 1),
                nonfinite_grads=int(v["nonfinite_grads"]),
            )
        self.last_row = row
        assert self.log is not None
        self.log.metrics(row)
        if "guard" in v:
            self.protection.on_read(v["guard"])
        return row

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
        if not self._started:  # nothing ran (or start() refused the folder): nothing to write
            self.summary = {"status": status or self.status or "failed", "steps": self._step}
            return self.summary
        status = status or self.status or "ok"
        if status == "ok":
            try:
                self.protection.sync()
            except TrainAborted:
                status = "aborted"
        self.status = status
        st = self.scaler.stats()
        wall = self._elapsed()
        configured = set(match_modules(self.model, self.precision.fp32_modules))
        assert self.log is not None
        summary: dict[str, Any] = {
            "status": status,
            "framework": self.framework,
            "final_loss": self.last_row.get("loss"),
            "steps": self._step,
            "max_steps": self.max_steps,
            "skipped": st["skipped_total"],
            "forward_overflows": st["forward_overflows"],
            "overflow_rate": st["skipped_total"] / max(st["steps"], 1),
            "final_scale": st["scale"],
            "precision": self.precision.name,
            "promoted_modules": [m for m in self.precision.exempted if m not in configured],
            "fp32_modules": list(self.precision.exempted),
            "events": self.log.event_counts() if self.is_main else {},
            "wall_time_s": wall,
            "tokens_per_s": self._tokens_total / max(wall, 1e-9) if self._tokens_total else None,
            "run_dir": str(self.run_dir),
        }
        err = self.log.summary(summary)
        if err:
            summary["summary_error"] = err
        if self._plot and self.is_main:
            self._send_plot()
        self.log.close(status)
        if self.display is not None and callable(getattr(self.display, "summary", None)):
            self.display.summary(summary)
        if self._own_display and self.display is not None:
            self.display.__exit__(None, None, None)
        self.summary = summary
        return summary

    def _send_plot(self) -> None:
        """``plot.png`` into the run folder and to the sinks (nothing without matplotlib)."""
        from ampctl.commands.plot import maybe_plot_run

        got = maybe_plot_run(self.run_dir)
        if isinstance(got, Path) and self.log is not None:
            self.log.artifact(got)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of the loop should keep so a resume continues the run: the step,
        the scaler's update count, the guard's history, tokens, wall time, the precision and
        the modules moved to fp32. Plain numbers, strings and lists (JSON and ``weights_only``
        safe). No host read."""
        return {
            "step": self._step,
            "updates": self.scaler.num_steps,
            "guard": self.protection.state_dict(),
            "tokens": self._tokens_total,
            "wall_s": self._elapsed(),
            "precision": self.precision.name,
            "exempted": list(self.precision.exempted),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, resumed_from: str | Path | None = None
    ) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`): the step, the guard's history,
        and the fp32 exemptions the guard had made. ``resumed_from``: the checkpoint, named in
        the ``resume`` event when :meth:`start` is not given one."""
        if self._started:
            raise IntegrationError(
                "ProtectedRun.load_state_dict: call it before the first step (before start())"
            )
        self._step = int(state.get("step", 0))
        # the scaler restored from the same checkpoint has this count
        self._updates_seen = int(state.get("updates", self.scaler.num_steps))
        self._resumed_from = resumed_from
        self.protection.load_state_dict(dict(state.get("guard", {})))
        self._tokens_total = int(state.get("tokens", 0))
        self._wall_before = float(state.get("wall_s", 0.0))
        for name in state.get("exempted", []):
            try:
                self.precision.exempt(self.model, name)
            except AttributeError:  # the module is gone (another model): nothing to exempt
                continue


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _fields_arg(cls: type, value: Any, arg: str) -> Any:
    """``value`` as a ``cls`` config (``GuardConfig``, ``LoggingConfig``): one already, or a
    mapping of its fields; anything else is an :class:`IntegrationError` naming ``arg``."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise IntegrationError(
            f"ProtectedRun: {arg}={value!r} is not allowed: {arg} must be a {cls.__name__} or a "
            "mapping of its fields"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise IntegrationError(
            f"ProtectedRun: {arg} has unknown fields {unknown}; allowed: {', '.join(sorted(names))}"
        )
    try:
        return cls(**value)
    except FieldError as e:
        raise IntegrationError(e.named(arg)) from None
