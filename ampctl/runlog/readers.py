"""Reading a run folder. Files from a run are data: nothing in them is imported, called or
resolved (``config.yaml`` is read without evaluating interpolations).

One rule for a bad JSONL line, everywhere: a line that is not a JSON object (cut off by a crash,
edited by hand, nested too deeply to read) is skipped and its line number kept in
:attr:`JsonlRows.bad_lines`, so a reader can say "N unreadable lines skipped" instead of failing
or silently guessing.

Every file is read under the resource rules of :mod:`ampctl.trust` (a size cap for a file read
whole, regular files only, no symlink out of its folder). The ``load_*`` readers are strict:
they raise :class:`RunFileError`, one line naming the file and what is wrong with it; the
``read_*`` readers are lenient (None or no rows for a missing or unreadable file) and keep why
in :attr:`JsonlRows.error` where they can.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError, first_line
from ampctl.trust import (
    MAX_LINE,
    FileRefused,
    ResourceRefused,
    check_tree,
    iter_lines,
    open_checked,
    read_bounded,
)

from .layout import RunLayout

__all__ = [
    "JsonlRows",
    "RunRecord",
    "RunFileError",
    "read_jsonl",
    "iter_jsonl",
    "JsonArrayStream",
    "read_json",
    "load_json",
    "read_config_text",
    "load_config_text",
    "as_number",
    "is_finite_number",
]


class RunFileError(UsageError):
    """A run or checkpoint file that cannot be read: ``reason`` says why in a few words (for a
    report line); the message names the file too."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{str(path)!r}: {reason}")
        self.path = Path(path)
        self.reason = reason


def _bytes(path: Path) -> bytes:
    try:
        return read_bounded(path)
    except FileRefused as e:
        raise RunFileError(path, e.reason) from None


def _what_it_holds(data: bytes) -> str | None:
    """Why bytes that should be text are not: pickle bytes, binary data (None: text)."""
    if data[:1] == b"\x80" and len(data) > 1 and data[1] <= 5:
        return "holds pickle bytes (a pickled Python object), not text"
    if b"\0" in data[:4096]:
        return "holds binary data, not text"
    return None


def _text(path: Path, data: bytes) -> str:
    why = _what_it_holds(data)
    if why is not None:
        raise RunFileError(path, why)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunFileError(path, f"is not UTF-8 text (byte {e.start})") from None


@dataclass
class JsonlRows:
    """The objects of a JSONL file and the (1-based) numbers of the lines that were not;
    ``error``: why the whole file could not be read (too large, not a regular file ...)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    error: str | None = None
    bad_count: int = 0  # every unreadable line (``bad_lines`` keeps the first numbers)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def note(self, path: Path) -> str | None:
        """One line about what could not be read, or None when every line was read."""
        return _note(path, self.error, self.bad_lines, max(self.bad_count, len(self.bad_lines)))


def _json_value(line: str) -> Any:
    """``json.loads``; a line nested too deeply for the parser is a ``ValueError`` too."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class JsonlStream:
    """The objects of a JSONL file, streamed in one pass (one line in memory at a time): iterate
    it once; afterwards :attr:`bad_lines` (the first :data:`KEPT_BAD_LINES` numbers),
    :attr:`bad_count` and :attr:`error` say what could not be read, as :class:`JsonlRows` does.

    A line that is not a JSON object, or longer than ``line_limit`` bytes, is skipped and
    counted; the file is never refused for its size."""

    KEPT_BAD_LINES = 100

    def __init__(self, path: str | Path, *, line_limit: int = MAX_LINE) -> None:
        self.path = Path(path)
        self.line_limit = line_limit
        self.bad_lines: list[int] = []
        self.bad_count = 0
        self.error: str | None = None
        self.lines = 0

    def _bad(self, n: int) -> None:
        self.bad_count += 1
        if len(self.bad_lines) < self.KEPT_BAD_LINES:
            self.bad_lines.append(n)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        p = self.path
        if not p.exists() and not p.is_symlink():
            return
        try:
            lines = iter_lines(p, line_limit=self.line_limit)
            first = True
            for n, raw in lines:
                self.lines = n
                if first:
                    first = False
                    why = _what_it_holds(raw or b"")
                    if why is not None:
                        self.error = why
                        return
                if raw is None:
                    self._bad(n)
                    continue
                if not raw.strip():
                    continue
                try:
                    obj = _json_value(raw.decode("utf-8", errors="replace"))
                except ValueError:
                    self._bad(n)
                    continue
                if isinstance(obj, dict):
                    yield obj
                else:
                    self._bad(n)
        except FileRefused as e:
            self.error = e.reason

    def note(self, path: Path | None = None) -> str | None:
        """One line about what could not be read, or None when every line was read."""
        return _note(path or self.path, self.error, self.bad_lines, self.bad_count)


def _note(path: Path, error: str | None, bad_lines: list[int], count: int) -> str | None:
    if error is not None:
        return f"{path}: unreadable: {error}"
    if not count:
        return None
    where = ", ".join(str(n) for n in bad_lines[:5])
    more = f" and {count - 5} more" if count > 5 else ""
    return f"{path}: skipped {count} unreadable line(s) ({where}{more})"


def iter_jsonl(path: str | Path, *, line_limit: int = MAX_LINE) -> JsonlStream:
    """The objects of a JSONL file, streamed (see :class:`JsonlStream`): a missing file has
    none; never raises for bad content or for the file's size."""
    return JsonlStream(path, line_limit=line_limit)


class _Invalid(Exception):
    """The document is not valid JSON where the stream stands (its message says how)."""


_WS = re.compile(r"[ \t\n\r]*")
_STRUCT = re.compile(r'["\[\]{}]')
_IN_STRING = re.compile(r'["\\]')
_SCALAR = re.compile(r"[^,\]}\s]*")
_SCALAR_STARTS = "-0123456789tfnNI"  # numbers, true, false, null and Python's NaN, Infinity


class _Chars:
    """The text of a file read forward in chunks (UTF-8, bad bytes replaced): ``s[pos:]`` is what
    is not read yet; what was read is dropped as the stream goes on."""

    def __init__(self, f: Any, chunk: int) -> None:
        import codecs

        self.f, self.chunk = f, chunk
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.s, self.pos, self.eof = "", 0, False
        self.dropped = 0  # characters before s[0]
        self.head = b""

    def more(self, n: int | None = None) -> bool:
        """Read on (``n`` bytes at least a chunk); False at the end of the file."""
        if self.eof:
            return False
        data = self.f.read(max(self.chunk, n or 0))
        if not self.head:
            self.head = data[:4096]
        self.eof = not data
        if self.pos > 0:
            self.dropped += self.pos
            self.s, self.pos = self.s[self.pos :], 0
        self.s += self.dec.decode(data, final=self.eof)
        return bool(data)

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            self.pos = _WS.match(self.s, self.pos).end()
            if self.pos < len(self.s) or not self.more():
                return self.s[self.pos] if self.pos < len(self.s) else ""

    def where(self) -> str:
        return f"character {self.dropped + self.pos + 1}"

    def opens(self, close: str) -> bool:
        """Past an opening bracket: whether there is an item before ``close`` (else past it)."""
        self.pos += 1
        if self.peek() == close:
            self.pos += 1
            return False
        return True

    def ends(self, close: str) -> bool:
        """Past the ',' after an item (False) or past ``close`` (True); anything else is not
        JSON."""
        nxt = self.peek()
        self.pos += 1
        if nxt == close:
            return True
        if nxt != ",":
            raise _Invalid(f"',' or '{close}' expected at {self.where()}")
        return False

    def value(self, limit: int, decoder: json.JSONDecoder) -> tuple[bool, Any]:
        """The next JSON value: ``(True, value)``, or ``(False, why)`` for one longer than
        ``limit`` characters or nested too deeply (skipped, never held whole). Raises
        :class:`_Invalid` for text that is not JSON."""
        first = self.peek()
        if first not in '[{"' and first not in _SCALAR_STARTS:
            # no JSON value starts so: not JSON here, however much follows (never read on)
            raise _Invalid(f"a value expected at {self.where()}")
        if first not in '[{"':  # a scalar: read on until what ends it is in the buffer
            while _SCALAR.match(self.s, self.pos).end() >= len(self.s) and self.more():
                if len(self.s) - self.pos > limit:
                    self.skip()
                    return False, f"longer than {_size(limit)}"
        while True:
            try:
                val, end = decoder.raw_decode(self.s, self.pos)
            except RecursionError:
                self.skip()
                return False, "nested too deeply to read"
            except json.JSONDecodeError as e:
                if len(self.s) - self.pos > limit:
                    self.skip()
                    return False, f"longer than {_size(limit)}"
                if self.more(len(self.s) - self.pos):  # a value cut at the chunk's end: read on
                    continue
                raise _Invalid(f"{e.msg} at {self.where()}") from None
            if end - self.pos > limit:
                self.pos = end
                return False, f"longer than {_size(limit)}"
            self.pos = end
            return True, val

    def _search(self, pattern: re.Pattern[str]) -> str:
        while True:
            m = pattern.search(self.s, self.pos)
            if m is not None:
                self.pos = m.end()
                return m.group()
            self.pos = len(self.s)
            if not self.more():
                raise _Invalid(f"ends inside a value at {self.where()}")

    def skip(self) -> None:
        """Pass over one value, a chunk at a time, holding none of it (structure only)."""
        if self.peek() not in '[{"':
            while True:
                self.pos = _SCALAR.match(self.s, self.pos).end()
                if self.pos < len(self.s) or not self.more():
                    return
        depth, in_string = 0, False
        while True:
            ch = self._search(_IN_STRING if in_string else _STRUCT)
            if in_string:
                if ch == "\\":
                    if self.pos >= len(self.s) and not self.more():
                        raise _Invalid(f"ends inside a string at {self.where()}")
                    self.pos += 1
                    continue
                in_string = False
                if depth == 0:
                    return
            elif ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
            else:
                depth -= 1
                if depth <= 0:
                    return


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n:,} characters"


class JsonArrayStream:
    """A JSON object file whose one large part is the array under ``key`` (``trainer_state.json``
    and its ``log_history``), read in one pass: iterate it once for the array's entries, one at
    a time; the object's other keys are in :attr:`top` afterwards (those read before the array
    already while it is iterated).

    An entry longer than ``entry_limit`` characters or nested too deeply is skipped and counted
    (:attr:`bad_entries`, :attr:`bad_count`, :attr:`bad_why`), as is any other key's value longer
    than ``value_limit`` (:attr:`skipped_keys`); the file is never refused for its size. Text
    that is not JSON stops the stream: :attr:`error` says where (the entries before it were
    read); so do pickle or binary bytes, a file that may not be opened, and a document that is
    not an object (``or_list``: a document that is the array itself is read as the array).
    Text after the object is not read (:attr:`trailing`). Memory is one entry and a chunk of the
    file, time linear in it."""

    KEPT_BAD = 100
    MAX_KEYS = 10_000

    def __init__(
        self,
        path: str | Path,
        key: str,
        *,
        entry_limit: int = MAX_LINE,
        value_limit: int = MAX_LINE,
        chunk: int = 1 << 16,
        or_list: bool = False,
    ) -> None:
        self.path, self.key, self.or_list = Path(path), key, or_list
        self.entry_limit, self.value_limit, self.chunk = entry_limit, value_limit, chunk
        self.top: dict[str, Any] = {}
        self.found_array = False
        self.entries = 0
        self.bad_entries: list[int] = []
        self.bad_count = 0
        self.bad_why: str | None = None
        self.skipped_keys: list[tuple[str, str]] = []
        self.error: str | None = None
        self.trailing = False

    def __iter__(self) -> Iterator[Any]:
        try:
            f, _st = open_checked(self.path)
        except FileRefused as e:
            self.error = e.reason
            return
        with f:
            c = _Chars(f, self.chunk)
            try:
                yield from self._object(c)
            except _Invalid as e:
                self.error = f"is not valid JSON ({e})"

    def _object(self, c: _Chars) -> Iterator[Any]:
        dec = json.JSONDecoder()
        first = c.peek()
        why = _what_it_holds(c.head)
        if why is not None:
            self.error = why
            return
        if first == "[" and self.or_list:  # the document is the array itself
            self.found_array = True
            yield from self._array(c, dec)
            self.trailing = c.peek() != ""
            return
        if first != "{":
            if first in ("[", '"') or first.isdigit() or first == "-":
                self.error = f"holds a {'list' if first == '[' else 'value'}, not an object"
            else:
                self.error = f"is not valid JSON (no object at {c.where()})"
            return
        if c.opens("}"):
            while True:
                if c.peek() != '"':
                    raise _Invalid(f"a key expected at {c.where()}")
                ok, name = c.value(self.value_limit, dec)
                if not ok:
                    raise _Invalid(f"a key {name} at {c.where()}")
                if c.peek() != ":":
                    raise _Invalid(f"':' expected at {c.where()}")
                c.pos += 1
                if name == self.key and c.peek() == "[":
                    self.found_array = True
                    yield from self._array(c, dec)
                else:
                    ok, v = c.value(self.value_limit, dec)
                    if ok and len(self.top) < self.MAX_KEYS:
                        self.top[name] = v
                    elif not ok:
                        self.skipped_keys.append((name, v))
                if c.ends("}"):
                    break
        self.trailing = c.peek() != ""

    def _array(self, c: _Chars, dec: json.JSONDecoder) -> Iterator[Any]:
        if not c.opens("]"):
            return
        while True:
            self.entries += 1
            ok, v = c.value(self.entry_limit, dec)
            if ok:
                yield v
            else:
                self.bad_count += 1
                self.bad_why = self.bad_why or v
                if len(self.bad_entries) < self.KEPT_BAD:
                    self.bad_entries.append(self.entries)
            if c.ends("]"):
                return

    def note(self) -> str | None:
        """One line about the entries and keys that were skipped, or None."""
        parts = []
        if self.bad_count:
            where = ", ".join(str(n) for n in self.bad_entries[:5])
            more = f" and {self.bad_count - 5} more" if self.bad_count > 5 else ""
            parts.append(
                f"skipped {self.bad_count} unreadable {self.key} entr"
                f"{'y' if self.bad_count == 1 else 'ies'} ({where}{more}: {self.bad_why})"
            )
        for name, why in self.skipped_keys[:3]:
            parts.append(f"skipped the value of {name!r} ({why})")
        if self.trailing:
            parts.append("text after the JSON object not read")
        return f"{self.path}: " + "; ".join(parts) if parts else None


def read_jsonl(path: str | Path, *, line_limit: int = MAX_LINE) -> JsonlRows:
    """Rows of a JSONL file, all kept (a missing file has none): for files whose rows are all
    needed at once (events, a resume's rows). Reads through :func:`iter_jsonl`, so a line over
    ``line_limit`` is skipped and counted, never the whole file refused; a reader of a history of
    any length streams with :func:`iter_jsonl` instead."""
    stream = iter_jsonl(path, line_limit=line_limit)
    out = JsonlRows(rows=list(stream))
    out.bad_lines, out.error = stream.bad_lines, stream.error
    out.bad_count = stream.bad_count
    return out


def load_json(path: str | Path) -> Any:
    """A JSON file, strictly: raises :class:`RunFileError` naming the file and what is wrong
    (missing, over the size cap, a symlink out of its folder, pickle or binary bytes, not
    UTF-8, not valid JSON, nested too deeply)."""
    p = Path(path)
    if not p.exists() and not p.is_symlink():
        raise RunFileError(p, "does not exist")
    text = _text(p, _bytes(p))
    try:
        return _json_value(text)
    except json.JSONDecodeError as e:
        raise RunFileError(
            p, f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except ValueError:
        raise RunFileError(p, "is nested too deeply to read (JSON arrays/objects)") from None


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON object file (summary.json, branch.json ...), or None when missing or unreadable."""
    try:
        obj = load_json(path)
    except RunFileError:
        return None
    return obj if isinstance(obj, dict) else None


def as_number(x: Any) -> float | None:
    """A value from a run file as a float: numbers, and the strings ``"nan"``/``"inf"``/
    ``"-inf"`` that the writers use for non-finite values; anything else (None, bools, text) is
    None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def is_finite_number(x: Any) -> bool:
    v = as_number(x)
    return v is not None and math.isfinite(v)


def _yaml_problem(e: Exception) -> str:
    tag = re.search(r"constructor for the tag '([^']*)'", str(e))
    if tag:
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        return (
            f"uses the YAML tag {name}, which is not allowed (a run's config is data: plain "
            "YAML only, no tags that build Python objects)"
        )
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or first_line(e)
    return f"is not valid YAML ({problem}{where})"


def load_config_text(path: str | Path) -> dict[str, Any]:
    """``config.yaml`` as plain data, interpolations left as text (never evaluated), strictly:
    raises :class:`RunFileError` naming the file and what is wrong (a YAML tag, a YAML error,
    aliases or nesting that make it no plain tree, not a mapping, the size cap)."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf._utils import get_yaml_loader
    from omegaconf.errors import OmegaConfBaseException

    p = Path(path)
    text = _text(p, _bytes(p))
    try:
        data = yaml.load(text, Loader=get_yaml_loader())  # noqa: S506 - omegaconf's SafeLoader
    except yaml.YAMLError as e:
        raise RunFileError(p, _yaml_problem(e)) from None
    except RecursionError:
        raise RunFileError(p, "is nested too deeply to read (YAML)") from None
    try:
        check_tree(data, source=str(p))
    except ResourceRefused as e:
        raise RunFileError(p, str(e).split(": ", 1)[-1]) from None
    if not isinstance(data, dict):
        raise RunFileError(p, f"holds a {type(data).__name__}, not a mapping of config keys")
    try:
        obj = OmegaConf.to_container(OmegaConf.create(data), resolve=False)
    except (OmegaConfBaseException, ValueError, TypeError) as e:
        raise RunFileError(p, f"is not a config OmegaConf reads: {first_line(e)}") from None
    return obj if isinstance(obj, dict) else {}


def read_config_text(path: str | Path) -> dict[str, Any] | None:
    """``config.yaml`` as plain data (see :func:`load_config_text`), or None when missing or
    unreadable."""
    try:
        return load_config_text(path)
    except RunFileError:
        return None


@dataclass
class RunRecord:
    """What a run folder (or one archived branch of it) recorded, read as data."""

    layout: RunLayout
    metrics: JsonlRows
    events: JsonlRows
    summary: dict[str, Any] | None
    config: dict[str, Any] | None

    @classmethod
    def read(
        cls, root: str | Path, *, upto_step: int | None = None, strict: bool = False
    ) -> RunRecord:
        """Read a run folder; with ``upto_step`` only rows and events up to that step. With
        ``strict``, a ``config.yaml`` that is there but unreadable raises :class:`RunFileError`
        (else it reads as no config)."""
        lay = RunLayout(Path(root))
        metrics, events = read_jsonl(lay.metrics), read_jsonl(lay.events)
        if upto_step is not None:
            metrics.rows = [r for r in metrics.rows if _step(r) <= upto_step]
            events.rows = [e for e in events.rows if _step(e) <= upto_step]
        return cls(
            layout=lay,
            metrics=metrics,
            events=events,
            summary=read_json(lay.summary),
            config=_config(lay.config, strict),
        )

    def notes(self) -> list[str]:
        """Lines about anything that could not be read."""
        return [
            n
            for n in (
                self.metrics.note(self.layout.metrics),
                self.events.note(self.layout.events),
            )
            if n
        ]


def _config(path: Path, strict: bool) -> dict[str, Any] | None:
    if not path.exists() and not path.is_symlink():
        return None
    return load_config_text(path) if strict else read_config_text(path)


def _step(row: dict[str, Any]) -> float:
    v = as_number(row.get("step"))
    return v if v is not None else -1.0
