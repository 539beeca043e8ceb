"""The weights of a Hugging Face / Accelerate folder, chosen by what is on disk (as transformers
does): ``model.safetensors`` (and its shards) through the ``safetensors`` library first, else
``pytorch_model.bin`` (and shards) with ``weights_only=True`` and ``mmap=True``.

A sharded folder is read through its index (``model.safetensors.index.json`` /
``pytorch_model.bin.index.json``, whose ``weight_map`` names the shard of every tensor): only
files of the folder itself that are named as shards are opened; a shard the index names that is
missing is reported, and the others are still read. Every tensor is read when the state health
asks for it, one at a time (:class:`~.lazy.LazyTensors`), never the whole folder at once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ampctl.runlog.readers import RunFileError, load_json

from ..stages import Problem
from .base import (
    FileNote,
    Found,
    float_tensors,
    is_pickled_by_design,
    load_noting,
    load_torch,
    safetensors_tensors,
)
from .lazy import LazyTensors
from .plain import is_optimizer_state, is_scaler_state

__all__ = ["weight_files", "read_weight_files", "index_file", "read_state_files"]

_SAFE = re.compile(r"^(model|pytorch_model)(_\d+)?(-\d{5}-of-\d{5})?\.safetensors\Z")
_BIN = re.compile(r"^pytorch_model(_\d+)?(-\d{5}-of-\d{5})?\.bin\Z")
_INDEX = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def weight_files(folder: Path) -> list[str]:
    """Names of the weight files in ``folder``: safetensors when there are any, else .bin."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    safe = [n for n in names if _SAFE.match(n)]
    return safe or [n for n in names if _BIN.match(n)]


def index_file(folder: Path, files: list[str]) -> str | None:
    """The index of the kind of ``files`` (safetensors or .bin shards) when the folder has it."""
    want = _INDEX[0] if any(n.endswith(".safetensors") for n in files) else _INDEX[1]
    return want if (folder / want).is_file() else None


def _indexed(
    folder: Path, name: str, on_disk: list[str], notes: list[FileNote], problems: list[Problem]
) -> list[str]:
    """The shards an index names, in its order, that are files of this folder named as shards;
    what it names otherwise is reported (an index is data: it names no path outside)."""
    try:
        index = load_json(folder / name)
    except RunFileError as e:
        notes.append(FileNote(name, False, f"unreadable: {e.reason}"))
        return on_disk
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        notes.append(FileNote(name, False, "holds no weight_map: the shards on disk are read"))
        return on_disk
    named = list(dict.fromkeys(str(v) for v in wmap.values()))
    pattern = _SAFE if name.endswith(".safetensors.index.json") else _BIN
    out = []
    for shard in named:
        if not pattern.match(shard):
            notes.append(FileNote(shard, False, f"named by {name}, not a shard name: not opened"))
        elif shard not in on_disk:
            problems.append(
                Problem(
                    "unreadable_file",
                    f"{str(folder / shard)!r} is named by {name} (its weight_map) but is not in "
                    f"the folder: the {sum(1 for v in wmap.values() if v == shard)} tensors it "
                    "holds were not checked",
                    file=shard,
                )
            )
            notes.append(FileNote(shard, False, "missing (named by the index)"))
        else:
            out.append(shard)
    notes.append(FileNote(name, True, f"shard index ({len(wmap)} tensors in {len(named)} files)"))
    return out


def read_weight_files(
    folder: Path, notes: list[FileNote], problems: list[Problem] | None = None
) -> LazyTensors:
    """The weights of ``folder``'s weight files (through their index when there is one), as
    :class:`~.lazy.LazyTensors`: nothing is read before the state health asks for a tensor.
    ``problems``: where a shard the index names but the folder lacks is reported."""
    problems = problems if problems is not None else []
    files = weight_files(folder)
    index = index_file(folder, files)
    if index is not None:
        files = _indexed(folder, index, files, notes, problems)
    weights = LazyTensors()
    for name in files:
        p = folder / name
        if name.endswith(".safetensors"):
            weights.update(safetensors_tensors(p))
            notes.append(FileNote(name, True, "weights (safetensors)"))
        else:
            weights.update(float_tensors(load_torch(p)))
            notes.append(FileNote(name, True, "weights (weights_only, mmap)"))
    return weights


def read_state_files(
    found: Found,
    folder: Path,
    is_optimizer: Callable[[str], bool],
    other: Callable[[Path], None],
) -> None:
    """The files of ``folder`` not yet in ``found.files``, by name: a pickled one noted as never
    loaded, the optimizer state (``is_optimizer(name)``) and ``scaler.pt`` (a GradScaler state:
    the run was fp16) read and kept, any other handed to ``other``."""
    used = {n.file for n in found.files}
    for f in sorted(folder.iterdir()):
        if f.name in used or not f.is_file():
            continue
        if is_pickled_by_design(f.name):
            found.files.append(FileNote(f.name, False, "pickled Python objects: never loaded"))
        elif is_optimizer(f.name):
            obj = load_noting(found, f)
            if is_optimizer_state(obj):
                found.optimizer = obj
                found.files.append(FileNote(f.name, True, "optimizer state"))
        elif f.name == "scaler.pt":
            obj = load_noting(found, f)
            if is_scaler_state(obj):
                found.scaler, found.scaler_kind = obj, "GradScaler"
                found.files.append(FileNote(f.name, True, "GradScaler state"))
        else:
            other(f)
    if found.scaler is not None:
        found.precision, found.precision_source = "fp16", "scaler.pt (GradScaler: fp16)"
