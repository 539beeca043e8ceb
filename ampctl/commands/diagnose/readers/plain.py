"""Plain files: ``torch.save(model.state_dict())`` (``.pt``/``.pth``/``.bin``, read with
``weights_only=True``), ``.safetensors`` (the ``safetensors`` library), and hand-rolled dicts
that keep the model, optimizer and scaler under their usual names (``model``/``model_state_dict``
/``state_dict``, ``optimizer``/``optimizer_state_dict``/``optim``, ``scaler``/``grad_scaler``/
``amp``, ``step``/``global_step``/``epoch``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from .base import Found, NotACheckpoint, float_tensors, safetensors_tensors

__all__ = ["STATE_DICT", "SAFETENSORS", "read_safetensors", "from_object", "is_optimizer_state"]

STATE_DICT = "state-dict"
SAFETENSORS = "safetensors"

MODEL_KEYS = ("model", "model_state_dict", "model_state", "state_dict", "module", "net")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optimizer_state", "optim", "opt")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp", "loss_scaler")
STEP_KEYS = ("step", "global_step", "iteration", "iter", "epoch")


def is_optimizer_state(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("param_groups"), list) and "state" in obj


def is_scaler_state(obj: Any) -> bool:
    return (
        isinstance(obj, dict) and "scale" in obj and ("_growth_tracker" in obj or "history" in obj)
    )


_DIGITS = re.compile(r"\d+")


def _numbered_peers(path: Path) -> list[tuple[list[int], Path]]:
    """Files beside ``path`` named as it is but for their numbers, with their numbers."""
    if not _DIGITS.search(path.name) or not path.parent.is_dir():
        return []
    pattern = re.compile("^" + _DIGITS.sub(r"(\\d+)", re.escape(path.name)) + r"\Z")
    out = []
    for p in path.parent.iterdir():
        same = p.is_dir() if path.is_dir() else p.is_file()  # folders beside a folder
        m = pattern.match(p.name) if p != path and same else None
        if m is not None:
            out.append(([int(g) for g in m.groups()], p))
    return out


def numbered(path: Path) -> bool:
    """Whether ``path`` is one of a numbered series (``ckpt_10.pt``, ``ckpt_20.pt``)."""
    return bool(_numbered_peers(path))


def numbered_siblings(path: Path) -> list[Path]:
    """Files beside ``path`` named as it is but for their numbers (``ckpt_20.pt`` beside
    ``ckpt_30.pt``), with lower numbers: the same run's earlier checkpoints, newest first."""
    nums = [int(n) for n in _DIGITS.findall(path.name)]
    lower = [(key, p) for key, p in _numbered_peers(path) if key < nums]
    return [p for _, p in sorted(lower, reverse=True)]


def step_from_name(found: Found) -> None:
    """A checkpoint that records no step, one of a numbered series (``ckpt_20.pt`` beside
    ``ckpt_10.pt``, ``checkpoint-20/`` beside ``checkpoint-10/``): its number is its step."""
    path = found.path
    if found.step is None and numbered(path):
        found.step = int(_DIGITS.findall(path.name)[-1])
        found.notes.append(f"step: from the name ({path.name} records none)")


def _order(sd: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (k, tuple(v.shape))
        for k, v in sd.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]


def key_of(obj: dict[str, Any], value: Any) -> str:
    return next((str(k) for k, v in obj.items() if v is value), "?")


def read_safetensors(path: Path) -> Found:
    weights = safetensors_tensors(path)
    found = Found(format=SAFETENSORS, path=path, weights=weights)
    found.files.append(_note(path, "weights (safetensors)"))
    return found


def _note(path: Path, why: str):
    from .base import FileNote

    return FileNote(path.name, True, why)


def from_object(obj: Any, path: Path) -> Found:
    """A loaded torch file that is neither an ampctl, Lightning nor DeepSpeed checkpoint."""
    if not isinstance(obj, dict):
        if isinstance(obj, torch.Tensor):
            obj = {"tensor": obj}
        else:
            raise NotACheckpoint(
                f"{str(path)!r} holds a {type(obj).__name__}, not a state dict or a dict of "
                "model/optimizer/scaler states"
            )
    found = Found(format=STATE_DICT, path=path, siblings=numbered_siblings(path))
    model = next((obj[k] for k in MODEL_KEYS if isinstance(obj.get(k), dict)), None)
    opt = next((obj[k] for k in OPTIMIZER_KEYS if is_optimizer_state(obj.get(k))), None)
    scaler = next((obj[k] for k in SCALER_KEYS if is_scaler_state(obj.get(k))), None)
    if model is None and opt is None and scaler is None and is_scaler_state(obj):
        scaler = obj  # torch.save(scaler.state_dict())
    elif model is None and opt is None and is_optimizer_state(obj):
        opt = obj  # torch.save(optimizer.state_dict())
    elif model is None and opt is None and scaler is None:
        model = obj  # torch.save(model.state_dict())
    if model is not None:
        found.weights = float_tensors(model)
        found.param_orders = [("state-dict order", _order(model))]
    if opt is not None:
        found.optimizer = opt
    if scaler is not None:
        found.scaler = scaler
        found.scaler_kind = "ampctl" if "history" in scaler else "GradScaler"
        where = "the file" if scaler is obj else f"the '{key_of(obj, scaler)}' entry"
        found.precision, found.precision_source = ("fp16", f"{where} (a loss scaler: fp16)")
    for k in STEP_KEYS:
        v = obj.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            found.step = v
            break
    step_from_name(found)
    parts = [
        n for n, x in (("model", model), ("optimizer", opt), ("scaler", scaler)) if x is not None
    ]
    if not found.weights and opt is None and scaler is None:
        raise NotACheckpoint(
            f"{str(path)!r} holds no floating tensors, optimizer state or scaler state"
        )
    found.files.append(_note(path, " + ".join(parts) or "tensors"))
    return found
