"""A folder of model weights alone, as ``save_pretrained`` writes it and the Hub serves it: weight
files or shards with their ``*.index.json``, and ``config.json`` (names, replay)."""

from __future__ import annotations

from pathlib import Path

from .base import FileNote, Found, NotACheckpoint, is_pickled_by_design
from .hf import hf_param_orders
from .lazy import shapes_of
from .plain import numbered_siblings, step_from_name
from .weights import read_weight_files, weight_files

__all__ = ["claims_folder", "read_folder"]


def claims_folder(folder: Path) -> bool:
    """A folder of model weights alone (``save_pretrained``'s: weight files or shards, their
    index, ``config.json``), as a model is downloaded from the Hub."""
    return folder.is_dir() and bool(weight_files(folder))


def read_folder(folder: Path, fmt: str) -> Found:
    """A folder of model weights (:func:`claims_folder`): its weights one tensor at a time,
    and with ``config.json`` its model (names, replay) as for a Trainer checkpoint."""
    found = Found(format=fmt, path=folder, siblings=numbered_siblings(folder))
    step_from_name(found)  # save_pretrained(f"checkpoint-{step}") in a loop of one's own
    found.weights = read_weight_files(folder, found.files, found.problems)
    used = {n.file for n in found.files}
    if (folder / "config.json").is_file():
        found.model_dir = folder
        found.files.append(FileNote("config.json", True, "model config (replay, names)"))
        found.param_orders = hf_param_orders(folder)
        if found.param_orders:
            rank = {n: i for i, (n, _) in enumerate(found.param_orders[-1][1])}
            found.weights = found.weights.reordered(lambda k: rank.get(k, len(rank)))
        used.add("config.json")
    found.unordered_params = shapes_of(found.weights)
    for f in sorted(folder.iterdir()):
        if f.name not in used and f.is_file():
            why = "pickled Python objects: never loaded" if is_pickled_by_design(f.name) else ""
            found.files.append(FileNote(f.name, False, why or "not needed"))
    if not found.weights:
        raise NotACheckpoint(f"{str(folder)!r}: its weight files hold no tensors")
    return found
