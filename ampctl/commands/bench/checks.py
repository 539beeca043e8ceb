"""Sections 2 and 3: the fused overflow check against a per-parameter one, and host reads per step."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ampctl.config import RunConfig, with_changes
from ampctl.errors import UsageError, first_line

from .common import Progress, _clock, _free, _median


# ---------------------------------------------------------------------------- 2. overflow check
def measure_overflow_check(
    device: torch.device, repeats: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Fused non-finite check vs the per-parameter checker on a 24-layer BERT's gradients.

    BERT-Large's shape on CUDA; on CPU a 24-layer BERT of hidden size 64 (same tensor count,
    small tensors, so it runs in seconds). The gradients come from one real backward pass and
    are finite. The fused side is timed to completion (a sync on CUDA); the naive side reads the
    device on the host up to twice per parameter by construction.
    """
    from ampctl.amp.overflow import check_and_unscale_, naive_overflow_check
    from ampctl.train.models import BertForMaskedLM

    if device.type == "cuda":
        shape = dict(vocab_size=30522, hidden_size=1024, num_heads=16, ffn_size=4096)
        batch, seq = 4, 128
    else:
        shape = dict(vocab_size=1024, hidden_size=64, num_heads=4, ffn_size=256)
        batch, seq = 2, 32
    layers = 24
    gen = torch.Generator().manual_seed(0)
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=rng_devices), torch.device(device):
        torch.manual_seed(0)  # built on the device: BERT-Large initialises in a blink there
        model = BertForMaskedLM(
            num_layers=layers, max_position=seq, dropout=0.0, attn_impl="sdpa", **shape
        )
    ids = torch.randint(4, shape["vocab_size"], (batch, seq), generator=gen).to(device)
    model(
        input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=ids
    ).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    one = torch.ones((), dtype=torch.float32, device=device)
    found = torch.zeros((), dtype=torch.float32, device=device)

    def naive() -> float:
        t0 = _clock(device)
        naive_overflow_check(params)
        return _clock(device) - t0

    def fused() -> float:
        t0 = _clock(device)
        check_and_unscale_(grads, one, found)  # x1.0: the gradients are unchanged
        return _clock(device) - t0

    for _ in range(3):  # warm-up
        naive(), fused()
    tn: list[float] = []
    tf: list[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            tn.append(naive())
            tf.append(fused())
        else:
            tf.append(fused())
            tn.append(naive())
    if progress is not None:
        progress(f"overflow check: {repeats} repeats on {len(grads)} gradient tensors")
    clean = not naive_overflow_check(params) and float(found.item()) == 0.0  # outside the timing
    out = {
        "ratio": _median([n / f for n, f in zip(tn, tf, strict=True)]),
        "naive_median_s": _median(tn),
        "fused_median_s": _median(tf),
        "repeats": repeats,
        "layers": layers,
        "hidden_size": shape["hidden_size"],
        "tensors": len(grads),
        "elements": sum(g.numel() for g in grads),
        "device": str(device),
        "finite": clean,
    }
    del model
    params.clear()
    grads.clear()
    _free(device)
    return out


# ---------------------------------------------------------------------------- 3. host reads
def count_step_reads(cfg: RunConfig, steps: int) -> tuple[int, dict[str, int]]:
    """Host reads over ``steps`` clean ``train_step(log=False)`` calls (after one warm-up step):
    ``(total, by method)``."""
    from ampctl.hostreads import count_host_reads
    from ampctl.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        trainer.train_step(log=False)  # lazy state (optimizer moments, scaler) is created here
        with count_host_reads() as reads:
            for _ in range(steps):
                trainer.train_step(log=False)
        device = trainer.device
        del trainer
    _free(device)
    return reads.total, {k: v for k, v in reads.by_method.items() if v}


def measure_host_reads(
    cfg: RunConfig, steps: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Host reads per step on the standard path (optim.fused=false) and the fused-optimizer
    path (optim.fused=true, clipping as configured)."""
    out: dict[str, Any] = {"steps": steps}
    for label, fused in (("standard", False), ("fused", True)):
        try:
            total, by = count_step_reads(with_changes(cfg, optim={"fused": fused}), steps)
        except UsageError as e:
            if not fused:
                raise
            out.update(fused=None, fused_total=None, fused_by_method={}, fused_error=first_line(e))
            continue
        out[label] = total / steps
        out[f"{label}_total"] = total
        out[f"{label}_by_method"] = by
        if progress is not None:
            progress(f"host reads: {label} path {total} in {steps} steps")
    out.setdefault("fused_error", None)
    out["goal"] = {"standard": 1, "fused": 0}
    return out
