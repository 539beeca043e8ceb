"""Part 2 of a diagnosis: what the run recorded before the checkpoint.

* ampctl run folders (through :mod:`ampctl.runlog`): metrics and events up to the checkpoint's
  step, the scaler's own per-update record, and which branch was read (a run resumed from an
  earlier checkpoint keeps the discarded history in ``branches/NNN-stepS/``);
* other tools' histories (:class:`~.readers.base.ForeignHistory`: HF ``log_history``, Lightning
  CSV / TensorBoard): loss, grad norm and learning rate per logged step.

Both give a :class:`~.stages.History`: every logged step (``rows``), the steps the run skipped,
the guard's events, the first overflow, the first non-finite loss (for HF, a logged 0.0 next to
a non-finite grad norm is a filtered NaN), the first non-finite grad norm, the step it broke
(the first non-finite loss, or the first step of a run of skipped steps still going at the end
of the record: an isolated skipped step whose scale recovered is no break), and the loss and
grad-norm trend before it. A grad norm "explodes" when its peak over the last ``TREND_ROWS``
rows before the break is ``EXPLOSION_FACTOR`` (10) times the median of the rows before them.
What the record *means* is the verdict's (:mod:`.verdict`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ampctl.amp import records as rec
from ampctl.runlog import RunLayout, as_number, list_branches, read_json
from ampctl.runlog.readers import iter_jsonl

from .common import EXPLOSION_FACTOR, TREND_ROWS, finite
from .readers.base import ForeignHistory
from .rows import RowKeeper
from .stages import (
    Aborted,
    Branch,
    Burst,
    Fallback,
    GradNormTrend,
    GuardEvent,
    History,
    LossTrend,
    Problem,
    Row,
    ScalerState,
)

__all__ = [
    "overflow_bursts",
    "event_bursts",
    "grad_norm_trend",
    "loss_trend",
    "run_history",
    "foreign_history",
    "branch_of",
    "unreadable_history",
]

_OVERFLOW_KINDS = (rec.GRADIENT, rec.FORWARD)


# ---------------------------------------------------------------------------- pure helpers
def overflow_bursts(rows: Iterable[tuple[int, float, Any]]) -> list[Burst]:
    """Runs of consecutive overflowed steps in scaler record rows ``(step, scale used, kind)``
    (a kind that is truthy and not a spike: spikes are skipped on purpose, not overflows).

    ``after_growth``: the burst's first step used a larger scale than the step before it (the
    scaler had just grown). Pure function."""
    rows = [(s, v, int(k) in _OVERFLOW_KINDS) for s, v, k, *_ in rows]
    bursts: list[Burst] = []
    i = 0
    while i < len(rows):
        if not rows[i][2]:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and rows[j + 1][2]:
            j += 1
        bursts.append(
            Burst(
                start=rows[i][0],
                end=rows[j][0],
                length=j - i + 1,
                scale=rows[i][1],
                after_growth=i > 0 and rows[i][1] > rows[i - 1][1],
            )
        )
        i = j + 1
    return bursts


def event_bursts(events: Iterable[dict[str, Any]]) -> list[Burst]:
    """Runs of consecutive steps with an overflow event (a run without the scaler's per-update
    record, e.g. no checkpoint): ``scale`` is the scale the first event reports after its
    backoff; ``after_growth`` is unknown there, so False. Pure function."""
    steps = sorted(
        {int(s): e for e in events if (s := as_number(e.get("step"))) is not None}.items()
    )
    bursts: list[Burst] = []
    for step, e in steps:
        if bursts and bursts[-1].end == step - 1:
            bursts[-1].end = step
            bursts[-1].length += 1
            continue
        bursts.append(Burst(step, step, 1, as_number(e.get("scale")), False))
    return bursts


def grad_norm_trend(
    norms: list[tuple[int, float]], window: int = TREND_ROWS, factor: float = EXPLOSION_FACTOR
) -> GradNormTrend | None:
    """Peak grad norm of the last ``window`` rows against the median of the rows before them
    (the first row when there are not enough). ``exploded`` when peak >= factor * baseline.
    ``norms``: ``(step, grad_norm)`` of logged rows; non-finite values are left out. Pure."""
    norms = [(s, g) for s, g in norms if finite(g)]
    if len(norms) < 2:
        return None
    if len(norms) > window:
        earlier, recent = norms[:-window], norms[-window:]
    else:
        earlier, recent = norms[:1], norms[1:]
    baseline = statistics.median(g for _, g in earlier)
    peak_step, peak = max(recent, key=lambda r: r[1])
    ratio = peak / baseline if baseline > 0 else math.inf
    return GradNormTrend(baseline, peak, peak_step, ratio, ratio >= factor)


def loss_trend(losses: list[tuple[int, float]]) -> LossTrend | None:
    """First, lowest and last finite loss before the break. Pure."""
    vals = [(s, v) for s, v in losses if finite(v)]
    if not vals:
        return None
    low = min(vals, key=lambda r: r[1])
    return LossTrend(vals[0][1], vals[0][0], low[1], low[0], vals[-1][1], vals[-1][0])


def _scale_changes(points: Iterable[tuple[int, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for step, scale in points:
        if not out or out[-1][1] != scale:
            out.append([step, scale])
    return out


def _step(r: dict[str, Any]) -> int | None:
    v = as_number(r.get("step"))
    return int(v) if v is not None and math.isfinite(v) else None


def trailing_run(steps: list[int], last_step: int | None) -> int | None:
    """The first step of the run of consecutive skipped ``steps`` that reaches ``last_step``
    (the end of the record), or None when the record ends on a step that was not skipped."""
    if not steps or last_step is None or steps[-1] < last_step:
        return None
    first = steps[-1]
    for s in reversed(steps[:-1]):
        if s != first - 1:
            break
        first = s
    return first


# ---------------------------------------------------------------------------- branches
def _resumes(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``resume`` events (its events only: the metrics are not read for them)."""
    return [
        {"step": _step(e), "from": e.get("resumed_from") or e.get("checkpoint")}
        for e in iter_jsonl(RunLayout(run_dir).events)
        if e.get("kind") == "resume"
    ]


def branch_of(ckpt: Path, run_dir: Path | None) -> Branch | None:
    """Which line of an ampctl run folder a checkpoint belongs to (``None`` outside one), and
    how often the folder's run was resumed (its ``resume`` events)."""
    if run_dir is None:
        return None
    root = run_dir
    archived = run_dir.parent.name == RunLayout.BRANCHES
    if archived:
        root = run_dir.parent.parent
    branches = list_branches(RunLayout(root))
    names = [f"{RunLayout.BRANCHES}/{b.name}" for b in branches]
    parent = read_json(RunLayout(root).parent)
    resumes = _resumes(root)
    if archived:
        info = next((b for b in branches if b.path == run_dir), None)
        fork = info.forked_at_step if info else None
        text = (
            f"archived branch {RunLayout.BRANCHES}/{run_dir.name} (set aside when the run was "
            f"resumed from step {fork}); rows up to step {fork} come from the main line"
        )
        line = "archived"
    else:
        line = "main"
        fork = branches[-1].forked_at_step if branches else None
        if branches:
            last = branches[-1]
            text = (
                f"main line; resumed from step {last.forked_at_step}, discarded history in "
                f"{RunLayout.BRANCHES}/{last.name}"
                + (f" ({len(branches)} branches)" if len(branches) > 1 else "")
            )
        elif resumes:
            at = ", ".join(str(r["step"]) for r in resumes[:5])
            text = (
                f"main line; resumed {len(resumes)} time(s), at step {at}, each from the newest "
                "checkpoint (nothing set aside)"
            )
        else:
            text = "main line (never resumed from an earlier checkpoint)"
    if isinstance(parent, dict) and parent.get("run"):
        text += f"; forked from {parent.get('checkpoint')} (step {parent.get('step')})"
    return Branch(
        line=line,
        text=text,
        forked_at_step=fork,
        branches=names,
        parent=parent if isinstance(parent, dict) else None,
        resumes=len(resumes),
    )


def _upto(step_limit: int | None):
    """Whether a run file's row is up to ``step_limit`` (as :meth:`RunRecord.read` filters)."""

    def keep(r: dict[str, Any]) -> bool:
        if step_limit is None:
            return True
        v = as_number(r.get("step"))
        return (v if v is not None else -1.0) <= step_limit

    return keep


def _records(
    run_dir: Path, step_limit: int | None, branch: Branch | None, keeper: RowKeeper
) -> tuple[int, list, list[str], list[list[str]], dict[str, Any] | None]:
    """Metrics rows (streamed into ``keeper``, one line at a time: their count is returned) and
    events up to ``step_limit``; an archived branch is preceded by the main line's rows up to
    the fork."""
    lay = RunLayout(run_dir)
    parts = [(lay, step_limit, False)]
    if branch is not None and branch.line == "archived" and branch.forked_at_step is not None:
        parts.insert(0, (RunLayout(run_dir.parent.parent), branch.forked_at_step, True))
    count, events, files = 0, [], []
    for layout, limit, main in parts:
        keep = _upto(limit)
        stream = iter_jsonl(layout.metrics)
        for r in stream:
            if keep(r):
                count += 1
                _add_row(keeper, r)
        evs = iter_jsonl(layout.events)  # streamed: only events (a kind) are kept, so a file
        # of `{}` lines costs no memory
        events += [
            e
            for e in evs
            if isinstance(e.get("kind"), str)
            and keep(e)
            and not (main and e.get("kind") == "branch")
        ]
        files = [(stream, layout.metrics), (evs, layout.events)] + files  # the run's own first
    # lines skipped are a note; a whole file that could not be read is named as unreadable
    notes = [n for rows, path in files if rows.error is None and (n := rows.note(path))]
    unreadable = [[str(path), rows.error] for rows, path in files if rows.error is not None]
    if (n := keeper.note(str(lay.metrics))) is not None:
        notes.append(n)
    return count, events, notes, unreadable, read_json(lay.summary)


# ---------------------------------------------------------------------------- ampctl runs
def _add_row(keeper: RowKeeper, r: dict[str, Any]) -> None:
    """One metrics row into the keeper (a step logged again after a rollback: the later row,
    the line the run went on with)."""
    step = _step(r)
    if step is None:
        return
    g = r.get
    keeper.add(
        Row(
            step=step,
            loss=_num(g("loss")),
            scale=_num(g("scale")),
            skipped=g("skipped"),
            grad_norm=_num(g("grad_norm")),
            grad_amax=_num(g("grad_amax")),
            learning_rate=_num(g("lr", g("learning_rate"))),
        )
    )


def _num(x: Any) -> float | None:
    """:func:`as_number`, with a float taken as it is (the common case: once a row, each
    figure)."""
    return x if type(x) is float else as_number(x)


def _guard_events(events: list[dict[str, Any]]) -> list[GuardEvent]:
    skip = ("step", "kind", "message", "time")
    return [
        GuardEvent(
            step=_step(e),
            kind=str(e.get("kind")),
            message=str(e.get("message", "")),
            data={k: v for k, v in e.items() if k not in skip},
        )
        for e in events
    ]


def _first_overflow(
    overflows: list[GuardEvent], scaler_rows: list[tuple], metrics: list[Row]
) -> tuple[int | None, str | None]:
    candidates = []
    if overflows:
        candidates.append((min(e.step for e in overflows), "events"))
    if scaler_rows and scaler_rows[0][0] == 1:
        steps = [s for s, _, k, _ in scaler_rows if k in _OVERFLOW_KINDS]
        if steps:
            candidates.append((steps[0], "scaler"))
    if candidates:
        return min(candidates)
    skipped = [r.step for r in metrics if (as_number(r.skipped) or 0) > 0]
    return (skipped[0], "metrics") if skipped else (None, None)


def _skipped_steps(events: list[GuardEvent], scaler_rows: list[tuple]) -> list[int]:
    """Steps the run skipped: overflow and spike events (an overflow a rollback discarded is
    not on the run's line), else the scaler's record."""
    steps = {
        e.step
        for e in events
        if (e.kind == "overflow" and not e.data.get("discarded")) or e.kind == "spike"
    }
    if not steps and scaler_rows and scaler_rows[0][0] == 1:
        steps = {s for s, _, k, _ in scaler_rows if k != rec.CLEAN}
    return sorted(steps)


def _scale_points(
    metrics: list[Row],
    scaler_rows: list[tuple],
    step_limit: int | None,
    scaler: ScalerState | None,
) -> list[list[float]]:
    first_hist = scaler_rows[0][0] if scaler_rows else None
    pts = [(r.step, r.scale) for r in metrics if r.scale is not None]
    pts = [(s, v) for s, v in pts if first_hist is None or s < first_hist]
    pts += [(s, v) for s, v, *_ in scaler_rows]
    if (
        step_limit is not None
        and scaler is not None
        and scaler.enabled
        and scaler.scale is not None
    ):
        pts.append((step_limit, float(scaler.scale)))
    return _scale_changes(pts)


def run_history(
    run_dir: Path,
    step_limit: int | None,
    scaler: ScalerState | None,
    branch: Branch | None = None,
) -> History | None:
    """What an ampctl run folder's metrics, events and the scaler's record say (rows up to the
    checkpoint's step; all of them when ``step_limit`` is None: a folder without checkpoints).
    None when the folder has neither metrics nor events."""
    lay = RunLayout(run_dir)
    if not any(f.exists() or f.is_symlink() for f in (lay.metrics, lay.events)):
        return None
    keeper = RowKeeper()
    count, events, notes, unreadable, summary = _records(run_dir, step_limit, branch, keeper)
    rows = keeper.rows()
    evs = [e for e in _guard_events(events) if e.step is not None]
    scaler_rows = scaler.rows if scaler is not None else []
    counts: dict[str, int] = {}
    for e in evs:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    overflows = [e for e in evs if e.kind == "overflow" and not e.data.get("discarded")]
    first_overflow, source = _first_overflow(overflows, scaler_rows, rows)
    nan_steps = [r.step for r in rows if r.loss is not None and not math.isfinite(r.loss)]
    nan_steps += [e.step for e in overflows if e.data.get("overflow") == "forward"]
    first_nan = min(nan_steps) if nan_steps else None
    gn_bad = [r.step for r in rows if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    named: dict[str, int] = {}
    for e in overflows:
        for p in dict.fromkeys(e.data.get("params") or []):
            if isinstance(p, str):
                named[p] = named.get(p, 0) + 1
    params = sorted(named, key=lambda p: -named[p])  # the most often named first
    status = (summary or {}).get("status")
    h = History(
        source="run folder",
        run_dir=str(run_dir),
        metrics_rows=count,
        events=counts,
        first_overflow_step=first_overflow,
        first_overflow_source=source,
        first_nan_loss_step=first_nan,
        first_nonfinite_grad_norm_step=min(gn_bad) if gn_bad else None,
        forward_overflows=sum(1 for e in overflows if e.data.get("overflow") == "forward"),
        scale_trajectory=_scale_points(rows, scaler_rows, step_limit, scaler),
        bursts=overflow_bursts(scaler_rows)
        if scaler_rows
        else event_bursts(e.data | {"step": e.step} for e in overflows),
        scaler_records=len(scaler_rows),
        break_step=first_nan,
        promotions=[
            str(e.data["module"]) for e in evs if e.kind == "promotion" and e.data.get("module")
        ],
        fallbacks=[
            Fallback(e.step, e.data.get("from_precision"), e.data.get("to_precision"))
            for e in evs
            if e.kind == "fallback"
        ],
        aborted=next((Aborted(e.step, e.message) for e in evs if e.kind == "abort"), None),
        overflow_params=params,
        skipped_steps=_skipped_steps(evs, scaler_rows),
        resumes=[
            {"step": e.step, "from": e.data.get("resumed_from") or e.data.get("checkpoint")}
            for e in evs
            if e.kind == "resume"
        ],
        notes=notes,
        unreadable=unreadable,
        status=status if isinstance(status, str) else None,
        rows=rows,
        guard_events=evs,
    )
    _trend(h)
    return h


def _trend(h: History) -> None:
    """The rows, loss and grad-norm trend before the break."""
    before = [r for r in h.rows if h.break_step is None or r.step < h.break_step]
    h.before_break = before[-TREND_ROWS:]
    skipped = set(h.skipped_steps)
    norms = [(r.step, r.grad_norm) for r in before if r.grad_norm is not None]
    h.grad_norm = grad_norm_trend([(s, g) for s, g in norms if s not in skipped])
    h.loss = loss_trend([(r.step, r.loss) for r in before if r.loss is not None])


# ---------------------------------------------------------------------------- other tools
def foreign_history(fh: ForeignHistory, step_limit: int | None) -> History:
    """The same record from another tool's log (HF ``log_history``, Lightning CSV/TensorBoard).

    A row whose grad norm is non-finite and whose loss is finite is a step the GradScaler
    skipped (the Trainer logs ``grad_norm: inf`` for it); one whose loss the Trainer's NaN filter
    logged as 0.0 is a non-finite loss."""
    keeper = RowKeeper(by_step=False)  # as the tool logged them
    filtered: list[int] = []
    counts = _RunningCounts()
    counted: set[int] = set()
    prev: float | None = None
    for r in fh.rows:  # one pass (a reader may give its rows lazily)
        if step_limit is not None and r["step"] > step_limit:
            continue
        loss = as_number(r.get("loss"))
        nan = False
        if fh.nan_filter and loss == 0.0:
            gn = as_number(r.get("grad_norm"))
            if (gn is not None and not math.isfinite(gn)) or (prev is not None and prev > 0):
                filtered.append(r["step"])
                nan = True
        if loss is not None and math.isfinite(loss) and loss != 0.0:
            prev = loss
        keeper.add(
            Row(
                step=r["step"],
                loss=math.nan if nan else loss,
                grad_norm=as_number(r.get("grad_norm")),
                learning_rate=as_number(r.get("learning_rate")),
                scale=as_number(r.get("scale")),
                skipped=as_number(r.get("skipped")),
            )
        )
        for role in ("skipped", "overflow"):  # running counts another tool logs
            if counts.went_up(role, r):
                counted.add(r["step"])
    if filtered:  # a step logged twice is a NaN in both rows when one of them was filtered
        again = set(filtered)
        rows = [
            Row(r.step, math.nan, r.scale, r.skipped, r.grad_norm, r.grad_amax, r.learning_rate)
            if r.step in again
            else r
            for r in keeper.rows()
        ]
    else:
        rows = keeper.rows()
    nan_loss = [r.step for r in rows if r.loss is not None and not math.isfinite(r.loss)]
    bad_gn = [r.step for r in rows if r.grad_norm is not None and not math.isfinite(r.grad_norm)]
    first_nan = min(nan_loss) if nan_loss else None
    last = rows[-1].step if rows else None
    storm = trailing_run(sorted(set(bad_gn) | set(nan_loss)), last)
    breaks = [s for s in (first_nan, storm) if s is not None]
    h = History(
        source=fh.source,
        # rows the reader merged away (a long log) are counted as read
        metrics_rows=keeper.seen + max(0, (fh.logged or 0) - len(fh.rows)),
        first_nan_loss_step=first_nan,
        nan_filtered_steps=filtered,
        first_nonfinite_grad_norm_step=min(bad_gn) if bad_gn else None,
        break_step=min(breaks) if breaks else None,
        skipped_steps=sorted((set(bad_gn) - set(nan_loss)) | counted),
        scale_trajectory=_scale_changes((r.step, r.scale) for r in rows if r.scale is not None),
        columns=dict(fh.columns),
        notes=list(fh.notes) + [n for n in [keeper.note(fh.source)] if n],
        rows=rows,
    )
    _trend(h)
    return h


class _RunningCounts:
    """Where a running count another tool logs (skipped steps, overflows) went up, row by row."""

    def __init__(self) -> None:
        self.prev: dict[str, float] = {}

    def went_up(self, role: str, row: dict[str, Any]) -> bool:
        v = as_number(row.get(role))
        if v is None or not math.isfinite(v):
            return False
        up = v > self.prev.get(role, 0.0)
        self.prev[role] = v
        return up


def unreadable_history(found: Any, h: History | None) -> list[Problem]:
    """A history file that is there but could not be read is named, never silently absent:
    ``history: FILE unreadable: WHY``, a ``note``: it is no problem of the run by itself (the
    verdict is made on what was read, and the checkpoint's own state is still judged)."""
    files = list(found.history_errors) + [tuple(u) for u in (h.unreadable if h else [])]
    return [
        Problem(
            "unreadable_history",
            f"history: {Path(name).name} unreadable: {why}",
            severity="note",
            file=str(name),
        )
        for name, why in files
    ]
