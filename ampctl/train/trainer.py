"""The protected training loop (a library call; ``ampctl train`` is a thin wrapper).

One optimizer step, then protection, then logging, then checkpointing -- each one call::

    while step < max_steps:                 # step_once():
        out = train_step()                  #   autocast forward, scaled backward (x grad_accum),
                                            #   fused unscale + check, clip, step or skip, update
        rewind = protection.after_step(...) #   guard: rollback | fallback | promotion | abort
        if rewind: apply_rewind(rewind)     #   a rollback hands the loop its position back
        elif log: log_step(out)             #   every log_every steps: one host read
        save()                              # every ckpt_every steps: atomic checkpoint

With ``trainer.compile=true`` the forward runs through ``torch.compile`` of the model; the
protected step around it is unchanged. Log steps with probes (fp8 cast health ...) run through
the eager module, which shares the parameters: a compiled graph does not run hooks added after
it was traced. The guard's forward replay always runs the eager module.

Host reads: one per step on the standard path (the scaler's skip flag, which also drives the
lr schedule and the guard), none with a fused optimizer (the skip, the lr schedule and the
guard's record stay on the device); plus one per log interval (every figure of the interval,
and on the fused path the guard's pending decisions, stacked). A skipped step on the standard
path reads once more (attribution); clean steps pay nothing more.
"""

from __future__ import annotations

import dataclasses
import errno
import shlex
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import make_precision
from ampctl.amp.actgrad import ActGradProbe
from ampctl.amp.precision import saved_in_fp32
from ampctl.amp.stats import grad_stats
from ampctl.protect.figures import DeviceFigures, LogWindow, Probe, sampling
from ampctl.protect.logger import RunLogger
from ampctl.protect.loss import extract_loss
from ampctl.protect.protection import Protection, Rewind, TrainAborted, TrainDiverged
from ampctl.protect.shell import RunShell, Shelled, write_config
from ampctl.runlog import RunLayout, as_number, branch_event, prepare_resume, read_jsonl
from ampctl.runlog.layout import checkpoint_step
from ampctl.train.builders import (
    BuildError,
    accepts_batch_keys,
    build_data_source,
    build_model,
    build_optimizer,
    resolve_device,
)
from ampctl.train.checkpoint import (
    CheckpointWriteError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from ampctl.train.dist import (
    DistContext,
    full_state,
    init_distributed,
    load_full_state,
    no_sync,
    wrap_model,
)
from ampctl.train.schedule import lr_factor

__all__ = [
    "Trainer",
    "TrainResult",
    "TrainAborted",
    "CheckpointWriteError",
    "train",
]


Fault = Callable[["Trainer", int, str], None]


@dataclass
class TrainResult:
    summary: dict[str, Any]
    run_dir: Path
    status: str  # ok | aborted | interrupted | failed
    exit_code: int


@dataclass
class StepOutput:
    skipped: bool | None  # as the scaler read it; None when nothing was read (fused optimizer)
    batches: list[dict[str, torch.Tensor]]
    stats: dict[str, torch.Tensor] | None  # gradient statistics (log steps)


class Trainer(Shelled):
    """Build everything from a config and run the protected loop.

    Args:
        cfg: a validated :class:`~ampctl.config.RunConfig` (not imported: the config composes
            this package's settings, so the loop imports no config module).
        run_dir: the run folder (created by the caller; see :func:`ampctl.runlog.new_run_dir`).
        display: object with ``update(metrics)``, ``event(event)``, ``summary(summary)``, or None.
        resume: a checkpoint dict (from :func:`load_checkpoint`) to continue from. When it is not
            the run's newest checkpoint the later history is set aside first
            (:func:`ampctl.runlog.prepare_resume`).
        fault: test hook ``fault(trainer, step, phase)`` called at ``"after_backward"`` (to plant
            inf/NaN) -- the planted-fault tests use it; None in normal runs.
    """

    def __init__(
        self,
        cfg: Any,
        run_dir: Path,
        *,
        display: Any = None,
        resume: dict[str, Any] | None = None,
        fault: Fault | None = None,
        dist_ctx: DistContext | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.fault = fault
        self.ctx = dist_ctx or init_distributed(cfg.dist.strategy, cfg.trainer.device)
        self.device = self._device()
        torch.manual_seed(cfg.trainer.seed)
        self.data = build_data_source(
            cfg.data,
            model=cfg.model,
            seed=cfg.trainer.seed,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
        )
        self.model = self._model()
        precision = self._precision(resume)
        self.fwd_model = wrap_model(self.model, self.ctx, self.device)
        self.compiled = self._compile(self.fwd_model) if cfg.trainer.compile else None
        optimizer = build_optimizer(cfg.optim, precision.optimizer_params(self.model), self.device)
        self.log = RunLogger(
            self.run_dir,
            is_main=self.ctx.is_main,
            display=display,
            logging=cfg.logging,
        )
        self.protection = Protection(
            self.model,
            optimizer,
            precision,
            config=cfg.guard,
            emit=self.log.event,
            progress_state=self._position,
            forward=self._forward_loss,
            rebuild_optimizer=lambda params: build_optimizer(cfg.optim, params, self.device),
            dist=self.ctx,
            rerun_clip=cfg.optim.clip_grad_norm,
        )
        self.shell = RunShell(
            self.protection,
            self.run_dir,
            framework="ampctl",
            max_steps=cfg.trainer.max_steps,
            overflow_window=cfg.trainer.overflow_window,
            on_rewind=self._rewound,
            log=self.log,
        )
        self.lr_scale = 1.0  # the lr multiplier rollbacks for divergence have cut
        self.diverged_since: int | None = None
        # the overrides of the command line that started the run (``ampctl train``): the
        # fresh-start hint repeats them (None: not started from a command line, or resumed)
        self.hint_overrides: list[str] | None = None
        self._stopped = False
        self.stop_checkpoint: Path | None = None  # written at a stop (abort, divergence)
        # figures sampled on log steps (see metrics.Probe)
        layers = cfg.logging.act_grad_layers or None
        self.probes: list[Probe] = [ActGradProbe(layers)] if cfg.logging.act_grads else []
        self._params_owner: tuple[Any, Any] = (None, None)  # what ``params`` was listed for
        self._params_list: list[nn.Parameter] = []
        self.step = 0
        self.applied: int | torch.Tensor = 0  # optimizer steps applied (drives the lr schedule)
        self.failure: str | None = None
        self._stop_signal: int | None = None
        self._stop_agreed = False  # under torchrun all ranks stop together, at a log step
        if resume is not None:
            self._load(resume)
        if self.fused:
            self.applied = torch.tensor(float(self.applied), device=self.device)

    # ------------------------------------------------------------------ building
    def _device(self) -> torch.device:
        device = resolve_device(self.cfg.trainer.device)
        if self.ctx.enabled and device.type == "cuda":
            device = torch.device("cuda", self.ctx.local_rank)
        if (
            self.ctx.enabled
            and self.ctx.strategy == "fsdp"
            and self.cfg.precision.name == "fp16-pure"
        ):
            raise BuildError(
                "precision=fp16-pure cannot be combined with dist.strategy=fsdp: use precision=fp16 "
                "(FSDP keeps fp32 shards; autocast computes in fp16)"
            )
        if self.ctx.enabled and self.ctx.strategy == "fsdp" and self.cfg.precision.name == "fp8":
            raise BuildError(
                "precision=fp8 cannot be combined with dist.strategy=fsdp yet: demoting an fp8 "
                "layer swaps a module whose weight FSDP has sharded; use dist.strategy=ddp"
            )
        if self.cfg.optim.fused and self.cfg.trainer.log_every > self.cfg.scaler.history_size:
            raise BuildError(
                f"trainer.log_every={self.cfg.trainer.log_every} is above "
                f"scaler.history_size={self.cfg.scaler.history_size}: with optim.fused=true the "
                "guard reads every step's record at the log step; raise scaler.history_size"
            )
        return device

    def _model(self) -> nn.Module:
        model = build_model(self.cfg.model).to(self.device)
        missing = accepts_batch_keys(model, list(self.data.batch_keys))
        if missing:
            raise BuildError(
                f"model._target_={self.cfg.model['_target_']}: forward() does not accept batch "
                f"keys {missing}; it is called as model(**batch) with "
                f"{', '.join(self.data.batch_keys)}"
            )
        return model

    def _compile(self, model: nn.Module) -> nn.Module:
        """``torch.compile`` of the forward model (compiled lazily, on the first step)."""
        import torch._dynamo

        backend = self.cfg.trainer.compile_backend
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise BuildError(
                f"trainer.compile_backend={backend!r} is not a torch.compile backend here: "
                f"use one of {', '.join(b for b in known if 'TESTING' not in b)}"
            )
        return torch.compile(model, backend=backend)

    def _precision(self, resume: dict[str, Any] | None):
        cfg = self.cfg
        name, in_fp32 = cfg.precision.name, []
        if resume is not None:
            # the run keeps the precision it had reached (a fallback sticks) unless the user
            # asks for another one on the command line of the resume
            asked = cfg.precision.name != resume["config"]["precision"]["name"]
            name = cfg.precision.name if asked else resume["precision"]["name"]
            in_fp32 = saved_in_fp32(resume["precision"])
        precision = make_precision(
            name,
            fp32_modules=cfg.precision.fp32_modules,
            device_type=self.device.type,
            scaler_args=dataclasses.asdict(cfg.scaler),
            options=cfg.precision.options(),
        )
        precision.prepare(self.model)
        if resume is not None:
            precision.restore(self.model, resume["precision"])  # e.g. fp8 layer demotions
        for n in in_fp32:
            precision.to_fp32(self.model, n)
        precision.scaler.init_state(self.device)
        if self.ctx.enabled:
            precision.scaler.reduce_flags = self.ctx.reduce_max
        return precision

    # ------------------------------------------------------------------ views
    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps (fp32 masters in fp16-pure); listed again only
        when the precision or the optimizer changes (a fallback), not on every step."""
        owner = self._params_owner
        if owner[0] is not self.precision or owner[1] is not self.optimizer:
            self._params_list = self.precision.optimizer_params(self.model)
            self._params_owner = (self.precision, self.optimizer)
        return self._params_list

    def active_probes(self) -> list[Probe]:
        """The loop's probes and the precision's (a fallback replaces the precision's)."""
        return [*self.probes, *self.precision.probes()]

    @property
    def fused(self) -> bool:
        """Whether the optimizer skips on the device (no host read per step)."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @property
    def tokens_per_step(self) -> int:
        d = self.cfg.data
        return d.batch_size * d.seq_len * self.cfg.trainer.grad_accum_steps * self.ctx.world_size

    # ------------------------------------------------------------------ the loop
    def run(self, *, close_log: bool = True) -> TrainResult:
        """Train to ``trainer.max_steps``. Writes metrics, events, checkpoints and summary.
        ``close_log=False`` leaves the sinks open after the summary (the caller sends the plot
        and closes ``self.log``)."""
        status, code = "ok", 0
        self.shell.open(self.step, self.cfg.to_dict())
        with _Signals(self):
            try:
                self.protection.start(self.step)
                while self.step < self.end:
                    before = self.step
                    self.step_once()
                    # a rollback put the step back (to a snapshot): no checkpoint of the restored
                    # state there -- its scale is the backed-off one of the trouble, and a
                    # checkpoint of that step written before it would be overwritten (#36)
                    due = self.step > before and self._is_due(self.cfg.trainer.ckpt_every, 0)
                    ckpt = self.save() if due else None
                    if self._stop_signal is not None and (
                        not self.ctx.enabled or self._stop_agreed
                    ):
                        status, code = self._interrupt(ckpt)
                        break
            except TrainAborted as e:
                status, code = e.status, 1  # aborted | diverged
                if isinstance(e, TrainDiverged):
                    self.diverged_since = e.since
                self._save_after_abort()
            except CheckpointWriteError as e:
                self._fail(str(e))
                status, code = "failed", 1
            except OSError as e:  # a metrics row or an event not written (a full disk ...)
                self._fail(_write_failure(e, self.step))
                status, code = "failed", 1
            except BaseException as e:
                self.log.close("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
                raise
        summary = self._summary(status)
        err = self.shell.write_summary(summary)
        if err:
            if code == 0:  # trained to the end, but the run folder lacks its summary
                code = 1
                self.failure = (
                    f"{err}; the last checkpoint is written: ampctl train --resume "
                    f"{self.run_dir} writes the summary once there is room"
                )
        if close_log:
            self.log.close(status)
        return TrainResult(summary=summary, run_dir=self.run_dir, status=status, exit_code=code)

    @property
    def end(self) -> int:
        """The step this process stops at: ``trainer.stop_at`` when set (successive halving runs
        a trial in pieces without moving the lr schedule's horizon), else ``max_steps``."""
        t = self.cfg.trainer
        return t.stop_at if t.stop_at is not None else t.max_steps

    def _is_due(self, every: int, ahead: int = 1) -> bool:
        """Whether step ``self.step + ahead`` is a multiple of ``every`` or the last step."""
        s = self.step + ahead
        return s % every == 0 or s == self.end

    # ------------------------------------------------------------------ one step
    def step_once(self) -> dict[str, Any] | None:
        """One turn of the loop: an optimizer step, the guard's decision on it (a rollback puts
        the loop's position back: :meth:`apply_rewind`), and the log step when one is due.
        Returns the metrics row written, if any."""
        log = self._is_due(self.cfg.trainer.log_every)
        out = self.train_step(log)
        rewind = self.protection.after_step(self.step, skipped=out.skipped, batches=out.batches)
        if self.protection.retried:  # rerun clean (a transient fault): the update was applied
            self.applied += 1
        if rewind is not None:
            self.apply_rewind(rewind)
            return None
        return self.log_step(out) if log else None

    def train_step(self, log: bool = False) -> StepOutput:
        """One optimizer step (with accumulation). One host read on the standard path (the
        skip flag), none with a fused optimizer."""
        accum = self.cfg.trainer.grad_accum_steps
        precision = self.precision
        self.optimizer.zero_grad(set_to_none=True)
        precision.zero_grad()
        batches = []
        self.protection.mark_step_start()  # the RNG state a rerun starts from (guard.rerun)
        probes = self.active_probes() if log else []
        # hooks need the eager module: a compiled graph does not run hooks added after tracing
        fwd = self.compiled if self.compiled is not None and not probes else self.fwd_model
        with sampling(probes, self.model, log):
            for i in range(accum):
                batch = {
                    k: v.to(self.device, non_blocking=True)
                    for k, v in self.data.next_batch().items()
                }
                batches.append(batch)
                with no_sync(self.fwd_model, self.ctx, last=i == accum - 1):
                    loss = self._forward_loss(fwd, batch) / accum
                    precision.backward(loss)
        precision.after_backward()
        if self.fault is not None:
            self.fault(self, self.step + 1, "after_backward")
        precision.unscale_(self.optimizer)
        stats = None
        if log:
            scale_t = self.scaler.get_scale_tensor() if self.scaler.is_enabled() else 1.0
            stats = grad_stats((p.grad for p in self.params), scale_t, self.device)
        if self.cfg.optim.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(
                self.params, self.cfg.optim.clip_grad_norm, foreach=True
            )
            self.scaler.report_grad_norm(norm)  # recorded; the spike rule's second figure
        self._set_lr()
        skipped = precision.optimizer_step(self.optimizer)
        self.step += 1
        self.shell.add_tokens(self.tokens_per_step)  # its loss is the scaler's record
        if skipped is False:
            self.applied += 1
        elif skipped is None:  # fused: the step counts unless the scaler skipped it (device)
            self.applied = self.applied + (1 - self.scaler.skip_flag())
        return StepOutput(skipped=skipped, batches=batches, stats=stats)

    def _forward_loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.precision.autocast():
            out = model(**batch)
        return extract_loss(out).float()

    def _set_lr(self) -> None:
        o = self.cfg.optim
        factor = lr_factor(
            self.applied,  # a host int, or (fused) a device tensor: no host read either way
            max_steps=self.cfg.trainer.max_steps,
            warmup_steps=o.warmup_steps,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
        )
        lr = o.lr * self.lr_scale * factor  # lr_scale: cut by rollbacks for divergence
        for g in self.optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].copy_(lr)
            else:
                g["lr"] = float(lr)

    # ------------------------------------------------------------------ logging
    def log_step(self, out: StepOutput) -> dict[str, Any] | None:
        """The log step (:meth:`RunShell.log_step`), with this loop's probes and its stop flag
        (the ranks stop together). Returns the row (None when a decision discarded the
        interval)."""
        probes = self.active_probes()  # before the read: a fallback decided there keeps the row
        fig = DeviceFigures(self.device)
        fig.add("stop", float(self._stop_signal is not None), "max")
        return self.shell.log_step(
            self.step,
            fig,
            stats=out.stats,
            lr=self.optimizer.param_groups[0]["lr"],
            probes=probes,
            ctx=self.ctx,
            # FSDP's gradients are sharded: combine over ranks; DDP's are already all-reduced
            sharded=self.ctx.enabled and self.ctx.strategy == "fsdp",
            on_read=self._agree_stop,
        )

    def _agree_stop(self, values: dict[str, Any]) -> None:
        """A rank that was signalled stops every rank, at this log step."""
        if values["stop"] > 0 and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another rank was signalled
        self._stop_agreed = values["stop"] > 0

    # ------------------------------------------------------------------ rollback
    def _position(self) -> dict[str, Any]:
        """The loop's own position, kept with each snapshot (the protection's progress_state):
        the step, the updates applied (the lr schedule), the data position and the RNG."""
        a = self.applied
        return {
            "step": self.step,
            "applied": a.clone() if isinstance(a, torch.Tensor) else a,
            "data": self.data.state_dict(),
            "rng": rng_state(),
        }

    def _rewound(self, rewind: Rewind) -> bool:
        self.apply_rewind(rewind)
        return True  # the position went back: the interval's steps run again

    def apply_rewind(self, rewind: Rewind) -> None:
        """Put the position of a rollback's (or fallback's) snapshot back; the interval's window
        restarts (its steps are run again)."""
        pos = rewind.progress
        if pos is not None:
            self.step = pos["step"]
            a = pos["applied"]
            self.applied = a.clone() if isinstance(a, torch.Tensor) else a
            self.data.load_state_dict(pos["data"])
            set_rng_state(pos["rng"])
        self.lr_scale *= rewind.lr_factor
        if rewind.skip_batches and pos is not None:
            self._skip_batches(rewind, pos["data"]["position"])
        self.shell.window = LogWindow(first_update=self.scaler.num_updates)

    def _skip_batches(self, rewind: Rewind, restored: int) -> None:
        """``guard.skip_batches``: go on past the batches of the step that caused the rollback,
        and that many more (PaLM's skip around a spike). The positions are an event; the data
        position is in every checkpoint, so a resume continues from the same place."""
        accum = self.cfg.trainer.grad_accum_steps
        bad_end = restored + (rewind.from_step - rewind.to_step) * accum
        to = bad_end + rewind.skip_batches
        self.data.load_state_dict({"position": to})
        self.log.event(
            {
                "step": self.step,
                "kind": "data_skip",
                "message": f"data skipped from batch {restored} to {to}: the batches of step "
                f"{rewind.from_step} and {rewind.skip_batches} after them",
                "from_position": restored,
                "to_position": to,
                "batches": to - restored,
            }
        )

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (weights_only-loadable). Under torchrun every rank
        must call it (FSDP gathers full state dicts; per-rank RNG and log windows are gathered).
        **Syncs** (copies the state to the host)."""
        model_sd, optim_sd = full_state(self.model, self.optimizer, self.ctx)
        per_rank = self.ctx.all_gather_object(
            {"rng": rng_state(), "log_window": self.shell.window.state_dict()}
        )
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scaler": self.scaler.state_dict(),
            "scheduler": {"applied": int(self.applied)},
            "rng": per_rank[0]["rng"],
            "data": {**self.data.state_dict(), "world_size": self.ctx.world_size},
            "config": self.cfg.to_dict(),
            "precision": self.precision.state_dict(),
            "master": self.precision.master_state(),
            "protection": self.protection.state_dict(),
            "trainer": {
                **self.shell.accounts(),
                "lr_scale": self.lr_scale,
                # written when the guard stopped the run: its scaler and optimizer hold what the
                # trouble left (a collapsed scale), whatever its step: diagnose never resumes it
                **({"stopped": True} if self._stopped else {}),
            },
            "log_window": per_rank[0]["log_window"],
            "dist": {
                "strategy": self.ctx.strategy if self.ctx.enabled else "none",
                "world_size": self.ctx.world_size,
                "per_rank": per_rank if self.ctx.enabled else None,
            },
        }

    def save(self) -> Path:
        """Write a checkpoint atomically; on failure the previous one stays and a clear
        :class:`CheckpointWriteError` is raised."""
        layout = RunLayout(self.run_dir)
        state = self.state()  # collective under torchrun
        if not self.ctx.is_main:
            return layout.checkpoint(self.step)
        return save_checkpoint(layout, self.step, state, keep_last=self.cfg.trainer.keep_last)

    def _save_after_abort(self) -> None:
        self._stopped = True  # the checkpoint says it holds the state at the stop
        try:
            self.stop_checkpoint = self.save()  # kept for diagnose: never a resume point
        except CheckpointWriteError as e:
            self._fail(str(e))

    def _fail(self, message: str) -> None:
        """The run stops on a failed write: the reason, and an ``error`` event when events.jsonl
        still takes one (on a full disk it may not: the reason is printed all the same)."""
        self.failure = message
        try:
            self.log.event({"step": self.step, "kind": "error", "message": message})
        except OSError:
            pass

    def _interrupt(self, ckpt: Path | None) -> tuple[str, int]:
        ckpt = ckpt or self.save()
        name = "SIGINT" if self._stop_signal == signal.SIGINT else "SIGTERM"
        self.log.event(
            {
                "step": self.step,
                "kind": "interrupt",
                "message": f"{name}: stopped after step {self.step}, checkpoint {ckpt}",
            }
        )
        return "interrupted", 130 if self._stop_signal == signal.SIGINT else 143

    def _load(self, ck: dict[str, Any]) -> None:
        self.step = int(ck["step"])
        saved = ck.get("dist") or {"strategy": "none", "world_size": 1, "per_rank": None}
        fsdp_now = self.ctx.enabled and self.ctx.strategy == "fsdp"
        if (saved["strategy"] == "fsdp") != fsdp_now:
            raise BuildError(
                f"checkpoint {ck.get('path')}: saved with dist.strategy={saved['strategy']} "
                f"({saved['world_size']} ranks); resume FSDP checkpoints under dist.strategy=fsdp and "
                "single-process/DDP checkpoints without it"
            )
        try:
            load_full_state(self.model, self.optimizer, ck["model"], ck["optimizer"], self.ctx)
        except (RuntimeError, KeyError, ValueError) as e:
            raise BuildError(
                f"checkpoint {ck.get('path')}: does not fit the configured model: "
                f"{str(e).splitlines()[0]}"
            ) from None
        self.precision.load_master_state(ck.get("master"))
        self.scaler.load_state_dict(ck["scaler"])
        # the state comes from the checkpoint, the rules from the config (a changed
        # scaler.init_scale sets the scale)
        self.scaler.reconfigure(self.cfg.scaler, was=ck["config"]["scaler"])
        self.applied = int(ck["scheduler"]["applied"])
        self.data.load_state_dict({"position": self._local_position(ck)})
        same_ranks = saved["per_rank"] is not None and len(saved["per_rank"]) == self.ctx.world_size
        mine = saved["per_rank"][self.ctx.rank] if same_ranks else None
        set_rng_state(mine["rng"] if mine else ck["rng"])
        # "guard": the key of checkpoints written by ampctl 0.2 and older
        self.protection.load_state_dict(ck.get("protection", ck.get("guard", {})))
        tr = ck.get("trainer", {})
        self.shell.load_accounts(tr)
        self.lr_scale = float(tr.get("lr_scale", 1.0))
        lw = (mine["log_window"] if mine else ck.get("log_window")) or {}
        self.shell.window = LogWindow.from_state(lw, self.device)
        if self.ctx.is_main and ck.get("path"):
            layout = RunLayout(self.run_dir)
            branch = prepare_resume(layout, Path(ck["path"]), self.step)
            if branch is not None:
                self.log.event(branch_event(layout, branch))
            # the row at the checkpoint is the run's latest figures until a step logs a new one
            # (a resume at the end, e.g. a run killed before its summary, writes it from this)
            for row in read_jsonl(layout.metrics):
                if as_number(row.get("step")) == self.step:
                    self.shell.last_row = row

    def _local_position(self, ck: dict[str, Any]) -> int:
        """This rank's data position; a run may resume on another number of ranks when the
        global position (batches consumed by all ranks) divides evenly."""
        d = ck["data"]
        global_pos = int(d["position"]) * int(d.get("world_size", 1))
        if global_pos % self.ctx.world_size:
            raise BuildError(
                f"checkpoint {ck.get('path')}: {global_pos} global batches consumed do not split "
                f"over {self.ctx.world_size} ranks; resume with a number of ranks that divides "
                f"{global_pos}"
            )
        return global_pos // self.ctx.world_size

    # ------------------------------------------------------------------ the end
    def _summary(self, status: str) -> dict[str, Any]:
        """summary.json (:meth:`RunShell.summary`); a diverged run also names the step its loss
        left its course and the last checkpoint written before it. **Syncs** once."""
        summary = self.shell.summary(status, self.step)
        if self.diverged_since is not None:
            summary["diverged_since"] = self.diverged_since
        if status in ("diverged", "aborted"):
            summary.update(self._trouble_hint(status))
        elif status in ("interrupted", "failed"):
            summary["resume_hint"] = shlex.join(["ampctl", "train", "--resume", str(self.run_dir)])
        return summary

    def _trouble_since(self, status: str) -> int:
        """The last step known good before the trouble: the earliest of the diverged rows'
        start, the state the first rollback restored (else the step the run stopped at) and the
        row before the first whose loss is above the run's first loss (a healthy run's rows are
        below it: :data:`~ampctl.protect.advice.ABOVE_START`). Reads ``metrics.jsonl``."""
        from ampctl.protect.advice import ABOVE_START
        from ampctl.runlog.readers import iter_jsonl

        restored = [self.diverged_since] if self.diverged_since is not None else []
        restored += [
            int(e.get("to_step", e["step"]))
            for e in self.protection.events
            if e.get("kind") in ("rollback", "divergence") and isinstance(e.get("step"), int)
        ]
        since = min(restored, default=self.step)
        start = self.protection.divergence.start
        if start is not None and start == start:  # a row above the run's first loss: trouble
            rows = iter_jsonl(RunLayout(self.run_dir).metrics) if self.ctx.is_main else []
            prev = 0
            for r in rows:
                step, loss = r.get("step"), r.get("loss")
                if not isinstance(step, int) or step > since:
                    break
                if isinstance(loss, int | float) and (loss != loss or loss > ABOVE_START * start):
                    return prev
                prev = step
        return since

    def _trouble_hint(self, status: str) -> dict[str, Any]:
        """The one resume hint of a run that diverged or was aborted: from the newest checkpoint
        written at or before the last good step, with the lr worked out from the run's rows
        (:func:`ampctl.protect.advice.lr_advice`); with none, the fresh-start command with the
        change (``hint_overrides``: the command line's overrides); never a checkpoint written
        in or after the trouble. Reads this run's ``metrics.jsonl`` (main process)."""
        from ampctl.protect.advice import fmt_lr, lr_advice
        from ampctl.runlog.readers import iter_jsonl

        since = self._trouble_since(status)
        stop = self.stop_checkpoint.resolve() if self.stop_checkpoint is not None else None
        good = [
            p
            for p in RunLayout(self.run_dir).checkpoints()
            if (checkpoint_step(p) or 0) <= since and p.resolve() != stop
        ]
        out: dict[str, Any] = {"trouble_since": since}
        out["last_good_checkpoint"] = str(good[-1]) if good else None
        if not self.ctx.is_main:
            return out
        rows = [
            (r.get("step"), r.get("loss"), r.get("lr"))
            for r in iter_jsonl(RunLayout(self.run_dir).metrics)
            if isinstance(r.get("step"), int)
        ]
        adv = lr_advice(rows, trouble=since + 1, start=self.protection.divergence.start)
        known = adv is not None and adv.known
        change = [f"optim.lr={fmt_lr(adv.lr)}"] if known else []
        if adv is not None:
            out["lr_advice"] = adv.why
        diagnose = shlex.join(["ampctl", "diagnose", str(self.run_dir)])
        if good and change:
            out["resume_hint"] = shlex.join(["ampctl", "train", "--resume", str(good[-1]), *change])
        elif good:
            out["resume_hint"] = diagnose
            out["resume_note"] = (
                "no lr of this run is known to have worked (its loss never fell below where it "
                "started): diagnose tries a ladder of lower ones from the last good checkpoint "
                "and prints the one that held"
            )
        elif change and self.hint_overrides is not None:
            keep = [
                o
                for o in self.hint_overrides
                if not o.lstrip("+~").startswith(("optim.lr=", "name="))
            ]
            out["resume_hint"] = shlex.join(["ampctl", "train", *keep, *change])
            out["resume_note"] = (
                f"no checkpoint was written before the trouble (step {since + 1}): start afresh"
            )
        else:
            out["resume_hint"] = diagnose
            out["resume_note"] = (
                f"no checkpoint was written before the trouble (step {since + 1})"
                + (
                    ""
                    if change
                    else " and no lr of this run is known to have worked: diagnose tries a "
                    "ladder of lower ones and prints the one that held"
                )
            )
        return out


_WRITE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO}


def _write_failure(e: OSError, step: int) -> str:
    """One line for a failed write: the file, the cause, and what is kept."""
    cause = e.strerror or str(e) or type(e).__name__
    if e.errno not in _WRITE_ERRNOS:
        return f"{e.filename or 'an I/O call'} at step {step}: {cause}"
    what = f"could not write {e.filename}" if e.filename else "a write failed"
    return (
        f"{what} at step {step}: {cause}; every file written before is whole (free space, then "
        "resume from the last checkpoint)"
    )


class _Signals:
    """Ctrl-C / SIGTERM: finish the step, checkpoint, stop (a second Ctrl-C stops at once)."""

    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer
        self.old: dict[int, Any] = {}

    def _handle(self, signum, _frame) -> None:
        if self.tr._stop_signal is not None:
            raise KeyboardInterrupt
        self.tr._stop_signal = signum

    def __enter__(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, h in self.old.items():
            signal.signal(sig, h)


def train(
    cfg: Any,
    run_dir: Path,
    *,
    display: Any = None,
    resume: str | Path | None = None,
    fault: Fault | None = None,
) -> TrainResult:
    """Library entry point: train ``cfg`` into ``run_dir`` (which must exist)."""
    run_dir = Path(run_dir)
    ck = load_checkpoint(resume) if resume is not None else None
    trainer = Trainer(cfg, run_dir, display=display, resume=ck, fault=fault)
    write_config(run_dir, cfg.to_dict())
    return trainer.run()
