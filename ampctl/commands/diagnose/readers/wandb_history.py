"""A W&B offline run (``wandb/offline-run-*/run-*.wandb``, or ``wandb/latest-run``) as a
history, streamed.

A ``.wandb`` file is a LevelDB log (a 7-byte header ``:W&B``, magic 0xBEE1, version 0, then
32 KiB blocks of chunks, each with a CRC-32 of its type and data, a 16-bit length and a type:
full, or first/middle/last of a record split over blocks) of W&B's ``Record`` protobufs.
``wandb.sdk.internal.datastore.DataStore`` was W&B's own Python reader of it; W&B 0.18 moved
the writer into its Go core (``wandb-core``) and later versions ship no Python reader. When the
installed wandb has it, it is used; otherwise the log is framed here (the same format: every
chunk's CRC checked, a record is never larger than the file, one longer than
``MAX_RECORD`` is skipped with a note) and each record is parsed with wandb's own protobuf
classes (``wandb.proto.wandb_internal_pb2.Record``), with a note saying so.

Only ``history`` records are read (one per ``wandb.log`` call): each item's ``value_json``
(NaN and Infinity come through as W&B writes them). The step is the first of the step metrics
logged in the row (:data:`STEP_NAMES`: the HF Trainer's ``train/global_step``, Lightning's
``trainer/global_step``, ampctl's ``ampctl/step``), else W&B's own ``_step`` counter. wandb is
imported only here, when a run is read.
"""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampctl.runlog.readers import RunFileError
from ampctl.trust import FileRefused, human_size, open_checked

from .base import ForeignHistory
from .history_names import _entries, as_float, build_history, not_read

__all__ = ["read_wandb", "run_files", "iter_records", "STEP_NAMES", "MAX_RECORD"]

#: step metrics a tool logs beside its figures, the first present wins; W&B's ``_step`` last
STEP_NAMES = ("train/global_step", "trainer/global_step", "ampctl/step", "global_step", "step")
#: the longest record read (a history row of scalars is a few KiB; images are not history)
MAX_RECORD = 16 << 20

_BLOCK = 32768
_HEAD = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_CRC = {t: zlib.crc32(bytes([t])) for t in (_FULL, _FIRST, _MIDDLE, _LAST)}


def run_files(path: Path) -> list[Path]:
    """The ``.wandb`` files of a ``wandb/`` folder, a run folder or one file, newest run first
    (``latest-run`` when it is there, else by the run folder's name, which starts with its
    date)."""
    if path.is_file():
        return [path]
    runs: list[Path] = []
    if path.name.startswith(("offline-run-", "run-")) or path.name == "latest-run":
        runs = [path]
    else:
        latest = path / "latest-run"
        found = [
            p
            for p in _entries(path)
            if p.is_dir() and p.name.startswith(("offline-run-", "run-")) and not p.is_symlink()
        ]
        runs = sorted(found, key=lambda p: p.name, reverse=True)
        if latest.is_symlink() and latest.resolve().parent == path.resolve():
            first = latest.resolve()
            runs = [first] + [r for r in runs if r.resolve() != first]
    return [f for r in runs for f in _entries(r) if f.suffix == ".wandb" and f.is_file()]


def _framed(path: Path, notes: list[str]) -> Iterator[bytes]:
    """The records of a LevelDB log, framed here (bounded: one record at a time)."""
    f, st = open_checked(path)
    size = st.st_size
    with f:
        head = f.read(_HEAD)
        if len(head) < _HEAD or struct.unpack("<4sHB", head) != (b":W&B", 0xBEE1, 0):
            raise RunFileError(path, "is not a W&B run file (no :W&B header)")
        index = _HEAD
        parts: list[bytes] | None = None
        held = 0
        skipping = False
        while True:
            left = _BLOCK - index % _BLOCK
            if left < _HEAD:  # a block's trailer: zeros
                f.seek(left, 1)
                index += left
            chunk = f.read(_HEAD)
            if len(chunk) < _HEAD:
                if parts is not None or chunk.strip(b"\0"):
                    notes.append(f"{path.name}: cut off at byte {index}: the rest is not read")
                return
            crc, length, kind = struct.unpack("<IHB", chunk)
            if crc == 0 and length == 0 and kind == 0:  # zero padding at the end
                return
            if index + _HEAD + length > size or kind not in _CRC:
                notes.append(
                    f"{path.name}: chunk at byte {index} claims {human_size(length)} of kind "
                    f"{kind}, which the file does not hold: the rest is not read"
                )
                return
            data = f.read(length)
            index += _HEAD + length
            if zlib.crc32(data, _CRC[kind]) & 0xFFFFFFFF != crc:
                notes.append(f"{path.name}: chunk at byte {index} fails its CRC: not read further")
                return
            if kind == _FULL:
                yield data
                parts, held, skipping = None, 0, False
            elif kind == _FIRST:
                parts, held, skipping = [data], len(data), False
            elif parts is not None or skipping:
                held += len(data)
                if held > MAX_RECORD and not skipping:
                    notes.append(
                        f"{path.name}: a record over {human_size(MAX_RECORD)} skipped (byte {index})"
                    )
                    parts, skipping = None, True
                elif parts is not None:
                    parts.append(data)
                if kind == _LAST:
                    if parts is not None:
                        yield b"".join(parts)
                    parts, held, skipping = None, 0, False


def _datastore_records(path: Path) -> Iterator[bytes]:
    from wandb.sdk.internal import datastore  # type: ignore[attr-defined]

    ds = datastore.DataStore()
    ds.open_for_scan(str(path))
    while True:
        data = ds.scan_data()
        if data is None:
            return
        yield data


def iter_records(path: Path, notes: list[str]) -> Iterator[Any]:
    """wandb ``Record`` protobufs of one ``.wandb`` file, one at a time."""
    from wandb.proto import wandb_internal_pb2 as pb

    try:
        from wandb.sdk.internal import datastore  # type: ignore[attr-defined]  # noqa: F401

        raw = _datastore_records(path)
    except ImportError:
        raw = _framed(path, notes)
    for data in raw:
        rec = pb.Record()
        try:
            rec.ParseFromString(data)
        except Exception:  # noqa: BLE001 - one damaged record: skipped, counted
            notes.append(f"{path.name}: a record that is not a W&B Record skipped")
            continue
        yield rec


def _row(history: Any) -> dict[str, Any] | None:
    vals: dict[str, Any] = {}
    for item in history.item:
        key = "/".join(item.nested_key) if item.nested_key else item.key
        try:
            v = as_float(json.loads(item.value_json))
        except (ValueError, RecursionError):
            continue
        if v is not None:
            vals[key] = v
    step = next((vals.pop(k) for k in STEP_NAMES if k in vals), None)
    wstep = vals.pop("_step", None)
    if step is None:
        step = (
            wstep if wstep is not None else (history.step.num if history.HasField("step") else None)
        )
    for k in ("_runtime", "_timestamp", *STEP_NAMES):
        vals.pop(k, None)
    if step is None or step != step or abs(step) == float("inf"):
        return None
    return {"step": int(step), **vals}


def read_wandb(path: Path) -> ForeignHistory | None:
    """The history of the newest W&B run in a ``wandb/`` folder (or of a run folder or
    ``.wandb`` file). Without wandb installed: a history with no rows and a note. Raises
    :class:`RunFileError` for a run file that may not be opened."""
    files = run_files(path)
    if not files:
        return None
    try:
        from wandb.proto import wandb_internal_pb2  # noqa: F401
    except ImportError:
        return not_read(path, "a W&B run", "wandb", "wandb")
    file = files[0]
    notes: list[str] = []  # filled while the rows are read
    info: list[str] = []
    try:
        from wandb.sdk.internal import datastore  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        import wandb

        info.append(
            f"wandb {getattr(wandb, '__version__', '?')} has no Python reader of .wandb files "
            "(wandb.sdk.internal.datastore): its LevelDB log framed by diagnose, records parsed "
            "with wandb's own protobuf (wandb.proto)"
        )
    if len(files) > 1:
        info.append(f"{len(files)} W&B runs found: the newest, {file.parent.name}, read")

    def rows() -> Iterator[dict[str, Any]]:
        try:
            for rec in iter_records(file, notes):
                if rec.WhichOneof("record_type") == "history":
                    row = _row(rec.history)
                    if row is not None:
                        yield row
        except FileRefused as e:
            raise RunFileError(file, e.reason) from None

    h = build_history(str(file), rows(), notes=itertools.chain(info, notes))
    if h is None and notes:
        return ForeignHistory(source=str(file), notes=info + notes)
    return h
