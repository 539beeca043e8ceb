"""Accelerate ``save_state`` folders: ``model.safetensors`` (or ``pytorch_model.bin``),
``optimizer.bin``, ``scheduler.bin``, ``scaler.pt`` (a ``GradScaler`` state, fp16 runs),
``random_states_0.pkl`` (pickled: never opened). With several models or optimizers the files are
numbered (``model_1.safetensors``, ``optimizer_1.bin``): the first of each is diagnosed.

Accelerate does not record parameter names with the optimizer state, and safetensors does not
keep the model's order, so optimizer state is named by shape (unique shapes only; the report
says which could not be named). A folder of ``save_state`` checkpoints
(``checkpoints/checkpoint_N``, automatic naming) gives its newest and lists the others.
"""

from __future__ import annotations

import re
from pathlib import Path

from .base import FileNote, Found, NotACheckpoint
from .lazy import shapes_of
from .weights import read_state_files, read_weight_files, weight_files

__all__ = ["FORMAT_NAME", "claims", "read"]

FORMAT_NAME = "accelerate"
_OPT = re.compile(r"^optimizer(_\d+)?\.bin\Z")
_AUTO = re.compile(r"^checkpoint_(\d+)\Z")


def _is_state_dir(path: Path) -> bool:
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    markers = any(n.startswith("random_states_") for n in names) or any(
        _OPT.match(n) for n in names
    )
    return markers and bool(weight_files(path) or any(_OPT.match(n) for n in names))


def _auto_checkpoints(path: Path) -> list[Path]:
    d = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [
        (int(m.group(1)), p)
        for p in d.iterdir()
        if p.is_dir() and (m := _AUTO.match(p.name)) and _is_state_dir(p)
    ]
    return [p for _, p in sorted(found, reverse=True)]


def claims(path: Path) -> bool:
    return _is_state_dir(path) or (path.is_dir() and bool(_auto_checkpoints(path)))


def read(path: Path) -> Found:
    siblings: list[Path] = []
    if not _is_state_dir(path):
        ckpts = _auto_checkpoints(path)
        if not ckpts:
            raise NotACheckpoint(f"{str(path)!r} is not an Accelerate save_state folder")
        path, siblings = ckpts[0], ckpts[1:]
    found = Found(format=FORMAT_NAME, path=path, siblings=siblings)
    m = _AUTO.match(path.name)
    found.weights = read_weight_files(path, found.files, found.problems)
    found.unordered_params = shapes_of(found.weights)
    read_state_files(
        found,
        path,
        lambda name: bool(_OPT.match(name)) and found.optimizer is None,
        lambda f: found.files.append(FileNote(f.name, False, "not needed")),
    )
    if found.optimizer is not None:
        steps = [
            st.get("step")
            for st in found.optimizer.get("state", {}).values()
            if isinstance(st, dict)
        ]
        steps = [int(s.item()) if hasattr(s, "item") else int(s) for s in steps if s is not None]
        if steps:
            found.step = max(steps)
            found.notes.append("step: the optimizer's step count (Accelerate keeps no step)")
    if found.step is None and m:
        found.step = int(m.group(1))
    return found
