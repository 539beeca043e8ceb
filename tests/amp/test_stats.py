"""Gradient statistics computed on the device."""

from __future__ import annotations

import math

import torch

from ampctl.amp.stats import grad_stats
from ampctl.hostreads import count_host_reads


def test_grad_stats_figures_and_no_host_read():
    grads = [
        torch.tensor([0.0, 1e-9, 3.0]),
        torch.tensor([float("nan"), 4.0]),  # non-finite tensor: counted, kept out of norm/max
        torch.tensor([-5.0, 1e-3]),
        None,
    ]
    with count_host_reads() as reads:
        st = grad_stats(grads, torch.tensor(1024.0), torch.device("cpu"))
    assert reads.total == 0
    v = {k: float(t) for k, t in st.items()}
    assert math.isclose(v["grad_norm"], math.sqrt(9 + 25 + 1e-6 + 1e-18), rel_tol=1e-6)
    assert v["grad_amax"] == 5.0
    # 0.0 underflows; 1e-9 * 1024 is above fp16's smallest subnormal 2**-24, so it does not
    assert v["grad_underflow"] == 1.0
    assert v["grad_elems"] == 7.0 and v["nonfinite_grads"] == 1.0
    # at scale 1 the 1e-9 gradient is below 2**-24 too
    assert float(grad_stats(grads, 1.0, torch.device("cpu"))["grad_underflow"]) == 2.0
