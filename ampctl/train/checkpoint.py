"""Atomic checkpoints that are safe to load from strangers.

* Written through :func:`ampctl.files.write_file`: a fresh temp file created exclusively in the
  same folder (never through a planted link), flushed, fsync'ed, then renamed over the final name
  (and the folder fsync'ed): a crash mid-write never leaves a broken latest checkpoint. A
  ``checkpoints/`` folder that is a symlink out of the run is refused, for writing and reading.
* Read with ``torch.load(..., weights_only=True)``: only tensors and plain containers, never
  code. Anything else is refused with :class:`CheckpointError` (one clear line).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import UsageError
from ampctl.files import write_file
from ampctl.runlog.layout import RunLayout, list_checkpoints
from ampctl.trust_paths import check_folder_inside

__all__ = [
    "CheckpointError",
    "CheckpointUnreadable",
    "CheckpointWriteError",
    "FORMAT",
    "load_resumable",
    "resume_line",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "rng_state",
    "set_rng_state",
]

FORMAT = "ampctl-checkpoint/1"


class CheckpointError(UsageError):
    """A checkpoint that is missing, truncated, not ours, or carries code."""


class CheckpointUnreadable(CheckpointError):
    """A checkpoint file that cannot be read back (empty, truncated, corrupt): a resume from its
    run folder passes over it to an older one (:func:`load_resumable`)."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


def save_checkpoint(run: RunLayout, step: int, state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write ``state`` as the run's ``checkpoints/step_XXXXXXXX.pt`` atomically; keep the newest
    ``keep_last``.

    On failure (disk full, permission) the partial temp file is removed, earlier checkpoints are
    untouched, and :class:`CheckpointWriteError` says so in one line.
    """
    ckpt_dir = run.checkpoints_dir
    final = run.checkpoint(step)
    payload = {"format": FORMAT, "step": int(step), **state}
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        check_folder_inside(ckpt_dir, run.root, what="the checkpoints folder")
        with write_file(final, "wb") as f:  # a fresh temp file, never through a link
            torch.save(payload, f)
    except OSError as e:
        prev = latest_checkpoint(ckpt_dir)
        raise CheckpointWriteError(
            f"could not write the step-{step} checkpoint in {ckpt_dir}: {e.strerror or e}; the "
            f"previous checkpoint {'(none)' if prev is None else prev} is intact"
        ) from None
    for old in list_checkpoints(ckpt_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the latest one of a run folder (``run/checkpoints/``)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"{str(path)!r} does not exist: give a checkpoint file or a run folder"
        )
    run = RunLayout.of_checkpoint(p)  # a file named in <run>/checkpoints/: its folder too
    if run is not None:
        check_folder_inside(run.checkpoints_dir, run.root, what="the checkpoints folder")
    if p.is_dir():
        check_folder_inside(RunLayout(p).checkpoints_dir, p, what="the checkpoints folder")
        if p.name == RunLayout.CHECKPOINTS:  # --resume RUN/checkpoints
            check_folder_inside(p, p.parent, what="the checkpoints folder")
        for d in (RunLayout(p).checkpoints_dir, p):
            latest = latest_checkpoint(d)
            if latest is not None:
                return latest
        raise CheckpointError(
            f"{str(path)!r} holds no checkpoint (looked for checkpoints/step_*.pt)"
        )
    return p


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``; refuse anything that is not one of ours."""
    p = resolve_checkpoint(path)
    if p.stat().st_size == 0:
        raise CheckpointUnreadable(f"{str(p)!r} is empty (0 bytes): not a checkpoint")
    from ampctl.trust import check_memory, human_size, torch_file_sizes

    total, _ = torch_file_sizes(p)  # sizes from the archive's directory, before allocating
    check_memory(total, what=f"{str(p)!r} ({human_size(total)} of tensors)", flag=None)
    try:
        obj = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line
        text = str(e)
        first = text.splitlines()[0] if text else type(e).__name__
        if "Unsupported global" in text or "GLOBAL" in text or "Unsupported class" in text:
            raise CheckpointError(
                f"{str(p)!r} was refused: it holds pickled objects beyond tensors and plain containers "
                f"(code could run on load); ampctl loads checkpoints with weights_only=True only"
            ) from None
        raise CheckpointUnreadable(
            f"{str(p)!r} is not a readable checkpoint (truncated or corrupt?): "
            + (
                "not data that torch.load(weights_only=True) accepts"
                if "Weights only load failed" in first
                else first
            )
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{str(p)!r} is not an ampctl checkpoint (no '{FORMAT}' format tag)")
    obj["path"] = str(p)
    return obj


def load_resumable(
    path: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[dict[str, Any], list[tuple[Path, str]]]:
    """What ``--resume PATH`` continues from: for a checkpoint file, that file
    (:func:`load_checkpoint`); for a run folder, its newest checkpoint that loads. A newer one
    that cannot be read back (:class:`CheckpointUnreadable`: cut short when the machine died
    during a copy, zeroed, corrupt) is passed over, newest first; a checkpoint refused for what
    it holds (code, not ampctl's) is not passed over: that is an error, as for a file named
    alone. Returns the checkpoint and the ``(path, reason)`` of each one passed over (the resume
    then sets them aside with the later history, :func:`ampctl.runlog.prepare_resume`)."""
    p = Path(path)
    if not p.is_dir():
        return load_checkpoint(p, map_location), []
    folder = RunLayout(p).checkpoints_dir
    ckpts = list_checkpoints(folder) or list_checkpoints(p)
    passed: list[tuple[Path, str]] = []
    for c in reversed(ckpts):
        try:
            return load_checkpoint(c, map_location), passed
        except CheckpointUnreadable as e:
            passed.append((c, str(e)))
    if passed:
        newest, why = passed[0]
        raise CheckpointUnreadable(
            f"{str(path)!r}: none of its {len(passed)} checkpoint(s) can be read back (the newest, "
            f"{newest.name}: {why})"
        )
    return load_checkpoint(p, map_location), []  # no checkpoint: the one-line error says so


def resume_line(ck: dict[str, Any], passed: list[tuple[Path, str]]) -> str:
    """One line saying which checkpoint a resume took and why not the newer ones."""
    names = ", ".join(p.name for p, _ in passed)
    why = passed[0][1]
    return (
        f"resuming from {Path(ck['path']).name} (step {ck['step']}), the newest checkpoint that "
        f"loads: {names} passed over ({why}); the resume sets it aside in branches/"
    )


def rng_state() -> dict[str, Any]:
    """Torch (CPU and CUDA) and Python RNG states, in weights_only-loadable form."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state.get("python")
    if py is not None:
        random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
