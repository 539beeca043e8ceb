"""Corpus runs written by Lightning's ``Trainer.fit`` (CPU, CSVLogger, ModelCheckpoint keeping
every checkpoint).

fp16 runs use Lightning's own ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``
plugin, passed explicitly (Lightning turns ``precision="16-mixed"`` into bf16 on a CPU): its
autocast, its ``GradScaler`` stepping and skipping, and the scaler's state in the ``.ckpt``.

The model is a small MLP on a regression: in fp16 Linear, GELU, LayerNorm, Linear, with the
tanh-approximated GELU written out as nanoGPT (and GPT-2's ``gelu_new``) write it: ``x ** 3``
inside overflows fp16, and at inputs of a few hundred its backward is NaN, while the forward's
``tanh`` saturates and stays finite.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn


def new_gelu(x: torch.Tensor) -> torch.Tensor:
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


class Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return new_gelu(x)


def _data(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4] * 2.0)
    return torch.utils.data.TensorDataset(x, y)


def fit(
    out: Path,
    *,
    steps: int = 120,
    every: int = 40,
    fp16: bool = True,
    fault=None,
    outlier_at: int | None = None,
) -> Path:
    """A Lightning run into ``out``; returns its ``version_0`` folder. ``fault(module, step)``
    runs after each training batch (a planted fault); ``outlier_at``: that step's batch is
    scaled by 1e22 (a corrupt batch: a finite loss, a gradient whose square overflows fp32).
    fp32 runs are Linear, ReLU, Linear."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            if fp16:
                self.net = nn.Sequential(
                    nn.Linear(16, 64), Gelu(), nn.LayerNorm(64), nn.Linear(64, 4)
                )
            else:
                self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

        def training_step(self, batch, _i):
            x, y = batch
            if outlier_at is not None and self.global_step + 1 == outlier_at:
                x = x * 1e22
            loss = nn.functional.smooth_l1_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if fault is not None:
                fault(self, self.global_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    plugins = []
    if fp16:
        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    ckpt = pl.callbacks.ModelCheckpoint(
        dirpath=None, every_n_train_steps=every, save_top_k=-1, filename="step{step}"
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        default_root_dir=str(out),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=pl.loggers.CSVLogger(str(out)),
        callbacks=[ckpt],
        plugins=plugins,
    )
    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    trainer.fit(Module(), loader)
    return out / "lightning_logs" / "version_0"


def _jump(at: int, factor: float):
    def fault(module, step: int) -> None:
        if step == at:
            with torch.no_grad():
                module.net[0].weight.mul_(factor)

    return fault


def healthy(out: Path) -> Path:
    return fit(out, steps=200, every=25)


def collapse(out: Path) -> Path:
    """At step 30 the first layer jumps 1000-fold: the GELU's input reaches ~1000, its fp16
    backward is NaN on every step after (the LayerNorm after it keeps the forward and the loss
    as they were), GradScaler halves the scale 170 times: 0.0 in the last checkpoint."""
    return fit(out, steps=200, every=25, fault=_jump(30, 1000.0))


def healthy_fp32(out: Path) -> Path:
    return fit(out, steps=60, every=20, fp16=False)


def optimizer_inf(out: Path) -> Path:
    """fp32 (no scaler): the batch of step 30 is scaled by 1e22: the Huber loss stays finite,
    the gradient's square overflows fp32: AdamW's ``exp_avg_sq`` holds inf (the update is 0,
    the weights stay finite; those elements never move again)."""
    return fit(out, steps=60, every=20, fp16=False, outlier_at=30)


def _callback_fit(out: Path, *, plant: range = range(0), resume_at: int | None = None) -> Path:
    """ampctl's ``AmpctlCallback`` writing its run folder (``out/run``) around a Lightning fit of
    80 steps, fp16 under ampctl's ``LossScaler``. ``plant``: the steps whose gradient of
    ``net.2.weight`` is made infinite (a hook); ``resume_at``: the fit stops there and a new one
    resumes from its newest checkpoint (``ckpt_path``)."""
    import lightning.pytorch as pl

    from ampctl.amp import LossScaler
    from ampctl.integrations.lightning import AmpctlCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
            self.net[2].weight.register_hook(self._plant)

        def _plant(self, grad: torch.Tensor) -> torch.Tensor:
            return (
                torch.full_like(grad, math.inf) if self.trainer.global_step + 1 in plant else grad
            )

        def training_step(self, batch, _i):
            x, y = batch
            loss = nn.functional.smooth_l1_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def trainer(steps: int, cb) -> pl.Trainer:
        return pl.Trainer(
            max_steps=steps, accelerator="cpu", default_root_dir=str(out), logger=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, pl.callbacks.ModelCheckpoint(
                dirpath=str(out / "ckpt"), every_n_train_steps=40, save_top_k=-1)],
        )  # fmt: skip

    loader = torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=False)
    cb = AmpctlCallback(
        out / "run", log_every=4, precision="fp16", scaler=LossScaler(init_scale=4096.0)
    )
    trainer(resume_at or 80, cb).fit(Module(), loader)
    if resume_at is not None:
        (ckpt,) = (out / "ckpt").iterdir()
        resumed = AmpctlCallback(out / "run", log_every=4, precision="fp16")
        trainer(80, resumed).fit(Module(), loader, ckpt_path=ckpt, weights_only=True)
    return out / "run"


def callback_resumed(out: Path) -> Path:
    """The callback's run folder, the fit stopped at step 40 and resumed from its newest
    checkpoint to 80: one resume, nothing set aside."""
    return _callback_fit(out, resume_at=40)


def callback_recovered(out: Path) -> Path:
    """The callback's run folder, infinite gradients in ``net.2.weight`` at steps 21-23: three
    overflows in a row, the guard rolls back to its snapshot of step 20, clean since."""
    return _callback_fit(out, plant=range(21, 24))


RUNS = {
    "lightning-callback-resumed": callback_resumed,
    "lightning-callback-recovered": callback_recovered,
    "lightning-healthy": healthy,
    "lightning-collapse": collapse,
    "lightning-fp32-healthy": healthy_fp32,
    "lightning-optimizer-inf": optimizer_inf,
}
