"""Shared fixtures: a fast tiny config and helpers to run the trainer in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ampctl.config import load_config

# A few steps of the tiny model; fast on 2 CPU cores.
FAST = [
    "trainer.max_steps=12",
    "trainer.log_every=4",
    "trainer.ckpt_every=6",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.vocab_size=64",
    "model.hidden_size=32",
    "model.ffn_size=64",
    "model.num_heads=2",
    "optim.warmup_steps=2",
    "scaler.init_scale=1024",
]


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


@pytest.fixture
def fast_cfg(tmp_path):
    def make(*extra: str):
        return load_config([*FAST, f"trainer.runs_dir={tmp_path / 'runs'}", *extra])

    return make


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
