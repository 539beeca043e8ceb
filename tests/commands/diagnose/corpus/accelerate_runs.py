"""Corpus runs of an Accelerate loop (CPU): ``accelerator.prepare``, ``accelerator.backward``,
``accelerator.save_state`` with automatic checkpoint naming (``checkpoints/checkpoint_N``).

fp16 runs use a real ``torch.amp.GradScaler``: on a GPU ``Accelerator(mixed_precision="fp16")``
makes one; on a CPU Accelerate trains in fp32 without one, so the writer sets the two attributes
it would have set on a GPU (``native_amp``, ``scaler``) before ``prepare``. bf16 runs are
Accelerate's own CPU bf16 autocast, with no scaler: nothing checks the gradients.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .torch_runs import mlp


def loop(
    out: Path,
    *,
    steps: int = 30,
    every: int = 10,
    fp16: bool = True,
    inf_batch: int | None = None,
) -> Path:
    """The loop into ``out``; ``inf_batch``: a step whose batch holds an inf (bad data)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)  # one Accelerator per run (the state is a singleton)
    GradientState._reset_state()
    acc = Accelerator(
        cpu=True,
        mixed_precision="fp16" if fp16 else "bf16",
        project_config=ProjectConfiguration(
            project_dir=str(out), automatic_checkpoint_naming=True, total_limit=None
        ),
    )
    if fp16:  # what Accelerate does for fp16 on a GPU (see the module docstring)
        acc.native_amp = True
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(8, 16, generator=g)
        y = torch.sin(2.0 * x[:, :4])
        if step == inf_batch:
            x[0, 0] = float("inf")
        loss = nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % every == 0:
            acc.save_state()
    return out


def healthy(out: Path) -> Path:
    return loop(out)


def bf16_healthy(out: Path) -> Path:
    return loop(out, fp16=False)


def nan_weights(out: Path) -> Path:
    """bf16, no scaler: an inf in the batch of step 25 goes through the optimizer: NaN weights
    in the last ``save_state``."""
    return loop(out, fp16=False, inf_batch=25)


RUNS = {
    "accelerate-healthy": healthy,
    "accelerate-bf16-healthy": bf16_healthy,
    "accelerate-nan-weights": nan_weights,
}
