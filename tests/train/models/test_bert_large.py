"""Two steps of conf=bert_large (335M parameters, the seeds' tuning) on the CPU with a small
batch and short sequences. Slow: minutes and ~14 GB of memory on a 2-core CPU.

    pytest -m slow tests/train/models/test_bert_large.py
"""

from __future__ import annotations

import math

import pytest

from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import read_jsonl

pytestmark = pytest.mark.slow


def test_two_steps_of_bert_large_on_cpu(tmp_path):
    cfg = load_config(
        [
            "conf=bert_large",
            "data.batch_size=2",
            "data.seq_len=16",
            "trainer.max_steps=2",
            "trainer.log_every=1",
            "trainer.device=cpu",
            "logging.plot=false",
            f"trainer.runs_dir={tmp_path}",
        ]
    )
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "bl"))
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert res.status == "ok" and [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["scale"] == 1024.0 and res.summary["fp32_modules"] == ["bert.embeddings"]
