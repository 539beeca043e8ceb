"""#36's closed loop: every broken case of the corpus whose advice diagnose tries (ampctl's own
runs, the HF Trainer's folders), followed as printed (an ampctl Resume line pasted and run; the
HF Trainer script rerun with the printed ``TrainingArguments`` and fp32 module from the printed
checkpoint), ends ok with a final loss within 10% of its healthy twin's at the same step
(closed_loop.py; README's table is ``python -m tests.commands.diagnose.closed_loop``).

Cost (measured under load on 2 cores): ~10-15 s a case (the diagnosis with its probe, and the
run the Resume line starts) on top of the corpus runs test_corpus.py writes anyway."""

from __future__ import annotations

import pytest

from .closed_loop import RERUNNABLE, TOLERANCE, close_loop
from .corpus.cases import BY_NAME


def _param(name: str):
    slow = [pytest.mark.slow] if BY_NAME[name].slow else []
    return pytest.param(name, id=name, marks=slow)


@pytest.mark.parametrize("name", [_param(n) for n in RERUNNABLE])
def test_the_printed_resume_line_ends_as_well_as_the_healthy_twin(name, corpus, tmp_path):
    if BY_NAME[name].fmt == "HF Trainer":
        pytest.importorskip("transformers")
    if "fp8" in name:
        pytest.importorskip("torchao.float8")
    loop = close_loop(corpus, name, tmp_path)
    assert loop.probe is not None and "held" in loop.probe  # checked before it was printed
    assert loop.status == "ok", loop
    assert loop.final is not None and loop.twin is not None, loop
    assert loop.final <= (1 + TOLERANCE) * loop.twin, loop
