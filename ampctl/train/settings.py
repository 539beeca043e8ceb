"""The config groups of ampctl's own loop: ``trainer.*``, ``optim.*``, ``data.*``, ``dist.*``.

Each is a plain dataclass, its defaults written once here and its rules in a table checked in
``__post_init__`` (a ``ValueError`` naming the field); the component that uses it
(:class:`~ampctl.train.trainer.Trainer`, the builders, the data sources, :mod:`~ampctl.train.dist`)
takes it as its own argument. This module imports nothing of the runtime, so
:class:`~ampctl.config.RunConfig` composes these groups without importing the loop (config flows
one way: the config imports these groups, nothing in ``ampctl.train`` imports the config).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ampctl.amp.checks import (
    boolean,
    check,
    integer,
    is_finite,
    is_int,
    need,
    number,
    one_of,
    optional,
)
from ampctl.errors import ConfigError

__all__ = [
    "DataConfig",
    "DistConfig",
    "OptimConfig",
    "TrainerConfig",
    "DATA_KINDS",
    "OPTIMIZERS",
    "SCHEDULES",
]

DATA_KINDS: tuple[str, ...] = ("synthetic", "text", "hf")


@dataclass(kw_only=True)
class TrainerConfig:
    """``trainer.*``: the loop's length, cadence, seed, device and run folder."""

    max_steps: int = 200  # optimizer steps (skipped ones included); the lr schedule spans them
    log_every: int = 10  # metrics.jsonl row, live table refresh and the one stats read
    ckpt_every: int = 100
    keep_last: int = 3  # checkpoints kept
    grad_accum_steps: int = 1
    seed: int = 0
    device: str = "auto"  # auto = cuda when present, else cpu
    runs_dir: str = "runs"
    overflow_window: int = 50  # steps in the overflow-rate window
    stop_at: int | None = None  # stop (checkpoint, status ok) here; max_steps keeps the lr horizon
    compile: bool = False  # torch.compile the model (log steps with probes run it eagerly)
    compile_backend: str = "inductor"  # a torch.compile backend: inductor | aot_eager | eager ...

    def __post_init__(self) -> None:
        check(self, _TRAINER_RULES)


_TRAINER_RULES = (
    (
        "max_steps log_every ckpt_every keep_last grad_accum_steps overflow_window",
        integer(ge=1),
        "an integer >= 1",
    ),
    ("seed", integer(ge=0), "an integer >= 0"),
    (
        "stop_at",
        optional(lambda v, c: is_int(v) and 1 <= v <= c.max_steps),
        lambda c: f"null or an integer in [1, max_steps={c.max_steps}]",
    ),
    (
        "device",
        lambda v, _: v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v) is not None,
        "one of auto, cpu, cuda, cuda:N",
    ),
    ("compile", boolean, "true or false"),
    (
        "compile_backend",
        lambda v, _: isinstance(v, str) and bool(v),
        "a torch.compile backend name, e.g. inductor (the default), aot_eager, eager",
    ),
)

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(kw_only=True)
class OptimConfig:
    """``optim.*``: the optimizer and its learning-rate schedule."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # SGD: betas[0] = momentum
    eps: float = 1e-8
    fused: bool = False  # fused AdamW: the loss scaler then makes no host read at all
    clip_grad_norm: float | None = 1.0  # None disables clipping
    # cosine | linear | constant, after warmup_steps, down to min_lr_ratio x lr (skipped steps
    # do not advance it)
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        check(self, _OPTIM_RULES)


_OPTIM_RULES = (
    ("name", one_of(OPTIMIZERS), f"one of {', '.join(OPTIMIZERS)}"),
    ("lr", number(gt=0), "a number > 0"),
    ("weight_decay", number(ge=0), "a number >= 0"),
    (
        "betas",
        lambda v, _: len(v) == 2 and all(is_finite(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1), e.g. [0.9,0.999]",
    ),
    ("eps", number(gt=0), "a number > 0"),
    ("clip_grad_norm", optional(number(gt=0)), "a number > 0, or null to disable clipping"),
    ("schedule", one_of(SCHEDULES), f"one of {', '.join(SCHEDULES)}"),
    ("warmup_steps", integer(ge=0), "an integer >= 0"),
    ("min_lr_ratio", number(ge=0, le=1), "in [0, 1]"),
    (
        "fused",
        lambda v, c: not v or c.name in ("adamw", "adam"),
        "false unless optim.name is adamw or adam (fused SGD cannot skip on the device)",
    ),
)


@dataclass(kw_only=True)
class DataConfig:
    """``data.*``: the data source (synthetic, text, hf) and its batches. ``conf/data/*.yaml``
    set the sizes of each source (``data=synthetic``, the default: vocabulary 256, sequences 32)."""

    kind: str = "synthetic"
    vocab_size: int = 1024
    seq_len: int = 64
    batch_size: int = 16  # per process and micro-batch
    mask_prob: float = 0.15  # objective=mlm only
    branching: int = 4  # data=synthetic: the Markov chain's successors per token
    path: str | None = None  # data=text, data=hf: the corpus
    # masked-LM or next-token batches; auto: causal for a model whose class name ends in
    # ForCausalLM or LMHeadModel (GPT-2, Llama, their HF classes), mlm otherwise
    objective: str = "auto"
    # data=hf only (ampctl.train.hf_data)
    tokenizer: str | None = None  # tokenizer.json, or a folder (tokenizers, AutoTokenizer)
    text_field: str = "text"  # the column holding the text (json, parquet, arrow)
    format: str = "auto"  # auto | text | json | parquet | arrow (a save_to_disk folder)
    split: str = "train"  # the split of a saved DatasetDict
    cache_dir: str | None = None  # tokenized streams; None: $AMPCTL_CACHE_DIR or ~/.cache/ampctl

    def __post_init__(self) -> None:
        check(self, _DATA_RULES)
        if self.kind == "text":
            if not self.path:
                raise ConfigError(
                    "data.path is missing: data=text needs data.path=FILE_OR_DIR (a UTF-8 text file or a folder of .txt files)"
                )
            need(
                self.vocab_size == 260,
                self,
                "vocab_size",
                self.vocab_size,
                "260 with data=text (byte-level tokenizer)",
            )
        if self.kind == "hf":
            if not self.path:
                raise ConfigError(
                    "data.path is missing: data=hf needs data.path= (a save_to_disk folder, "
                    "text/json/parquet files, a folder or a glob of them)"
                )
            if not self.tokenizer:
                raise ConfigError(
                    "data.tokenizer is missing: data=hf needs data.tokenizer= (a tokenizer.json "
                    "or a tokenizer folder; make one with `ampctl tokenizer train`)"
                )


_DATA_RULES = (
    (
        "kind",
        one_of(DATA_KINDS),
        "one of synthetic, text, hf (select with data=synthetic, data=text or data=hf)",
    ),
    ("vocab_size", lambda v, _: v >= 8, "an integer >= 8"),
    ("seq_len", lambda v, _: v >= 4, "an integer >= 4"),
    ("batch_size", lambda v, _: v >= 1, "an integer >= 1"),
    ("mask_prob", number(gt=0, lt=1), "in (0, 1)"),
    ("branching", lambda v, _: v >= 1, "an integer >= 1"),
    ("objective", one_of(("auto", "mlm", "causal")), "one of auto, mlm, causal"),
    (
        "format",
        one_of(("auto", "text", "json", "parquet", "arrow")),
        "one of auto, text, json, parquet, arrow",
    ),
    ("text_field", lambda v, _: bool(v), "a column name"),
)


@dataclass(kw_only=True)
class DistConfig:
    """``dist.*``: data parallelism under torchrun (ignored in a single process)."""

    strategy: str = "ddp"  # ddp | fsdp (FSDP2 fully_shard)

    def __post_init__(self) -> None:
        check(self, (("strategy", one_of(("ddp", "fsdp")), "one of ddp, fsdp"),))
