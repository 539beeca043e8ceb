"""TensorBoard event files (``events.out.tfevents.*``) as a history, streamed.

Read through tensorboard's low-level record reader
(``tensorboard.backend.event_processing.event_file_loader.LegacyEventFileLoader``: one parsed
``Event`` at a time; its subclass ``EventFileLoader`` adds compat layers that turn every
``simple_value`` into a tensor, time spent for nothing here: a 0-d numeric tensor, the form of
``tf.summary.scalar`` and ``add_scalar(new_style=True)``, is read too), never ``EventAccumulator``, which
keeps every event and samples scalars down to a reservoir. Memory is one record plus the rows kept (steps x known names).

Before the loader sees a file, its record frames are walked (12 bytes read per record, the rest
skipped by a seek): a record whose length field claims more than the file holds after it (a
cut-off file, or a length planted to make the reader allocate gigabytes) ends the reading there,
with a note; tensorboard's reader would allocate what the field claims. Event files of one
folder and of its sibling run folders (torchtitan's ``tb/<timestamp>/``, the HF Trainer's
``runs/<date>_<host>/``) are one history, read oldest first: a step logged again (a resumed
run) keeps the later value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ampctl.runlog.readers import RunFileError
from ampctl.trust import FileRefused, human_size, open_checked

from .base import ForeignHistory
from .history_names import _entries, _tb_dirs, build_history, not_read

__all__ = ["read_tensorboard", "event_files", "iter_scalars", "valid_records"]

_PREFIX = "events.out.tfevents."
_FRAME = 16  # length (8) + its crc (4) + the data's crc (4)


def event_files(path: Path) -> list[Path]:
    """The event files of a folder (or of its run sub-folders, one level), oldest first (by
    the timestamp in the name, then the name), or the one file given."""
    if path.is_file():
        return [path]
    files = [p for d in _tb_dirs(path) for p in _entries(d) if p.name.startswith(_PREFIX)]

    def when(p: Path) -> tuple[float, str]:
        part = p.name[len(_PREFIX) :].split(".", 1)[0]
        return (float(part) if part.isdigit() else 0.0, str(p))

    return sorted((p for p in files if p.is_file() or p.is_symlink()), key=when)


def valid_records(path: Path) -> tuple[int, str | None]:
    """How many whole records the file holds before the first frame that does not fit (its
    length claims more than the file holds after it), and a note naming that frame. Reads 12
    bytes per record; time linear in the number of records."""
    f, st = open_checked(path)
    size = st.st_size
    n = pos = 0
    with f:
        while pos < size:
            head = f.read(12)
            if len(head) < 12:
                return n, f"{path.name}: cut off inside record {n + 1}: the rest is not read"
            (length,) = struct.unpack("<Q", head[:8])
            if pos + _FRAME + length > size:
                return n, (
                    f"{path.name}: record {n + 1} (byte {pos}) claims "
                    f"{human_size(length)}, the file holds {human_size(size - pos - _FRAME)} "
                    "after it: not read (nor anything after it)"
                )
            pos += _FRAME + length
            f.seek(pos)
            n += 1
    return n, None


_TENSOR_FIELDS = {1: "float_val", 2: "double_val", 3: "int_val", 9: "int64_val", 19: "half_val"}


def _value(v: Any) -> float | None:
    """A scalar summary value: ``simple_value`` (what ``SummaryWriter.add_scalar`` writes) or a
    0-d numeric tensor (``tf.summary.scalar``), read from the proto's fields without numpy."""
    if v.HasField("simple_value"):
        return float(v.simple_value)
    if not v.HasField("tensor") or v.tensor.tensor_shape.dim:
        return None
    t = v.tensor
    field = _TENSOR_FIELDS.get(t.dtype)
    if field is None:
        return None
    vals = getattr(t, field)
    if len(vals) == 1:
        x = vals[0]
        return float(np_half(x)) if field == "half_val" else float(x)
    if t.tensor_content and field in ("float_val", "double_val"):
        fmt, size = ("<f", 4) if field == "float_val" else ("<d", 8)
        if len(t.tensor_content) == size:
            return float(struct.unpack(fmt, t.tensor_content)[0])
    return None


def np_half(bits: int) -> float:
    """An fp16 value stored as its 16 bits (``half_val``)."""
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def iter_scalars(path: Path, notes: list[str]) -> Iterator[dict[str, Any]]:
    """``{"step", tag: value}`` per event of one file (scalars only; a note for a frame that
    does not fit or a record that cannot be read). Raises :class:`FileRefused`."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    count, why = valid_records(path)
    if why:
        notes.append(why)
    if count == 0:
        return
    loader = LegacyEventFileLoader(str(path))
    seen = 0
    it = loader.Load()
    while seen < count:
        try:
            ev = next(it)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - a damaged record: what was read is kept
            notes.append(f"{path.name}: record {seen + 1} unreadable ({type(e).__name__})")
            break
        seen += 1
        if not ev.HasField("summary"):
            continue
        row: dict[str, Any] = {"step": int(ev.step)}
        for v in ev.summary.value:
            x = _value(v)
            if x is not None:
                row[v.tag] = x
        if len(row) > 1:
            yield row


def read_tensorboard(
    path: Path, pick: Callable[[list[str]], dict[str, str]] | None = None
) -> ForeignHistory | None:
    """The history in a folder of event files (or one file). ``pick``: see
    :func:`~.histories.build_history`. Without tensorboard installed: a history with no rows
    and a note saying so. Raises :class:`RunFileError` for a file that may not be opened."""
    files = event_files(path)
    if not files:
        return None
    try:
        import tensorboard.backend.event_processing.event_file_loader  # noqa: F401
    except ImportError:
        return not_read(path, "TensorBoard events", "tensorboard")
    notes: list[str] = []

    def rows() -> Iterator[dict[str, Any]]:
        for f in files:
            try:
                yield from iter_scalars(f, notes)
            except FileRefused as e:
                raise RunFileError(f, e.reason) from None

    if len(files) > 1:
        notes.append(f"{len(files)} event files read as one history, oldest first")
    h = build_history(str(path), rows(), pick=pick, notes=notes)
    if h is None and notes:
        return ForeignHistory(source=str(path), notes=notes)
    return h
