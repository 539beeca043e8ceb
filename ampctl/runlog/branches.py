"""Branches: resuming from an earlier checkpoint never destroys what a run recorded.

A run folder always holds its *main line*: the history that leads to its newest checkpoint.

* ``--resume`` from the newest checkpoint continues the main line. Rows logged after that
  checkpoint (by a process that crashed before its next checkpoint) are dropped: the resumed run
  recomputes them, identically.
* ``--resume`` from an earlier checkpoint (step S) sets the later history aside before anything
  is written: the checkpoints after S, the metrics rows and events after S, ``summary.json`` and
  ``plot.png`` move into ``branches/NNN-stepS/`` with a ``branch.json`` saying where it forked and
  why. The main line is trimmed to step S and continues from there; a ``branch`` event at step S
  records the fork. ``--resume RUN_DIR`` therefore always continues the newest branch, and the
  discarded one stays on disk for ``ampctl plot`` (which overlays it) and ``ampctl diagnose``.
* ``--resume CKPT --name NEW`` forks into a new run folder instead: NEW gets the rows and events
  up to S and a ``parent.json`` naming the run and checkpoint it came from; the original run is
  not touched.

Every step is crash-safe: copies are written before anything is removed, and files are moved by
rename, so a crash in the middle leaves rows in both places, never in neither.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .layout import RunLayout, checkpoint_step
from .readers import as_number, read_json
from .writers import RunWriter, atomic_write_text

__all__ = [
    "BranchInfo",
    "prepare_resume",
    "fork_into",
    "list_branches",
    "split_lines",
    "branch_event",
    "fork_event",
    "describe_lineage",
]


@dataclass(frozen=True)
class BranchInfo:
    """An archived branch of a run folder."""

    path: Path
    forked_at_step: int
    last_step: int | None
    resumed_from: str | None
    archived_at: float | None
    complete: bool

    @property
    def name(self) -> str:
        return self.path.name

    @classmethod
    def read(cls, path: Path) -> BranchInfo:
        info = read_json(RunLayout(path).branch_info) or {}
        fork = as_number(info.get("forked_at_step"))
        last = as_number(info.get("last_step"))
        return cls(
            path=path,
            forked_at_step=int(fork) if fork is not None else -1,
            last_step=int(last) if last is not None else None,
            resumed_from=info.get("resumed_from"),
            archived_at=as_number(info.get("archived_at")),
            complete=bool(info.get("complete", False)),
        )


def list_branches(run: RunLayout) -> list[BranchInfo]:
    """The archived branches of a run folder, oldest first."""
    d = run.branches_dir
    if not d.is_dir():
        return []
    return [BranchInfo.read(p) for p in sorted(d.iterdir()) if p.is_dir()]


def split_lines(path: Path, step: int) -> tuple[list[str], list[str]]:
    """The lines of a JSONL file up to ``step`` and after it. A line that cannot be read goes
    with the line before it (so nothing is dropped)."""
    keep: list[str] = []
    later: list[str] = []
    if not path.is_file():
        return keep, later
    after = False
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            s = as_number(obj.get("step")) if isinstance(obj, dict) else None
            if s is not None:
                after = s > step
        except json.JSONDecodeError:
            pass
        (later if after else keep).append(line)
    return keep, later


def _write_lines(path: Path, lines: list[str]) -> None:
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def _next_branch_dir(run: RunLayout, step: int) -> Path:
    run.branches_dir.mkdir(exist_ok=True)
    n = len([p for p in run.branches_dir.iterdir() if p.is_dir()]) + 1
    while True:
        path = run.branches_dir / f"{n:03d}-step{step}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1


def prepare_resume(run: RunLayout, checkpoint: Path, step: int) -> BranchInfo | None:
    """Make ``run`` ready to continue from ``checkpoint`` (at ``step``); see the module docstring.

    Returns the archived branch, or None when the checkpoint was the newest (nothing set aside).
    """
    later_ckpts = [p for p in run.checkpoints() if (checkpoint_step(p) or -1) > step]
    m_keep, m_later = split_lines(run.metrics, step)
    e_keep, e_later = split_lines(run.events, step)
    if not later_ckpts:
        # 1) the newest checkpoint: rows after it were logged by a process that crashed before its
        #    next checkpoint; the resumed run recomputes them.
        if m_later:
            _write_lines(run.metrics, m_keep)
        if e_later:
            _write_lines(run.events, e_keep)
        return None
    # 2) an earlier checkpoint: set the later history aside, then trim the main line.
    dest = RunLayout(_next_branch_dir(run, step))
    last_steps = [checkpoint_step(p) or 0 for p in later_ckpts]
    info: dict[str, Any] = {
        "forked_at_step": int(step),
        "last_step": max(last_steps),
        "resumed_from": str(checkpoint),
        "archived_at": time.time(),
        "checkpoints": [p.name for p in later_ckpts],
        "metrics_rows": len(m_later),
        "events": len(e_later),
        "complete": False,
    }
    writer = RunWriter(dest.root)
    writer.write_json(dest.branch_info, info)
    _write_lines(dest.metrics, m_later)
    _write_lines(dest.events, e_later)
    dest.checkpoints_dir.mkdir(exist_ok=True)
    for p in later_ckpts:
        os.replace(p, dest.checkpoints_dir / p.name)
    for name in (RunLayout.SUMMARY, RunLayout.PLOT, RunLayout.CONFIG):
        src = run.root / name
        if src.is_file():
            if name == RunLayout.CONFIG:  # the main line keeps its config; the branch gets a copy
                atomic_write_text(dest.root / name, src.read_text())
            else:
                os.replace(src, dest.root / name)
    _write_lines(run.metrics, m_keep)
    _write_lines(run.events, e_keep)
    info["complete"] = True
    writer.write_json(dest.branch_info, info)
    return BranchInfo.read(dest.root)


def fork_into(new_run: RunLayout, checkpoint: Path, step: int) -> RunLayout | None:
    """Start ``new_run`` (an empty, new folder) from ``checkpoint`` at ``step``: record where it
    came from and, when the checkpoint sits in a run folder, copy that run's rows and events up
    to ``step``. Returns the parent run folder (None for a loose checkpoint file)."""
    parent = RunLayout.of_checkpoint(Path(checkpoint).resolve())
    writer = RunWriter(new_run.root)
    writer.write_json(
        new_run.parent,
        {
            "run": str(parent.root) if parent is not None else None,
            "checkpoint": str(checkpoint),
            "step": int(step),
        },
    )
    if parent is None:
        return None
    m_keep, _ = split_lines(parent.metrics, step)
    e_keep, _ = split_lines(parent.events, step)
    if parent.root.parent.name == RunLayout.BRANCHES:  # an archived branch holds only its tail
        owner = RunLayout(parent.root.parent.parent)
        fork = BranchInfo.read(parent.root).forked_at_step
        m_keep = split_lines(owner.metrics, fork)[0] + m_keep
        e_keep = split_lines(owner.events, fork)[0] + e_keep
    _write_lines(new_run.metrics, m_keep)
    _write_lines(new_run.events, e_keep)
    return parent


def branch_event(run: RunLayout, info: BranchInfo) -> dict[str, Any]:
    """The ``branch`` event that records, in the main line, where history was set aside."""
    rel = info.path.relative_to(run.root)
    raw = read_json(RunLayout(info.path).branch_info) or {}
    return {
        "step": info.forked_at_step,
        "kind": "branch",
        "message": f"resumed from step {info.forked_at_step}: the later history (to step "
        f"{info.last_step}, {len(raw.get('checkpoints', []))} checkpoint(s), "
        f"{raw.get('metrics_rows', 0)} metrics rows, {raw.get('events', 0)} events) is kept in "
        f"{rel}",
        "archived": str(rel),
        "resumed_from": info.resumed_from,
    }


def fork_event(parent: RunLayout | None, checkpoint: Path, step: int) -> dict[str, Any]:
    """The ``branch`` event at the start of a run forked from a checkpoint."""
    of = f" of run {parent.root}" if parent is not None else ""
    return {
        "step": int(step),
        "kind": "branch",
        "message": f"forked from {checkpoint} (step {step}){of}",
        "parent": str(parent.root) if parent is not None else None,
        "resumed_from": str(checkpoint),
    }


def describe_lineage(run: RunLayout) -> str:
    """One line saying which line of history a folder holds: a run's main line (and the
    branches resumes set aside), an archived branch, or a fork of another run's checkpoint."""
    if run.root.parent.name == RunLayout.BRANCHES:
        info = BranchInfo.read(run.root)
        owner = run.root.parent.parent
        return (
            f"archived branch {run.root.name} of {owner}: the history after step "
            f"{info.forked_at_step} that a resume set aside"
        )
    parts = []
    parent = read_json(run.parent)
    if parent:
        parts.append(f"forked from {parent.get('checkpoint')} (step {parent.get('step')})")
    branches = list_branches(run)
    if branches:
        at = ", ".join(str(b.forked_at_step) for b in branches)
        parts.append(
            f"resumed from step {at}; {len(branches)} set-aside branch(es) in {RunLayout.BRANCHES}/"
        )
    return "main line" + (f" ({'; '.join(parts)})" if parts else "")
