"""A run folder read for drawing: metrics, events, summary, the exact skipped steps from the
latest checkpoint's scaler history, and the branches a resume set aside."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError
from ampctl.runlog import BranchInfo, RunLayout, list_branches, read_json, read_jsonl

from .common import RESTORING, _kept, _num


@dataclass
class SkipMark:
    """Skipped steps at ``step``: ``count`` of them; ``exact`` when the step is known (scaler
    history), else the logged step that closed an interval with skips (metrics counter)."""

    step: int
    scale: float
    count: int
    exact: bool


Restore = tuple[int, int, str, int]


@dataclass
class RunData:
    """What a run folder says, ready to draw (no matplotlib needed)."""

    run_dir: Path
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    scale_steps: list[int] = field(default_factory=list)  # per-step scale line (history) ...
    scale_values: list[float] = field(default_factory=list)
    skips: list[SkipMark] = field(default_factory=list)
    skip_source: str = "metrics"  # "history" | "history+metrics" | "metrics"
    restores: list[Restore] = field(default_factory=list)
    branches: list[BranchInfo] = field(default_factory=list)  # history set aside by resumes
    notes: list[str] = field(default_factory=list)  # lines that could not be read, ...

    @property
    def name(self) -> str:
        return self.run_dir.name

    def series(self, key: str) -> tuple[list[float], list[float], list[bool]]:
        """(steps, values, kept) of one metrics key, in file order; missing values are NaN."""
        xs = [_num(r.get("step")) for r in self.rows]
        return xs, [_num(r.get(key)) for r in self.rows], _kept(xs)


def _check_run_dir(run_dir: Path, what: str = "run folder") -> Path:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UsageError(
            f"{str(run_dir)!r} does not exist: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not run_dir.is_dir():
        raise UsageError(
            f"{str(run_dir)!r} is a file: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not RunLayout(run_dir).metrics.is_file():
        raise UsageError(
            f"{str(run_dir)!r} has no metrics.jsonl: give a {what} written by ampctl train, "
            "or a sweep folder with results.json"
        )
    return run_dir


Restore = tuple[int, int, str, int]  # (decided at step, restored step, kind, steps discarded)


def _restore_points(events: list[dict[str, Any]]) -> list[Restore] | None:
    """Each rollback/fallback in order: the step it was decided at (``from_step``; in runs of
    ampctl 0.1, the step of the overflow event just before it), the step restored, the kind and
    the steps that ran after the decision and were discarded (fused optimizer path). None when
    the decision step cannot be known."""
    out: list[Restore] = []
    last_overflow: int | None = None
    for ev in events:
        kind = ev.get("kind")
        if kind == "overflow":
            last_overflow = int(_num(ev.get("step")))
        elif kind in RESTORING:
            to = int(_num(ev.get("to_step", ev.get("step", 0))))
            frm = _num(ev.get("from_step"))
            frm = int(frm) if math.isfinite(frm) else last_overflow
            if frm is None or frm <= to:
                return None
            out.append((frm, to, kind, int(_num(ev.get("discarded_steps", 0)) or 0)))
            last_overflow = None
    return out


def _latest_scaler_state(run_dir: Path) -> dict[str, Any] | None:
    """The scaler state (and step, wall time) of the run's latest checkpoint, or None when the
    folder has none or it cannot be read. The checkpoint is memory-mapped with
    ``weights_only=True``: only the small scaler tensors are actually read."""
    import torch

    path = RunLayout(run_dir).latest_checkpoint()
    if path is None:
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        hist = torch.as_tensor(ck["scaler"]["history"], dtype=torch.float64).reshape(-1, 3).tolist()
        return {
            "step": int(ck["step"]),
            "skipped_total": int(ck["scaler"].get("skipped_total", sum(r[2] for r in hist))),
            "wall_s": float((ck.get("trainer") or {}).get("wall_s", math.inf)),
            "history": hist,
        }
    except Exception:  # noqa: BLE001 - a broken checkpoint only costs the exact skip steps
        return None


def _map_updates(n_updates: int, restores: list[Restore]) -> list[int]:
    """Trainer step of each scaler update 1..n: one step per update; after a restore decided at
    step ``frm`` (and ``discarded`` more steps that already ran), back to the restored step (the
    scaler keeps counting through them)."""
    steps, t, j, back_after = [], 0, 0, None
    for _ in range(n_updates):
        t += 1
        steps.append(t)
        if back_after is None and j < len(restores) and restores[j][0] == t:
            back_after = t + restores[j][3]
        if back_after is not None and t == back_after:
            t = restores[j][1]
            j += 1
            back_after = None
    return steps


def _metric_skips(rows: list[dict[str, Any]], below: float, above: float) -> list[SkipMark]:
    """Skip markers from the cumulative counter: for each logged row, the skips since the row
    before that fall at or below ``below`` or beyond ``above`` (counts, not steps)."""
    marks, prev = [], 0.0
    for r in rows:
        s = _num(r.get("skipped"))
        if math.isnan(s):
            continue
        n = max(0.0, min(s, below) - min(prev, below)) + max(0.0, s - max(prev, above))
        if n > 0:
            marks.append(
                SkipMark(
                    step=int(_num(r.get("step"))),
                    scale=_num(r.get("scale")),
                    count=int(n),
                    exact=False,
                )
            )
        prev = max(prev, s)
    return marks


def load_run_data(run_dir: str | Path) -> RunData:
    """Read a run folder: metrics, events, summary, and the exact skipped steps and per-step
    scale from the latest checkpoint's scaler history when it is there and consistent with the
    events; otherwise skips per log interval from the metrics. Raises UsageError for a missing
    folder, no metrics.jsonl, or no rows. Reads the checkpoint on the CPU (no device)."""
    from .foreign import foreign_run_data  # another tool's log beside it (#40)

    if (foreign := foreign_run_data(run_dir, RunData)) is not None:
        return foreign
    run_dir = _check_run_dir(Path(run_dir))
    lay = RunLayout(run_dir)
    metrics, events_read = read_jsonl(lay.metrics), read_jsonl(lay.events)
    rows = [r for r in metrics if math.isfinite(_num(r.get("step")))]
    if not rows:
        raise UsageError(
            f"{str(lay.metrics)!r} is empty: nothing to plot yet (a row is written every "
            "trainer.log_every steps)"
        )
    events = [e for e in events_read if math.isfinite(_num(e.get("step")))]
    data = RunData(run_dir=run_dir, rows=rows, events=events, summary=read_json(lay.summary))
    data.notes = [n for n in (metrics.note(lay.metrics), events_read.note(lay.events)) if n]
    data.branches = [b for b in list_branches(lay) if RunLayout(b.path).metrics.is_file()]
    restores = _restore_points(events)
    data.restores = restores or []
    if restores is None:  # place restores at their recorded step
        data.restores = [
            (int(e["step"]), int(e.get("to_step", e["step"])), e["kind"], 0)
            for e in events
            if e.get("kind") in RESTORING
        ]

    st = _latest_scaler_state(run_dir)
    hist_ok = False
    if st is not None and st["history"] and restores is not None:
        n = int(st["history"][-1][0])  # update number of the last record (1-based)
        tsteps = _map_updates(n, restores)
        hist_ok = tsteps[-1] == st["step"] and all(int(r[0]) >= 1 for r in st["history"])
    if not hist_ok:
        data.skips = _metric_skips(rows, below=math.inf, above=math.inf)
        xs, ys, _ = data.series("scale")
        data.scale_steps, data.scale_values = xs, ys
        data.skip_source = "metrics"
        return data

    hist = st["history"]
    first_t = tsteps[int(hist[0][0]) - 1]
    covered = sum(1 for r in hist if r[2] > 0)
    before = st["skipped_total"] - covered  # skips older than the history ring buffer
    after = st["skipped_total"]  # skips beyond the checkpoint
    xs, ys = [], []
    for r in rows:  # the part the ring buffer forgot
        if _num(r.get("step")) < first_t and _num(r.get("elapsed_s")) <= st["wall_s"]:
            xs.append(_num(r["step"]))
            ys.append(_num(r.get("scale")))
    for u, scale, sk in hist:
        t = tsteps[int(u) - 1]
        xs.append(t)
        ys.append(scale)
        if sk > 0:
            data.skips.append(SkipMark(step=t, scale=scale, count=1, exact=True))
    for r in rows:  # rows logged after the checkpoint
        if _num(r.get("elapsed_s")) > st["wall_s"]:
            xs.append(_num(r["step"]))
            ys.append(_num(r.get("scale")))
    extra = _metric_skips(rows, below=before, above=after)
    data.skips += extra
    data.scale_steps, data.scale_values = xs, ys
    data.skip_source = "history+metrics" if extra else "history"
    return data
