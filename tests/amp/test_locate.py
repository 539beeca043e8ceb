"""The locator (ampctl.amp.locate) on a real model's forward and backward: an intentional ``-inf``
(an attention mask's padding) is not a fault."""

from __future__ import annotations

import torch

from ampctl.amp.locate import first_bad, trace_modules
from ampctl.train.models import BertForMaskedLM


def test_locator_ignores_intentional_minus_inf_masks():
    model = BertForMaskedLM(
        vocab_size=64,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        ffn_size=64,
        max_position=16,
        dropout=0.0,
    )
    ids = torch.randint(4, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[:, 10:] = False  # padding: the eager attention fills -inf there
    with torch.autocast("cpu", dtype=torch.float16):
        traces, back = trace_modules(
            model, lambda: model(input_ids=ids, attention_mask=mask, labels=ids).loss, backward=True
        )
    assert first_bad(traces) is None and first_bad(back) is None
    assert len(traces) > 5 and len(back) > 5
