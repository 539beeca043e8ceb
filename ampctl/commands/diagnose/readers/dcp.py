"""torch.distributed.checkpoint folders (``.metadata`` + ``*.distcp``; torchtitan, FSDP2 and
``dcp.save`` write them), read on one process into memory with no process group.

DCP's own reader unpickles ``.metadata`` with plain ``pickle.load`` and every non-tensor value
with ``torch.load(weights_only=False)``: code in the folder would run. Here:

* ``.metadata`` (read whole, under the size cap) is unpickled by :class:`AllowListUnpickler`,
  whose only way to a global is a lookup of the exact ``module.name`` in an allow-list of
  classes (:data:`METADATA_GLOBALS`: DCP's metadata classes, ``torch.Size``, the dtypes,
  layouts, paths), as torch's own ``weights_only`` unpickler looks names up in the list given to
  ``torch.serialization.safe_globals``; nothing is imported and no attribute is looked up, so a
  protocol-4 dotted name (``torch.distributed.checkpoint.metadata`` + ``os.system``) reaches
  nothing. torch's unpickler itself reads protocol 2 only; DCP writes protocol 4.
* the metadata is checked before anything is read or allocated: every record names a file of
  this folder and lies inside it, and the tensors' bytes fit the memory limit;
* tensors are read by DCP (each chunk with ``torch.load(weights_only=True)``) into tensors
  allocated here from the metadata, one at a time when the state health asks for it (DCP's
  per-item reads: memory is about the largest tensor; small ones, steps and norms, are read
  together up front); non-tensor values (``BYTE_IO``: torchtitan's train state,
  optimizer hyperparameters) are pickled Python objects and are listed as not read unless
  ``--trust-code``, when DCP's own loader reads them.

The state is usually ``{"model": ..., "optimizer"/"optim": ..., "step"/"train_state": ...}``;
optimizer state written by ``get_state_dict`` is keyed by parameter name, so it is named exactly.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import math
import pathlib
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import first_line
from ampctl.trust import (
    FileRefused,
    check_memory,
    checked_file,
    human_size,
    read_bounded,
    streaming_need,
)

from .base import FileNote, Found, NotACheckpoint, PickleRefused, ReaderError, float_tensors
from .lazy import LazyTensors, TensorSource, shapes_of, tensor_sources
from .plain import MODEL_KEYS, OPTIMIZER_KEYS, STEP_KEYS, is_optimizer_state

__all__ = ["FORMAT_NAME", "claims", "read", "AllowListUnpickler", "metadata_globals"]

FORMAT_NAME = "dcp"
_STEP = re.compile(r"^step-(\d+)$")
METADATA = ".metadata"


def metadata_globals() -> list[tuple[Any, str]]:
    """The classes and functions a DCP ``.metadata`` pickle may name, as ``(object, full
    name)`` pairs (the form ``torch.serialization.safe_globals`` takes)."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp = "torch.distributed.checkpoint"
    classes = [
        md.Metadata,
        md.TensorStorageMetadata,
        md.BytesStorageMetadata,
        md.ChunkStorageMetadata,
        md.TensorProperties,
        md.MetadataIndex,
        md.StorageMeta,
        md._MEM_FORMAT_ENCODING,
    ]
    out = [(c, f"{dcp}.metadata.{c.__name__}") for c in classes]
    out += [
        (_StorageInfo, f"{dcp}.filesystem._StorageInfo"),
        (torch.Size, "torch.Size"),
        (torch.serialization._get_layout, "torch.serialization._get_layout"),
        (pathlib.PosixPath, "pathlib.PosixPath"),
        (pathlib.PurePosixPath, "pathlib.PurePosixPath"),
        (pathlib.PureWindowsPath, "pathlib.PureWindowsPath"),
        (collections.OrderedDict, "collections.OrderedDict"),
    ]
    out += [(v, f"torch.{k}") for k, v in vars(torch).items() if isinstance(v, torch.dtype)]
    return out


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler (any protocol) that reaches a global only by looking its exact
    ``module.name`` up in ``allowed`` (``(object, full name)`` pairs): no import, no attribute
    lookup, so a dotted name cannot walk from an allowed module to anything it imported."""

    def __init__(self, file: Any, allowed: list[tuple[Any, str]]) -> None:
        super().__init__(file)
        self._allowed = {name: obj for obj, name in allowed}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        raise pickle.UnpicklingError(full)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id (not DCP metadata)")


def claims(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def read_metadata(path: Path) -> Any:
    """``.metadata`` of a DCP folder through :class:`AllowListUnpickler`, then checked
    (:func:`_check_records`). Raises :class:`PickleRefused`, :class:`ReaderError` or
    :class:`~ampctl.trust.FileRefused`."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = path / METADATA
    data = read_bounded(where)
    try:
        md = AllowListUnpickler(io.BytesIO(data), metadata_globals()).load()
    except pickle.UnpicklingError as e:
        raise PickleRefused(where, [first_line(e)], allowed="DCP's metadata classes") from None
    except (EOFError, ValueError, AttributeError, TypeError, IndexError, KeyError) as e:
        raise ReaderError(f"{str(where)!r} is not readable DCP metadata: {first_line(e)}") from None
    except RecursionError:
        raise ReaderError(
            f"{str(where)!r} is not readable DCP metadata: nested too deeply"
        ) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise ReaderError(f"{str(where)!r} holds a {type(md).__name__}, not DCP metadata")
    _check_records(path, md)
    return md


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _check_records(path: Path, md: Any) -> None:
    """Every storage record names a plain file of this folder (no path, no ``..``, no link
    out of it) and lies within that file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    sizes: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str):
            raise ReaderError(f"{str(path / METADATA)!r}: a storage record is malformed")
        if not _SAFE_NAME.match(name) or name in (".", ".."):
            raise FileRefused(
                path / METADATA,
                f"a record names the file {name!r}, which is not a file of this checkpoint "
                "folder: not opened",
            )
        if name not in sizes:
            sizes[name] = checked_file(path / name).st_size
        offset, length = info.offset, info.length
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise ReaderError(f"{str(path / METADATA)!r}: a storage record is malformed")
        if offset + length > sizes[name]:
            raise FileRefused(
                path / name,
                f"the record of {getattr(index, 'fqn', '?')!r} claims bytes {offset}..{offset + length}, "
                f"beyond the end of the {human_size(sizes[name])} file (a tensor header larger "
                "than the file): not read",
            )


def _tensor_entries(md: Any) -> tuple[dict[str, Any], list[str]]:
    """``({fqn: TensorStorageMetadata}, [fqn of non-tensor values])``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, other = {}, []
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            tensors[str(fqn)] = entry
        else:
            other.append(str(fqn))
    return tensors, other


#: Tensors up to this many bytes are read together up front (steps, norms, scalars); larger
#: ones are read one at a time when the state health asks for them.
EAGER_BYTES = 1 << 16


def _sizes(path: Path, tensors: dict[str, Any]) -> dict[str, int]:
    sizes = {}
    for fqn, entry in tensors.items():
        dtype = entry.properties.dtype
        if not isinstance(dtype, torch.dtype) or not all(
            isinstance(d, int) and d >= 0 for d in entry.size
        ):
            raise ReaderError(f"{str(path / METADATA)!r}: the entry of {fqn!r} is malformed")
        sizes[fqn] = math.prod(entry.size) * dtype.itemsize
    return sizes


def _check_all_fit(path: Path, tensors: dict[str, Any]) -> None:
    """The bytes of every entry checked against the memory limit (DCP's own loader,
    ``--trust-code``, reads them together)."""
    sizes = _sizes(path, tensors)
    total, largest = sum(sizes.values()), max(sizes.values(), default=0)
    check_memory(total + 3 * largest, what=f"{str(path)!r} ({human_size(total)} of tensors)")


@contextlib.contextmanager
def _dcp_reading(path: Path) -> Iterator[None]:
    """DCP's warnings about a single process silenced; a failure in the block (other than a
    refusal) is one :class:`ReaderError` line."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is.*")
        try:
            yield
        except (PickleRefused, ReaderError, FileRefused):
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - damaged: one line
            raise ReaderError(
                f"{str(path)!r} is not a readable DCP checkpoint: {_failure(e)}"
            ) from None


def _read_items(md: Any, path: Path, flat: dict[str, torch.Tensor]) -> None:
    """DCP's per-item read of the tensors of ``flat`` (allocated here) from the folder."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = _reader_class(md)(str(path))
    planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=True)
    with _dcp_reading(path):
        dcp_load(flat, storage_reader=reader, planner=planner, no_dist=True)


def _one_item(md: Any, path: Path, fqn: str, entry: Any) -> torch.Tensor:
    flat = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
    _read_items(md, path, flat)
    return flat[fqn]


def _streamed(md: Any, path: Path, tensors: dict[str, Any]) -> dict[str, Any]:
    """``{fqn: tensor or TensorSource}``: the small tensors read now in one pass, each larger
    one a source that DCP reads alone when asked for. Checked first against the memory limit:
    what reading one tensor at a time takes (:func:`~ampctl.trust.streaming_need`)."""
    sizes = _sizes(path, tensors)
    total, largest = sum(sizes.values()), max(sizes.values(), default=0)
    small = {f: e for f, e in tensors.items() if sizes[f] <= EAGER_BYTES}
    check_memory(
        streaming_need(largest, extra=sum(sizes[f] for f in small)),
        what=f"{str(path)!r} ({human_size(total)} of tensors)",
    )
    flat: dict[str, Any] = {
        f: torch.empty(tuple(e.size), dtype=e.properties.dtype) for f, e in small.items()
    }
    if flat:
        _read_items(md, path, flat)
    for fqn, entry in tensors.items():
        if fqn not in small:
            flat[fqn] = TensorSource(
                name=fqn,
                shape=tuple(entry.size),
                dtype=entry.properties.dtype,
                nbytes=sizes[fqn],
                identity=(str(path), fqn),
                load=functools.partial(_one_item, md, path, fqn, entry),
            )
    return flat


def _leaves(obj: Any) -> dict[str, Any]:
    """Floating tensors and tensor sources of a nested state, keyed by dotted path (as
    :func:`~.base.float_tensors`), the sources renamed to their paths."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        key, node = stack.pop()
        if isinstance(node, TensorSource):
            if node.is_floating_point:
                out[key] = dataclasses.replace(node, name=key)
        elif isinstance(node, torch.Tensor):
            out.update(float_tensors(node, key))
        elif isinstance(node, dict):
            items = [(f"{key}.{k}" if key else str(k), v) for k, v in node.items()]
            stack.extend(reversed(items))
    return out


def _weights(model: dict[str, Any]) -> LazyTensors:
    leaves = _leaves(model)
    return LazyTensors(
        v if isinstance(v, TensorSource) else tensor_sources({k: v}, floating_only=False)[0]
        for k, v in leaves.items()
    )


def _nest(md: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """The flat ``{fqn: value}`` nested as it was saved (DCP's ``planner_data`` paths)."""
    paths = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[Any, Any] = {}
    for fqn, value in flat.items():
        keys = paths.get(fqn)
        if not (
            isinstance(keys, tuple | list)
            and 0 < len(keys) <= 64
            and all(isinstance(k, str | int) for k in keys)
        ):
            keys = fqn.split(".")
        node = out
        for k in keys[:-1]:
            nxt = node.get(k)
            node[k] = nxt = nxt if isinstance(nxt, dict) else {}
            node = nxt
        node[keys[-1]] = value
    return out


def _reader_class(md: Any) -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's file reader with the metadata already read and checked here."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeReader


def _load(path: Path, trust_code: bool) -> tuple[dict[str, Any], list[str]]:
    """The state (nested) and the non-tensor values left unread."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    md = read_metadata(path)
    tensors, other = _tensor_entries(md)
    if not trust_code:  # tensors one at a time (DCP per-item reads)
        return _nest(md, _streamed(md, path, tensors)), other
    _check_all_fit(path, tensors)
    reader = _reader_class(md)(str(path))
    with _dcp_reading(path):  # the user allows DCP's own loader (non-tensor values unpickled)
        return _load_state_dict_from_keys(storage_reader=reader), []


def _failure(e: BaseException) -> str:
    """What went wrong, in one line; DCP wraps each rank's exception in a
    ``CheckpointException`` (a ``BaseException``) with ``failures = {rank: (exc, trace)}``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) and first else e
    text = first_line(e)
    if "Weights only load failed" in text:
        return "a tensor record is not data torch.load(weights_only=True) accepts (damaged?)"
    return text


def read(path: Path, *, trust_code: bool = False) -> Found:
    sd, unread = _load(path, trust_code)
    found = Found(format=FORMAT_NAME, path=path)
    model = next((sd[k] for k in MODEL_KEYS if isinstance(sd.get(k), dict)), None)
    opt = next((sd[k] for k in OPTIMIZER_KEYS if isinstance(sd.get(k), dict)), None)
    if model is None and opt is None:
        model = sd
    if model is not None:
        found.weights = _weights(model)
        found.param_orders = [("model order", shapes_of(found.weights))]
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
    found.files.append(FileNote(METADATA, True, "metadata (allow-list unpickler)"))
    found.files += [FileNote(p.name, True, "tensor data") for p in sorted(path.glob("*.distcp"))]
    if unread:
        unread = sorted(unread, key=lambda fqn: fqn.count("."))  # top-level ones (step) first
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        found.files.append(
            FileNote(
                f"{len(unread)} non-tensor value(s)",
                False,
                f"pickled Python objects ({shown}); --trust-code loads them with DCP's loader",
            )
        )
        found.notes.append(  # --json's notes say it too, not only the text report's file list
            f"{len(unread)} non-tensor value(s) not read (pickled Python objects: {shown}); "
            "--trust-code loads them with DCP's loader"
        )
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
    for k, v in _leaves(opt).items():
        if k.startswith("state."):
            param, _, key = k[6:].rpartition(".")
            state.setdefault(param, {})[key] = v
    if not state:
        return None
    return {"state": state, "param_groups": [{"params": list(state)}]}
