"""File names of a run folder (the only place they are spelled)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunLayout", "is_run_dir", "CHECKPOINT_NAME"]

#: ``checkpoints/step_00000100.pt``: eight or more digits of the step.
CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})\.pt\Z")


class _In:
    """A file or folder of the run folder: ``layout.<attribute>`` is ``layout.root / name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, layout: RunLayout | None, owner: type | None = None) -> Any:
        return self if layout is None else layout.root / self.name


@dataclass(frozen=True)
class RunLayout:
    """Where each file of a run folder (or of an archived branch inside it) lives."""

    root: Path

    CONFIG = "config.yaml"
    METRICS = "metrics.jsonl"
    EVENTS = "events.jsonl"
    SUMMARY = "summary.json"
    PLOT = "plot.png"
    CHECKPOINTS = "checkpoints"
    BRANCHES = "branches"
    BRANCH = "branch.json"  # inside an archived branch: where it forked, why
    PARENT = "parent.json"  # in a run forked from another run's checkpoint
    TENSORBOARD = "tensorboard"

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    config = _In(CONFIG)
    metrics = _In(METRICS)
    events = _In(EVENTS)
    summary = _In(SUMMARY)
    plot = _In(PLOT)
    checkpoints_dir = _In(CHECKPOINTS)
    branches_dir = _In(BRANCHES)
    branch_info = _In(BRANCH)
    parent = _In(PARENT)
    tensorboard = _In(TENSORBOARD)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{int(step):08d}.pt"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (temp files are ignored)."""
        return list_checkpoints(self.checkpoints_dir)

    def latest_checkpoint(self) -> Path | None:
        ckpts = self.checkpoints()
        return ckpts[-1] if ckpts else None

    @classmethod
    def of_checkpoint(cls, ckpt: str | Path) -> RunLayout | None:
        """The run folder a checkpoint file sits in (``<run>/checkpoints/step_*.pt``), or None."""
        p = Path(ckpt)
        if p.parent.name == cls.CHECKPOINTS and CHECKPOINT_NAME.match(p.name):
            return cls(p.parent.parent)
        return None


def list_checkpoints(folder: str | Path) -> list[Path]:
    """``step_*.pt`` files of a folder, oldest first."""
    d = Path(folder)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in d.iterdir()
        if (m := CHECKPOINT_NAME.match(p.name)) and p.is_file()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: str | Path) -> int | None:
    """The step in a checkpoint's file name, or None for another name."""
    m = CHECKPOINT_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_run_dir(path: str | Path) -> bool:
    """Whether a folder looks like a run folder (metrics, events, summary or checkpoints). An
    empty events.jsonl (every run starts one) is not yet a run: nothing was recorded."""
    lay = RunLayout(Path(path))
    return Path(path).is_dir() and (
        lay.metrics.is_file()
        or (lay.events.is_file() and lay.events.stat().st_size > 0)
        or lay.summary.is_file()
        or bool(lay.checkpoints())
    )
