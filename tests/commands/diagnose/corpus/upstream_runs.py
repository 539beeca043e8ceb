"""Corpus runs of failures users report upstream (#40), each a real tiny run of the real library
beside its healthy twin, named after the issue it reproduces.

The plain loops save what such a loop saves (``torch.save`` of model, optimizer, scaler and
scheduler states, or ``save_pretrained`` folders) and log to TensorBoard under their own names
(``loss``, ``lr``, ``scale``, ``grad_norm``); what the run printed (the library's warnings, the
error it stopped on, its last words) goes to ``train.log``, as a job's log would hold it.
"""

from __future__ import annotations

import datetime
import math
import socket
import time
import warnings
from pathlib import Path

import torch
from torch import nn

LOG = "train.log"


def _log(out: Path, rows: list[dict]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as w:
        for r in rows:
            for k, v in r.items():
                if k != "step":
                    w.add_scalar(k, v, r["step"])


def _say(out: Path, *lines: str) -> None:
    """What the run printed, appended to its ``train.log``."""
    with (out / LOG).open("a") as f:
        f.writelines(f"{line}\n" for line in lines)


def mlp(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))


# ---------------------------------------------------------------------------- transformers #5651
def t5_loop(out: Path, *, jump_at: int | None, steps: int = 12, every: int = 4) -> Path:
    """transformers' T5 at tiny size (2 layers, d_model 32, d_ff 64) fine-tuned in a plain loop
    with fp16 autocast and a GradScaler, as in #5651 (apex O1 then, autocast now), saved with
    ``save_pretrained(f"checkpoint-{step}")`` every ``every`` steps. ``jump_at``: the weight of
    encoder block 1's ``DenseReluDense.wo`` grows 4x10^4-fold at the end of that step (the
    stand-in for T5's FFN activations that grew during fine-tuning): its output passes 65504
    (~1e5 in fp32), so fp16 gives inf and the loss is NaN on every later step."""
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True)
    cfg = T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        i = torch.randint(0, 4096, (4, 1), generator=g)
        ids = (torch.arange(16) * (1 + i % 3) + i) % 64
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids.flip(1)).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
        rows[-1]["scale"] = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == jump_at:
            with torch.no_grad():
                model.encoder.block[1].layer[1].DenseReluDense.wo.weight.mul_(4e4)
        if step % every == 0:
            model.save_pretrained(out / f"checkpoint-{step}")
    _log(out, rows)
    return out


# ---------------------------------------------------------------------------- pytorch #55585
def scheduler_loop(out: Path, *, fixed: bool, steps: int = 16) -> Path:
    """fp16 autocast + GradScaler(init_scale=2**24) with a 10-step linear warmup: the first
    steps overflow and ``scaler.step`` skips ``optimizer.step``. ``fixed=False``: the loop of
    pytorch #55585 / transformers #11106 (``scheduler.step()`` every iteration: the warmup
    advances on skipped steps, and torch warns); ``fixed=True``: the scheduler steps only when
    the optimizer did (the scale did not drop: the Trainer's fix, transformers #11144)."""
    out.mkdir(parents=True)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(1)
    rows = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(1, steps + 1):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)
            before = scaler.get_scale()
            rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
            rows[-1].update(lr=sched.get_last_lr()[0], scale=before)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if not fixed or scaler.get_scale() >= before:
                sched.step()
    _say(out, *(f"{w.category.__name__}: {w.message}" for w in said))
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "step": steps,
        },
        out / "ckpt.pt",
    )
    _log(out, rows)
    return out


# ---------------------------------------------------------------------------- pytorch #98828
def growth_loop(out: Path, *, growth_interval: int, steps: int = 150) -> Path:
    """pytorch #98828's own loop (batches of 256 rows, not 1: the loss's course is then readable):
    ``nn.Linear(5, 1)``, Adam, targets near 1e-4, a GradScaler with ``growth_interval=1``: the
    gradients never overflow, so the scale doubles every step.
    torch >= 2.1 caps the growth (pytorch #98876) at 2**127, float32's largest power of two;
    before, it became inf. The twin keeps the default ``growth_interval=2000``."""
    out.mkdir(parents=True)
    torch.manual_seed(0)
    net = nn.Linear(5, 1)
    opt = torch.optim.Adam(net.parameters())
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    rows = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = torch.randn(256, 5), 1e-4 * torch.randn(256, 1)
        loss = ((net(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        rows.append({"step": step, "loss": loss.item(), "scale": scaler.get_scale()})
        scaler.step(opt)
        scaler.update()
    torch.save(
        {"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
        out / "ckpt.pt",
    )
    _log(out, rows)
    return out


# ---------------------------------------------------------------------------- pytorch #157436
class TwoTasks(nn.Module):
    """A shared trunk and one head per task; rank r trains task r, so the other task's head has
    ``None`` gradients on that rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def _average(params: list[nn.Parameter], world: int) -> list[str]:
    """The gradients averaged across ranks by hand (a zero for a ``None`` one, so every rank
    reduces the same tensors, as DDP does); returns the parameters that had none here."""
    import torch.distributed as dist

    none = [i for i, p in enumerate(params) if p.grad is None]
    flat = torch.cat(
        [(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params]
    )
    dist.all_reduce(flat)
    for p, g in zip(params, flat.div_(world).split([p.numel() for p in params]), strict=True):
        p.grad = g.view_as(p).clone()
    return [str(i) for i in none]


def _rank(rank: int, world: int, port: int, out: Path, fixed: bool, steps: int, bad: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    model = TwoTasks()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**17)
    g = torch.Generator().manual_seed(1 + rank)
    rows, none = [], []
    for step in range(1, steps + 1):
        x = torch.randn(32, 8, generator=g)
        if rank == 0 and step == bad:
            x = x * 4  # a hard batch on rank 0 (4x the loss): its fp16 gradients overflow
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x, rank).float(), torch.sin((rank + 1) * x[:, :4]))
        scaler.scale(loss).backward()
        if fixed:  # averaged before the GradScaler checks them: every rank checks the same
            none = _average(params, world)
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if not fixed:  # averaged after this rank's GradScaler checked its own gradients
            none = _average(params, world)
        rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
        rows[-1]["scale"] = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 25 == 0 or step == steps):
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            torch.save(
                {**state, "scaler": scaler.state_dict(), "step": step}, out / f"ckpt_{step}.pt"
            )
    if rank == 0:
        _log(out, rows)
        _say(out, f"rank 0: None gradients before averaging: params {none}")
    else:  # what rank 1's GradScaler came to (rank 0 saves the checkpoints)
        torch.save(scaler.state_dict(), out / "rank1-scaler.pt")
    dist.destroy_process_group()


def ranks_loop(out: Path, *, fixed: bool, steps: int = 101, bad: int = 10) -> Path:
    """Two ranks (gloo, ``torch.multiprocessing``, fork) train one task each on a shared trunk,
    fp16 autocast and one GradScaler(init_scale=2**17) per rank, averaging the gradients by
    hand. ``fixed=False``: averaged after ``scaler.unscale_`` (to clip and log them first):
    each rank's GradScaler decided on its own gradients, where the other task's head is
    ``None`` before the average. At step ``bad`` one batch of rank 0 overflows: rank 0 skips, rank 1 saw nothing
    and applies the average that holds rank 0's inf; rank 0 applies rank 1's NaN the step after.
    From then on every step is skipped and the scale halves on each: 131072 (2^17) to
    5.29e-23 (2^-74) over the 91 steps of pytorch #157436. ``fixed=True``: averaged before
    ``unscale_`` (as DDP does in ``backward``): both ranks skip step ``bad`` and go on. Rank 0
    saves ``ckpt_{step}.pt`` every 25 steps and at the end, and logs; rank 1 saves its
    GradScaler's state at the end (``rank1-scaler.pt``)."""
    import torch.distributed  # noqa: F401 - imported here once, not in each forked rank
    import torch.multiprocessing as mp

    torch.optim.AdamW(TwoTasks().parameters())  # so are the modules an optimizer imports
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (2, port, out, fixed, steps, bad)
    ranks = mp.start_processes(_rank, args=args, nprocs=2, start_method="fork", join=False)
    deadline = time.monotonic() + 120  # a rank that hangs fails the run, never the suite
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            raise TimeoutError("the two ranks did not finish in 120 s")
    return out


# ---------------------------------------------------------------------------- LLaVA #363
def fp16_weights_fit(out: Path, *, trainable_fp16: bool, steps: int = 6) -> Path:
    """Lightning ``Trainer.fit`` with its ``MixedPrecision("16-mixed")`` plugin (a real
    GradScaler) on a model whose frozen base was loaded in fp16 (as ``from_pretrained(...,
    torch_dtype=torch.float16)`` loads it) with a trainable head. ``trainable_fp16=True``: the
    head is fp16 too (LLaVA #363's projector, bitsandbytes #945's adapter): the GradScaler
    refuses its gradients at the first step ("Attempting to unscale FP16 gradients."), and
    Lightning's ``OnExceptionCheckpoint`` saves the state it stopped in. The twin trains its
    fp32 head over the fp16 base. The error the fit stopped on goes to ``train.log``."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.base = nn.Sequential(nn.Linear(8, 32), nn.GELU()).half().requires_grad_(False)
            self.head = nn.Linear(32, 4)
            if trainable_fp16:
                self.head.half()

        def training_step(self, batch, _i):
            x, y = batch
            loss = nn.functional.mse_loss(self.head(self.base(x)).float(), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.head.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(2 * x[:, :4]))
    ckpts = out / "checkpoints"
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", default_root_dir=str(out), log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False,
        logger=pl.loggers.CSVLogger(str(out), name="", version=""),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        callbacks=[
            pl.callbacks.ModelCheckpoint(ckpts, every_n_train_steps=3, save_top_k=-1),
            pl.callbacks.OnExceptionCheckpoint(ckpts),
        ],
    )  # fmt: skip
    out.mkdir(parents=True)
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
    except ValueError as e:
        _say(out, f"{type(e).__name__}: {e}")
    return out


# ---------------------------------------------------------------------------- marin #7271
def poisoned_loop(out: Path, *, padded_at: int | None, steps: int = 20, every: int = 5) -> Path:
    """A bf16 loop without a loss scaler (as on TPUs), a masked Euclidean loss
    ``sqrt(sum(((pred - y) * mask)**2))`` per sample, gradients clipped to norm 1. At
    ``padded_at`` one sample of the batch is padding (mask 0): its distance is 0, a finite loss,
    but the backward of ``sqrt`` at 0 is NaN, clipping spreads it, and AdamW writes NaN into
    every weight. On the next step the loss is NaN: the loop stops as marin's does ("NaN loss
    at step N. Stopping training."), saves its final checkpoint as it ends, and reports success.
    The twin has no padding."""
    out.mkdir(parents=True)
    model = mlp(32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(8, 8, generator=g)
        mask = torch.ones(8, 1)
        if step == padded_at:
            mask[-1] = 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(x).float()
        loss = ((pred - torch.sin(2 * x[:, :4])) * mask).pow(2).sum(-1).sqrt().mean()
        if not math.isfinite(loss.item()):
            _say(out, f"NaN loss at step {step}. Stopping training.")
            break
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
        if step % every == 0:
            torch.save(_state(model, opt, step), out / f"ckpt_{step}.pt")
    torch.save(_state(model, opt, step), out / f"ckpt_{step}.pt")  # the final, forced save
    _say(out, f"training finished at step {step}: succeeded")
    _log(out, rows)
    return out


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


# ---------------------------------------------------------------------------- a bf16 spike
def spike_loop(out: Path, *, bad_batch: int | None, steps: int = 24) -> Path:
    """bf16 autocast, AdamW, gradients clipped to norm 1: one batch ``1e3`` times too large
    (a corrupt sample, a unit mistake) at ``bad_batch``; the twin has none."""
    out.mkdir(parents=True)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=g)
        if step == bad_batch:
            x = x * 1e3
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out / "ckpt.pt")
    _log(out, rows)
    return out


RUNS = {
    "t5-wo-overflow": lambda out: t5_loop(out, jump_at=6),
    "t5-healthy": lambda out: t5_loop(out, jump_at=None),
    "scheduler-on-skips": lambda out: scheduler_loop(out, fixed=False),
    "scheduler-gated": lambda out: scheduler_loop(out, fixed=True),
    "scale-growth-1": lambda out: growth_loop(out, growth_interval=1),
    "scale-growth-default": lambda out: growth_loop(out, growth_interval=2000),
    "ranks-unscaled-before-average": lambda out: ranks_loop(out, fixed=False),
    "ranks-averaged-first": lambda out: ranks_loop(out, fixed=True),
    "fp16-trainable": lambda out: fp16_weights_fit(out, trainable_fp16=True),
    "fp16-base-fp32-head": lambda out: fp16_weights_fit(out, trainable_fp16=False),
    "nan-backward-saved": lambda out: poisoned_loop(out, padded_at=13),
    "no-padding": lambda out: poisoned_loop(out, padded_at=None),
    "bf16-spike": lambda out: spike_loop(out, bad_batch=12),
    "bf16-no-spike": lambda out: spike_loop(out, bad_batch=None),
}
#: The library each run needs beyond torch (tensorboard: every loop logs to it).
NEEDS = {
    "t5-wo-overflow": "transformers",
    "t5-healthy": "transformers",
    "fp16-trainable": "lightning",
    "fp16-base-fp32-head": "lightning",
}
