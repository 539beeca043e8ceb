"""Distributed training on CPU with gloo, 2 processes: rank-consistent overflow handling, and
DDP / FSDP matching the single-process run on the same global batch.

The ranks are forked from the session's forkserver (tests/conftest.py), which has imported torch
and the trainer once (a fresh interpreter per rank pays seconds of imports on 2 cores);
``torchrun -m ampctl train`` runs as a real launcher for DDP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.config import load_config
from ampctl.train.dist import DistContext
from ampctl.train.trainer import train
from tests.conftest import FAST, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(fn, *args) -> None:
    """``fn(rank, *args)`` in 2 processes forked from the session's forkserver (tests/conftest.py:
    torch and the trainer imported once); a rank that fails raises."""
    mp.start_processes(fn, args=args, nprocs=2, join=True, start_method="forkserver")


def _rank_env(rank: int, world: int, port: int) -> None:
    """What torchrun sets for a rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)


def _cli_rank(rank: int, world: int, port: int, args: list[str]) -> None:
    """``ampctl train ARGS`` as one of torchrun's ranks: the CLI joins the group from the
    environment."""
    _rank_env(rank, world, port)
    res = CliRunner().invoke(app, ["train", *args])
    assert res.exit_code == 0, res.output


def _worker(rank: int, world: int, port: int, runs: str, out: str, strategy: str) -> None:
    _rank_env(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, strategy=strategy)
    cfg = load_config(
        [*FAST, f"trainer.runs_dir={runs}", f"dist.strategy={strategy}", "guard.rollback_after=0"]
    )
    run_dir = ctx.broadcast_object(
        __import__("ampctl.runlog", fromlist=["x"]).new_run_dir(runs, "d") if rank == 0 else None
    )

    def fault(tr, step, phase):
        if step == 5 and rank == 1:  # the overflow happens on rank 1 only
            from ampctl.amp.overflow import local_tensor

            local_tensor(tr.params[3].grad).view(-1)[0] = float("inf")

    from ampctl.train.trainer import Trainer

    tr = Trainer(cfg, run_dir, dist_ctx=ctx, fault=fault)
    res = tr.run()
    from ampctl.amp.overflow import local_tensor

    torch.save(
        {
            "history": tr.scaler.history(),
            "scale": tr.scaler.get_scale(),
            "skipped": tr.scaler.skipped_steps,
            "weights": [local_tensor(p).detach().clone() for p in tr.params],
            "status": res.status,
        },
        os.path.join(out, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_overflow_on_one_rank_skips_on_all(tmp_path, strategy):
    out = tmp_path / "out"
    out.mkdir()
    _ranks(_worker, 2, _free_port(), str(tmp_path / "runs"), str(out), strategy)
    r0 = torch.load(out / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "rank1.pt", weights_only=True)
    assert r0["status"] == r1["status"] == "ok"
    assert r0["history"] == r1["history"]
    assert [h[2] for h in r0["history"]].index(True) == 4  # step 5 skipped on both ranks
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["scale"] == r1["scale"] == 512.0
    if strategy == "ddp":  # replicated weights are identical
        assert all(torch.equal(a, b) for a, b in zip(r0["weights"], r1["weights"], strict=True))
    events = read_jsonl(tmp_path / "runs" / "d" / "events.jsonl")
    assert [e["kind"] for e in events] == ["overflow"] and events[0]["step"] == 5


def _torchrun(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={_free_port()}",
        "-m",
        "ampctl",
        "train",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_ddp_and_fsdp_match_single_process_on_the_same_global_batch(tmp_path):
    runs = tmp_path / "runs"
    common = [*FAST, f"trainer.runs_dir={runs}", "logging.plot=false", "--quiet", "precision=fp32"]
    # one process accumulating 2 micro-batches sees global batches 2i, 2i+1: what 2 ranks see
    single = train(
        load_config([*common[:-2], "precision=fp32", "trainer.grad_accum_steps=2"]),
        _mk(runs, "single"),
    )
    assert single.status == "ok"
    losses = {"single": [r["loss"] for r in read_jsonl(single.run_dir / "metrics.jsonl")]}
    res = _torchrun([*common, "dist.strategy=ddp", "--name", "ddp"], nproc=2)  # a real torchrun
    assert res.returncode == 0, res.stderr[-2000:]
    _ranks(_cli_rank, 2, _free_port(), [*common, "dist.strategy=fsdp", "--name", "fsdp"])
    for strategy in ("ddp", "fsdp"):
        losses[strategy] = [r["loss"] for r in read_jsonl(runs / strategy / "metrics.jsonl")]
    # fp32: the only difference is the order of the gradient sum (all-reduce vs accumulation),
    # a few ulps per step; over 12 AdamW steps that stays far below 1e-4 relative.
    for strategy in ("ddp", "fsdp"):
        assert losses[strategy] == pytest.approx(losses["single"], rel=1e-4), strategy


def _mk(runs, name):
    from ampctl.runlog.writers import new_run_dir

    return new_run_dir(runs, name)


@pytest.mark.slow
def test_fsdp_resume_of_gpt2_through_its_hf_layout_hooks(tmp_path):
    """GPT-2's state dict transposes its Conv1D weights (Hugging Face layout) in hooks; FSDP2's
    full state dicts go through them (gather on save, distribute on load): a resumed run must
    match an uninterrupted one, and the checkpoint must hold the [in, out] layout."""
    import json

    runs = tmp_path / "runs"
    common = ["conf=gpt2_tiny", *FAST, "model.num_heads=2", "precision=fp32", "--quiet"]
    common += [f"trainer.runs_dir={runs}", "dist.strategy=fsdp"]
    for name in ("full", "part"):
        res = _torchrun([*common, "--name", name], nproc=2)
        assert res.returncode == 0, res.stderr[-2000:]
    part = runs / "part"
    (part / "checkpoints" / "step_00000012.pt").unlink()
    rows = [r for r in read_jsonl(part / "metrics.jsonl") if r["step"] <= 6]
    (part / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _torchrun(["--resume", str(part), "--quiet"], nproc=2)
    assert res.returncode == 0, res.stderr[-2000:]
    a = [r["loss"] for r in read_jsonl(runs / "full" / "metrics.jsonl")]
    b = [r["loss"] for r in read_jsonl(part / "metrics.jsonl")]
    assert a == b and len(a) == 3
    ck = torch.load(part / "checkpoints" / "step_00000012.pt", weights_only=True)
    assert ck["model"]["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
