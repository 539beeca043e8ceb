"""A run that survives planted faults: the README's "Surviving a planted overflow" section.

    python examples/planted_overflow.py

The default tiny BERT gets an extra module, ``amp``, that squares its input through a large
intermediate. From step 61 on that intermediate overflows in fp16 (it is fine in fp32): a
forward overflow that no loss scale can cure. From step 150 the gradients of one weight are
made infinite for three steps in a row. The guard attributes, locates, promotes, rolls back,
and the run ends with a finite loss.
"""

from __future__ import annotations

import sys

import torch
from rich.console import Console
from torch import nn

from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.models import BertForMaskedLM
from ampctl.train.trainer import Trainer
from ampctl.ui.display import Display


class Amplifier(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.boost = 1.0  # raised to 1000 at step 60: (1000 x)^2 overflows fp16's 65504

    def forward(self, x):
        h = self.lin(x) * self.boost
        return 0.1 * (h * h) / (self.boost * self.boost)


class PlantedBert(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.bert_mlm = BertForMaskedLM(**kw)
        self.amp = Amplifier(kw["hidden_size"])
        self.bert_mlm.bert.embeddings.register_forward_hook(lambda m, i, o: o + self.amp(o))

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.bert_mlm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def fault(trainer: Trainer, step: int, phase: str) -> None:
    if step == 60:
        trainer.model.amp.boost = 1000.0
    if step in (150, 151, 152) and not getattr(trainer, "_planted_" + str(step), False):
        setattr(trainer, "_planted_" + str(step), True)  # once: the rollback replays these steps
        trainer.model.bert_mlm.bert.encoder.layer[0].output.dense.weight.grad.view(-1)[0] = float(
            "inf"
        )


def main() -> int:
    cfg = load_config(
        ["model._target_=__main__.PlantedBert", "trainer.max_steps=200", *sys.argv[1:]]
    )
    run_dir = new_run_dir(cfg.trainer.runs_dir, None, "planted")
    console = Console()
    with Display(cfg.trainer.max_steps, mode="plain", console=console) as display:
        trainer = Trainer(cfg, run_dir, display=display, fault=fault)
        result = trainer.run()
    display.summary(result.summary)
    from ampctl.commands.plot import maybe_plot_run

    print(maybe_plot_run(run_dir))
    return result.exit_code


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
