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
    read_bounded,
)

from .layout import RunLayout

__all__ = [
    "JsonlRows",
    "RunRecord",
    "RunFileError",
    "read_jsonl",
    "iter_jsonl",
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
