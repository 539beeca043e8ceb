"""Section 1: the protected loop against a bare ``torch.amp.GradScaler`` loop, interleaved."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ampctl.config import RunConfig, with_changes

from .common import OVERHEAD_GOAL, BenchError, Progress, _clock, _free, _median


# ---------------------------------------------------------------------------- 1. overhead
class _BareLoop:
    """The reference: a plain ``torch.amp.GradScaler`` loop over the same model architecture,
    initial weights and batches as a :class:`Trainer` (built before its first step)."""

    def __init__(self, cfg: RunConfig, trainer: Any) -> None:
        from ampctl.amp import make_precision
        from ampctl.train.builders import build_data_source, build_model, build_optimizer

        self.device = trainer.device
        self.accum = cfg.trainer.grad_accum_steps
        self.clip = cfg.optim.clip_grad_norm
        self.model = build_model(cfg.model).to(self.device)
        self.model.load_state_dict(trainer.model.state_dict())  # casts fp16-pure weights up
        if trainer.precision.master is not None:  # fp16-pure: the exact fp32 values are the masters
            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, master in trainer.precision.named_optimizer_params(trainer.model):
                    own[name].copy_(master)
        # fp16-pure has no GradScaler equivalent: the bare loop runs fp16 autocast instead
        name = "fp16" if cfg.precision.name == "fp16-pure" else cfg.precision.name
        self.policy = make_precision(
            name,
            fp32_modules=list(cfg.precision.fp32_modules),
            device_type=self.device.type,
            options=cfg.precision.options(),
        )
        # the same fp32 modules (fp8: and torchao's convert_to_float8_training of the
        # same layers, bf16 autocast, no scaling): the same architecture
        self.policy.prepare(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.params, self.device)
        s = cfg.scaler
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=s.init_scale,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
            enabled=self.policy.needs_scaler,
        )
        self.data = build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)

    def step(self) -> float:
        """One optimizer step; returns its wall time. GradScaler.step reads its found-inf flag
        on the host (one sync), as the protected loop does."""
        from ampctl.protect.loss import extract_loss

        t0 = _clock(self.device)
        for _ in range(self.accum):
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in self.data.next_batch().items()
            }
            with self.policy.autocast():
                loss = extract_loss(self.model(**batch)).float() / self.accum
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return _clock(self.device) - t0


def measure_overhead(
    cfg: RunConfig, pairs: int, warmup: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Protected loop vs bare GradScaler loop, interleaved step by step.

    The protected side is :meth:`Trainer.run` itself (display off, guard as configured, a log
    step every ``trainer.log_every`` steps, metrics written to a temporary run folder); only
    checkpoint writes are left out (the bare loop writes none). Each protected iteration -- the
    step, the guard's bookkeeping, the log read -- is timed from one ``train_step`` call to the
    next, and one bare step runs between two protected iterations: A, B, A, B ...
    """
    from ampctl.train.trainer import Trainer

    total = warmup + pairs + 1  # the last iteration has no end mark: not timed
    cfg = with_changes(cfg, trainer={"max_steps": total, "ckpt_every": total})
    prot: list[float] = []
    bare_t: list[float] = []
    logs: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        bare = _BareLoop(cfg, trainer)
        device = trainer.device
        real_step = trainer.train_step
        mark: dict[str, Any] = {"t": None, "log": False}

        def interleaved(log: bool) -> dict[str, Any]:
            now = _clock(device)
            if mark["t"] is not None:
                prot.append(now - mark["t"])
                logs.append(mark["log"])
                n = len(prot)
                if progress is not None and n > warmup and (n - warmup) % 10 == 0:
                    progress(f"overhead: {n - warmup}/{pairs} pairs")
            if trainer.step + 1 < total:
                bare_t.append(bare.step())
            mark["log"] = log
            mark["t"] = _clock(device)
            return real_step(log)

        trainer.train_step = interleaved  # type: ignore[method-assign]
        trainer.save = lambda: Path(d)  # type: ignore[method-assign]
        result = trainer.run()
        params = sum(p.numel() for p in trainer.model.parameters())
        trainer = bare = real_step = None  # free both models before the next section
    _free(device)
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if len(prot) < warmup + 1:
        raise BenchError(
            f"bench: the protected loop stopped after {len(prot)} steps (status {result.status}); "
            "fix the config (see `ampctl train` with the same overrides) and run again"
        )
    a, b, lg = prot[warmup:], bare_t[warmup : len(prot)], logs[warmup:]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    base = "torch.amp.GradScaler loop: autocast, scale(loss).backward(), unscale_, clip_grad_norm_, step, update, zero_grad"
    if cfg.precision.name == "fp16-pure":
        base += " (fp16 autocast with fp32 weights: GradScaler has no pure-fp16 mode)"
    elif cfg.precision.name == "fp8":
        base = (
            "torchao float8 loop: convert_to_float8_training (the same layers), bf16 autocast, "
            "backward, clip_grad_norm_, step, zero_grad (GradScaler disabled: no scaling)"
        )
    return {
        "ratio": _median(ratios),
        "total_ratio": sum(a) / sum(b),
        "protected_median_s": _median(a),
        "bare_median_s": _median(b),
        "pairs": len(a),
        "warmup": warmup,
        "log_every": cfg.trainer.log_every,
        "log_steps": sum(lg),
        "goal": OVERHEAD_GOAL,
        "protected": f"Trainer.run ({cfg.precision.name}, guard {'on' if cfg.guard.enabled else 'off'}, display off, "
        "metrics written, checkpoints left out)",
        "baseline": base,
        "params": params,
    }
