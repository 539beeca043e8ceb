"""Checkpoints of every format, written once per session by the real libraries (see makers); the
diagnose command run in-process; and the planted numbers the course's and the verdict's tests
build (logged rows, a history, a departure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.commands.diagnose.course import Departure
from ampctl.commands.diagnose.stages import GuardEvent, History, Row

from . import makers


@pytest.fixture(scope="session")
def fmt_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("formats")


def _once(root: Path, name: str, make) -> Path:
    torch.set_num_threads(1)
    path = root / name
    if not path.exists():
        make(path)
    return path


@pytest.fixture(scope="session")
def hf_dirs(fmt_root) -> dict[str, Path]:
    pytest.importorskip("transformers")
    hf = _once(fmt_root, "hf", makers.make_hf)
    return {
        "healthy": hf,
        "nan": _once(fmt_root, "hf-nan", lambda p: makers.plant_hf(hf, p)),
        "diverged": _once(fmt_root, "hf-diverged", lambda p: makers.make_hf(p, lr=1e6, steps=6)),
    }


@pytest.fixture(scope="session")
def plain_files(fmt_root) -> dict[str, Path]:
    pytest.importorskip("safetensors")
    return makers.make_plain(fmt_root / "plain")


def diagnose_cli(path: Path, *extra: str) -> tuple[int, dict | None, str]:
    """``ampctl diagnose PATH --json`` in-process: (exit code, report or None, stderr)."""
    res = CliRunner().invoke(
        app, ["diagnose", str(path), "--json", "--device", "cpu", "-b", "1", *extra]
    )
    report = json.loads(res.stdout) if res.exit_code in (0, 1) else None
    return res.exit_code, report, res.stderr


def kinds(report: dict) -> list[str]:
    return [p["kind"] for p in report["problems"]]


def problem(report: dict, kind: str) -> dict:
    return next(p for p in report["problems"] if p["kind"] == kind)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The corpus's runs, each written once per session, when a case first needs it (shared
    by test_corpus.py and test_closed_loop.py)."""
    from .corpus.cases import Corpus

    return Corpus(tmp_path_factory.mktemp("corpus"))


def rows(losses, start=1, lr=None) -> list[Row]:
    """Logged rows of these losses from step ``start`` (and these learning rates)."""
    return [
        Row(step=start + i, loss=v, learning_rate=None if lr is None else lr[i])
        for i, v in enumerate(losses)
    ]


def history(losses=(), skipped=(), events=(), scale=(), start=1, lr=None) -> History:
    """A run folder's history: rows of ``losses``, the ``skipped`` steps, guard ``events`` as
    ``(step, kind)`` or ``(step, kind, data)``, the ``scale`` trajectory as ``(step, scale)``."""
    return History(
        source="run folder",
        rows=rows(list(losses), start=start, lr=lr),
        skipped_steps=list(skipped),
        scale_trajectory=[list(x) for x in scale],
        guard_events=[GuardEvent(e[0], e[1], "", dict(e[2]) if len(e) > 2 else {}) for e in events],
    )


def dep(**kw) -> Departure:
    """A departure of the loss from its course: these fields over a default one."""
    base = dict(
        step=10,
        last_good_step=8,
        loss=3.0,
        min_loss=2.0,
        min_step=5,
        first_loss=4.0,
        peak=3.5,
        peak_step=11,
        resolved_at=None,
        never_improved=False,
    )
    return Departure(**(base | kw))
