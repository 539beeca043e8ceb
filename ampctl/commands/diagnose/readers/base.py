"""What every reader returns, and the only ways a reader may open a file.

A checkpoint from elsewhere is data. Files are opened under the resource rules of
:mod:`ampctl.trust` (regular files only, no symlink out of its folder, sizes read from headers
and checked against the memory limit before anything is allocated) with

* :func:`load_torch`: ``torch.load(..., weights_only=True, mmap=True)`` of a file that is a
  ``torch.save`` zip archive (its tensors stay in the file until touched, so memory is what a
  caller touches at once), or a legacy file (told by its first bytes: a raw pickle, text or other bytes are
  named as such); a file holding pickled objects beyond tensors and plain containers is refused
  (:class:`PickleRefused`, naming the first class it asked for, found by scanning the pickle's
  opcodes, never by running them);
* :func:`safetensors_tensors`: the ``safetensors`` library (no pickle at all), one tensor per
  ``safe_open`` (:class:`~.lazy.LazyTensors`: read when asked for, never all at once);
* :func:`load_restricted`: ``torch.load(weights_only=True)`` with a short allowlist of inert
  stand-ins for the named data classes of one library (DeepSpeed's loss scaler and ZeRO stage
  enum): the stand-in stores the pickled state and runs no code of that library;
* :func:`read_json` (:mod:`ampctl.runlog`).

Files that are pickled Python objects by design (``training_args.bin``, RNG states,
``random_states_0.pkl``) are never opened: a folder scan lists them as "not read".
"""

from __future__ import annotations

import functools
import pickletools
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import UsageError, first_line
from ampctl.trust import (
    MAX_DEPTH,
    FileRefused,
    check_memory,
    checked_file,
    human_size,
    streaming_need,
    torch_file_layout,
)

from ..stages import Problem
from .lazy import LazyTensors, TensorSource

__all__ = [
    "Found",
    "ForeignHistory",
    "FileNote",
    "ReaderError",
    "PickleRefused",
    "NotACheckpoint",
    "load_torch",
    "load_noting",
    "load_safetensors",
    "safetensors_tensors",
    "load_restricted",
    "pickle_globals",
    "PICKLED_BY_DESIGN",
    "is_pickled_by_design",
    "float_tensors",
    "install_hint",
]

#: File names that hold pickled Python objects by design: never opened.
PICKLED_BY_DESIGN = ("training_args.bin", "rng_state", "random_states_", ".pkl", "sampler.bin")


class ReaderError(UsageError):
    """A path that no reader can read (one line naming it and what is allowed)."""


class NotACheckpoint(ReaderError):
    """A file or folder that holds no checkpoint of the formats diagnose reads."""


class PickleRefused(ReaderError):
    """A file that holds pickled objects beyond tensors and plain containers."""

    def __init__(
        self, path: Path, classes: list[str], *, raw: bool = False, allowed: str | None = None
    ) -> None:
        named = f" ({', '.join(classes[:3])})" if classes else ""
        what = (
            f"it names {', '.join(classes[:3])}, which is not one of {allowed}"
            if allowed
            else "it is a raw pickle, not a file torch.save wrote"
            + (f", and names {', '.join(classes[:3])}" if classes else "")
            if raw
            else f"it holds pickled objects beyond tensors and plain containers{named}"
        )
        how = "an allow-list unpickler" if allowed else "weights_only=True"
        super().__init__(
            f"{str(path)!r} was refused: {what}; code could run on load, and diagnose reads "
            f"it with {how} only"
        )
        self.path = path
        self.classes = classes


@dataclass
class FileNote:
    """A file of a checkpoint folder and what diagnose did with it."""

    file: str
    read: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "read": self.read, "why": self.why}


@dataclass
class ForeignHistory:
    """A training history kept by another tool: one row per logged step with ``step`` and any
    of ``loss``, ``grad_norm``, ``learning_rate`` (floats; non-finite kept)."""

    source: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: dict[str, str] = field(default_factory=dict)  # role -> the tool's column name
    notes: list[str] = field(default_factory=list)
    nan_filter: bool = False  # HF Trainer logs a NaN loss as 0.0 (logging_nan_inf_filter)
    #: rows the reader read, when it kept fewer (a long log, kept bounded: see ``diagnose.rows``)
    logged: int | None = None


@dataclass
class Found:
    """What a reader found in one checkpoint, in terms every format shares.

    ``optimizer`` is a ``torch.optim.Optimizer.state_dict()``-shaped dict (``state`` keyed by
    index or name, ``param_groups`` listing them). ``param_orders``: candidate orders of the
    trainable parameters as ``(label, [(name, shape)])``, the order the optimizer most likely
    listed them in first (see :func:`~ampctl.commands.diagnose.health.name_optimizer_state`).
    ``scaler``: the loss scaler's raw state (ampctl ``LossScaler``, ``torch.amp.GradScaler`` or
    DeepSpeed's), ``scaler_kind`` says which.
    """

    format: str
    path: Path
    step: int | None = None
    #: name -> tensor: a dict (of memory-mapped tensors from ``torch.load(mmap=True)``) or
    #: :class:`~.lazy.LazyTensors` (each read from its file when asked for)
    weights: Mapping[str, torch.Tensor] = field(default_factory=dict)
    masters: list[torch.Tensor] | None = None
    master_names: list[str] | None = None  # when the format names them
    optimizer: dict[str, Any] | None = None
    optimizer_note: str | None = None
    param_orders: list[tuple[str, list[tuple[str, tuple[int, ...]]]]] = field(default_factory=list)
    #: parameters whose order is unknown (e.g. from safetensors): used to name by shape only
    unordered_params: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    scaler: dict[str, Any] | None = None
    scaler_kind: str | None = None
    precision: str | None = None
    precision_source: str | None = None
    fp32_modules: list[str] = field(default_factory=list)
    config: dict[str, Any] | None = None  # an ampctl checkpoint's saved config (data)
    model_dir: Path | None = None  # a Hugging Face folder with config.json (for the replay)
    history: ForeignHistory | None = None
    #: history files that are there but could not be read: ``(file name, why)``
    history_errors: list[tuple[str, str]] = field(default_factory=list)
    run_dir: Path | None = None  # an ampctl run folder
    run_config: dict[str, Any] | None = None  # its config.yaml (data) when no config is saved
    files: list[FileNote] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    siblings: list[Path] = field(default_factory=list)  # other checkpoints, newest first
    raw: dict[str, Any] | None = None  # the loaded ampctl checkpoint (its replay needs it)
    problems: list[Problem] = field(default_factory=list)  # e.g. a refused file


def install_hint(package: str, extra: str = "diagnose") -> str:
    return f"needs {package}: pip install {package} (or pip install 'ampctl[{extra}]')"


def is_pickled_by_design(name: str) -> bool:
    return any(
        name == p or name.startswith(p) or (p.startswith(".") and name.endswith(p))
        for p in PICKLED_BY_DESIGN
    )


def float_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Floating tensors of a nested dict/list, keyed by dotted path. Each container is walked
    once (one reached again through a shared reference is not walked again: its tensors keep
    their first path), without recursion; one nested deeper than ``MAX_DEPTH`` is refused."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(prefix, obj, 0)]
    while stack:
        key, node, depth = stack.pop()
        if isinstance(node, torch.Tensor):
            if node.is_floating_point():
                out[key] = node
            continue
        if not isinstance(node, dict | list | tuple) or id(node) in seen:
            continue
        seen.add(id(node))
        if depth >= MAX_DEPTH:
            raise ReaderError(f"{key or 'the state'}: nested deeper than {MAX_DEPTH} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        children = [(f"{key}.{k}" if key else str(k), v, depth + 1) for k, v in items]
        stack.extend(reversed(children))
    return out


# ---------------------------------------------------------------------------- pickle scanning
def _pickle_bytes(path: Path) -> bytes | None:
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                names = [n for n in z.namelist() if n.endswith("data.pkl")]
                return z.read(names[0]) if names else None
        with open(path, "rb") as f:
            return f.read(1 << 24)
    except (OSError, zipfile.BadZipFile, KeyError):
        return None


_PLAIN_GLOBALS = {
    "collections.OrderedDict",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_parameter",
    "torch.Size",
}


def pickle_globals(path: str | Path) -> list[str]:
    """The classes and functions a pickle (or a torch zip file's ``data.pkl``) names, found by
    reading its opcodes (nothing is imported or run). Torch's own tensor rebuilders and storage
    types are left out."""
    data = _pickle_bytes(Path(path))
    if not data:
        return []
    found: list[str] = []
    strings: list[str] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(str(arg))
            elif op.name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
    except Exception:  # noqa: BLE001 - a damaged pickle: report what was found so far
        pass
    out = []
    for g in (f.replace("__builtin__.", "builtins.") for f in found):
        if g in _PLAIN_GLOBALS or g.startswith("torch.") and g.endswith("Storage"):
            continue
        if g.startswith("torch.") and isinstance(getattr(torch, g[6:], None), torch.dtype):
            continue
        if g not in out:
            out.append(g)
    return out


# ---------------------------------------------------------------------------- loading
_ZIP = b"PK\x03\x04"
_LEGACY = b"\x80\x02\x8a\x0a"  # a legacy torch.save file opens with its pickled magic number


def _not_torch(p: Path, head: bytes) -> ReaderError | None:
    """Why a file is not one torch.save wrote, told by its first bytes (None: it may be)."""
    if head.startswith((_ZIP, _LEGACY)):
        return None
    if head[:1] == b"\x80" and len(head) > 1 and head[1] <= 5:
        return PickleRefused(p, pickle_globals(p), raw=True)
    text = head.decode("utf-8", errors="replace")
    if text.count("\ufffd") <= 1 and all(c.isprintable() or c.isspace() for c in text):
        shown = " ".join(text.split())[:40]
        return NotACheckpoint(
            f"{str(p)!r} holds text ({shown!r}), not a checkpoint: diagnose reads files that "
            "torch.save or safetensors wrote, and checkpoint folders"
        )
    return NotACheckpoint(
        f"{str(p)!r} is not a checkpoint: it starts with the bytes {head[:8].hex(' ')}, not a "
        "torch.save zip archive or pickle"
    )


def load_torch(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, memory-mapped for a zip archive
    (``mmap=True``: a tensor's bytes are read when it is touched), after the file's kind is told
    from its first bytes and what it will take is checked against the memory limit (the
    pickle's objects and the largest tensor, not the file). Raises
    :class:`PickleRefused` for a file with pickled objects (or a raw pickle),
    :class:`NotACheckpoint` for text or foreign bytes, :class:`ReaderError` for an empty,
    truncated or corrupt one, and :class:`~ampctl.trust.FileRefused` /
    :class:`~ampctl.trust.ResourceRefused` under the resource rules."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise ReaderError(f"{str(p)!r} does not exist: give a checkpoint file or folder")
    if checked_file(p).st_size == 0:
        raise ReaderError(f"{str(p)!r} is empty (0 bytes): not a checkpoint")
    with open(p, "rb") as f:
        head = f.read(256)
    refused = _not_torch(p, head)
    if refused is not None:
        raise refused
    storages, largest, pickled = torch_file_layout(p)
    mmap = head.startswith(_ZIP)
    # a zip archive is memory-mapped: only the pickle's objects and what a reader touches at
    # once (about its largest tensor) are held; a legacy file is read whole
    need = streaming_need(largest, extra=10 * pickled) if mmap else storages + 3 * largest
    check_memory(
        need,
        what=f"{str(p)!r} ({human_size(storages)} of tensors)",
        mapped=p.stat().st_size if mmap else 0,
    )
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line
        text = str(e)
        if "Unsupported global" in text or "GLOBAL" in text or "Unsupported class" in text:
            raise PickleRefused(p, pickle_globals(p)) from None
        if isinstance(e, MemoryError | RecursionError):
            why = "out of memory" if isinstance(e, MemoryError) else "nested too deeply"
            raise ReaderError(f"{str(p)!r} could not be loaded: {why}") from None
        first = first_line(e)
        if "Weights only load failed" in first or "Unsupported operand" in text:
            first = "not data that torch.load(weights_only=True) accepts"
        raise ReaderError(
            f"{str(p)!r} is not a readable checkpoint (truncated or corrupt?): {first}"
        ) from None


def load_noting(found: Found, path: Path) -> Any:
    """:func:`load_torch` for one file of a folder: a refused file is listed as not read and
    becomes a ``refused_file`` problem instead of ending the diagnosis."""
    try:
        return load_torch(path)
    except PickleRefused as e:
        found.files.append(FileNote(path.name, False, "refused: holds pickled objects"))
        found.problems.append(Problem("refused_file", str(e), file=path.name))
    except (ReaderError, FileRefused) as e:
        found.files.append(FileNote(path.name, False, f"unreadable: {first_line(e)}"))
        found.problems.append(Problem("unreadable_file", str(e), file=path.name))
    return None


_ST_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
_ST_MAX_HEADER = 100 << 20  # the safetensors format's own limit


_ST_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}  # fmt: skip


def _safetensors_header(path: Path) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], int]:
    """``([(name, dtype, shape, begin, need)], data bytes)`` of a ``.safetensors`` file's header
    (read alone, bounded), each entry checked against the file's size."""
    import json
    import math

    size = checked_file(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > _ST_MAX_HEADER or 8 + n > size:
            raise FileRefused(path, "has no safetensors header (its length field does not fit)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise FileRefused(path, "its safetensors header is not valid JSON") from None
    data = size - 8 - n
    entries = []
    for name, t in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            shape = tuple(int(d) for d in t["shape"])
            need = math.prod(shape) * _ST_DTYPE_BYTES.get(t["dtype"], 1)
            dtype = str(t["dtype"])
        except (KeyError, TypeError, ValueError):
            raise FileRefused(path, f"its safetensors header entry {name!r} is malformed") from None
        if end > data or begin < 0 or end - begin < need or min(shape, default=0) < 0:
            raise FileRefused(
                path,
                f"tensor {name!r} declares {human_size(max(need, end - begin))} of data, but the "
                f"file holds {human_size(data)} after its header (a tensor header larger than "
                "the file): not read",
            )
        entries.append((str(name), dtype, shape, begin, need))
    return entries, data


def _safe_open(path: Path) -> Any:
    try:
        from safetensors import safe_open
    except ImportError:
        raise ReaderError(
            f"{str(path)!r}: reading .safetensors {install_hint('safetensors')}"
        ) from None
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise ReaderError(
            f"{str(path)!r} is not a readable safetensors file: {first_line(e)}"
        ) from None


def _safetensors_one(path: Path, name: str) -> torch.Tensor:
    """One tensor of a ``.safetensors`` file, through its own ``safe_open`` (closed, and the
    file unmapped, before the tensor is returned: only that tensor stays in memory)."""
    with _safe_open(path) as f:
        try:
            return f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - a damaged file: one line
            raise ReaderError(
                f"{str(path)!r}: tensor {name!r} could not be read: {first_line(e)}"
            ) from None


def safetensors_tensors(path: str | Path) -> LazyTensors:
    """The tensors of a ``.safetensors`` file through the ``safetensors`` library (never
    ``torch.load``), each read by its own ``safe_open`` when asked for
    (:class:`~.lazy.LazyTensors`), after the header is checked against the file's size, by
    the library (names, offsets, overlaps) and against the memory limit: what reading one
    tensor at a time takes (:func:`~ampctl.trust.streaming_need`), never the file's size."""
    p = Path(path)
    entries, _data = _safetensors_header(p)
    largest = max((e[4] for e in entries), default=0)
    total = sum(e[4] for e in entries)
    check_memory(
        streaming_need(largest),
        what=f"{str(p)!r} ({human_size(total)} of tensors)",
        mapped=p.stat().st_size,  # safe_open maps the whole file
    )
    with _safe_open(p) as f:  # the library's own checks of the header, once
        names = set(f.keys())
    sources = []
    for name, dtype, shape, begin, need in sorted(entries, key=lambda e: e[3]):
        if name not in names or dtype not in _ST_TORCH_DTYPES:
            continue
        sources.append(
            TensorSource(
                name=name,
                shape=shape,
                dtype=_ST_TORCH_DTYPES[dtype],
                nbytes=need,
                identity=(str(p), begin, shape),
                load=functools.partial(_safetensors_one, p, name),
            )
        )
    return LazyTensors(sorted(sources, key=lambda s: s.name))


def load_safetensors(path: str | Path) -> LazyTensors:
    """:func:`safetensors_tensors` (the name of the days when the file was read whole)."""
    return safetensors_tensors(path)


class InertObject:
    """Stand-in for a named data class of another library while unpickling: keeps the
    constructor arguments and the pickled state, runs no code of that library."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = {}  # noqa: RUF012 - replaced per instance
    state: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def fields(self) -> dict[str, Any]:
        if isinstance(self.state, dict):
            return dict(self.state)
        if isinstance(self.state, tuple) and self.state and isinstance(self.state[-1], dict):
            return dict(self.state[-1])
        return {}


def _inert(name: str) -> type:
    return type(name.rsplit(".", 1)[-1], (InertObject,), {"qualified": name})


def load_restricted(path: str | Path, inert: list[str]) -> Any:
    """:func:`load_torch`, with the classes named in ``inert`` read as :class:`InertObject`
    stand-ins (their state kept as data). Any other class is refused as usual."""
    stand_ins = [(_inert(n), n) for n in inert]
    with torch.serialization.safe_globals(stand_ins):
        return load_torch(path)
