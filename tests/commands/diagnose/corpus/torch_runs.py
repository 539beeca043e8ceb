"""Corpus runs of a plain PyTorch loop: ``torch.autocast`` and ``torch.amp.GradScaler("cpu")``
(fp16) or bf16 autocast without a scaler, AdamW, and the checkpoints such a loop writes:
``torch.save({"model", "optimizer", "scaler", "step"}, f"ckpt_{step}.pt")``. No history file:
what diagnose knows of the run is in the checkpoints (their state, scale and the optimizer's
update count).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def loop(
    out: Path,
    *,
    steps: int = 40,
    every: int = 10,
    fp16: bool = True,
    init_scale: float = 2.0**24,
    inf_grads: range = range(0),
    inf_batch: int | None = None,
    scaler_files: bool = False,
) -> Path:
    """The loop; ``inf_grads``: steps whose gradient of the first layer's weight is made
    infinite after the backward (a planted fault); ``inf_batch``: a step whose batch holds an
    inf (bad data). Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, enabled=fp16)
    dtype = torch.float16 if fp16 else torch.bfloat16
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, generator=g)
        y = torch.sin(2.0 * x[:, :4])
        if step == inf_batch:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in inf_grads:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step % every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            if fp16:
                state["scaler"] = scaler.state_dict()
            torch.save(state, out / f"ckpt_{step}.pt")
            if scaler_files and fp16:
                torch.save(scaler.state_dict(), out / f"scaler_{step}.pt")
    return out


def healthy(out: Path) -> Path:
    """init_scale 2^24: the first steps overflow while GradScaler halves down to its level."""
    return loop(out)


def storm(out: Path) -> Path:
    """Every step from 29 on overflows (the first layer's gradient made infinite): GradScaler
    skips and halves 12 times; the last checkpoint is written in the storm."""
    return loop(out, inf_grads=range(29, 41))


def bf16_healthy(out: Path) -> Path:
    return loop(out, fp16=False)


def nan_weights(out: Path) -> Path:
    """bf16 without a scaler (nothing checks the gradients): an inf in the batch of step 25
    makes the loss and the gradients NaN, and AdamW writes NaN into every weight."""
    return loop(out, fp16=False, inf_batch=25)


def collapse(out: Path) -> Path:
    """Every step from 11 on overflows, for 200 steps: GradScaler's scale halves to 0.0. The
    loop saves ``scaler.state_dict()`` alone too (``scaler_N.pt``)."""
    return loop(
        out, steps=210, every=10, init_scale=2.0**16, inf_grads=range(11, 211), scaler_files=True
    )


RUNS = {
    "torch-healthy": healthy,
    "torch-storm": storm,
    "torch-bf16-healthy": bf16_healthy,
    "torch-nan-weights": nan_weights,
    "torch-collapse": collapse,
}
