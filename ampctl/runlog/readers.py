"""Reading a run folder. Files from a run are data: nothing in them is imported, called or
resolved (``config.yaml`` is read without evaluating interpolations).

One rule for a bad JSONL line, everywhere: a line that is not a JSON object (cut off by a crash,
or edited by hand) is skipped and its line number kept in :attr:`JsonlRows.bad_lines`, so a
reader can say "N unreadable lines skipped" instead of failing or silently guessing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .layout import RunLayout

__all__ = ["JsonlRows", "RunRecord", "read_jsonl", "read_json", "as_number", "is_finite_number"]


@dataclass
class JsonlRows:
    """The objects of a JSONL file and the (1-based) numbers of the lines that were not."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def note(self, path: Path) -> str | None:
        """One line about skipped lines, or None when every line was read."""
        if not self.bad_lines:
            return None
        where = ", ".join(str(n) for n in self.bad_lines[:5])
        more = f" and {len(self.bad_lines) - 5} more" if len(self.bad_lines) > 5 else ""
        return f"{path}: skipped {len(self.bad_lines)} unreadable line(s) ({where}{more})"


def read_jsonl(path: str | Path) -> JsonlRows:
    """Rows of a JSONL file (a missing file has none). Never raises for bad content."""
    out = JsonlRows()
    p = Path(path)
    if not p.is_file():
        return out
    for i, line in enumerate(p.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            out.bad_lines.append(i)
            continue
        if isinstance(obj, dict):
            out.rows.append(obj)
        else:
            out.bad_lines.append(i)
    return out


def read_json(path: str | Path) -> dict[str, Any] | None:
    """A JSON object file (summary.json, branch.json ...), or None when missing or unreadable."""
    try:
        obj = json.loads(Path(path).read_text(errors="replace"))
    except (OSError, json.JSONDecodeError):
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


def read_config_text(path: str | Path) -> dict[str, Any] | None:
    """``config.yaml`` as plain data, interpolations left as text (never evaluated)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.load(Path(path))
        obj = OmegaConf.to_container(cfg, resolve=False)
    except (OSError, OmegaConfBaseException, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


@dataclass
class RunRecord:
    """What a run folder (or one archived branch of it) recorded, read as data."""

    layout: RunLayout
    metrics: JsonlRows
    events: JsonlRows
    summary: dict[str, Any] | None
    config: dict[str, Any] | None

    @classmethod
    def read(cls, root: str | Path, *, upto_step: int | None = None) -> RunRecord:
        """Read a run folder; with ``upto_step`` only rows and events up to that step."""
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
            config=read_config_text(lay.config) if lay.config.is_file() else None,
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


def _step(row: dict[str, Any]) -> float:
    v = as_number(row.get("step"))
    return v if v is not None else -1.0
