"""torch.distributed.checkpoint folders (``.metadata`` + ``*.distcp``; torchtitan, FSDP2 and
``dcp.save`` write them), read on one process into memory with no process group.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` (code in the file would run);
here it is read by an unpickler that accepts only DCP's metadata classes, torch sizes and dtypes
and paths, and refuses anything else. Tensor data is read by DCP (raw storage bytes; other
values with ``weights_only=True``).

The state is usually ``{"model": ..., "optimizer"/"optim": ..., "step"/"train_state": ...}``;
optimizer state written by ``get_state_dict`` is keyed by parameter name, so it is named exactly.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import first_line

from .base import FileNote, Found, NotACheckpoint, PickleRefused, ReaderError, float_tensors
from .plain import MODEL_KEYS, OPTIMIZER_KEYS, STEP_KEYS, is_optimizer_state

__all__ = ["FORMAT_NAME", "claims", "read", "SafeMetadataUnpickler"]

FORMAT_NAME = "dcp"
_STEP = re.compile(r"^step-(\d+)$")
METADATA = ".metadata"

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata: DCP's metadata classes, ``torch.Size``, dtypes, paths only."""

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch.distributed.checkpoint.metadata",) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def claims(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                try:
                    md = SafeMetadataUnpickler(f).load()
                except pickle.UnpicklingError as e:
                    raise PickleRefused(Path(path), [first_line(e)]) from None
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader


def _check_metadata(path: Path) -> None:
    """Unpickle ``.metadata`` with the restricted unpickler before DCP sees the folder."""
    try:
        with open(path / METADATA, "rb") as f:
            SafeMetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise PickleRefused(path / METADATA, [first_line(e)]) from None
    except (OSError, EOFError, ValueError, AttributeError, TypeError) as e:
        raise ReaderError(
            f"{str(path / METADATA)!r} is not readable DCP metadata: {first_line(e)}"
        ) from None


def _load(path: Path) -> dict[str, Any]:
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    _check_metadata(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        try:
            return _load_state_dict_from_keys(storage_reader=_reader_class()(str(path)))
        except (PickleRefused, ReaderError):
            raise
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint: one line
            raise ReaderError(
                f"{str(path)!r} is not a readable DCP checkpoint: {first_line(e)}"
            ) from None


def read(path: Path) -> Found:
    sd = _load(path)
    found = Found(format=FORMAT_NAME, path=path)
    model = next((sd[k] for k in MODEL_KEYS if isinstance(sd.get(k), dict)), None)
    opt = next((sd[k] for k in OPTIMIZER_KEYS if isinstance(sd.get(k), dict)), None)
    if model is None and opt is None:
        model = sd
    if model is not None:
        found.weights = float_tensors(model)
        found.param_orders = [
            ("model order", [(k, tuple(v.shape)) for k, v in found.weights.items()])
        ]
    if opt is not None:
        found.optimizer = opt if is_optimizer_state(opt) else _flat_optimizer(opt)
    for k in (*STEP_KEYS, "train_state"):
        v = sd.get(k)
        if isinstance(v, dict):
            v = v.get("step")
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = int(v.item())
        if isinstance(v, int) and not isinstance(v, bool):
            found.step = v
            break
    if found.step is None and (m := _STEP.match(path.name)):
        found.step = int(m.group(1))
    if not found.weights and found.optimizer is None:
        raise NotACheckpoint(f"{str(path)!r}: the DCP checkpoint holds no model or optimizer state")
    found.files.append(FileNote(METADATA, True, "metadata (restricted unpickler)"))
    found.files += [FileNote(p.name, True, "tensor data") for p in sorted(path.glob("*.distcp"))]
    found.siblings = _siblings(path)
    return found


def _siblings(path: Path) -> list[Path]:
    """Other ``step-N`` checkpoints beside a ``step-N`` folder (torchtitan's layout), newest
    first; none for a folder named otherwise."""
    m = _STEP.match(path.name)
    if m is None:
        return []
    found = [
        (int(s.group(1)), p)
        for p in path.parent.iterdir()
        if p != path and (s := _STEP.match(p.name)) and claims(p)
    ]
    return [p for _, p in sorted(found, reverse=True)]


def _flat_optimizer(opt: dict[str, Any]) -> dict[str, Any] | None:
    """An optimizer state flattened as ``state.<param>.<key>`` back into ``{"state": ...}``."""
    state: dict[str, dict[str, Any]] = {}
    for k, v in float_tensors(opt).items():
        if k.startswith("state."):
            param, _, key = k[6:].rpartition(".")
            state.setdefault(param, {})[key] = v
    if not state:
        return None
    return {"state": state, "param_groups": [{"params": list(state)}]}
