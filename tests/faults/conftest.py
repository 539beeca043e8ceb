"""Helpers for the fault tests: a tiny config (a few steps of a one-layer model, ~55 KB
checkpoints), and ``ampctl`` run as a real process, optionally under a file size limit
(``RLIMIT_FSIZE``: a write past it fails with EFBIG as on a full disk with ENOSPC; Python ignores
SIGXFSZ)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from ampctl.cli import app

REPO = Path(__file__).resolve().parents[2]

TINY = [
    "data.batch_size=2",
    "data.seq_len=8",
    "data.vocab_size=16",
    "model.hidden_size=8",
    "model.ffn_size=16",
    "model.num_heads=1",
    "model.num_layers=1",
    "optim.warmup_steps=2",
    "scaler.init_scale=1024",
    "logging.plot=false",
]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def ampctl(*args: str, limit: int | None = None, timeout: float = 300, **kw):
    """``python -m ampctl ARGS`` to its end; ``limit``: the largest file it may write (bytes)."""

    def cap() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "ampctl", *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=cap,
        **kw,
    )


def ampctl_here(*args: str):
    """``ampctl ARGS`` in this process (torch is imported already: no process start)."""
    return CliRunner().invoke(app, list(args))


def rows(path: Path) -> list[dict]:
    """Every line of a JSONL file, each parsed (a half-written line fails the test)."""
    text = Path(path).read_text()
    assert text == "" or text.endswith("\n"), f"{path} ends in half a line"
    return [json.loads(line) for line in text.splitlines()]
