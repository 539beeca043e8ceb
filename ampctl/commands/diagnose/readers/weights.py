"""The weights of a Hugging Face / Accelerate folder, chosen by what is on disk (as transformers
does): ``model.safetensors`` (and its shards) through the ``safetensors`` library first, else
``pytorch_model.bin`` (and shards) with ``weights_only=True``."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .base import FileNote, float_tensors, load_safetensors, load_torch

__all__ = ["weight_files", "read_weight_files"]

_SAFE = re.compile(r"^(model|pytorch_model)(_\d+)?(-\d{5}-of-\d{5})?\.safetensors\Z")
_BIN = re.compile(r"^pytorch_model(_\d+)?(-\d{5}-of-\d{5})?\.bin\Z")


def weight_files(folder: Path) -> list[str]:
    """Names of the weight files in ``folder``: safetensors when there are any, else .bin."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    safe = [n for n in names if _SAFE.match(n)]
    return safe or [n for n in names if _BIN.match(n)]


def read_weight_files(folder: Path, notes: list[FileNote]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        p = folder / name
        if name.endswith(".safetensors"):
            weights.update(load_safetensors(p))
            notes.append(FileNote(name, True, "weights (safetensors)"))
        else:
            weights.update(float_tensors(load_torch(p)))
            notes.append(FileNote(name, True, "weights (weights_only)"))
    return weights
