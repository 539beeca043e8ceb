"""Atomic checkpoints that are safe to load from strangers.

* Written to ``<name>.tmp`` in the same folder, flushed, fsync'ed, then renamed over the final
  name (and the folder fsync'ed): a crash mid-write never leaves a broken latest checkpoint.
* Read with ``torch.load(..., weights_only=True)``: only tensors and plain containers, never
  code. Anything else is refused with :class:`CheckpointError` (one clear line).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import UsageError

__all__ = [
    "CheckpointError",
    "FORMAT",
    "save_checkpoint",
    "load_checkpoint",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_checkpoint",
    "rng_state",
    "set_rng_state",
]

FORMAT = "ampctl-checkpoint/1"
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(UsageError):
    """A checkpoint that is missing, truncated, not ours, or carries code."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 3
) -> Path:
    """Write ``state`` as ``ckpt_dir/step_XXXXXXXX.pt`` atomically; keep the newest ``keep_last``.

    On failure (disk full, permission) the partial temp file is removed, earlier checkpoints are
    untouched, and the OSError propagates.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{step:08d}.pt"
    tmp = ckpt_dir / f".step_{step:08d}.pt.tmp"
    payload = {"format": FORMAT, "step": int(step), **state}
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    for old in list_checkpoints(ckpt_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints in a folder, oldest first (temp files are ignored)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_file()
    ]
    return [p for _, p in sorted(found)]


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
    if p.is_dir():
        for d in (p / "checkpoints", p):
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
        raise CheckpointError(f"{str(p)!r} is empty (0 bytes): not a checkpoint")
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
        raise CheckpointError(
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
