"""The protected training loop (a library call; ``ampctl train`` is a thin wrapper).

Per optimizer step::

    autocast forward -> scaler.scale(loss).backward()   (x grad_accum_steps)
    -> [fp16-pure: grads to fp32 masters] -> scaler.unscale_ (fused inf/NaN check)
    -> [log step: gradient stats on the device] -> clip -> lr -> scaler.step -> scaler.update
    -> guard: continue | attribution + forward locate + promotion | rollback | fallback | abort

Host reads: one per step (the scaler's skip flag, which also drives the lr schedule and the
guard), zero with a fused optimizer; plus one at each log interval (all figures stacked).
Skipped steps add the guard's attribution read; clean steps pay nothing more.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampctl.amp import LossScaler, PrecisionPolicy, bf16_supported, nonfinite_tensor_names
from ampctl.amp.guard import Action, GuardRules, OverflowGuard
from ampctl.amp.locate import first_bad, trace_modules
from ampctl.config import RunConfig, to_yaml
from ampctl.monitor.sinks import make_tensorboard_sink
from ampctl.monitor.stats import grad_stats
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
    latest_checkpoint,
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

__all__ = ["Trainer", "TrainResult", "TrainAborted", "build_scaler", "train"]


class TrainAborted(RuntimeError):
    """The guard gave up (abort policy, or nothing left to fall back to)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


@dataclass
class TrainResult:
    summary: dict[str, Any]
    run_dir: Path
    status: str  # ok | aborted | interrupted
    exit_code: int


def build_scaler(cfg: RunConfig, policy: PrecisionPolicy) -> LossScaler:
    """The run's LossScaler: ``scaler.*`` are its constructor arguments; scaling is on for the
    fp16 family (bf16/fp32 still detect and skip non-finite steps)."""
    return LossScaler(**dataclasses.asdict(cfg.scaler), enabled=policy.needs_scaler)


@dataclass
class _Snapshot:
    step: int
    applied: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scale: torch.Tensor  # device copy: taking a snapshot reads nothing on the host
    data: dict[str, int]
    rng: dict[str, Any]
    master: list[torch.Tensor] | None


@dataclass
class _LogAcc:
    loss_sum: torch.Tensor | None = None
    loss_n: torch.Tensor | None = None
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)


class Trainer:
    """Build everything from a config and run the protected loop.

    Args:
        cfg: validated config.
        run_dir: the run folder (created by the caller; see :func:`ampctl.train.run.new_run_dir`).
        display: object with ``update(metrics)``, ``event(event)``, ``summary(summary)``, or None.
        resume: a checkpoint dict (from :func:`load_checkpoint`) to continue from.
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
        fault: Callable[[Trainer, int, str], None] | None = None,
        dist_ctx: DistContext | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.display = display
        self.fault = fault
        self.ctx = dist_ctx or init_distributed(cfg.dist.strategy, cfg.trainer.device)
        self.device = resolve_device(cfg.trainer.device)
        if self.ctx.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.ctx.local_rank)
        if self.ctx.enabled and self.ctx.strategy == "fsdp" and cfg.precision.name == "fp16-pure":
            raise BuildError(
                "precision=fp16-pure cannot be combined with dist.strategy=fsdp: use precision=fp16 "
                "(FSDP keeps fp32 shards; autocast computes in fp16)"
            )
        torch.manual_seed(cfg.trainer.seed)
        self.data = build_data_source(cfg, self.ctx.rank, self.ctx.world_size)
        self.model = build_model(cfg).to(self.device)
        missing = accepts_batch_keys(self.model, ["input_ids", "attention_mask", "labels"])
        if missing:
            raise BuildError(
                f"model._target_={cfg.model['_target_']}: forward() does not accept batch keys {missing}; "
                "it is called as model(**batch) with input_ids, attention_mask, labels"
            )
        precision = cfg.precision.name
        exempted: list[str] = []
        if resume is not None:
            # the run keeps the precision it had reached (a fallback sticks) unless the user
            # asks for another one on the command line of the resume
            asked = cfg.precision.name != resume["config"]["precision"]["name"]
            precision = cfg.precision.name if asked else resume["precision"]["name"]
            exempted = list(resume["precision"]["exempted"])
        self._apply_policy(precision, exempted)
        self.fwd_model = wrap_model(self.model, self.ctx, self.device)
        self._build_optim()
        rules = {
            f.name: getattr(cfg.guard, f.name)
            for f in dataclasses.fields(GuardRules)
            if hasattr(cfg.guard, f.name)
        }
        self.guard = OverflowGuard(GuardRules(**rules, bf16_ok=bf16_supported(self.device)))
        self.step = 0
        self.applied = 0  # optimizer steps actually applied (drives the lr schedule)
        self.events: list[dict[str, Any]] = []
        self.snapshot: _Snapshot | None = None
        self._clean_since_snapshot = 0
        self._stop_signal: int | None = None
        self._stop_agreed = False  # under torchrun all ranks stop together, at a log step
        self.failure: str | None = None
        self._wall0 = time.perf_counter()
        self._wall_before = 0.0
        self._tokens_total = 0
        self.last_metrics: dict[str, Any] = {}
        self._acc = _LogAcc()  # the open log window (kept in checkpoints: resumed rows match)
        self.tb = None
        self._tb_hint = None
        if self.ctx.is_main and cfg.logging.tensorboard:
            tb = make_tensorboard_sink(self.run_dir, True)
            self.tb, self._tb_hint = (None, tb) if isinstance(tb, str) else (tb, None)
        if resume is not None:
            self._load(resume)

    # ------------------------------------------------------------------ set-up
    def _apply_policy(self, name: str, exempted: list[str]) -> None:
        self.policy = PrecisionPolicy(
            name=name,
            fp32_modules=list(self.cfg.precision.fp32_modules),
            device_type=self.device.type,
        )
        for n in exempted:
            if n not in self.policy.exempted:
                self.policy.exempt(self.model, n)
        self.policy.prepare(self.model)

    def _build_optim(self) -> None:
        self.params = self.policy.optimizer_params(self.model)
        self.named_params = self.policy.named_optimizer_params(self.model)
        self.optimizer = build_optimizer(self.cfg.optim, self.params, self.device)
        self.scaler = build_scaler(self.cfg, self.policy)
        self.scaler.init_state(self.device)
        if self.ctx.enabled:
            self.scaler.reduce_flags = self.ctx.reduce_max
        self._fused = bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @property
    def tokens_per_step(self) -> int:
        d = self.cfg.data
        return d.batch_size * d.seq_len * self.cfg.trainer.grad_accum_steps * self.ctx.world_size

    # ------------------------------------------------------------------ state
    def _log_window(self) -> dict[str, Any]:
        acc = self._acc
        return {
            "loss_sum": acc.loss_sum.detach().cpu() if acc.loss_sum is not None else None,
            "loss_n": acc.loss_n.detach().cpu() if acc.loss_n is not None else None,
            "tokens": acc.tokens,
        }

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint holds (weights_only-loadable). Under torchrun every rank
        must call it (FSDP gathers full state dicts; per-rank RNG and log windows are gathered)."""
        model_sd, optim_sd = full_state(self.model, self.optimizer, self.ctx)
        per_rank = self.ctx.all_gather_object(
            {"rng": rng_state(), "log_window": self._log_window()}
        )
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "scaler": self.scaler.state_dict(),
            "scheduler": {"applied": self.applied},
            "rng": per_rank[0]["rng"],
            "data": {**self.data.state_dict(), "world_size": self.ctx.world_size},
            "config": self.cfg.to_dict(),
            "precision": {"name": self.policy.name, "exempted": list(self.policy.exempted)},
            "master": [m.detach().cpu() for m in self.params]
            if self.policy.master is not None
            else None,
            "guard": self.guard.state_dict(),
            "trainer": {
                "tokens": self._tokens_total,
                "wall_s": self._wall(),
                "events": len(self.events),
            },
            "log_window": per_rank[0]["log_window"],
            "dist": {
                "strategy": self.ctx.strategy if self.ctx.enabled else "none",
                "world_size": self.ctx.world_size,
                "per_rank": per_rank if self.ctx.enabled else None,
            },
        }

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
                f"checkpoint {ck.get('path')}: does not fit the configured model: {str(e).splitlines()[0]}"
            ) from None
        if ck.get("master") is not None and self.policy.master is not None:
            with torch.no_grad():
                for m, v in zip(self.params, ck["master"], strict=True):
                    m.copy_(v)
        self.scaler.load_state_dict(ck["scaler"])
        self._apply_scaler_overrides(ck)
        self.applied = int(ck["scheduler"]["applied"])
        self.data.load_state_dict({"position": self._local_position(ck)})
        same_ranks = saved["per_rank"] is not None and len(saved["per_rank"]) == self.ctx.world_size
        mine = saved["per_rank"][self.ctx.rank] if same_ranks else None
        set_rng_state(mine["rng"] if mine else ck["rng"])
        self.guard.load_state_dict(ck.get("guard", {}))
        tr = ck.get("trainer", {})
        self._tokens_total = int(tr.get("tokens", 0))
        self._wall_before = float(tr.get("wall_s", 0.0))
        lw = (mine["log_window"] if mine else ck.get("log_window")) or {}
        if lw.get("loss_sum") is not None:
            self._acc.loss_sum = lw["loss_sum"].to(self.device)
            self._acc.loss_n = lw["loss_n"].to(self.device)
        self._acc.tokens = int(lw.get("tokens", 0))
        for name in ("metrics.jsonl", "events.jsonl"):
            _trim_jsonl(self.run_dir / name, self.step)

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
                f"checkpoint {ck.get('path')}: {global_pos} global batches consumed do not split over "
                f"{self.ctx.world_size} ranks; resume with a number of ranks that divides {global_pos}"
            )
        return global_pos // self.ctx.world_size

    def _wall(self) -> float:
        return self._wall_before + time.perf_counter() - self._wall0

    def take_snapshot(self) -> None:
        """Keep the current (good) state in memory for rollback. Device copies, no host read."""
        self.snapshot = _Snapshot(
            step=self.step,
            applied=self.applied,
            model={k: v.detach().clone() for k, v in self.model.state_dict().items()},
            optimizer=copy.deepcopy(self.optimizer.state_dict()),
            scale=self.scaler.get_scale_tensor().clone(),
            data=self.data.state_dict(),
            rng=rng_state(),
            master=[m.detach().clone() for m in self.params]
            if self.policy.master is not None
            else None,
        )

    def _restore(self, snap: _Snapshot) -> None:
        self.model.load_state_dict(snap.model)
        if snap.master is not None and self.policy.master is not None:
            with torch.no_grad():
                for m, v in zip(self.params, snap.master, strict=True):
                    m.copy_(v)
        self.optimizer.load_state_dict(copy.deepcopy(snap.optimizer))
        self.data.load_state_dict(snap.data)
        set_rng_state(snap.rng)
        self.step = snap.step
        self.applied = snap.applied

    # ------------------------------------------------------------------ events, sinks
    def emit(self, kind: str, message: str, **extra: Any) -> None:
        ev = {"step": self.step, "kind": kind, "message": message, "time": time.time(), **extra}
        self.events.append(ev)
        self.guard.count(kind)
        if not self.ctx.is_main:
            return
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(ev, default=str) + "\n")
        if self.tb is not None:
            self.tb.log_event(ev)
        if self.display is not None:
            self.display.event(ev)

    def _write_metrics(self, row: dict[str, Any]) -> None:
        if not self.ctx.is_main:
            return
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row, default=_json_number) + "\n")
        if self.tb is not None:
            self.tb.log_metrics(row)

    def save(self) -> Path:
        """Write a checkpoint atomically; on failure the previous one stays and a clear
        :class:`CheckpointWriteError` is raised."""
        ckpt_dir = self.run_dir / "checkpoints"
        state = self.state()  # collective under torchrun
        if not self.ctx.is_main:
            return ckpt_dir / f"step_{self.step:08d}.pt"
        try:
            return save_checkpoint(ckpt_dir, self.step, state, keep_last=self.cfg.trainer.keep_last)
        except OSError as e:
            prev = latest_checkpoint(ckpt_dir)
            raise CheckpointWriteError(
                f"could not write the step-{self.step} checkpoint in {ckpt_dir}: "
                f"{e.strerror or e}; the previous checkpoint "
                f"{'(none)' if prev is None else prev} is intact"
            ) from None

    # ------------------------------------------------------------------ one step
    def _set_lr(self) -> None:
        o = self.cfg.optim
        kw = dict(
            max_steps=self.cfg.trainer.max_steps,
            warmup_steps=o.warmup_steps,
            schedule=o.schedule,
            min_lr_ratio=o.min_lr_ratio,
        )
        if self._fused:
            # applied steps = recorded steps - skipped, on the device: no host read
            counters = self.scaler.device_counters() if self.scaler.device is not None else None
            applied = (
                torch.full(
                    (), float(self.scaler.num_steps), dtype=torch.float64, device=self.device
                )
                - counters["skipped_total"].double()
                if counters is not None
                else torch.zeros((), device=self.device)
            )
            for g in self.optimizer.param_groups:
                g["lr"].copy_(o.lr * lr_factor(applied, **kw))
        else:
            lr = o.lr * lr_factor(self.applied, **kw)  # host counter, plain float math
            for g in self.optimizer.param_groups:
                g["lr"] = lr

    def current_lr(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        return float(lr) if not isinstance(lr, torch.Tensor) else float(lr.item())

    def _forward_loss(
        self, batch: dict[str, torch.Tensor], model: nn.Module | None = None
    ) -> torch.Tensor:
        with self.policy.autocast():
            out = (model or self.fwd_model)(**batch)
        return extract_loss(out).float()

    def train_step(self, log: bool) -> dict[str, Any]:
        """One optimizer step (with accumulation). Returns what the guard needs."""
        accum = self.cfg.trainer.grad_accum_steps
        self.optimizer.zero_grad(set_to_none=True)
        if self.policy.master is not None:
            self.policy.master.zero_grad()
        batches = []
        loss_total = None
        for i in range(accum):
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in self.data.next_batch().items()
            }
            batches.append(batch)
            with no_sync(self.fwd_model, self.ctx, last=i == accum - 1):
                loss = self._forward_loss(batch) / accum
                self.scaler.scale(loss).backward()
            loss_total = loss.detach() if loss_total is None else loss_total + loss.detach()
        self.policy.after_backward()
        if self.fault is not None:
            self.fault(self, self.step + 1, "after_backward")
        self.scaler.unscale_(self.optimizer)
        stats = None
        if log:
            scale_t = self.scaler.get_scale_tensor() if self.scaler.is_enabled() else 1.0
            stats = grad_stats((p.grad for p in self.params), scale_t, self.device)
        clip = self.cfg.optim.clip_grad_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, clip, foreach=True)
        self._set_lr()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.policy.after_step()
        self.step += 1
        self._tokens_total += self.tokens_per_step
        skipped = self.scaler.last_step_skipped_host  # read by step() already: free
        if skipped is False:
            self.applied += 1
        elif skipped is None:  # fused: the schedule ran on the device; keep the host count lazily
            self.applied = self.scaler.num_steps  # corrected at the log read
        return {"loss": loss_total, "skipped": skipped, "batches": batches, "stats": stats}

    # ------------------------------------------------------------------ guard
    def _on_skip(self, out: dict[str, Any]) -> tuple[bool, float]:
        """Attribution and forward-overflow handling for a skipped step (reads the device: on
        overflow steps only). Returns (forward overflow?, scale now)."""
        st = self.scaler.stats()  # a read, on overflow steps only
        fwd = st["forward_overflows"] > getattr(self, "_fwd_seen", 0)
        self._fwd_seen = st["forward_overflows"]
        g = self.cfg.guard
        names = (
            nonfinite_tensor_names(
                ((n, p.grad) for n, p in self.named_params), limit=g.attribution_limit
            )
            if g.attribution
            else []
        )
        kind = "forward" if fwd else "gradient"
        msg = f"{kind} overflow, step skipped; scale now {st['scale']:g}"
        if names:
            msg += f"; non-finite grads in {', '.join(names)}"
        self.emit("overflow", msg, overflow=kind, params=names, scale=st["scale"])
        if fwd and g.locate_forward:
            self._locate_and_promote(out["batches"])
        return fwd, st["scale"]

    def _locate_and_promote(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Replay this step's batches with forward hooks and promote the first module whose
        output is non-finite. Every batch is replayed (ranks stay in step under FSDP) and the
        ranks agree on one module (the first found, in rank order)."""
        found = None
        for batch in batches:
            with torch.no_grad():
                traces, _ = trace_modules(
                    self.model, lambda b=batch: self._forward_loss(b, model=self.model)
                )
            bad = first_bad(traces)
            if bad is not None and found is None:
                found = (bad.name, bad.dtype)
        found = next((f for f in self.ctx.all_gather_object(found) if f is not None), None)
        if found is None:
            self.emit(
                "locate",
                "forward overflow did not reproduce on replay (non-deterministic or data-dependent)",
            )
            return
        name, dtype = found
        if name == "<model>" or not self.cfg.guard.promote or self.policy.name == "fp32":
            self.emit("locate", f"forward overflow first appears in {name} ({dtype})", module=name)
            return
        if self.policy.exempt(self.model, name):
            self.emit(
                "promotion",
                f"forward overflow first appears in {name} (non-finite, {dtype}): now runs in fp32",
                module=name,
            )
        else:
            self.emit("locate", f"forward overflow in {name}, already fp32", module=name)

    def _apply(self, decision) -> None:
        if decision.action is Action.CONTINUE:
            return
        if decision.action is Action.WARN:
            self.emit("warning", decision.reason)
            return
        if decision.action is Action.ABORT:
            self.emit("abort", decision.reason)
            raise TrainAborted(decision.reason)
        old_scale = self.scaler.get_scale()
        decided_at = self.step
        # with no snapshot (guard.snapshot_every=0) the current state is the restart point:
        # skipped steps never touched it
        snap = self.snapshot
        if snap is not None:
            self._restore(snap)  # the scaler keeps its counters: the skips happened
        to_step = self.step
        snap_scale = float(snap.scale.item()) if snap is not None else old_scale
        if decision.action is Action.ROLLBACK:
            new_scale = max(
                min(old_scale, snap_scale) * self.cfg.guard.rollback_backoff,
                self.scaler.min_scale,
            )
            self.scaler.update(new_scale=new_scale)
            self.guard.after_rollback()
            self.emit(
                "rollback",
                f"{decision.reason}: restored step {to_step}, scale {old_scale:g} -> {new_scale:g}",
                to_step=to_step,
                from_step=decided_at,
            )
            return
        # FALLBACK
        old = self.policy.name
        counters = self.scaler.state_dict()
        self._switch_precision(decision.precision)
        if self.scaler.is_enabled():
            counters["scale"] = snap_scale
        self.scaler.load_state_dict(counters)
        self.guard.after_fallback()
        self.snapshot = None
        if self.cfg.guard.snapshot_every > 0:
            self.take_snapshot()
        self.emit(
            "fallback",
            f"{decision.reason}; restored step {to_step}",
            from_precision=old,
            to_precision=decision.precision,
            to_step=to_step,
            from_step=decided_at,
        )

    def _switch_precision(self, name: str) -> None:
        """Change the run's precision in place, keeping weights, optimizer state and exemptions."""
        opt_state = self.optimizer.state_dict()
        if self.policy.master is not None:  # fp16-pure: the masters become the weights
            with torch.no_grad():
                for p, m in self.policy.master.pairs:
                    p.data = m.detach().clone()
        self.model.float()
        exempted = list(self.policy.exempted)
        for n in exempted:
            self.policy.unexempt(self.model, n)
        self._apply_policy(name, exempted)
        self._build_optim()
        self.optimizer.load_state_dict(opt_state)

    # ------------------------------------------------------------------ logging
    def _log(self, acc: _LogAcc, stats: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Read every figure of the interval in one transfer (under torchrun, after one SUM and
        one MAX all-reduce: loss over all ranks, FSDP's sharded gradient stats, the stop flag)."""
        dev = self.device
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        c = self.scaler.device_counters()
        window = self.cfg.trainer.overflow_window
        sharded = self.ctx.enabled and self.ctx.strategy == "fsdp"
        sums = [
            acc.loss_sum if acc.loss_sum is not None else zero,
            acc.loss_n if acc.loss_n is not None else zero,
        ]
        maxes = [torch.full((), float(self._stop_signal is not None), device=dev)]
        if stats is not None:
            sums += [
                stats["grad_norm"] ** 2,
                stats["grad_underflow"],
                stats["grad_elems"],
                stats["nonfinite_grads"],
            ]
            maxes += [stats["grad_amax"]]
        sum_t = torch.stack([x.double().to(dev) for x in sums])
        max_t = torch.stack([x.double().to(dev) for x in maxes])
        if self.ctx.enabled:
            if sharded:
                sum_t = self.ctx.reduce_sum(sum_t)
                max_t = self.ctx.reduce_max(max_t)
            else:  # DDP: gradients are already all-reduced; only the loss and the stop flag differ
                sum_t = torch.cat([self.ctx.reduce_sum(sum_t[:2]), sum_t[2:]])
                max_t = self.ctx.reduce_max(max_t)
        local = [
            c["scale"],
            c["skipped_total"],
            c["forward_overflows"],
            c["consecutive_overflows"],
            self.scaler.recent_skips(window),
        ]
        vals = torch.cat(
            [sum_t, max_t, torch.stack([x.double().to(dev) for x in local])]
        ).tolist()  # the log read
        loss_sum, loss_n = vals[0], vals[1]
        g_sums = vals[2:6] if stats is not None else None
        k = len(sums)
        stop, g_amax = vals[k], (vals[k + 1] if stats is not None else None)
        scale, skipped, fwd, consec, win = vals[k + len(maxes) :]
        if stop > 0 and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another rank was signalled
        self._stop_agreed = stop > 0
        now = time.perf_counter()
        dt = max(now - acc.t0, 1e-9)
        if self._fused:
            self.applied = self.scaler.num_steps - int(skipped)
        row = {
            "step": self.step,
            "loss": (loss_sum / loss_n) if loss_n > 0 else float("nan"),
            "scale": scale if self.scaler.is_enabled() else 1.0,
            "skipped": int(skipped),
            "forward_overflows": int(fwd),
            "consecutive_overflows": int(consec),
            "overflow_rate": win / max(min(window, self.scaler.num_steps), 1),
            "lr": self.current_lr(),
            "precision": self.policy.name,
            "tokens_per_s": acc.tokens / dt,
            "elapsed_s": self._wall(),
            "max_steps": self.cfg.trainer.max_steps,
        }
        if g_sums is not None:
            gn2, gu, ge, gb = g_sums
            row.update(
                grad_norm=math.sqrt(gn2),
                grad_amax=g_amax,
                grad_underflow_frac=gu / max(ge, 1),
                nonfinite_grads=int(gb),
            )
        else:
            row.update(
                grad_norm=None, grad_amax=None, grad_underflow_frac=None, nonfinite_grads=None
            )
        self._write_metrics(row)
        self.last_metrics = row
        if self.display is not None:
            self.display.update(row)
        # the fused path takes guard decisions here, from the device counters
        if self._fused and self.cfg.guard.enabled and consec > 0:
            decision = self.guard.observe(
                step=self.step,
                skipped=True,
                forward_overflow=False,
                at_floor=self._at_floor(scale),
                precision=self.policy.name,
            )
            self.guard.consecutive = int(consec)
            self._apply(decision)
        return row

    def _at_floor(self, scale: float) -> bool:
        return self.scaler.is_enabled() and scale <= self.scaler.min_scale

    # ------------------------------------------------------------------ run
    def _handle_signal(self, signum, _frame) -> None:
        if self._stop_signal is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum

    def run(self) -> TrainResult:
        """Train to ``trainer.max_steps``. Writes metrics, events, checkpoints and summary."""
        cfg = self.cfg.trainer
        old_handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                old_handlers[sig] = signal.signal(sig, self._handle_signal)
            except ValueError:  # not the main thread
                pass
        status, code = "ok", 0
        acc = self._acc
        self._fwd_seen = self.scaler.forward_overflows
        if self._tb_hint:
            self.emit("warning", self._tb_hint)
        try:
            snapshots = self.cfg.guard.enabled and self.cfg.guard.snapshot_every > 0
            if snapshots and self.snapshot is None:
                self.take_snapshot()
            while self.step < cfg.max_steps:
                log = (self.step + 1) % cfg.log_every == 0 or self.step + 1 == cfg.max_steps
                out = self.train_step(log)
                lt = out["loss"]
                finite = torch.isfinite(lt)
                acc.loss_sum = (
                    torch.where(finite, lt, 0.0)
                    if acc.loss_sum is None
                    else acc.loss_sum + torch.where(finite, lt, 0.0)
                )
                acc.loss_n = finite.double() if acc.loss_n is None else acc.loss_n + finite.double()
                acc.tokens += self.tokens_per_step
                if self.cfg.guard.enabled and out["skipped"] is not None:
                    fwd, scale = self._on_skip(out) if out["skipped"] else (False, 0.0)
                    at_floor = out["skipped"] and self._at_floor(scale)
                    decision = self.guard.observe(
                        step=self.step,
                        skipped=out["skipped"],
                        forward_overflow=fwd,
                        at_floor=at_floor,
                        precision=self.policy.name,
                    )
                    self._apply(decision)
                    if snapshots and not out["skipped"]:
                        self._clean_since_snapshot += 1
                        if (
                            self._clean_since_snapshot >= self.cfg.guard.snapshot_every
                            and self.guard.consecutive == 0
                        ):
                            self.take_snapshot()
                            self._clean_since_snapshot = 0
                if log:
                    self._log(acc, out["stats"])
                    acc = self._acc = _LogAcc()
                path = None
                if self.step % cfg.ckpt_every == 0 or self.step == cfg.max_steps:
                    path = self.save()
                if self._stop_signal is not None and (not self.ctx.enabled or self._stop_agreed):
                    path = path or self.save()
                    name = "SIGINT" if self._stop_signal == signal.SIGINT else "SIGTERM"
                    self.emit(
                        "interrupt", f"{name}: stopped after step {self.step}, checkpoint {path}"
                    )
                    status, code = "interrupted", 130 if self._stop_signal == signal.SIGINT else 143
                    break
        except TrainAborted:
            status, code = "aborted", 1
            try:
                self.save()  # skipped steps never touched the weights: keep them for diagnose
            except CheckpointWriteError as e:
                self.failure = str(e)
                self.emit("error", str(e))
        except CheckpointWriteError as e:
            self.failure = str(e)
            self.emit("error", str(e))
            status, code = "failed", 1
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            if self.tb is not None:
                self.tb.close()
        summary = self._summary(status)
        try:
            _atomic_write(
                self.run_dir / "summary.json",
                json.dumps(summary, indent=2, default=_json_number) + "\n",
            )
        except OSError as e:
            summary["summary_error"] = f"summary.json not written: {e.strerror or e}"
        return TrainResult(summary=summary, run_dir=self.run_dir, status=status, exit_code=code)

    def _summary(self, status: str) -> dict[str, Any]:
        st = self.scaler.stats()
        wall = self._wall()
        counts: dict[str, int] = {}
        for e in self.events:
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
        return {
            "status": status,
            "final_loss": self.last_metrics.get("loss"),
            "steps": self.step,
            "max_steps": self.cfg.trainer.max_steps,
            "skipped": st["skipped_total"],
            "forward_overflows": st["forward_overflows"],
            "overflow_rate": st["skipped_total"] / max(st["steps"], 1),
            "final_scale": st["scale"],
            "precision": self.policy.name,
            "promoted_modules": [m for m in self.policy.exempted if m not in _configured(self)],
            "fp32_modules": list(self.policy.exempted),
            "events": counts,
            "wall_time_s": wall,
            "tokens_per_s": self._tokens_total / max(wall, 1e-9),
            "run_dir": str(self.run_dir),
        }


def _configured(tr: Trainer) -> list[str]:
    from ampctl.amp.precision import match_modules

    return match_modules(tr.model, tr.cfg.precision.fp32_modules)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _trim_jsonl(path: Path, max_step: int) -> None:
    """Drop rows logged after ``max_step`` (a resumed run recomputes them identically)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if int(row.get("step", 0)) <= max_step:
            keep.append(line)
    _atomic_write(path, "".join(k + "\n" for k in keep))


def _json_number(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


def train(
    cfg: RunConfig,
    run_dir: Path,
    *,
    display: Any = None,
    resume: str | Path | None = None,
    fault: Callable[[Trainer, int, str], None] | None = None,
) -> TrainResult:
    """Library entry point: train ``cfg`` into ``run_dir`` (which must exist)."""
    run_dir = Path(run_dir)
    ck = load_checkpoint(resume) if resume is not None else None
    trainer = Trainer(cfg, run_dir, display=display, resume=ck, fault=fault)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return trainer.run()
