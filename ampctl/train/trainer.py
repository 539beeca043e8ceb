"""The protected training loop (a library call; ``ampctl train`` is a thin wrapper).

One optimizer step, then protection, then logging, then checkpointing -- each one call::

    while step < max_steps:
        out = train_step()                  # autocast forward, scaled backward (x grad_accum),
                                            # fused unscale + check, clip, step or skip, update
        protection.after_step(step, ...)    # guard: rollback | fallback | promotion | abort
        log_step(out)                       # every log_every steps: one host read
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
import math
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ampctl.amp import make_precision, match_modules
from ampctl.amp.actgrad import ActGradProbe
from ampctl.amp.checks import is_int, need
from ampctl.amp.stats import grad_stats
from ampctl.runlog import RunLayout, branch_event, prepare_resume
from ampctl.train.builders import (
    BuildError,
    accepts_batch_keys,
    build_data_source,
    build_model,
    build_optimizer,
    extract_loss,
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
from ampctl.train.logger import RunLogger
from ampctl.train.metrics import DeviceFigures, LogWindow, Probe, sampling
from ampctl.train.protection import Protection, TrainAborted
from ampctl.train.schedule import lr_factor

if TYPE_CHECKING:
    from ampctl.config import RunConfig

__all__ = [
    "Trainer",
    "TrainerConfig",
    "TrainResult",
    "TrainAborted",
    "CheckpointWriteError",
    "train",
]


@dataclass(kw_only=True)
class TrainerConfig:
    """``trainer.*``: the loop's length, cadence, seed, device and run folder."""

    max_steps: int = 200
    log_every: int = 10
    ckpt_every: int = 100
    keep_last: int = 3
    grad_accum_steps: int = 1
    seed: int = 0
    device: str = "auto"
    runs_dir: str = "runs"
    overflow_window: int = 50
    stop_at: int | None = None  # stop (checkpoint, status ok) here; max_steps keeps the lr horizon
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        for k in (
            "max_steps",
            "log_every",
            "ckpt_every",
            "keep_last",
            "grad_accum_steps",
            "overflow_window",
        ):
            v = getattr(self, k)
            need(is_int(v) and v >= 1, self, k, v, "an integer >= 1")
        need(is_int(self.seed) and self.seed >= 0, self, "seed", self.seed, "an integer >= 0")
        need(
            self.stop_at is None or (is_int(self.stop_at) and 1 <= self.stop_at <= self.max_steps),
            self,
            "stop_at",
            self.stop_at,
            f"null or an integer in [1, max_steps={self.max_steps}]",
        )
        need(
            self.device in ("auto", "cpu", "cuda")
            or re.fullmatch(r"cuda:\d+", self.device) is not None,
            self,
            "device",
            self.device,
            "one of auto, cpu, cuda, cuda:N",
        )
        need(isinstance(self.compile, bool), self, "compile", self.compile, "true or false")
        need(
            isinstance(self.compile_backend, str) and bool(self.compile_backend),
            self,
            "compile_backend",
            self.compile_backend,
            "a torch.compile backend name, e.g. inductor (the default), aot_eager, eager",
        )


Fault = Callable[["Trainer", int, str], None]


@dataclass
class TrainResult:
    summary: dict[str, Any]
    run_dir: Path
    status: str  # ok | aborted | interrupted | failed
    exit_code: int


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean loss of the step's micro-batches (device)
    skipped: bool | None  # as the scaler read it; None when nothing was read (fused optimizer)
    batches: list[dict[str, torch.Tensor]]
    stats: dict[str, torch.Tensor] | None  # gradient statistics (log steps)


class _Progress:
    """What a rollback rewinds besides weights, optimizer state and scale."""

    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer

    def state_dict(self) -> dict[str, Any]:
        a = self.tr.applied
        return {
            "step": self.tr.step,
            "applied": a.clone() if isinstance(a, torch.Tensor) else a,
            "data": self.tr.data.state_dict(),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tr.step = state["step"]
        a = state["applied"]
        self.tr.applied = a.clone() if isinstance(a, torch.Tensor) else a
        self.tr.data.load_state_dict(state["data"])
        set_rng_state(state["rng"])


class Trainer:
    """Build everything from a config and run the protected loop.

    Args:
        cfg: validated config.
        run_dir: the run folder (created by the caller; see :func:`ampctl.train.run.new_run_dir`).
        display: object with ``update(metrics)``, ``event(event)``, ``summary(summary)``, or None.
        resume: a checkpoint dict (from :func:`load_checkpoint`) to continue from. When it is not
            the run's newest checkpoint the later history is set aside first
            (:func:`ampctl.runlog.prepare_resume`).
        fault: test hook ``fault(trainer, step, phase)`` called at ``"after_backward"`` (to plant
            inf/NaN) -- the planted-fault tests use it; None in normal runs.
    """

    def __init__(
        self,
        cfg: RunConfig,
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
        self.data = build_data_source(cfg, self.ctx.rank, self.ctx.world_size)
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
            progress=_Progress(self),
            forward=self._forward_loss,
            rebuild_optimizer=lambda params: build_optimizer(cfg.optim, params, self.device),
            dist=self.ctx,
        )
        # figures sampled on log steps (see metrics.Probe)
        self.probes: list[Probe] = [ActGradProbe()] if cfg.logging.act_grads else []
        self._params_owner: tuple[Any, Any] = (None, None)  # what ``params`` was listed for
        self._params_list: list[nn.Parameter] = []
        self.step = 0
        self.applied: int | torch.Tensor = 0  # optimizer steps applied (drives the lr schedule)
        self.window = LogWindow()
        self.last_metrics: dict[str, Any] = {}
        self.failure: str | None = None
        self._stop_signal: int | None = None
        self._stop_agreed = False  # under torchrun all ranks stop together, at a log step
        self._wall0 = time.perf_counter()
        self._wall_before = 0.0
        self._tokens_total = 0
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
        model = build_model(self.cfg).to(self.device)
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
        name, exempted = cfg.precision.name, []
        if resume is not None:
            # the run keeps the precision it had reached (a fallback sticks) unless the user
            # asks for another one on the command line of the resume
            asked = cfg.precision.name != resume["config"]["precision"]["name"]
            name = cfg.precision.name if asked else resume["precision"]["name"]
            exempted = list(resume["precision"]["exempted"])
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
        for n in exempted:
            precision.exempt(self.model, n)
        precision.scaler.init_state(self.device)
        if self.ctx.enabled:
            precision.scaler.reduce_flags = self.ctx.reduce_max
        return precision

    # ------------------------------------------------------------------ views
    @property
    def precision(self):
        """The precision plugin in use (a fallback replaces it)."""
        return self.protection.precision

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.protection.optimizer

    @property
    def scaler(self):
        return self.precision.scaler

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

    def _wall(self) -> float:
        return self._wall_before + time.perf_counter() - self._wall0

    # ------------------------------------------------------------------ the loop
    def run(self, *, close_log: bool = True) -> TrainResult:
        """Train to ``trainer.max_steps``. Writes metrics, events, checkpoints and summary.
        ``close_log=False`` leaves the sinks open after the summary (the caller sends the plot
        and closes ``self.log``)."""
        status, code = "ok", 0
        t = time.perf_counter()
        self.log.open(self.step, self.cfg.to_dict())
        # starting a sink (an MLflow store, W&B's process) is not training time
        opened = time.perf_counter() - t
        self._wall0 += opened
        self.window.t0 += opened
        with _Signals(self):
            try:
                self.protection.start(self.step)
                while self.step < self.end:
                    log = self._is_due(self.cfg.trainer.log_every)
                    out = self.train_step(log)
                    self.protection.after_step(self.step, skipped=out.skipped, batches=out.batches)
                    if log:
                        self.log_step(out)
                    ckpt = self.save() if self._is_due(self.cfg.trainer.ckpt_every, 0) else None
                    if self._stop_signal is not None and (
                        not self.ctx.enabled or self._stop_agreed
                    ):
                        status, code = self._interrupt(ckpt)
                        break
            except TrainAborted:
                status, code = "aborted", 1
                self._save_after_abort()
            except CheckpointWriteError as e:
                self.failure = str(e)
                self.log.event({"step": self.step, "kind": "error", "message": str(e)})
                status, code = "failed", 1
            except BaseException as e:
                self.log.close("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
                raise
        summary = self._summary(status)
        err = self.log.summary(summary)
        if err:
            summary["summary_error"] = err
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
    def train_step(self, log: bool = False) -> StepOutput:
        """One optimizer step (with accumulation). One host read on the standard path (the
        skip flag), none with a fused optimizer."""
        accum = self.cfg.trainer.grad_accum_steps
        precision = self.precision
        self.optimizer.zero_grad(set_to_none=True)
        precision.zero_grad()
        batches, loss_total = [], None
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
                loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
        precision.after_backward()
        if self.fault is not None:
            self.fault(self, self.step + 1, "after_backward")
        precision.unscale_(self.optimizer)
        stats = None
        if log:
            scale_t = self.scaler.get_scale_tensor() if self.scaler.is_enabled() else 1.0
            stats = grad_stats((p.grad for p in self.params), scale_t, self.device)
        if self.cfg.optim.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.clip_grad_norm, foreach=True)
        self._set_lr()
        skipped = precision.optimizer_step(self.optimizer)
        self.step += 1
        self._tokens_total += self.tokens_per_step
        if skipped is False:
            self.applied += 1
        elif skipped is None:  # fused: the step counts unless the scaler skipped it (device)
            self.applied = self.applied + (1 - self.scaler.device_counters()["last_skipped"])
        self.window.add(loss_total, self.tokens_per_step)
        return StepOutput(loss=loss_total, skipped=skipped, batches=batches, stats=stats)

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
        for g in self.optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].copy_(o.lr * factor)
            else:
                g["lr"] = float(o.lr * factor)

    # ------------------------------------------------------------------ logging
    def log_step(self, out: StepOutput) -> dict[str, Any] | None:
        """Read the interval's figures in one transfer, take the guard's waiting decisions (fused
        path), write the row. Returns the row (None when a decision discarded the interval)."""
        probes = self.active_probes()  # before the read: a fallback decided there keeps the row
        fig = self._figures(out.stats, probes)
        vals = fig.read(self.ctx)  # the log read
        if vals["stop"] > 0 and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another rank was signalled
        self._stop_agreed = vals["stop"] > 0
        rewound_from = self.step
        if "guard" in vals:
            self.protection.on_read(vals["guard"])
        window, self.window = self.window, LogWindow()
        if self.step != rewound_from:  # a late rollback discarded the interval's steps
            return None
        row = self._row(vals, window, out.stats is not None, probes)
        self.last_metrics = row
        self.log.metrics(row)
        self.protection.after_log(self.step)  # fp8 layer demotions from the probe's figures
        return row

    def _figures(self, stats: dict[str, torch.Tensor] | None, probes: list[Probe]) -> DeviceFigures:
        fig = DeviceFigures(self.device)
        w = self.window
        fig.add("loss_sum", w.loss_sum if w.loss_sum is not None else 0.0, "sum")
        fig.add("loss_n", w.loss_n if w.loss_n is not None else 0.0, "sum")
        fig.add("stop", float(self._stop_signal is not None), "max")
        if stats is not None:
            # FSDP's gradients are sharded: combine over ranks; DDP's are already all-reduced
            sharded = self.ctx.enabled and self.ctx.strategy == "fsdp"
            s, m = ("sum", "max") if sharded else (None, None)
            fig.add("grad_norm_sq", stats["grad_norm"] ** 2, s)
            fig.add("grad_underflow", stats["grad_underflow"], s)
            fig.add("grad_elems", stats["grad_elems"], s)
            fig.add("nonfinite_grads", stats["nonfinite_grads"], s)
            fig.add("grad_amax", stats["grad_amax"], m)
        for k, v in self.scaler.device_counters().items():
            fig.add(k, v)
        fig.add("recent_skips", self.scaler.recent_skips(self.cfg.trainer.overflow_window))
        fig.add("lr", self.optimizer.param_groups[0]["lr"])
        for probe in probes:
            probe.figures(fig)
        pending = self.protection.pending_reads()
        if pending is not None:
            fig.add("guard", pending, vector=True)
        return fig

    def _row(
        self, v: dict[str, Any], window: LogWindow, with_stats: bool, probes: list[Probe]
    ) -> dict[str, Any]:
        dt = max(time.perf_counter() - window.t0, 1e-9)
        n = self.scaler.num_steps
        row = {
            "step": self.step,
            "loss": v["loss_sum"] / v["loss_n"] if v["loss_n"] > 0 else float("nan"),
            "scale": v["scale"] if self.scaler.is_enabled() else 1.0,
            "skipped": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "overflow_rate": v["recent_skips"] / max(min(self.cfg.trainer.overflow_window, n), 1),
            "lr": v["lr"],
            "precision": self.precision.name,
            "tokens_per_s": window.tokens / dt,
            "elapsed_s": self._wall(),
            "max_steps": self.cfg.trainer.max_steps,
            "grad_norm": None,
            "grad_amax": None,
            "grad_underflow_frac": None,
            "nonfinite_grads": None,
            "act_grad_underflow_frac": None,
            "act_grad_zero_frac": None,
        }
        for probe in probes:
            row.update(probe.row(v))
        if with_stats:
            row.update(
                grad_norm=math.sqrt(max(v["grad_norm_sq"], 0.0)),
                grad_amax=v["grad_amax"],
                grad_underflow_frac=v["grad_underflow"] / max(v["grad_elems"], 1),
                nonfinite_grads=int(v["nonfinite_grads"]),
            )
        return row

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (weights_only-loadable). Under torchrun every rank
        must call it (FSDP gathers full state dicts; per-rank RNG and log windows are gathered).
        **Syncs** (copies the state to the host)."""
        model_sd, optim_sd = full_state(self.model, self.optimizer, self.ctx)
        per_rank = self.ctx.all_gather_object(
            {"rng": rng_state(), "log_window": self.window.state_dict()}
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
            "guard": self.protection.state_dict(),
            "trainer": {"tokens": self._tokens_total, "wall_s": self._wall()},
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
        try:
            self.save()  # skipped steps never touched the weights: keep them for diagnose
        except CheckpointWriteError as e:
            self.failure = str(e)
            self.log.event({"step": self.step, "kind": "error", "message": str(e)})

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
        self._apply_scaler_overrides(ck)
        self.applied = int(ck["scheduler"]["applied"])
        self.data.load_state_dict({"position": self._local_position(ck)})
        same_ranks = saved["per_rank"] is not None and len(saved["per_rank"]) == self.ctx.world_size
        mine = saved["per_rank"][self.ctx.rank] if same_ranks else None
        set_rng_state(mine["rng"] if mine else ck["rng"])
        self.protection.load_state_dict(ck.get("guard", {}))
        tr = ck.get("trainer", {})
        self._tokens_total = int(tr.get("tokens", 0))
        self._wall_before = float(tr.get("wall_s", 0.0))
        lw = (mine["log_window"] if mine else ck.get("log_window")) or {}
        self.window = LogWindow.from_state(lw, self.device)
        if self.ctx.is_main and ck.get("path"):
            layout = RunLayout(self.run_dir)
            branch = prepare_resume(layout, Path(ck["path"]), self.step)
            if branch is not None:
                self.log.event(branch_event(layout, branch))

    def _apply_scaler_overrides(self, ck: dict[str, Any]) -> None:
        """On resume the scaler's state (scale, trackers, counters) comes from the checkpoint,
        its rules from the config: growth/backoff/interval/hysteresis/bounds follow the config,
        and a changed ``scaler.init_scale`` sets the scale."""
        s, old = self.cfg.scaler, ck["config"]["scaler"]
        sc = self.scaler
        sc.set_growth_factor(s.growth_factor)
        sc.set_backoff_factor(s.backoff_factor)
        sc.set_growth_interval(s.growth_interval)
        sc.set_hysteresis(s.hysteresis)
        sc.set_bounds(s.min_scale, s.max_scale)
        if sc.is_enabled() and s.init_scale != old["init_scale"]:
            sc.update(new_scale=s.init_scale)

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
        st = self.scaler.stats()
        wall = self._wall()
        configured = set(match_modules(self.model, self.cfg.precision.fp32_modules))
        return {
            "status": status,
            "final_loss": self.last_metrics.get("loss"),
            "steps": self.step,
            "max_steps": self.cfg.trainer.max_steps,
            "skipped": st["skipped_total"],
            "forward_overflows": st["forward_overflows"],
            "overflow_rate": st["skipped_total"] / max(st["steps"], 1),
            "final_scale": st["scale"],
            "precision": self.precision.name,
            "promoted_modules": [m for m in self.precision.exempted if m not in configured],
            "fp32_modules": list(self.precision.exempted),
            **self.precision.summary(self.model),
            "events": self.log.event_counts(),
            "wall_time_s": wall,
            "tokens_per_s": self._tokens_total / max(wall, 1e-9),
            "run_dir": str(self.run_dir),
        }


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
    cfg: RunConfig,
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
    from ampctl.config import to_yaml

    RunLayout(run_dir).config.write_text(to_yaml(cfg))
    return trainer.run()
