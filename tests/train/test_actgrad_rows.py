"""The activation-gradient underflow figure in a run's metrics rows (logging.act_grads)."""

from __future__ import annotations

import pytest

from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import read_jsonl


def _rows(fast_cfg, name, *extra):
    cfg = fast_cfg("trainer.max_steps=8", "trainer.log_every=4", *extra)
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, name))
    return read_jsonl(res.run_dir / "metrics.jsonl")


def test_fp16_rows_carry_both_underflow_figures_and_the_scale_lowers_the_activation_one(
    fast_cfg,
):
    every = "logging.act_grad_layers=0"  # every layer on every log step
    scaled = _rows(fast_cfg, "scaled", "precision=fp16", "scaler.init_scale=65536", every)
    unscaled = _rows(
        fast_cfg,
        "unscaled",
        "precision=fp16",
        every,
        "scaler.init_scale=1",
        "scaler.min_scale=1",
        "scaler.max_scale=1",
    )
    for r in scaled + unscaled:
        assert 0.0 <= r["act_grad_underflow_frac"] <= 1.0
        assert 0.0 <= r["act_grad_zero_frac"] <= r["act_grad_underflow_frac"]
        assert r["grad_underflow_frac"] is not None  # the parameter-gradient figure stays
    # same data, same first step: only the scale differs at step 4's backward
    # (masked LM: the unmasked positions' gradients are exactly zero in both runs)
    u, s = unscaled[0], scaled[0]
    sub_u = u["act_grad_underflow_frac"] - u["act_grad_zero_frac"]
    sub_s = s["act_grad_underflow_frac"] - s["act_grad_zero_frac"]
    assert sub_u > 10 * sub_s  # subnormals: the scale lifts them into fp16's normal range
    assert u["act_grad_zero_frac"] > s["act_grad_zero_frac"] + 0.05  # and fewer flush to zero


@pytest.mark.parametrize(
    "extra", [("precision=fp32",), ("precision=fp16", "logging.act_grads=false")]
)
def test_no_figure_without_fp16_activations_or_when_switched_off(fast_cfg, extra):
    rows = _rows(fast_cfg, "off", *extra)
    assert [r["act_grad_underflow_frac"] for r in rows] == [None, None]
    assert [r["act_grad_zero_frac"] for r in rows] == [None, None]
