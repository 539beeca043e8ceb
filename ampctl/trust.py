"""A checkpoint or a run folder is data from a stranger.

Nothing a saved config names is imported, called or resolved unless it ships with ampctl or the
user allowed it on the command line (compare Hugging Face's ``trust_remote_code=False``):

* ``_target_`` (anywhere in the config): allowed when it names a model that ships with ampctl
  (exported by :mod:`ampctl.train.models`), when the user passes ``--trust-code``, or when the
  user gives the same ``KEY._target_=VALUE`` as an override on the command line.
* Interpolations and resolvers (``${...}``, e.g. ``${oc.env:SECRET}``): never evaluated in a saved
  config. ampctl saves configs resolved, so one in a checkpoint was written by hand or another
  tool; it is refused with a line naming the key.

Configs the user composes (``conf/``, ``--config-dir``, overrides) are the user's own and are not
restricted.

Resources: a file from a checkpoint or run folder is also sized like data from a stranger (one
policy for every reader, here):

* a file read whole (JSON, YAML, JSONL, DeepSpeed's ``latest``, DCP's ``.metadata``) is refused
  above :data:`MAX_WHOLE_FILE` (the limit is in the message), and so is one that is not a regular
  file (a FIFO would block, a device never ends) or a symlink pointing out of its own folder;
* a saved config is walked once: a container met twice (shared references, YAML aliases), nested
  deeper than :data:`MAX_DEPTH` or holding more than :data:`MAX_NODES` values is refused;
* what a checkpoint will take in memory is estimated from its headers before anything is
  allocated (read one tensor at a time: about its largest tensor, :func:`streaming_need`; a file
  is never refused for its size alone) and refused above the memory limit
  (:func:`memory_limit`: ``--max-memory``, or what this process may still use: the free memory
  and its address-space limit).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import re
import resource
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError

__all__ = [
    "UntrustedConfigError",
    "SHIPPED_MODEL_MODULE",
    "is_shipped_target",
    "find_targets",
    "find_interpolations",
    "check_saved_config",
    "check_targets",
    "refuse_interpolations",
    "targets_in_overrides",
    "MAX_WHOLE_FILE",
    "MAX_DEPTH",
    "MAX_NODES",
    "FileRefused",
    "ResourceRefused",
    "checked_file",
    "read_bounded",
    "MAX_LINE",
    "open_checked",
    "iter_lines",
    "check_tree",
    "parse_size",
    "human_size",
    "memory_limit",
    "max_memory",
    "context_value",
    "check_memory",
    "torch_file_sizes",
    "torch_file_layout",
    "streaming_need",
    "STREAM_OVERHEAD",
    "check_model_fits",
]

SHIPPED_MODEL_MODULE = "ampctl.train.models"


class UntrustedConfigError(UsageError):
    """A saved config names code that ampctl will not run without the user's consent."""

    def __init__(self, message: str, *, key: str, value: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


def is_shipped_target(target: str) -> bool:
    """Whether ``target`` names a model that ships with ampctl (a name exported by
    ``ampctl.train.models``, reached through that package or one of its submodules).

    Only ampctl's own modules are imported to answer; any other name is not shipped."""
    if not isinstance(target, str):
        return False
    module_name, _, attr = target.rpartition(".")
    if module_name != SHIPPED_MODEL_MODULE and not module_name.startswith(
        SHIPPED_MODEL_MODULE + "."
    ):
        return False
    try:
        shipped = importlib.import_module(SHIPPED_MODEL_MODULE)
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    obj = getattr(module, attr, None)
    exported = {id(getattr(shipped, n, None)) for n in getattr(shipped, "__all__", ())}
    return obj is not None and id(obj) in exported


def _walk(tree: Any, source: str) -> Iterator[tuple[str, Any]]:
    """Every ``(key, value)`` below ``tree`` depth first, each container once (a tree that
    shares one, or is too deep or too large, is refused first: :func:`check_tree`)."""
    check_tree(tree, source=source)
    stack: list[tuple[str, Any]] = list(reversed(_children("", tree)))
    while stack:
        key, node = stack.pop()
        yield key, node
        stack.extend(reversed(_children(key, node)))


def _children(key: str, node: Any) -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [(f"{key}.{k}" if key else str(k), v) for k, v in node.items()]
    if isinstance(node, list | tuple):
        return [(f"{key}[{i}]", v) for i, v in enumerate(node)]
    return []


def find_targets(tree: Any, source: str = "the config") -> list[tuple[str, str]]:
    """Every ``(key, value)`` whose key ends in ``_target_``."""
    return [(k, v) for k, v in _walk(tree, source) if k.rsplit(".", 1)[-1] == "_target_"]


def find_interpolations(tree: Any, source: str = "the config") -> list[tuple[str, str]]:
    """Every ``(key, text)`` of a string value that holds an interpolation or resolver."""
    return [(k, v) for k, v in _walk(tree, source) if isinstance(v, str) and "${" in v]


def targets_in_overrides(overrides: Iterable[str]) -> dict[str, str]:
    """``{key: value}`` of the ``KEY._target_=VALUE`` overrides a user typed."""
    out: dict[str, str] = {}
    for o in overrides:
        key, sep, value = o.lstrip("+").partition("=")
        if sep and key.rsplit(".", 1)[-1] == "_target_":
            out[key] = value.strip().strip("'\"")
    return out


def refuse_interpolations(saved: Any, *, source: str) -> None:
    """Refuse a saved config holding an interpolation or resolver (never evaluated)."""
    for key, text in find_interpolations(saved, source):
        raise UntrustedConfigError(
            f"{source}: {key} holds the interpolation {text!r}; a saved config is data and "
            "ampctl evaluates nothing in it (ampctl saves configs resolved: this one was edited "
            "or written by another tool); set the key on the command line instead",
            key=key,
            value=text,
        )


def check_targets(
    tree: Any,
    *,
    source: str,
    trust_code: bool = False,
    overrides: Iterable[str] = (),
    flag: str = "--trust-code",
) -> None:
    """Refuse a ``_target_`` that does not ship with ampctl, unless ``trust_code`` or the user
    gave the same ``KEY._target_=VALUE`` in ``overrides``."""
    given = targets_in_overrides(overrides)
    for key, target in find_targets(tree, source):
        if trust_code or is_shipped_target(target) or given.get(key) == target:
            continue
        raise UntrustedConfigError(
            f"{source}: {key}={target!r} does not ship with ampctl and a checkpoint is data, so "
            f"it is not imported; if you trust it, add {flag} or give {key}={target} on the "
            "command line",
            key=key,
            value=str(target),
        )


def check_saved_config(
    saved: Any,
    *,
    source: str,
    trust_code: bool = False,
    overrides: Iterable[str] = (),
    flag: str = "--trust-code",
) -> None:
    """Refuse a saved config that would run code (:func:`refuse_interpolations`, then
    :func:`check_targets`). Raises :class:`UntrustedConfigError` naming the key, the value and
    how to allow it."""
    refuse_interpolations(saved, source=source)
    check_targets(saved, source=source, trust_code=trust_code, overrides=overrides, flag=flag)


# ---------------------------------------------------------------------------- resources
#: Largest file read whole (JSON, YAML, JSONL, DeepSpeed's ``latest``, DCP's ``.metadata``).
MAX_WHOLE_FILE = 64 << 20
#: Longest single line (a JSONL row, a CSV record) or entry a streaming reader takes: one longer
#: is skipped and counted, the rest of the file is still read (a file is never refused for its
#: size alone).
MAX_LINE = 1 << 20
#: Deepest nesting and most values of a saved config (ampctl's own are ~6 levels, ~200 values).
MAX_DEPTH = 100
MAX_NODES = 1_000_000


class FileRefused(UsageError):
    """A file of a checkpoint or run folder that is not opened or not read whole; ``reason``
    is the short why (for a report line), the message names the file too."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{str(path)!r}: {reason}")
        self.path = Path(path)
        self.reason = reason


class ResourceRefused(UsageError):
    """Something a checkpoint holds that would take more memory or work than allowed; from
    :func:`check_memory`, ``need`` and ``limit`` are the bytes compared (else None)."""

    need: int | None = None
    limit: int | None = None


def human_size(n: float) -> str:
    """``n`` bytes as ``1.5 GiB`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, *, option: str = "--max-memory") -> int:
    """``"8G"``, ``"512MiB"``, ``"1.5g"`` or a number of bytes, as bytes (binary units).
    Raises :class:`UsageError` naming ``option``."""
    m = _SIZE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{option} {text!r} is not a size: give e.g. 8G, 512M or 1.5GiB")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


def checked_file(path: str | Path) -> os.stat_result:
    """The ``stat`` of a file that may be opened: a regular file, and, when ``path`` is a
    symlink, one whose target lies inside the folder holding the link. Raises
    :class:`FileRefused`."""
    p = Path(path)
    if p.is_symlink():
        target = p.resolve()
        if not target.is_relative_to(p.parent.resolve()):
            raise FileRefused(
                p,
                f"is a symlink to {str(target)!r}, outside its folder: not opened (a checkpoint "
                "is data and its links may not reach out of it)",
            )
    try:
        st = p.stat()
    except OSError as e:
        raise FileRefused(p, f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a FIFO or device)"
        raise FileRefused(p, f"is {kind}: not opened")
    return st


def read_bounded(path: str | Path, *, limit: int = MAX_WHOLE_FILE) -> bytes:
    """The bytes of a file read whole, after :func:`checked_file`; refused (naming the limit)
    when larger than ``limit``. Never reads more than ``limit`` bytes."""
    st = checked_file(path)
    if st.st_size > limit:
        raise FileRefused(
            path,
            f"is {human_size(st.st_size)}, over the {human_size(limit)} limit for a file read "
            "whole: not read",
        )
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(path, f"grew past the {human_size(limit)} limit while read: not read")
    return data


def open_checked(path: str | Path) -> tuple[Any, os.stat_result]:
    """A binary file object for a file that may be opened (:func:`checked_file`), opened without
    following a final symlink unless :func:`checked_file` allowed it; the caller closes it."""
    st = checked_file(path)
    try:
        f = open(path, "rb")  # noqa: SIM115 (the caller closes it)
    except OSError as e:
        raise FileRefused(path, f"cannot be read: {e.strerror or e}") from None
    return f, st


def iter_lines(
    path: str | Path, *, line_limit: int = MAX_LINE, chunk: int = 1 << 16
) -> Iterator[tuple[int, bytes | None]]:
    """The lines of a file, streamed: ``(number, bytes)`` with the 1-based line number and the
    line without its end; a line longer than ``line_limit`` bytes comes as ``(number, None)``
    (skipped, never held whole). Memory is one chunk plus one line, time linear in the file.
    Raises :class:`FileRefused` (before the first line) for a file that may not be opened."""
    f, _st = open_checked(path)
    with f:
        n = 0
        while True:
            line = f.readline(line_limit + 1)
            if not line:
                return
            n += 1
            if len(line) > line_limit and not line.endswith(b"\n"):
                while True:  # the rest of the overlong line, a chunk at a time
                    rest = f.readline(chunk)
                    if not rest or rest.endswith(b"\n"):
                        break
                yield n, None
                continue
            yield n, line.rstrip(b"\r\n")


def check_tree(
    tree: Any, *, source: str, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES
) -> None:
    """Refuse a config that is not a plain tree: a dict or list met twice (shared references,
    YAML aliases: walking it would revisit the shared part, exponentially often when they
    nest), nested deeper than ``max_depth`` or holding more than ``max_nodes`` values. Walks
    each container once, without recursion. Raises :class:`ResourceRefused`."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(tree, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ResourceRefused(f"{source}: holds more than {max_nodes} values: not read")
        if not isinstance(node, dict | list | tuple):
            continue
        if id(node) in seen:
            raise ResourceRefused(
                f"{source}: one container appears at two places (shared references or YAML "
                "aliases); a saved config is a plain tree: not read"
            )
        seen.add(id(node))
        if depth >= max_depth:
            raise ResourceRefused(f"{source}: nested deeper than {max_depth} levels: not read")
        values = node.values() if isinstance(node, dict) else node
        stack.extend((v, depth + 1) for v in values)


_MAX_MEMORY: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "ampctl_max_memory", default=None
)


@contextlib.contextmanager
def context_value(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """Within the block, ``var`` is ``value`` (in this context: a thread or task of its own
    keeps its own)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def max_memory(limit: int | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`memory_limit` is ``limit`` (bytes; None: the default)."""
    return context_value(_MAX_MEMORY, limit)


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_limit() -> tuple[int, str]:
    """``(bytes, where the limit comes from)``: ``--max-memory`` when given (see
    :func:`max_memory`), else what this process may still take: 80% of the free memory
    (``MemAvailable``), and no more than its address-space limit (``RLIMIT_AS``) leaves."""
    given = _MAX_MEMORY.get()
    if given is not None:
        return given, "--max-memory"
    free = _proc_kib("/proc/meminfo", "MemAvailable")
    limit, source = (int(free * 0.8), "80% of the free memory") if free else (8 << 30, "default")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        room = max(soft - (_proc_kib("/proc/self/status", "VmSize") or 0), 0)
        if room < limit:
            limit, source = room, "what this process's address-space limit (RLIMIT_AS) leaves"
    return limit, source


def check_memory(
    need: int, *, what: str, flag: str | None = "--max-memory", mapped: int = 0
) -> None:
    """Refuse ``what`` when it needs more than :func:`memory_limit` (estimated before anything
    is allocated). ``mapped``: bytes of files it maps (address space, not memory: they count
    only against an address-space limit, ``RLIMIT_AS``). Raises :class:`ResourceRefused` naming
    both sizes and how to raise it."""
    limit, source = memory_limit()
    if mapped and _MAX_MEMORY.get() is None and source.startswith("what this process's address"):
        need += mapped
    if need <= limit:
        return
    hint = f"; if the machine has the memory, pass {flag} SIZE (e.g. {flag} 64G)" if flag else ""
    e = ResourceRefused(
        f"{what} needs about {human_size(need)} of memory, more than the {human_size(limit)} "
        f"allowed ({source}): nothing was allocated{hint}"
    )
    e.need, e.limit = need, limit
    raise e


_STORAGE_RECORD = re.compile(r"(^|/)data/\d+$")


def torch_file_sizes(path: str | Path) -> tuple[int, int]:
    """``(bytes, largest)``: what ``torch.load`` of ``path`` will allocate for tensor storages
    in all, and its largest storage, read from the zip archive's directory (nothing is
    unpickled); a legacy (non-zip) file counts its own size. The pickle of a zip archive
    counts ten times its size (the Python objects it builds). Raises :class:`FileRefused` for
    a record that claims more bytes than the file holds (a tensor header larger than the file).
    """
    storages, largest, pickled = torch_file_layout(path)
    return storages + 10 * pickled, largest


def torch_file_layout(path: str | Path) -> tuple[int, int, int]:
    """``(storage bytes, largest storage, pickle bytes)`` of a ``torch.save`` file, read from
    the zip archive's directory (nothing is unpickled); a legacy (non-zip) file is one storage
    of its own size and no separate pickle. Raises :class:`FileRefused` as
    :func:`torch_file_sizes` does."""
    import zipfile

    p = Path(path)
    size = checked_file(p).st_size
    try:
        if not zipfile.is_zipfile(p):
            return size, size, 0
        with zipfile.ZipFile(p) as z:
            infos = z.infolist()
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise FileRefused(p, f"is not a readable zip archive: {e}") from None
    total = largest = pickled = 0
    for info in infos:
        if info.header_offset + info.compress_size > size:
            raise FileRefused(
                p,
                f"its record {info.filename!r} claims {human_size(info.compress_size)} at byte "
                f"{info.header_offset}, beyond the end of the {human_size(size)} file (a tensor "
                "header larger than the file): not read",
            )
        if _STORAGE_RECORD.search(info.filename):
            total += info.file_size
            largest = max(largest, info.file_size)
        elif info.filename.endswith(".pkl"):
            pickled += info.file_size
    return total, largest, pickled


#: What a streaming read takes beyond its largest tensor: the chunks a tensor's figures are
#: computed over, their temporaries, the reader's own state.
STREAM_OVERHEAD = 64 << 20


def streaming_need(largest: int, *, extra: int = 0, factor: float = 1.0) -> int:
    """Memory a checkpoint read one tensor at a time takes: ``factor`` times its largest tensor
    (the tensor's pages, mapped from the file while its figures are taken) plus
    :data:`STREAM_OVERHEAD` and ``extra`` (the objects a pickle builds), never the size of the
    file."""
    return int(factor * largest) + STREAM_OVERHEAD + extra


def check_model_fits(
    build: Callable[[], Any],
    state: dict[str, Any],
    *,
    source: str,
    factor: float = 4.0,
    extra: int = 0,
    flag: str | None = "--max-memory",
    may_lack: Callable[[str], bool] | None = None,
) -> None:
    """Before a model is built from a saved config for a checkpoint's tensors: build it on the
    meta device (no memory), refuse when its parameters and buffers differ in name or shape
    from the checkpoint's ``state`` (the config's dimensions are checked against the tensors,
    not believed), then check ``factor`` times its bytes plus ``extra`` against the memory
    limit. ``may_lack``: names the checkpoint need not hold (tied weights). A model that cannot
    be built on the meta device (code of the user's own, allowed by
    ``--trust-code``) is not checked here. Raises :class:`ResourceRefused`."""
    import torch

    try:
        with torch.device("meta"):
            model = build()
        expected = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - not buildable on meta: the real build says why
        return
    bad = [
        (k, tuple(v.shape), tuple(state[k].shape))
        for k, v in expected.items()
        if isinstance(state.get(k), torch.Tensor) and tuple(state[k].shape) != tuple(v.shape)
    ]
    if bad:
        k, want, have = bad[0]
        raise ResourceRefused(
            f"{source}: does not fit the configured model: the config builds {k} as "
            f"{list(want)}, the checkpoint holds {list(have)}"
            + (f" ({len(bad)} tensors differ)" if len(bad) > 1 else "")
            + "; nothing was allocated"
        )
    missing = [
        k
        for k in expected
        if not isinstance(state.get(k), torch.Tensor) and not (may_lack and may_lack(k))
    ]
    if missing:
        raise ResourceRefused(
            f"{source}: does not fit the configured model: the config builds {len(missing)} "
            f"tensor(s) the checkpoint does not hold (first {missing[0]}); nothing was allocated"
        )
    size = sum(v.numel() * v.element_size() for v in expected.values())
    check_memory(int(factor * size) + extra, what=f"{source}: the model", flag=flag)
