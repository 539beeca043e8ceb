"""What every reader returns, and the only ways a reader may open a file.

A checkpoint from elsewhere is data. Files are opened with

* :func:`load_torch`: ``torch.load(..., weights_only=True)``; a file holding pickled objects
  beyond tensors and plain containers is refused (:class:`PickleRefused`, naming the first
  class it asked for, found by scanning the pickle's opcodes, never by running them);
* :func:`load_safetensors`: the ``safetensors`` library (no pickle at all);
* :func:`load_restricted`: ``torch.load(weights_only=True)`` with a short allowlist of inert
  stand-ins for the named data classes of one library (DeepSpeed's loss scaler and ZeRO stage
  enum): the stand-in stores the pickled state and runs no code of that library;
* :func:`read_json` (:mod:`ampctl.runlog`).

Files that are pickled Python objects by design (``training_args.bin``, RNG states,
``random_states_0.pkl``) are never opened: a folder scan lists them as "not read".
"""

from __future__ import annotations

import pickletools
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ampctl.errors import UsageError, first_line

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

    def __init__(self, path: Path, classes: list[str]) -> None:
        named = f" ({', '.join(classes[:3])})" if classes else ""
        super().__init__(
            f"{str(path)!r} was refused: it holds pickled objects beyond tensors and plain "
            f"containers{named}; code could run on load, and diagnose reads files with "
            "weights_only=True only"
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
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
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
    run_dir: Path | None = None  # an ampctl run folder
    run_config: dict[str, Any] | None = None  # its config.yaml (data) when no config is saved
    files: list[FileNote] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    siblings: list[Path] = field(default_factory=list)  # other checkpoints, newest first
    raw: dict[str, Any] | None = None  # the loaded ampctl checkpoint (its replay needs it)
    problems: list[dict[str, Any]] = field(default_factory=list)  # e.g. a refused file


def install_hint(package: str, extra: str = "diagnose") -> str:
    return f"needs {package}: pip install {package} (or pip install 'ampctl[{extra}]')"


def is_pickled_by_design(name: str) -> bool:
    return any(
        name == p or name.startswith(p) or (p.startswith(".") and name.endswith(p))
        for p in PICKLED_BY_DESIGN
    )


def float_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Floating tensors of a nested dict/list, keyed by dotted path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(float_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(float_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
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
def load_torch(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU. Raises :class:`PickleRefused` for a
    file with pickled objects and :class:`ReaderError` for an empty, truncated or foreign one."""
    p = Path(path)
    if not p.is_file():
        raise ReaderError(f"{str(p)!r} does not exist: give a checkpoint file or folder")
    if p.stat().st_size == 0:
        raise ReaderError(f"{str(p)!r} is empty (0 bytes): not a checkpoint")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes one clear line
        text = str(e)
        if "Unsupported global" in text or "GLOBAL" in text or "Unsupported class" in text:
            raise PickleRefused(p, pickle_globals(p)) from None
        first = first_line(e)
        raise ReaderError(
            f"{str(p)!r} is not a readable checkpoint (truncated or corrupt?): "
            + (
                "not data that torch.load(weights_only=True) accepts"
                if "Weights only load failed" in first
                else first
            )
        ) from None


def load_noting(found: Found, path: Path) -> Any:
    """:func:`load_torch` for one file of a folder: a refused file is listed as not read and
    becomes a ``refused_file`` problem instead of ending the diagnosis."""
    try:
        return load_torch(path)
    except PickleRefused as e:
        found.files.append(FileNote(path.name, False, "refused: holds pickled objects"))
        found.problems.append(
            {"kind": "refused_file", "severity": "error", "message": str(e), "file": path.name}
        )
    except ReaderError as e:
        found.files.append(FileNote(path.name, False, f"unreadable: {first_line(e)}"))
        found.problems.append(
            {"kind": "unreadable_file", "severity": "error", "message": str(e), "file": path.name}
        )
    return None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file through the ``safetensors`` library (never ``torch.load``)."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ReaderError(
            f"{str(path)!r}: reading .safetensors {install_hint('safetensors')}"
        ) from None
    try:
        return dict(load_file(str(path), device="cpu"))
    except Exception as e:  # noqa: BLE001 - a damaged file: one line
        raise ReaderError(
            f"{str(path)!r} is not a readable safetensors file: {first_line(e)}"
        ) from None


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
