"""Part 2 of a diagnosis: what the run recorded before the checkpoint.

* ampctl run folders (through :mod:`ampctl.runlog`): metrics and events up to the checkpoint's
  step, the scaler's own per-update record, and which branch was read (a run resumed from an
  earlier checkpoint keeps the discarded history in ``branches/NNN-stepS/``);
* other tools' histories (:class:`~.readers.base.ForeignHistory`: HF ``log_history``, Lightning
  CSV / TensorBoard): loss, grad norm and learning rate per logged step.

Both give the same dict: the first overflow, the first non-finite loss (for HF, a logged 0.0
next to a non-finite grad norm is a filtered NaN), the first non-finite grad norm, the step it
broke, the loss and grad-norm trend before it. A grad norm "explodes" when its peak over the last
``TREND_ROWS`` rows before the break is ``EXPLOSION_FACTOR`` (10) times the median of the rows
before them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ampctl.runlog import RunLayout, RunRecord, as_number, list_branches, read_json

from .common import EXPLOSION_FACTOR, TREND_ROWS, finite, problem
from .readers.base import ForeignHistory

__all__ = [
    "overflow_bursts",
    "event_bursts",
    "grad_norm_trend",
    "run_history",
    "foreign_history",
    "branch_of",
    "history_problems",
    "unreadable_history",
]


# ---------------------------------------------------------------------------- pure helpers
def overflow_bursts(rows: Iterable[tuple[int, float, bool]]) -> list[dict[str, Any]]:
    """Runs of consecutive skipped steps in scaler history rows ``(step, scale used, skipped)``.

    ``after_growth``: the burst's first step used a larger scale than the step before it (the
    scaler had just grown). Pure function."""
    rows = list(rows)
    bursts: list[dict[str, Any]] = []
    i = 0
    while i < len(rows):
        if not rows[i][2]:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and rows[j + 1][2]:
            j += 1
        bursts.append(
            {
                "start": rows[i][0],
                "end": rows[j][0],
                "length": j - i + 1,
                "scale": rows[i][1],
                "after_growth": i > 0 and rows[i][1] > rows[i - 1][1],
            }
        )
        i = j + 1
    return bursts


def event_bursts(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of consecutive steps with an overflow event (a run without the scaler's per-update
    record, e.g. no checkpoint): ``scale`` is the scale the first event reports after its
    backoff; ``after_growth`` is unknown there, so False. Pure function."""
    steps = sorted(
        {int(s): e for e in events if (s := as_number(e.get("step"))) is not None}.items()
    )
    bursts: list[dict[str, Any]] = []
    for step, e in steps:
        if bursts and bursts[-1]["end"] == step - 1:
            bursts[-1]["end"] = step
            bursts[-1]["length"] += 1
            continue
        scale = as_number(e.get("scale"))
        bursts.append(
            {"start": step, "end": step, "length": 1, "scale": scale, "after_growth": False}
        )
    return bursts


def grad_norm_trend(
    norms: list[tuple[int, float]], window: int = TREND_ROWS, factor: float = EXPLOSION_FACTOR
) -> dict[str, Any] | None:
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
    return {
        "baseline": baseline,
        "peak": peak,
        "peak_step": peak_step,
        "ratio": ratio,
        "exploded": ratio >= factor,
    }


def loss_trend(losses: list[tuple[int, float]]) -> dict[str, Any] | None:
    """First, lowest and last finite loss before the break. Pure."""
    vals = [(s, v) for s, v in losses if finite(v)]
    if not vals:
        return None
    low = min(vals, key=lambda r: r[1])
    return {
        "first": vals[0][1],
        "first_step": vals[0][0],
        "min": low[1],
        "min_step": low[0],
        "last": vals[-1][1],
        "last_step": vals[-1][0],
    }


def _scale_changes(points: Iterable[tuple[int, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for step, scale in points:
        if not out or out[-1][1] != scale:
            out.append([step, scale])
    return out


def _empty(source: str) -> dict[str, Any]:
    return {
        "source": source,
        "run_dir": None,
        "metrics_rows": 0,
        "events": {},
        "first_overflow_step": None,
        "first_overflow_source": None,
        "first_nan_loss_step": None,
        "nan_filtered_steps": [],
        "first_nonfinite_grad_norm_step": None,
        "forward_overflows": 0,
        "scale_trajectory": [],
        "bursts": [],
        "scaler_records": 0,
        "break_step": None,
        "before_break": [],
        "loss": None,
        "grad_norm": None,
        "promotions": [],
        "fallbacks": [],
        "aborted": None,
        "notes": [],
        "unreadable": [],
    }


def _step(r: dict[str, Any]) -> int | None:
    v = as_number(r.get("step"))
    return int(v) if v is not None and math.isfinite(v) else None


# ---------------------------------------------------------------------------- branches
def branch_of(ckpt: Path, run_dir: Path | None) -> dict[str, Any] | None:
    """Which line of an ampctl run folder a checkpoint belongs to (``None`` outside one)."""
    if run_dir is None:
        return None
    root = run_dir
    archived = run_dir.parent.name == RunLayout.BRANCHES
    if archived:
        root = run_dir.parent.parent
    branches = list_branches(RunLayout(root))
    names = [f"{RunLayout.BRANCHES}/{b.name}" for b in branches]
    parent = read_json(RunLayout(root).parent)
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
        else:
            text = "main line (never resumed from an earlier checkpoint)"
    if isinstance(parent, dict) and parent.get("run"):
        text += f"; forked from {parent.get('checkpoint')} (step {parent.get('step')})"
    return {
        "line": line,
        "text": text,
        "forked_at_step": fork,
        "branches": names,
        "parent": parent if isinstance(parent, dict) else None,
    }


def _records(
    run_dir: Path, step_limit: int | None, branch: dict[str, Any] | None
) -> tuple[list, list, list[str]]:
    """Metrics rows and events up to ``step_limit``; an archived branch is preceded by the main
    line's rows up to the fork."""
    rec = RunRecord.read(run_dir, upto_step=step_limit)
    metrics, events = list(rec.metrics.rows), list(rec.events.rows)
    records = [rec]
    if branch is not None and branch["line"] == "archived" and branch["forked_at_step"] is not None:
        main = RunRecord.read(run_dir.parent.parent, upto_step=branch["forked_at_step"])
        metrics = main.metrics.rows + metrics
        events = [e for e in main.events.rows if e.get("kind") != "branch"] + events
        records.append(main)
    files = [
        (rows, path)
        for r in records
        for rows, path in ((r.metrics, r.layout.metrics), (r.events, r.layout.events))
    ]
    # lines skipped are a note; a whole file that could not be read is a finding
    notes = [n for rows, path in files if rows.error is None and (n := rows.note(path))]
    unreadable = [(str(path), rows.error) for rows, path in files if rows.error is not None]
    return metrics, events, notes, unreadable


# ---------------------------------------------------------------------------- ampctl runs
def run_history(
    run_dir: Path,
    step_limit: int | None,
    scaler_rows: list[tuple[int, float, bool]],
    scaler: dict[str, Any] | None,
    branch: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """What an ampctl run folder's metrics, events and the scaler's record say (rows up to the
    checkpoint's step; all of them when ``step_limit`` is None: a folder without checkpoints).
    None when the folder has neither metrics nor events."""
    lay = RunLayout(run_dir)
    if not any(f.exists() or f.is_symlink() for f in (lay.metrics, lay.events)):
        return None
    metrics, events, notes, unreadable = _records(run_dir, step_limit, branch)
    metrics = [r for r in metrics if _step(r) is not None]
    events = [e for e in events if _step(e) is not None]
    counts: dict[str, int] = {}
    for e in events:
        counts[str(e.get("kind"))] = counts.get(str(e.get("kind")), 0) + 1
    overflow_events = [e for e in events if e.get("kind") == "overflow"]

    first_overflow, source = None, None
    candidates = []
    if overflow_events:
        candidates.append((min(_step(e) for e in overflow_events), "events"))
    if scaler_rows and scaler_rows[0][0] == 1 and any(k for _, _, k in scaler_rows):
        candidates.append((next(s for s, _, k in scaler_rows if k), "scaler"))
    if candidates:
        first_overflow, source = min(candidates)
    else:
        skipped = [_step(r) for r in metrics if (as_number(r.get("skipped")) or 0) > 0]
        if skipped:
            first_overflow, source = skipped[0], "metrics"

    nan_steps = [
        _step(r)
        for r in metrics
        if (lv := as_number(r.get("loss"))) is not None and not math.isfinite(lv)
    ]
    nan_steps += [_step(e) for e in overflow_events if e.get("overflow") == "forward"]
    first_nan = min(nan_steps) if nan_steps else None
    gn_bad = [
        _step(r)
        for r in metrics
        if (g := as_number(r.get("grad_norm"))) is not None and not math.isfinite(g)
    ]

    first_hist = scaler_rows[0][0] if scaler_rows else None
    pts = [(_step(r), as_number(r.get("scale"))) for r in metrics]
    pts = [(s, v) for s, v in pts if v is not None and (first_hist is None or s < first_hist)]
    pts += [(s, v) for s, v, _ in scaler_rows]
    if (
        step_limit is not None
        and scaler is not None
        and scaler.get("enabled")
        and scaler.get("scale") is not None
    ):
        pts.append((step_limit, float(scaler["scale"])))

    out = _empty("run folder")
    out.update(
        run_dir=str(run_dir),
        metrics_rows=len(metrics),
        events=counts,
        first_overflow_step=first_overflow,
        first_overflow_source=source,
        first_nan_loss_step=first_nan,
        first_nonfinite_grad_norm_step=min(gn_bad) if gn_bad else None,
        forward_overflows=sum(1 for e in overflow_events if e.get("overflow") == "forward"),
        scale_trajectory=_scale_changes(pts),
        bursts=overflow_bursts(scaler_rows) if scaler_rows else event_bursts(overflow_events),
        scaler_records=len(scaler_rows),
        break_step=first_nan,
        promotions=[
            str(e["module"]) for e in events if e.get("kind") == "promotion" and e.get("module")
        ],
        fallbacks=[
            {"step": _step(e), "from": e.get("from_precision"), "to": e.get("to_precision")}
            for e in events
            if e.get("kind") == "fallback"
        ],
        aborted=next(
            (
                {"step": _step(e), "message": str(e.get("message", ""))}
                for e in events
                if e.get("kind") == "abort"
            ),
            None,
        ),
        notes=notes,
        unreadable=unreadable,
    )
    _trend(out, metrics, first_nan)
    return out


def _trend(out: dict[str, Any], rows: list[dict[str, Any]], break_step: int | None) -> None:
    before = [r for r in rows if break_step is None or _step(r) < break_step]
    keys = ("step", "loss", "scale", "skipped", "grad_norm", "grad_amax", "learning_rate")
    out["before_break"] = [{k: r.get(k) for k in keys} for r in before[-TREND_ROWS:]]
    norms = [(_step(r), g) for r in before if (g := as_number(r.get("grad_norm"))) is not None]
    out["grad_norm"] = grad_norm_trend(norms)
    losses = [(_step(r), v) for r in before if (v := as_number(r.get("loss"))) is not None]
    out["loss"] = loss_trend(losses)


# ---------------------------------------------------------------------------- other tools
def foreign_history(h: ForeignHistory, step_limit: int | None) -> dict[str, Any]:
    """The same dict from another tool's log (HF ``log_history``, Lightning CSV/TensorBoard)."""
    rows = [r for r in h.rows if step_limit is None or r["step"] <= step_limit]
    filtered: list[int] = []
    prev: float | None = None
    for r in rows:
        loss = as_number(r.get("loss"))
        if h.nan_filter and loss == 0.0:
            gn = as_number(r.get("grad_norm"))
            if (gn is not None and not math.isfinite(gn)) or (prev is not None and prev > 0):
                filtered.append(r["step"])
        if loss is not None and math.isfinite(loss) and loss != 0.0:
            prev = loss
    nan_loss = [
        r["step"]
        for r in rows
        if (v := as_number(r.get("loss"))) is not None and not math.isfinite(v)
    ]
    bad_gn = [
        r["step"]
        for r in rows
        if (g := as_number(r.get("grad_norm"))) is not None and not math.isfinite(g)
    ]
    first_nan = min(nan_loss + filtered) if nan_loss or filtered else None
    breaks = [s for s in (first_nan, min(bad_gn) if bad_gn else None) if s is not None]
    out = _empty(h.source)
    out.update(
        metrics_rows=len(rows),
        first_nan_loss_step=first_nan,
        nan_filtered_steps=filtered,
        first_nonfinite_grad_norm_step=min(bad_gn) if bad_gn else None,
        break_step=min(breaks) if breaks else None,
        columns=dict(h.columns),
        notes=list(h.notes),
    )
    clean = [dict(r, loss=math.nan) if r["step"] in filtered else r for r in rows]
    _trend(out, clean, out["break_step"])
    return out


# ---------------------------------------------------------------------------- problems
def history_problems(h: dict[str, Any], scaler: dict[str, Any] | None) -> list[dict[str, Any]]:
    problems = []
    if h["first_nan_loss_step"] is not None:
        step = h["first_nan_loss_step"]
        if h["nan_filtered_steps"]:
            msg = (
                f"the loss became non-finite at step {step} (logged as 0.0 by the Trainer's NaN "
                f"filter at {len(h['nan_filtered_steps'])} step(s))"
            )
        elif h["source"] == "run folder":
            msg = f"the loss became non-finite (forward overflow) at step {step}"
        else:
            msg = f"the loss became non-finite at step {step}"
        if h["promotions"]:
            msg += f"; the guard moved {', '.join(h['promotions'])} to fp32"
        problems.append(problem("nan_loss", msg, step=step))
    ab = h.get("aborted")
    if ab is not None:
        problems.append(
            problem(
                "run_aborted",
                f"the guard aborted the run at step {ab['step']}: {ab['message']}",
                step=ab["step"],
            )
        )
    gstep = h["first_nonfinite_grad_norm_step"]
    if gstep is not None and h["source"] != "run folder":
        problems.append(
            problem(
                "nonfinite_grad_norm",
                f"the grad norm is non-finite from step {gstep}",
                step=gstep,
            )
        )
    gn = h["grad_norm"]
    if gn is not None and gn["exploded"]:
        problems.append(
            problem(
                "grad_norm_explosion",
                f"grad norm rose to {gn['peak']:.4g} at step {gn['peak_step']}, "
                f"{gn['ratio']:.3g}x its earlier median {gn['baseline']:.4g}",
                step=gn["peak_step"],
            )
        )
    # Growth probing skips a step each time the scale grows into overflow (hysteresis steps
    # with hysteresis); a problem when it recurs and wastes >= 1% of the recorded steps.
    after = [b for b in h["bursts"] if b["after_growth"]]
    wasted = sum(b["length"] for b in after) / max(h["scaler_records"], 1)
    if len(after) >= 2 and wasted >= 0.01:
        gi = scaler["growth_interval"] if scaler else None
        steps = ", ".join(str(b["start"]) for b in after[:5])
        problems.append(
            problem(
                "overflow_after_growth",
                f"{len(after)} overflow burst(s) right after the scale grew (steps {steps}), "
                f"{wasted:.1%} of the recorded steps skipped"
                + (f", growth_interval {gi}" if gi else ""),
                severity="warning",
            )
        )
    return problems


def unreadable_history(found: Any, h: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A history file that is there but could not be read is a finding, never silently absent:
    ``history: FILE unreadable: WHY`` (a warning: the checkpoint's own state is still judged)."""
    files = list(found.history_errors) + [tuple(u) for u in (h or {}).get("unreadable", [])]
    return [
        problem(
            "unreadable_history",
            f"history: {Path(name).name} unreadable: {why}",
            severity="warning",
            file=str(name),
        )
        for name, why in files
    ]
