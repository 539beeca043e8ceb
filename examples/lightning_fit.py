"""A Lightning fit under ampctl's scaler, guard and run folder: the README's Lightning section.

    python examples/lightning_fit.py [RUN_DIR]

ampctl's 2-layer BERT in a LightningModule on the synthetic masked-LM corpus, fp16 on the CPU
(Lightning alone would turn ``16-mixed`` into bf16 there), 40 steps with a step-wise lr schedule.
One weight's gradients are made infinite at steps 25-27: three attributed overflows in a row and
a rollback (weights, optimizer state, lr schedule, scale). The only ampctl line is the callback.
"""

from __future__ import annotations

import logging
import sys

import lightning as L
import torch

from ampctl.integrations.lightning import AmpctlCallback
from ampctl.runlog.writers import default_run_name
from ampctl.train.data import SyntheticSource
from ampctl.train.models import BertForMaskedLM

PLANTED_STEPS = (25, 26, 27)


class MaskedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = BertForMaskedLM(
            vocab_size=256, max_position=32, hidden_size=64, num_layers=2, num_heads=4,
            ffn_size=256, dropout=0.0, attn_impl="eager",
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_after_backward(self):
        if self.trainer.global_step + 1 in PLANTED_STEPS:  # the planted burst
            self.model.bert.encoder.layer[0].output.dense.weight.grad[0, 0] = float("inf")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


if __name__ == "__main__":
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    data = SyntheticSource(vocab_size=256, seq_len=32, batch_size=16)
    loader = torch.utils.data.DataLoader([data.next_batch() for _ in range(40)], batch_size=None)
    run_dir = sys.argv[1] if len(sys.argv) > 1 else f"runs/{default_run_name('lightning')}"
    trainer = L.Trainer(
        max_steps=40,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AmpctlCallback(run_dir, precision="fp16", log_every=10, display="plain")],
    )
    trainer.fit(MaskedLM(), loader)
