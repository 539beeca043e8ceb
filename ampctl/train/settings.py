"""The config groups of ampctl's own loop: ``trainer.*``, ``optim.*``, ``data.*``, ``dist.*``.

Each is a plain dataclass validated in ``__post_init__`` (a ``ValueError`` naming the field); the
component that uses it (:class:`~ampctl.train.trainer.Trainer`, the builders, the data sources,
:mod:`~ampctl.train.dist`) takes it as its own argument. This module imports nothing of the
runtime, so :class:`~ampctl.config.RunConfig` composes these groups without importing the loop
(config flows one way: runtime modules import the config, never the reverse).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ampctl.amp.checks import is_finite, is_int, need
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

    max_steps: int = 200
    log_every: int = 10
    ckpt_every: int = 100
    keep_last: int = 3
    grad_accum_steps: int = 1
    seed: int = 0
    device: str = "auto"
    runs_dir: str = "runs"
    overflow_window: int = 50
    stop_at: int | None = None  # stop (checkpoint, status ok) here; max_steps keeps the lr horizon
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        for k in (
            "max_steps",
            "log_every",
            "ckpt_every",
            "keep_last",
            "grad_accum_steps",
            "overflow_window",
        ):
            v = getattr(self, k)
            need(is_int(v) and v >= 1, self, k, v, "an integer >= 1")
        need(is_int(self.seed) and self.seed >= 0, self, "seed", self.seed, "an integer >= 0")
        need(
            self.stop_at is None or (is_int(self.stop_at) and 1 <= self.stop_at <= self.max_steps),
            self,
            "stop_at",
            self.stop_at,
            f"null or an integer in [1, max_steps={self.max_steps}]",
        )
        need(
            self.device in ("auto", "cpu", "cuda")
            or re.fullmatch(r"cuda:\d+", self.device) is not None,
            self,
            "device",
            self.device,
            "one of auto, cpu, cuda, cuda:N",
        )
        need(isinstance(self.compile, bool), self, "compile", self.compile, "true or false")
        need(
            isinstance(self.compile_backend, str) and bool(self.compile_backend),
            self,
            "compile_backend",
            self.compile_backend,
            "a torch.compile backend name, e.g. inductor (the default), aot_eager, eager",
        )


OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")


@dataclass(kw_only=True)
class OptimConfig:
    """``optim.*``: the optimizer and its learning-rate schedule."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    fused: bool = False
    clip_grad_norm: float | None = 1.0
    schedule: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        need(self.name in OPTIMIZERS, self, "name", self.name, f"one of {', '.join(OPTIMIZERS)}")
        need(is_finite(self.lr) and self.lr > 0, self, "lr", self.lr, "a number > 0")
        need(
            is_finite(self.weight_decay) and self.weight_decay >= 0,
            self,
            "weight_decay",
            self.weight_decay,
            "a number >= 0",
        )
        need(
            len(self.betas) == 2 and all(is_finite(b) and 0 <= b < 1 for b in self.betas),
            self,
            "betas",
            list(self.betas),
            "two numbers in [0, 1), e.g. [0.9,0.999]",
        )
        need(is_finite(self.eps) and self.eps > 0, self, "eps", self.eps, "a number > 0")
        need(
            self.clip_grad_norm is None
            or (is_finite(self.clip_grad_norm) and self.clip_grad_norm > 0),
            self,
            "clip_grad_norm",
            self.clip_grad_norm,
            "a number > 0, or null to disable clipping",
        )
        need(
            self.schedule in SCHEDULES,
            self,
            "schedule",
            self.schedule,
            f"one of {', '.join(SCHEDULES)}",
        )
        need(
            is_int(self.warmup_steps) and self.warmup_steps >= 0,
            self,
            "warmup_steps",
            self.warmup_steps,
            "an integer >= 0",
        )
        need(
            is_finite(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1,
            self,
            "min_lr_ratio",
            self.min_lr_ratio,
            "in [0, 1]",
        )
        need(
            not self.fused or self.name in ("adamw", "adam"),
            self,
            "fused",
            self.fused,
            "false unless optim.name is adamw or adam (fused SGD cannot skip on the device)",
        )


@dataclass(kw_only=True)
class DataConfig:
    """``data.*``: the data source (synthetic, text, hf) and its batches."""

    kind: str = "synthetic"
    vocab_size: int = 1024
    seq_len: int = 64
    batch_size: int = 16
    mask_prob: float = 0.15
    branching: int = 4
    path: str | None = None
    # masked-LM or next-token batches; auto: causal for a model whose class name ends in
    # ForCausalLM or LMHeadModel (GPT-2, Llama, their HF classes), mlm otherwise
    objective: str = "auto"
    # data=hf only (ampctl.train.hf_data)
    tokenizer: str | None = None
    text_field: str = "text"
    format: str = "auto"
    split: str = "train"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        need(
            self.kind in DATA_KINDS,
            self,
            "kind",
            self.kind,
            "one of synthetic, text, hf (select with data=synthetic, data=text or data=hf)",
        )
        need(self.vocab_size >= 8, self, "vocab_size", self.vocab_size, "an integer >= 8")
        need(self.seq_len >= 4, self, "seq_len", self.seq_len, "an integer >= 4")
        need(self.batch_size >= 1, self, "batch_size", self.batch_size, "an integer >= 1")
        need(
            is_finite(self.mask_prob) and 0 < self.mask_prob < 1,
            self,
            "mask_prob",
            self.mask_prob,
            "in (0, 1)",
        )
        need(self.branching >= 1, self, "branching", self.branching, "an integer >= 1")
        need(
            self.objective in ("auto", "mlm", "causal"),
            self,
            "objective",
            self.objective,
            "one of auto, mlm, causal",
        )
        need(
            self.format in ("auto", "text", "json", "parquet", "arrow"),
            self,
            "format",
            self.format,
            "one of auto, text, json, parquet, arrow",
        )
        need(bool(self.text_field), self, "text_field", self.text_field, "a column name")
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


@dataclass(kw_only=True)
class DistConfig:
    """``dist.*``: data parallelism under torchrun (ignored in a single process)."""

    strategy: str = "ddp"

    def __post_init__(self) -> None:
        need(self.strategy in ("ddp", "fsdp"), self, "strategy", self.strategy, "one of ddp, fsdp")
