"""Fidelity of precision=fp8 (torchao float8, protected): the default task trained with the same
seed and steps in fp8, bf16 and fp32. Slow (several minutes on 2 CPU cores):

    pytest -m slow -s tests/train/test_fidelity_fp8.py

The compared loss is the mean over the last 30 steps (three log rows), as in test_fidelity.py.
Goal: fp8 within 3% of bf16 (e4m3 keeps 3 mantissa bits, e5m2 gradients 2).
"""

from __future__ import annotations

import pytest

from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import read_jsonl

pytestmark = pytest.mark.slow


def _final(tmp_path, precision: str) -> tuple[float, dict]:
    cfg = load_config([f"precision={precision}", f"trainer.runs_dir={tmp_path}"])
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, precision))
    tail = read_jsonl(res.run_dir / "metrics.jsonl")[-3:]
    return sum(r["loss"] for r in tail) / len(tail), res.summary


def test_fp8_within_3pct_of_bf16(tmp_path):
    pytest.importorskip("torchao.float8")
    f8, s8 = _final(tmp_path, "fp8")
    b16, sb = _final(tmp_path, "bf16")
    ref, s32 = _final(tmp_path, "fp32")
    gap_b, gap_32 = abs(f8 - b16) / b16, abs(f8 - ref) / ref
    print(
        f"\nfp8 fidelity (default task, {s8['steps']} steps, seed 0, mean loss of the last 30 "
        f"steps):\n  fp8  {f8:.4f}  vs bf16 {gap_b:.2%}  vs fp32 {gap_32:.2%}  skipped "
        f"{s8['skipped']}  demoted {len(s8['fp8_demoted'])}  ({s8['wall_time_s']:.0f} s)"
        f"\n  bf16 {b16:.4f}  ({sb['wall_time_s']:.0f} s)\n  fp32 {ref:.4f}  ({s32['wall_time_s']:.0f} s)"
    )
    assert s8["status"] == "ok" and s8["precision"] == "fp8"
    assert gap_b <= 0.03
