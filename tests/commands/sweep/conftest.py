"""Helpers for the sweep tests that run real ``python -m ampctl train`` processes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from ampctl.commands.sweep import sweep
from tests.conftest import FAST

STEPS = 8
PLANTED = "model._target_=tests.commands.sweep.planted.Planted"
# every trial process would end by drawing its own plot.png (matplotlib: ~2 s of CPU a process);
# no sweep test reads it, and the sweep's results and figure read metrics.jsonl
NO_PLOT = "logging.plot=false"


def run_sweep_here(runs: Path, *overrides: str, **kw):
    """A sweep of the FAST config into ``runs``, plain output captured: ``(result, text)``."""
    buf = io.StringIO()
    console = Console(file=buf, width=200)
    kw.setdefault("mode", "plain")
    # one thread per trial whatever --jobs is: --jobs 1 and --jobs 2 then do the same float
    # reductions, so their losses are bit-identical (two threads would reorder the sums)
    kw.setdefault("threads", 1)
    kw.setdefault("steps", STEPS)
    result = sweep([*FAST, f"trainer.runs_dir={runs}", NO_PLOT, *overrides], console=console, **kw)
    return result, buf.getvalue()


@pytest.fixture
def hold_file(tmp_path):
    """A file whose existence keeps ``hold`` / ``far`` planted trials running (1 s a step)."""
    path = tmp_path / "hold"
    path.write_text("")
    yield path
    path.unlink(missing_ok=True)
