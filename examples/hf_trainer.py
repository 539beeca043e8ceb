"""The HF Trainer under ampctl's scaler, guard and run folder: the README's HF Trainer section.

    python examples/hf_trainer.py [RUN_DIR]

A 2-layer GPT-2 built from a config (nothing downloaded) on token rows of the synthetic corpus,
``TrainingArguments(fp16=True, use_cpu=True)`` with the Trainer's default fused AdamW and linear
schedule, 40 steps. Without ``protect_trainer`` this trains in fp32 (Accelerate's choice on a
CPU); with it, fp16 autocast and the LossScaler. The LM head's gradients are made infinite at
steps 25-27: three attributed overflows and a rollback, and the lr schedule skips those steps.
"""

from __future__ import annotations

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ampctl.integrations.transformers import protect_trainer
from ampctl.runlog.writers import default_run_name
from ampctl.train.data import SyntheticSource

PLANTED_STEPS = (25, 26, 27)


class Rows(torch.utils.data.Dataset):
    """Token rows of the synthetic corpus (causal-LM targets: the rows themselves)."""

    def __init__(self, n: int) -> None:
        self.ids = SyntheticSource(vocab_size=256, seq_len=32, batch_size=n).next_batch()[
            "input_ids"
        ]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PlantedBurst(TrainerCallback):
    """The LM head's gradient is infinite in the backward passes of PLANTED_STEPS."""

    def __init__(self, model) -> None:
        self.step = 0
        model.lm_head.weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if self.step in PLANTED_STEPS else g
        )

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1


if __name__ == "__main__":
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    )
    args = TrainingArguments(
        output_dir="/tmp/ampctl-hf-example",
        max_steps=40,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        save_strategy="no",
        use_cpu=True,
        fp16=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Rows(640), callbacks=[PlantedBurst(model)]
    )
    run_dir = sys.argv[1] if len(sys.argv) > 1 else f"runs/{default_run_name('hf')}"
    protect_trainer(trainer, run_dir, display="plain")  # the one ampctl line
    trainer.train()
