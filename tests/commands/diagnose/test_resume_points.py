"""#36's resume points on real runs written by the real libraries, each beside its healthy twin:

* an FSDP2 run (2 processes, gloo, CPU: what torchrun starts) saving DCP checkpoints as
  torchtitan lays them out (``checkpoint/step-N``, TensorBoard in ``tb/``): the loss bottoms at
  step 8, the weights explode (finite: loss 4e11 at step 12) and go NaN at 13. The resume point
  comes before the bottom, never the exploded step-12 (nor step-9, whose loss already rose);
  without its history, the sibling checkpoints' weights say where the trouble began;
* a Lightning bf16 run whose lr grows: the loss bottoms near step 42 and creeps up until the
  end, never a jump. The resume point comes before the creep began, not where it crossed a band.
"""

from __future__ import annotations

import os
import shutil
import socket
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from .conftest import diagnose_cli

# ---------------------------------------------------------------------------- FSDP2
FSDP_STEPS, FSDP_EVERY, FSDP_HIGH_AT = 15, 3, 7


def _fsdp_rank(rank: int, out: Path, port: int, high: float) -> None:
    """One rank: a 3-layer linear net, each layer and the root ``fully_shard``-ed, SGD at lr
    0.06 (``high`` from step 7), a full-batch regression per rank; DCP every 3 steps, rank 0
    logs torchtitan's TensorBoard names."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 1))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.06)
        g = torch.Generator().manual_seed(1)
        w, x = torch.randn(8, 1, generator=g), torch.randn(64, 8, generator=g) + 0.1 * rank
        rows = []
        for step in range(1, FSDP_STEPS + 1):
            loss = nn.functional.mse_loss(model(x), x @ w)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).full_tensor()
            for group in opt.param_groups:
                group["lr"] = high if step >= FSDP_HIGH_AT else 0.06
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            rows.append((step, float(mean) / 2, float(norm), opt.param_groups[0]["lr"]))
            if step % FSDP_EVERY == 0:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    msd, osd = get_state_dict(model, opt)
                    ckpt = out / "checkpoint" / f"step-{step}"
                    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt))
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(str(out / "tb" / "20260101-0000")) as tb:
                for step, loss_, norm_, lr in rows:
                    tb.add_scalar("loss_metrics/global_avg_loss", loss_, step)
                    tb.add_scalar("grad_norm", norm_, step)
                    tb.add_scalar("lr", lr, step)
    finally:
        dist.destroy_process_group()


def fsdp_run(out: Path, high: float) -> Path:
    """The run's dump folder (two forked processes, as torchrun would start them)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_fsdp_rank, args=(out, port, high), nprocs=2, start_method="fork")
    return out


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    pytest.importorskip("tensorboard")
    root = tmp_path_factory.mktemp("fsdp2")
    broken, twin = fsdp_run(root / "broken", 0.3), fsdp_run(root / "twin", 0.06)
    bare = root / "bare"  # the broken run's checkpoints without their history
    shutil.copytree(broken / "checkpoint", bare / "checkpoint")
    return {"broken": broken, "twin": twin, "bare": bare}


def _verdict(path: Path) -> tuple[int, dict]:
    code, report, err = diagnose_cli(path, "--no-probe")
    assert report is not None, err
    return code, report


def test_fsdp2_resumes_before_the_loss_rose_not_from_the_exploded_checkpoint(fsdp):
    code, r = _verdict(fsdp["broken"] / "checkpoint" / "step-15")
    assert code == 1 and r["problems"][0]["kind"] == "lr_divergence"
    assert "(step 8)" in r["verdict"]["summary"]  # where the loss bottomed
    assert r["verdict"]["first_bad_step"] == 8
    # step-12 (loss ~4e11, weights exploded but finite) and step-9 (the loss already rising)
    # come after the first sign of trouble
    assert r["resume"]["checkpoint"] == str(fsdp["broken"] / "checkpoint" / "step-6")
    assert "optim.lr" in {x["override"].split("=")[0] for x in r["recommendations"]}
    code, r = _verdict(fsdp["twin"] / "checkpoint" / "step-15")
    assert code == 0 and r["verdict"]["status"] == "healthy" and r["problems"] == []
    assert r["resume"]["checkpoint"] == str(fsdp["twin"] / "checkpoint" / "step-15")


def test_fsdp2_without_history_dates_the_trouble_by_the_sibling_checkpoints(fsdp):
    """No loss logged: the checkpoints' weights (step-12's ~1e8x step-3's) put the trouble after
    step 9, not at the NaN checkpoint's own step 15."""
    code, r = _verdict(fsdp["bare"] / "checkpoint" / "step-15")
    assert code == 1 and r["problems"][0]["kind"] == "nonfinite_weights"
    assert r["verdict"]["first_bad_step"] == 10
    assert r["resume"]["checkpoint"] == str(fsdp["bare"] / "checkpoint" / "step-9")
    after = {c["path"].rsplit("/", 1)[-1] for c in r["checkpoints"] if c.get("after_trouble")}
    assert after == {"step-12"}  # healthy in itself (finite), but after the trouble began


# ---------------------------------------------------------------------------- Lightning
def lightning_run(out: Path, grow: float | None) -> Path:
    """Lightning bf16-mixed on a CPU, AdamW at 3e-3 times ``1 + (step / grow)^2`` (None: a
    constant lr), 120 steps, a checkpoint every 20, the loss logged every step (CSVLogger)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

        def training_step(self, batch, _i):
            loss = nn.functional.smooth_l1_loss(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
            f = (lambda s: 1 + (s / grow) ** 2) if grow else (lambda s: 1.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :4] * 2.0))
    trainer = pl.Trainer(
        max_steps=120,
        accelerator="cpu",
        precision="bf16-mixed",
        default_root_dir=str(out),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=pl.loggers.CSVLogger(str(out)),
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                every_n_train_steps=20, save_top_k=-1, filename="step{step}"
            ),
            pl.callbacks.LearningRateMonitor("step"),
        ],
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=32))
    return out / "lightning_logs" / "version_0" / "checkpoints"


def test_lightning_creep_resumes_before_the_creep_began(tmp_path):
    pytest.importorskip("lightning")
    torch.set_num_threads(1)
    ckpts = lightning_run(tmp_path / "creep", grow=12.0)
    code, r = _verdict(ckpts / "stepstep=120.ckpt")
    v = r["verdict"]
    assert code == 1 and r["problems"][0]["kind"] == "lr_divergence", v
    assert "(step 42)" in v["summary"] and v["first_bad_step"] == 44, v
    # the creep crossed the 25% band near step 100: the checkpoints from 60 on are after it began
    assert r["resume"]["checkpoint"] == str(ckpts / "stepstep=40.ckpt")
    twin = lightning_run(tmp_path / "twin", grow=None)
    code, r = _verdict(twin / "stepstep=120.ckpt")
    assert code == 0 and r["verdict"]["status"] == "healthy" and r["problems"] == []
    assert r["resume"]["checkpoint"] == str(twin / "stepstep=120.ckpt")
