"""An Accelerate loop under ampctl's scaler, guard and run folder: the README's Accelerate
section.

    python examples/accelerate_loop.py [RUN_DIR]

ampctl's 2-layer BERT on the synthetic masked-LM corpus, ``Accelerator(mixed_precision="fp16",
cpu=True)``: Accelerate alone trains this in fp32 with no scaler; ``install_scaler`` before
``prepare`` makes it fp16 autocast with a LossScaler. One weight's gradients are made infinite at
steps 25-27: three attributed overflows in a row and a rollback. ``accelerator.save_state`` at
step 20 keeps the LossScaler (``scaler.pt``) and the run's state (``ampctl_run.json``).
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator

from ampctl.integrations.accelerate import install_scaler, protected_run
from ampctl.runlog.writers import default_run_name
from ampctl.train.data import SyntheticSource
from ampctl.train.models import BertForMaskedLM

torch.manual_seed(0)
torch.set_num_threads(2)
data = SyntheticSource(vocab_size=256, seq_len=32, batch_size=16)
model = BertForMaskedLM(
    vocab_size=256, max_position=32, hidden_size=64, num_layers=2, num_heads=4, ffn_size=256,
    dropout=0.0, attn_impl="eager",
)  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
run_dir = sys.argv[1] if len(sys.argv) > 1 else f"runs/{default_run_name('accelerate')}"

accelerator = Accelerator(mixed_precision="fp16", cpu=True)
install_scaler(accelerator)  # before prepare: fp16 autocast + LossScaler, also on a CPU
model, optimizer = accelerator.prepare(model, optimizer)
run = protected_run(accelerator, model, optimizer, run_dir=run_dir, max_steps=40, display="plain")
planted = accelerator.unwrap_model(model).bert.encoder.layer[0].output.dense.weight
with run:
    for step in range(1, 41):
        batch = data.next_batch()
        loss = model(**batch).loss
        accelerator.backward(loss)
        if step in (25, 26, 27):  # the planted burst
            planted.grad[0, 0] = float("inf")
        optimizer.step()  # LossScaler: step or skip, update
        run.after_step(loss, batch)  # guard + run folder, before zero_grad()
        optimizer.zero_grad()
        if step == 20:
            accelerator.save_state(f"{run_dir}/accelerate-step20")
