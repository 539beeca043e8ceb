"""Your own fp16 loop under ampctl's guard: the README's "Integrations" section (Your own loop).

    python examples/own_loop.py [RUN_DIR]

A plain PyTorch loop (autocast, ``scaler.scale(loss).backward()``, ``scaler.step``,
``scaler.update``) around ampctl's 2-layer BERT on the synthetic masked-LM corpus, with two
changes: ``LossScaler`` instead of ``torch.amp.GradScaler``, and a ``ProtectedRun`` around the
loop. One weight's gradients are made infinite at steps 25-27 (a planted burst): three
attributed overflows in a row, then a rollback to the last snapshot with the scale cut.
"""

from __future__ import annotations

import sys

import torch

from ampctl.amp import LossScaler
from ampctl.integrations import ProtectedRun
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
scaler = LossScaler()  # instead of torch.amp.GradScaler("cpu")
planted = model.bert.encoder.layer[0].output.dense.weight
run_dir = sys.argv[1] if len(sys.argv) > 1 else f"runs/{default_run_name('own-loop')}"

with ProtectedRun(model, optimizer, scaler, run_dir=run_dir, max_steps=40, display="plain") as run:
    for step in range(1, 41):
        batch = data.next_batch()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        if step in (25, 26, 27):  # the planted burst
            planted.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        run.after_step(loss, batch)  # guard + run folder, before the next zero_grad()
