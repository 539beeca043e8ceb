"""A planted model for the sweep tests: the tiny BERT, with a role that makes its trial process
misbehave on purpose, the same way under every launcher.

* ``ok``: plain training;
* ``die``: the process SIGKILLs itself at its second forward (a trial that dies on its node);
* ``hold``: from its 5th forward on (after the first row at ``log_every=4``) each forward
  sleeps 1 s while ``hold_file`` exists (at most ``HOLD_MAX_S`` in all), so the trial is still
  running, seconds after its first row, when the test presses Ctrl-C or the sweep checks it;
* ``far``: as ``hold``, and its loss is 10x the true one (finite, far above every other trial),
  so the sweep's live divergence check must stop it.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ampctl.train.models import BertForMaskedLM

HOLD_MAX_S = 120.0  # a broken stop makes the test fail, not hang


class Planted(BertForMaskedLM):
    def __init__(self, *, role: str = "ok", hold_file: str = "", **kw) -> None:
        super().__init__(**kw)
        self.role, self.hold_file = role, hold_file
        self.calls = 0
        self.held = 0.0

    def forward(self, **batch):
        self.calls += 1
        if self.role == "die" and self.calls == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.role in ("hold", "far") and self.hold_file and self.calls > 4:
            for _ in range(10):
                if not Path(self.hold_file).exists() or self.held >= HOLD_MAX_S:
                    break
                time.sleep(0.1)
                self.held += 0.1
        out = super().forward(**batch)
        if self.role == "far" and out.loss is not None:
            out.loss = out.loss * 10
        return out
