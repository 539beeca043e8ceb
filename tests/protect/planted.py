"""A tiny BERT with planted faults tied to batches, for the guard's tests (issue #27).

A batch is told by its *fingerprint* (:func:`fingerprint`: a weighted sum of its token ids), which
the tests compute from the synthetic source's ``batch_at(position)``: the fault follows the data,
whenever and however often the batch is run (the guard's replays and reruns included).

* ``spike_batches``: the loss of those batches is multiplied by ``spike`` (finite: a bad batch);
* ``nan_batches``: the loss of those batches is NaN (a fault the data causes every time).
"""

from __future__ import annotations

import torch

from ampctl.train.models import BertForMaskedLM


def fingerprint(input_ids: torch.Tensor) -> int:
    """A batch's fingerprint. **Syncs** (a planted-fault model reads its batch)."""
    w = torch.arange(1, input_ids.numel() + 1, dtype=torch.int64).reshape(input_ids.shape)
    return int((input_ids.long().cpu() * w).sum()) % 2_147_483_647


class Faulty(BertForMaskedLM):
    def __init__(
        self,
        *,
        spike_batches: list[int] | None = None,
        spike: float = 1e4,
        nan_batches: list[int] | None = None,
        **kw,
    ) -> None:
        super().__init__(**kw)
        self.spike_batches = set(spike_batches or ())
        self.spike = spike
        self.nan_batches = set(nan_batches or ())
        self.hits: list[int] = []  # fingerprints of the planted batches run (reruns included)

    def forward(self, **batch):
        out = super().forward(**batch)
        fp = fingerprint(batch["input_ids"])
        if fp in self.spike_batches:
            self.hits.append(fp)
            out.loss = out.loss * self.spike
        if fp in self.nan_batches:
            self.hits.append(fp)
            out.loss = out.loss * float("nan")
        return out
