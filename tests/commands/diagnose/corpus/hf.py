"""Corpus runs written by the Hugging Face ``Trainer`` (a tiny GPT-2 built from a config, CPU).

fp16 with a real ``torch.amp.GradScaler``: on a GPU the Trainer's Accelerator makes one for
``fp16=True``; on a CPU Accelerate trains fp16 runs in fp32 without one, so the writer sets the
two attributes Accelerate would have set on a GPU (``native_amp``, ``scaler``) before
``train()`` prepares the model. Everything else -- autocast, unscale, clipping, the skipped step,
``grad_norm: inf`` in ``trainer_state.json``, ``scaler.pt`` -- is the libraries' own.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, SEQ = 64, 16


class Patterns(torch.utils.data.Dataset):
    """Learnable token sequences: arithmetic progressions mod the vocabulary."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(SEQ) * (1 + i % 3) + i) % VOCAB
        return {"input_ids": ids, "labels": ids}


def gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def trainer_run(
    out: Path,
    *,
    lr: float = 1e-3,
    steps: int = 30,
    save_steps: int = 10,
    init_scale: float = 2.0**16,
    growth_interval: int = 8,
    fp16: bool = True,
    fault=None,
    resume: Path | None = None,
    fp32_modules: tuple[str, ...] = (),
    **args,
) -> Path:
    """An HF Trainer run into ``out`` (its output_dir); ``fault(model, step)`` is called at the
    end of each step (a planted fault, for the cases that need one). ``resume``: the checkpoint
    ``train(resume_from_checkpoint=...)`` starts from; ``fp32_modules``: modules whose forward
    runs in fp32 (autocast off, inputs cast up: what diagnose's advice says in the user's
    terms); ``args``: more ``TrainingArguments`` (``warmup_steps``, ``max_grad_norm`` ...)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = gpt2()
    args = TrainingArguments(
        output_dir=str(out), use_cpu=True, fp16=fp16, max_steps=steps,
        per_device_train_batch_size=4, save_steps=save_steps, logging_steps=1, report_to=[],
        learning_rate=lr, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        save_only_model=False, **{"warmup_steps": 0, **args},
    )  # fmt: skip
    for name in fp32_modules:
        _in_fp32(model.get_submodule(name))
    callbacks = []
    if fault is not None:

        class Fault(TrainerCallback):
            def on_step_end(self, args, state, control, **kw):
                fault(kw["model"], state.global_step)

        callbacks.append(Fault())
    trainer = Trainer(model=model, args=args, train_dataset=Patterns(), callbacks=callbacks)
    if fp16:  # what Accelerate does for fp16 on a GPU (see the module docstring)
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler(
            "cpu", init_scale=init_scale, growth_interval=growth_interval
        )
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return out


def _in_fp32(module: torch.nn.Module) -> None:
    """``module``'s forward in fp32: autocast off inside, floating inputs cast up."""
    forward = module.forward

    def fp32_forward(*a, **kw):
        up = [x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in a]
        with torch.autocast("cpu", enabled=False):
            return forward(*up, **kw)

    module.forward = fp32_forward


def _scale_weight(name: str, factor: float, at: int):
    """A fault: ``name`` multiplied by ``factor`` at the end of step ``at`` (a weight that
    jumped: the stand-in for activations that grew)."""

    def fault(model, step: int) -> None:
        if step == at:
            with torch.no_grad():
                model.get_parameter(name).mul_(factor)

    return fault


def healthy(out: Path) -> Path:
    """lr 1e-3, GradScaler growth_interval 8: the scale grows into overflow, skips that step,
    backs off; the loss keeps falling."""
    return trainer_run(out)


def lr_diverged(out: Path) -> Path:
    """lr 1.0: the loss rises from 3.91 to 27 at the first update and to 33 by step 5; from
    step 7 the gradients are NaN on every step (the fp16 backward of block 1's GELU)."""
    return trainer_run(out, lr=1.0)


def lr_too_high(out: Path) -> Path:
    """lr 0.3: the loss jumps from 3.91 to 11.3 in the first four updates and is back near its
    start only at step ~20, as the linear decay lowers the lr; every gradient stays finite (no
    step skipped): checkpoints 10-30 hold finite tensors and a sane scale, all written after
    the trouble began."""
    return trainer_run(out, lr=0.3)


def backward_nan(out: Path) -> Path:
    """At step 15 the first MLP projection of block 1 jumps 1000-fold: its GELU's input
    reaches ~500, ``x**3`` overflows fp16 in the backward (the forward's tanh saturates and
    stays finite); every later step is skipped."""
    return trainer_run(out, fault=_scale_weight("transformer.h.1.mlp.c_fc.weight", 1000.0, 15))


def forward_overflow(out: Path) -> Path:
    """At step 15 the first MLP projection of block 0 jumps 2x10^5-fold (its weights stay below 65504): its fp16 output
    overflows (finite in fp32); the loss is non-finite from step 16."""
    return trainer_run(out, fault=_scale_weight("transformer.h.0.mlp.c_fc.weight", 2e5, 15))


def underflow(out: Path) -> Path:
    """GradScaler(init_scale=1) that never grows: fp16's activation gradients flush to zero."""
    return trainer_run(out, init_scale=1.0, growth_interval=1_000_000)


RUNS = {
    "hf-healthy": healthy,
    "hf-lr-1.0": lr_diverged,
    "hf-lr-0.3": lr_too_high,
    "hf-backward-nan": backward_nan,
    "hf-forward-overflow": forward_overflow,
    "hf-underflow": underflow,
}
