"""Plugin defaults and the CUDA bf16 check (issue #31: mutants of ampctl.amp.precision that
the plugin tests left alive)."""

from __future__ import annotations

import torch
from torch import nn

from ampctl.amp.precision import PrecisionPolicy, make_precision
from ampctl.amp.precision.base import bf16_supported
from ampctl.amp.precision.fp32 import FP32Precision


def test_the_policy_alias_keeps_the_options_for_a_fallback():
    p = PrecisionPolicy(name="fp16", options={"recipe": "rowwise", "exclude": ["head"]})
    assert p.options == {"recipe": "rowwise", "exclude": ["head"]}


def test_a_plugin_built_directly_has_empty_options():
    assert FP32Precision().options == {}


def test_the_base_plugin_demotes_nothing():
    p = make_precision("fp32")
    model = nn.Sequential(nn.Linear(4, 4))
    assert p.demote(model, "0", "why") is False
    assert p.demotable(model) == []
    assert isinstance(model[0], nn.Linear)


def test_bf16_on_cuda_needs_a_cuda_device_that_supports_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_supported("cuda") is True
    assert bf16_supported(torch.device("cuda", 0)) is True
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert bf16_supported("cuda") is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_supported("cuda") is False
    assert bf16_supported("cpu") is True
