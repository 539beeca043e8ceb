"""Writes the DeepSpeed checkpoints under ``deepspeed/`` with the real library (DeepSpeed is
not a test dependency: it needs a compiler and, for fp16, a GPU). Run where DeepSpeed is
installed, on CPU:

    DS_ACCELERATOR=cpu python tests/commands/diagnose/data/make_deepspeed.py

Checked in: ``zero0-fp32`` (ZeRO stage 0, fp32: the optimizer state sits in the model states
file) and ``zero2-bf16`` (ZeRO stage 2, bf16: flat fp32 masters and Adam moments in the
optim_states file), each healthy and ``-nan``: one NaN in the weight ``0.weight`` (element
[1, 2]; in ZeRO-2 also in its fp32 master) and one inf in the ``exp_avg_sq`` of ``2.weight``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "deepspeed"


def run(name: str, stage: int, bf16: bool, plant: bool) -> None:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    eng, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    g = torch.Generator().manual_seed(1)
    dtype = next(eng.parameters()).dtype
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).to(dtype)
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
    if plant:
        _plant(eng, opt, stage)
    dest = OUT / name
    shutil.rmtree(dest, ignore_errors=True)
    eng.save_checkpoint(str(dest))
    for extra in ("zero_to_fp32.py", "zero_to_torch.py"):  # helper scripts: not checkpoint data
        (dest / extra).unlink(missing_ok=True)


def _plant(eng, opt, stage: int) -> None:
    with torch.no_grad():
        eng.module[0].weight[1, 2] = float("nan")
        if stage == 0:
            st = opt.state[eng.module[2].weight]
            st["exp_avg_sq"].view(-1)[5] = float("inf")
            return
        # ZeRO-2: one flat fp32 partition per group; params in module order
        flat_master = opt.single_partition_of_fp32_groups[0]
        state = opt.optimizer.state[flat_master]
        offset = 16 * 8 + 16  # 0.weight, 0.bias, then 2.weight
        state["exp_avg_sq"][offset + 5] = float("inf")
        flat_master[1 * 8 + 2] = float("nan")


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    jobs = {
        "zero0-fp32": (0, False, False),
        "zero0-fp32-nan": (0, False, True),
        "zero2-bf16": (2, True, False),
        "zero2-bf16-nan": (2, True, True),
    }
    for name, (stage, bf16, plant) in jobs.items():
        if which in ("all", name):
            run(name, stage, bf16, plant)


if __name__ == "__main__":
    main()
