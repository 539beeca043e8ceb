"""A nanoGPT-shaped loop under ampctl's guard: the README's "Integrations" section (nanoGPT).

    python examples/nanogpt_style.py OUT_DIR [scratch|resume] [MAX_ITERS]

The shape of nanoGPT's ``train.py``: module-level settings, ``get_batch`` from a token array,
``while True:`` with gradient accumulation (the loss divided by the micro-steps before
``scaler.scale(loss).backward()``), clipping after ``scaler.unscale_``, a checkpoint of model,
optimizer and ``iter_num`` every ``eval_interval`` iterations (no scaler state, as nanoGPT), and
``init_from="resume"``. Three changes for ampctl:

* ``LossScaler()`` where nanoGPT has ``torch.cuda.amp.GradScaler(enabled=...)``;
* ``run = ProtectedRun(...).attach(step=iter_num)`` before the loop (no ``with`` block needed;
  on ``resume`` the run folder continues at ``iter_num``, and the scale comes back from it, since
  nanoGPT's checkpoint holds none);
* ``run.after_step()`` after ``scaler.update()``: the step's loss is what the scaler saw over all
  micro-steps (no extra call per micro-step), then ``run.detach()`` at the end.

Data: a character-level corpus generated here (nothing is downloaded), a tiny GPT-2 (ampctl's,
Hugging Face module names), fp16 autocast on the CPU.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from ampctl.amp import LossScaler
from ampctl.integrations import ProtectedRun
from ampctl.train.models import GPT2LMHeadModel

# ----------------------------------------------------------------------------- settings
out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/nanogpt-style")
init_from = sys.argv[2] if len(sys.argv) > 2 else "scratch"  # scratch | resume
max_iters = int(sys.argv[3]) if len(sys.argv) > 3 else 40
eval_interval = 10  # a checkpoint every this many iterations
log_interval = 10
gradient_accumulation_steps = 4
batch_size, block_size = 8, 32
learning_rate, min_lr, warmup_iters = 3e-3, 3e-4, 5
grad_clip = 1.0
device_type, dtype = "cpu", torch.float16
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
torch.manual_seed(1337)
torch.set_num_threads(2)

# ----------------------------------------------------------------------------- data
words = "the quick brown fox jumps over the lazy dog and the cat naps in the sun".split()
g = torch.Generator().manual_seed(0)
text = " ".join(words[i] for i in torch.randint(len(words), (20_000,), generator=g).tolist())
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    return x, x  # labels = inputs: the model shifts them (Hugging Face convention)


def get_lr(it: int) -> float:
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / max(max_iters - warmup_iters, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * min(ratio, 1.0))) * (learning_rate - min_lr)


# ----------------------------------------------------------------------------- model
model = GPT2LMHeadModel(
    vocab_size=len(chars), max_position=block_size, hidden_size=64, num_layers=2, num_heads=4,
    ffn_size=256, dropout=0.0,
)  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95))
iter_num = 0
ckpt_path = out_dir / "ckpt.pt"
if init_from == "resume":
    checkpoint = torch.load(ckpt_path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    iter_num = checkpoint["iter_num"]

scaler = LossScaler()  # nanoGPT: torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
ctx = torch.autocast(device_type=device_type, dtype=dtype)
run = ProtectedRun(
    model, optimizer, scaler, run_dir=out_dir / "ampctl", max_steps=max_iters,
    log_every=log_interval, display="plain",
).attach(step=iter_num)  # fmt: skip

# ----------------------------------------------------------------------------- the loop
X, Y = get_batch()
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if iter_num % eval_interval == 0 and iter_num > 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "iter_num": iter_num,
            },
            ckpt_path,
        )
    for _micro_step in range(gradient_accumulation_steps):
        with ctx:
            loss = model(input_ids=X, labels=Y).loss
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    run.after_step(tokens=tokens_per_iter)  # guard + run folder (the loss: what the scaler saw)
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num >= max_iters:
        break
run.detach()
