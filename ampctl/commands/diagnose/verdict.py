"""Part 4 of a diagnosis: the verdict on the whole run, its cause, and where to resume.

The verdict uses everything the earlier stages found: the checkpoint's state, the run's course
(:mod:`.course`: the history, the other checkpoints of the run, the scaler's record), the guard's
events and the replay. It is

* ``broken`` (exit code 1) when there is a problem, listed cause first (:data:`ORDER`): an lr
  divergence before the non-finite steps it led to, a broken state, the module whose forward or
  backward leaves the precision's range, a collapsed scale with what made it collapse (an
  overflow storm, or a bad floor or backoff), an overflow storm still going, ...;
* ``recovered`` (exit code 0) when the run left its course and came back -- a rollback, a
  promotion, a fallback, skipped spikes, a storm that ended, a transient fault the rerun did not
  reproduce -- with those events named;
* ``healthy`` otherwise. Isolated skipped steps whose scale recovered while the loss kept its
  course are how dynamic loss scaling works: no problem, no advice.

The resume point is the newest checkpoint with a healthy state written before the first sign of
trouble (:attr:`~.course.Course.first_bad_step`), never one written after it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from .common import STATE_KINDS
from .course import STORM_MIN, CheckpointFacts, Course, Departure, diverged, run_course
from .stages import (
    CheckpointHealth,
    Episode,
    GuardEvent,
    History,
    Problem,
    Replay,
    Row,
    ScalerState,
    Verdict,
)

__all__ = ["ORDER", "STATE_KINDS", "Judgement", "judge", "history_problems", "lr_change"]

#: Problem kinds, cause first: the verdict's kind is the first problem's.
ORDER = (
    ("refused_file", "unreadable_file"),
    ("lr_divergence",),
    ("nonfinite_weights", "nonfinite_master", "extreme_weights", "extreme_master"),
    ("nonfinite_optimizer_state", "extreme_optimizer_state"),
    ("forward_overflow", "forward_nonfinite_fp32", "nonfinite_loss"),
    ("backward_nonfinite", "backward_nonfinite_fp32"),
    ("fp8_nonfinite",),
    ("bad_scale", "scale_collapsed", "scale_at_floor"),
    ("overflow_storm",),
    ("nan_loss",),
    ("run_aborted",),
    ("grad_norm_explosion",),
    ("gradient_underflow",),
)
_RANK = {k: i for i, kinds in enumerate(ORDER) for k in kinds}

#: Share of the recorded steps that growth probing may waste before it is a finding.
GROWTH_WASTE = 0.10
#: Guard events that make a run "recovered" once it went on clean after them.
_RECOVERIES = ("rollback", "fallback", "promotion", "demotion", "spike", "rerun", "divergence")


@dataclass
class Judgement:
    """The verdict and what the recommendations need from it."""

    verdict: Verdict
    problems: list[Problem]
    checkpoints: list[CheckpointHealth]
    resume: str | None
    resume_why: str | None
    course: Course
    #: (divide the lr by, why) when the lr is the cause
    lr: tuple[float, str] | None = None
    #: the cause of a collapsed scale: "overflow" | "floor" | "backoff" | None
    collapse: str | None = None
    storm_params: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- lr
def lr_change(course: Course, h: History | None, lr: float | None) -> tuple[float, str] | None:
    """How much to lower the learning rate, from the history (a factor, and why):

    * the guard's divergence rule rolled back and cut the lr (an ``lr_factor``): down to the
      highest lr the run went on clean at after it (the rows after the rollback), else that
      factor;
    * the guard's divergence rule stopped a run whose logged lr had risen since its lowest loss
      (a schedule, a change): back to the lr of the lowest loss; else 2x;
    * the loss rose from the first updates, before it ever fell: 10x (and a warmup), in a
      warmup too (no lr is known to have worked: its lowest row is where it started);
    * the loss fell while a warmup raised the lr and rose once the lr grew past the lr of its
      lowest row (the last lr that worked): down to that lr, at least 2x;
    * it fell first and rose later at the same lr: 2x (and clipping).

    ``lr``: the run's configured lr (the factor divides it)."""
    rows = h.rows if h is not None else []
    ev = next((e for e in _events(h, "divergence") if _number(e.data.get("lr_factor"))), None)
    if ev is not None:
        f = float(ev.data["lr_factor"])
        f = 1 / f if f < 1 else f
        why = f"the guard's divergence rule rolled back at step {_at(ev)} and cut it {f:g}x"
        after = [r.learning_rate for r in rows if r.step > _at(ev) and _number(r.learning_rate)]
        if after and _clean_end(course) and lr and lr > 1.05 * max(after):
            return lr / max(after), f"{why}; the run went on clean at lr {max(after):.3g}"
        return f, why
    d = course.departure
    if d is None:
        stop = next(iter(_events(h, "divergence")), None)
        if stop is None:
            return None
        why = f"the guard's divergence rule stopped the run at step {stop.step}"
        rose = _lr_rise(rows, stop)
        if rose is not None:
            low, high = rose
            f = max(2.0, max(lr or 0.0, high.learning_rate) / low.learning_rate)
            return f, (
                f"{why}, after the lr rose from {low.learning_rate:.3g} (step {low.step}, its "
                f"lowest loss {low.loss:.4g}) to {high.learning_rate:.3g} (step {high.step}): "
                f"back to {low.learning_rate:.3g}"
            )
        return 2.0, why
    if d.never_improved:  # no lr is known to have worked: far too high, even in a warmup
        grew = f", {_lr_grew(d)}" if d.lr_rose else ""
        return (
            10.0,
            f"the loss rose from the first updates, before it ever fell{grew}: far too high",
        )
    if d.lr_rose:
        peak = max([lr or 0.0, d.lr_peak, *(r.learning_rate or 0.0 for r in rows)])
        f = max(2.0, peak / d.lr_at_min)
        return f, (
            f"the loss was at its lowest while the lr was at most {d.lr_at_min:.3g} and rose as "
            f"the lr grew past it (lr {d.lr_at_step:.3g} at step {d.step})"
        )
    return 2.0, "the loss fell for a while and then rose at the same learning rate"


def _at(e: GuardEvent) -> int:
    """The step a divergence event was found at (a rollback's event is written at the step it
    restored, its ``from_step`` is where the rule fired)."""
    at = e.data.get("from_step", e.step)
    return int(at) if _number(at) else e.step


def _lr_rise(rows: list[Row], stop: GuardEvent) -> tuple[Row, Row] | None:
    """The row of the lowest loss logged before the divergence the guard stopped at, and the
    row of the highest lr logged from it to the stop, when the lr rose more than 5% in between
    (None: it did not, or no lr is logged)."""
    upto = [r for r in rows if r.step <= stop.step and _number(r.learning_rate) and _fin(r.loss)]
    since = stop.data.get("since")
    before = [r for r in upto if not _number(since) or r.step <= since] or upto
    if not before:
        return None
    low = min(before, key=lambda r: r.loss)
    high = max((r for r in upto if r.step >= low.step), key=lambda r: r.learning_rate)
    return (low, high) if high.learning_rate > 1.05 * low.learning_rate else None


def _fin(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _lr_grew(d: Departure) -> str:
    return f"as the lr grew from {d.lr_at_min:.3g} to {d.lr_peak:.3g} (step {d.lr_peak_step})"


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _events(h: History | None, kind: str) -> list[GuardEvent]:
    return [e for e in (h.guard_events if h else []) if e.kind == kind]


# ---------------------------------------------------------------------------- history problems
def _storm_text(e: Episode, params: list[str]) -> str:
    named = f"; non-finite gradients in {', '.join(params[:3])}" if params else ""
    return f"{e.text}{named}"


def history_problems(
    h: History | None, course: Course, scaler: ScalerState | None
) -> list[Problem]:
    """The problems the run's course shows (the state's and the replay's come separately)."""
    problems: list[Problem] = []
    d = course.departure
    div_stop = next((e for e in _events(h, "divergence") if e.data.get("action") == "stop"), None)
    if diverged(course) and d is not None:
        nxt = next(
            (
                e
                for e in course.episodes
                if e.kind in ("storm", "nonfinite_loss") and e.start > d.step
            ),
            None,
        )
        start = " at the first updates, before it ever fell" if d.never_improved else ""
        if d.lr_rose:
            start += f", {_lr_grew(d)}"
        peak, at = d.peak, d.peak_step
        if nxt is not None:  # its peak before the non-finite steps (not a batch's loss after)
            tail = f", before the gradients went non-finite at step {nxt.start}"
            rows = [r for r in (h.rows if h else []) if d.step <= r.step < nxt.start]
            top = max((r for r in rows if _fin(r.loss)), key=lambda r: r.loss, default=None)
            if top is not None:
                peak, at = top.loss, top.step
        elif d.resolved_at is None:
            tail = ", and did not come back"
        else:
            tail = f", and was back at its level of step {d.min_step} only at step {d.resolved_at}"
            if d.lr_rose and d.lr_back is not None and 1.05 * d.lr_back < d.lr_peak:
                tail += f", the lr down to {d.lr_back:.3g}"
        problems.append(
            Problem(
                "lr_divergence",
                f"the loss rose from {d.min_loss:.4g} (step {d.min_step}) to {peak:.4g} (step "
                f"{at}){start}{tail}: the learning rate is too high",
                step=d.step,
            )
        )
    elif div_stop is not None:
        problems.append(
            Problem(
                "lr_divergence",
                f"the guard stopped the run at step {div_stop.step}: {div_stop.message}",
                step=div_stop.step,
            )
        )
    nf = course.unresolved("nonfinite_loss")
    if nf is not None:
        msg = (
            f"the loss became non-finite at step {nf.start} and stayed so to the end of the record"
        )
        if h is not None and h.nan_filtered_steps:
            msg += f" (logged as 0.0 by the Trainer's NaN filter at {len(h.nan_filtered_steps)} step(s))"
        problems.append(Problem("nan_loss", msg, step=nf.start))
    storm = course.unresolved("storm")
    if storm is not None:
        params = params_in(h, storm.start, storm.end)
        problems.append(
            Problem(
                "overflow_storm",
                f"overflow storm: {_storm_text(storm, params)}: the gradients were non-finite at "
                "every scale the scaler tried",
                step=storm.start,
                params=params or None,
            )
        )
    ab = h.aborted if h else None
    if ab is not None:
        problems.append(
            Problem(
                "run_aborted",
                f"the guard aborted the run at step {ab.step}: {ab.message}",
                step=ab.step,
            )
        )
    gn = h.grad_norm if h else None
    if gn is not None and gn.exploded and (h.break_step is not None or problems):
        problems.append(
            Problem(
                "grad_norm_explosion",
                f"grad norm rose to {gn.peak:.4g} at step {gn.peak_step}, "
                f"{gn.ratio:.3g}x its earlier median {gn.baseline:.4g}",
                step=gn.peak_step,
            )
        )
    problems += _growth_problems(h, scaler)
    return problems


def _growth_problems(h: History | None, scaler: ScalerState | None) -> list[Problem]:
    """Growth probing skips a step each time the scale grows into overflow (hysteresis steps
    with hysteresis): how dynamic scaling works, a finding only when it recurs and wastes
    :data:`GROWTH_WASTE` of the recorded steps."""
    if h is None:
        return []
    after = [b for b in h.bursts if b.after_growth]
    wasted = sum(b.length for b in after) / max(h.scaler_records, 1)
    if len(after) < 2 or wasted < GROWTH_WASTE:
        return []
    gi = scaler.growth_interval if scaler else None
    steps = ", ".join(str(b.start) for b in after[:5])
    return [
        Problem(
            "overflow_after_growth",
            f"{len(after)} overflow burst(s) right after the scale grew (steps {steps}), "
            f"{wasted:.1%} of the recorded steps skipped"
            + (f", growth_interval {gi}" if gi else ""),
            severity="warning",
        )
    ]


# ---------------------------------------------------------------------------- collapse
def _collapse_cause(
    scaler: ScalerState | None, course: Course, rep: Replay | None
) -> tuple[str | None, str]:
    """Why the scale collapsed: ``("overflow", text)`` -- a storm of skipped steps drove it
    down --, ``("floor", text)`` -- the floor is above S*, so even the lowest scale overflows --,
    ``("backoff", text)`` -- a backoff factor of 0."""
    if scaler is not None and scaler.backoff_factor == 0:
        return "backoff", "backoff_factor 0 sets the scale to 0 on the first overflow"
    g = rep.gradients if rep is not None and rep.ran else None
    if (
        scaler is not None
        and scaler.at_floor
        and g is not None
        and scaler.min_scale
        and g.ideal_scale < scaler.min_scale
    ):
        return "floor", (
            f"the floor min_scale {scaler.min_scale:g} is above S* = 65504 / max|g| = "
            f"{g.ideal_scale:.4g}: even the lowest scale allowed overflows"
        )
    storm = course.unresolved("storm") or next(iter(course.of("storm")[::-1]), None)
    every = "the gradients were non-finite at every scale the scaler tried"
    if storm is not None:
        return "overflow", f"persistent overflow: {storm.text}: {every}"
    return "overflow", (
        "persistent overflow: a scale falls only on an overflow, so it halved on step after "
        f"step: {every}"
    )


def _name_spikes(problems: list[Problem], course: Course, own: CheckpointFacts | None) -> None:
    """A broken optimizer state after a single outlier loss: that batch is the likely cause."""
    spikes = [
        e for e in course.of("loss_spike") if own is None or own.step is None or e.start <= own.step
    ]
    if not spikes:
        return
    e = spikes[-1]
    for p in problems:
        if p.kind in ("nonfinite_optimizer_state", "extreme_optimizer_state", "nonfinite_weights"):
            p.message += f"; {e.text} (one batch, {SPIKE_WORDS}): its gradient is the likely cause"
            break


SPIKE_WORDS = "an outlier: the loss was back on the next step"


# ---------------------------------------------------------------------------- ordering
def _ordered(problems: list[Problem]) -> list[Problem]:
    last = len(ORDER)
    return sorted(problems, key=lambda p: _RANK.get(p.kind, last + (p.severity == "warning")))


def _fold_collapse(problems: list[Problem], collapse: str, cause: str) -> list[Problem]:
    """A collapsed scale names its cause; a storm that explains it is not listed twice, nor is
    the underflow at the collapsed scale (the run resumes from before it)."""
    kinds = {p.kind for p in problems}
    out = []
    for p in problems:
        if p.kind == "overflow_storm" and kinds & {"scale_collapsed", "scale_at_floor"}:
            continue
        if p.kind == "gradient_underflow" and collapse == "overflow":
            continue
        if p.kind in ("scale_collapsed", "scale_at_floor"):
            p.message += f"; cause: {cause}"
        out.append(p)
    return out


# ---------------------------------------------------------------------------- checkpoints
def _checkpoints(
    facts: list[CheckpointFacts], first_bad: int | None
) -> tuple[list[CheckpointHealth], str | None]:
    out = []
    for c in facts:
        after = not c.bad and first_bad is not None and c.step is not None and c.step >= first_bad
        out.append(CheckpointHealth(c.path, c.step, not c.bad, list(c.bad), after or None))
    usable = [c for c in out if c.healthy and not c.after_trouble]
    usable.sort(key=lambda c: -1 if c.step is None else c.step, reverse=True)
    return out, usable[0].path if usable else None


def _resume_why(
    first_bad: int | None, resume: str | None, course: Course, own_bad: bool
) -> str | None:
    if first_bad is None:
        return None
    where = f"the first sign of trouble (step {first_bad})"
    if own_bad and course.first_bad_step is None:
        where = "this checkpoint, whose own state is broken"
    if resume is None:
        return f"no checkpoint with a healthy state was written before {where}"
    return f"the newest checkpoint with a healthy state written before {where}"


# ---------------------------------------------------------------------------- events
_EVENT_TEXTS = {  # the events told in one fixed sentence (their fields, and the step)
    "abort": "the guard aborted the run at step {step}",
    "fallback": "fell back {from_precision} -> {to_precision} at step {step}",
    "promotion": "the guard moved {module} to fp32 at step {step}",
    "promotion_undone": "moved {module} back from fp32 at step {step}: not the cause",
    "demotion": "demoted {module} fp8 -> bf16 at step {step}",
}


class _Fields(dict):
    def __missing__(self, key: str) -> None:  # a field the event lacks reads None
        return None


def _event_text(e: GuardEvent) -> str | None:
    d = e.data
    if e.kind == "rollback":
        return f"rolled back to {d.get('to_step', e.step)}"
    if e.kind in _EVENT_TEXTS:
        return _EVENT_TEXTS[e.kind].format_map(_Fields(d, step=e.step))
    if e.kind == "rerun":
        rank = f", rank {d['rank']}" if d.get("rank") is not None else ""
        if d.get("verdict") == "transient":
            return f"step {e.step} did not reproduce on rerun: hardware/transient{rank}"
        batch = f", batch {d['batch']}" if d.get("batch") is not None else ""
        return (
            f"step {e.step} reproduced on rerun ({d.get('cause', 'overflow')}): data or numerics "
            f"at step {e.step}{batch}{rank}"
        )
    if e.kind == "divergence":
        ratio, low = d.get("ratio"), d.get("min_loss")
        # the rule holds against the run's first loss too: then min_loss is that loss
        than = "the loss it started from" if "started from" in e.message else "its lowest"
        r = f" ({ratio:.3g}x {than}, {low:.4g})" if _number(ratio) and _number(low) else ""
        if d.get("action") == "rollback":
            f = d.get("lr_factor")
            lr = f", lr x{f:g}" if _number(f) else ""
            to = f" to {d['to_step']}" if _number(d.get("to_step")) else ""
            return f"the loss diverged at step {_at(e)}{r}: rolled back{to}{lr}"
        if d.get("action") == "warn":
            return f"the loss diverged at step {e.step}{r}: the guard warned"
        return f"the loss diverged at step {e.step}{r}: the guard stopped the run"
    return None


def _spikes(h: History | None) -> str | None:
    sp = _events(h, "spike")
    if not sp:
        return None
    steps = ", ".join(str(e.step) for e in sp[:6]) + (" ..." if len(sp) > 6 else "")
    return f"{len(sp)} spike{'s' if len(sp) > 1 else ''} skipped at {steps}"


def _story(h: History | None, course: Course) -> list[str]:
    """What the run went through, in step order, in words."""
    items: list[tuple[int, str]] = []
    acted = _recovery_steps(h)
    for e in course.episodes:
        if e.kind in ("storm", "nonfinite_loss", "departure", "loss_spike") or (
            e.kind == "isolated" and _acted_on(acted, e)
        ):
            items.append((e.start, _overflow_words(h, e)))
    sp = _spikes(h)
    if sp is not None:
        items.append((_events(h, "spike")[0].step, sp))
    for e in h.guard_events if h else []:
        if e.kind != "spike" and (t := _event_text(e)) is not None:
            items.append((_at(e) if e.kind in ("rollback", "divergence") else e.step, t))
    discarded = [e.step for e in _events(h, "overflow") if e.data.get("discarded")]
    if discarded:
        items.append((discarded[0], f"{len(discarded)} overflow(s) on steps a rollback discarded"))
    items.sort(key=lambda x: x[0])
    told: list[list] = []  # [text, times]
    for t in (t for _, t in items):  # a repeated event once, counted
        if told and told[-1][0] == t:
            told[-1][1] += 1
        else:
            told.append([t, 1])
    return [t if n == 1 else f"{t} ({n}x)" for t, n in told]


def _recovery_steps(h: History | None) -> list[int]:
    """The steps the guard acted at, sorted (a rollback also at the step its rule fired): looked
    up by bisection for each episode (linear in the events, not episodes x events)."""
    events = h.guard_events if h else []
    steps = [g.step for g in events if g.kind in _RECOVERIES]
    steps += [int(g.data.get("from_step", g.step)) for g in events if g.kind == "rollback"]
    return sorted(steps)


def _acted_on(h: History | list[int] | None, e: Episode) -> bool:
    """Whether the guard acted from the episode's first step to the step after its last (``h``:
    the history, or its :func:`_recovery_steps` when asked for many episodes)."""
    acted = h if isinstance(h, list) else _recovery_steps(h)
    k = bisect.bisect_left(acted, e.start)
    return k < len(acted) and acted[k] <= e.end + 1


def _overflow_words(h: History | None, e: Episode) -> str:
    if e.kind not in ("storm", "isolated"):
        return e.text
    n = e.end - e.start + 1
    span = f"{e.start}–{e.end}" if e.end != e.start else str(e.start)
    params = params_in(h, e.start, e.end)
    named = f" (non-finite gradients in {', '.join(params[:3])})" if params else ""
    return f"{n} overflow{'s' if n > 1 else ''} at {span}{named}"


# ---------------------------------------------------------------------------- the verdict
def judge(
    *,
    own: CheckpointFacts | None,
    siblings: list[CheckpointFacts],
    problems: list[Problem],
    h: History | None,
    scaler: ScalerState | None,
    rep: Replay | None,
    lr: float | None,
    scaled: bool = True,
) -> Judgement:
    """The verdict on the run (see the module docstring). ``problems``: the state's, the
    reader's and the replay's; the course's are added here."""
    facts = ([own] if own is not None else []) + siblings
    course = run_course(h, scaler, facts)
    problems = list(problems) + history_problems(h, course, scaler)
    kinds = {p.kind for p in problems}
    collapse = None
    if kinds & {"scale_collapsed", "scale_at_floor"}:
        collapse, cause = _collapse_cause(scaler, course, rep)
        problems = _fold_collapse(problems, collapse, cause)
    _name_spikes(problems, course, own)
    if not scaled:
        for p in problems:
            if p.kind in ("nonfinite_weights", "nonfinite_master"):
                p.message += (
                    "; nothing checked the gradients before the optimizer applied them (no loss "
                    "scaler): one non-finite step is enough"
                )
    problems = _ordered(problems)
    first_bad = course.first_bad_step
    bad_own = own is not None and own.bad and own.step is not None
    if bad_own and (first_bad is None or own.step < first_bad):
        first_bad = own.step  # its own state is broken: the trouble is no later than it
    checkpoints, resume = _checkpoints(facts, first_bad)
    events = _story(h, course)
    rolled = any(e.data.get("action") == "rollback" for e in _events(h, "divergence"))
    diverging = "lr_divergence" in {p.kind for p in problems} or rolled
    change = lr_change(course, h, lr) if diverging else None
    if problems:
        status, kind = "broken", problems[0].kind
        summary = f"broken: {problems[0].message}"
        cause = problems[0].message
    elif events:
        status, kind, cause = "recovered", None, None
        summary = (
            "recovered: " + ", ".join(events) + (", clean since" if _clean_end(course) else "")
        )
    else:
        status, kind, cause = "healthy", None, None
        summary = "healthy" + _healthy_note(course)
    verdict = Verdict(
        status=status,
        kind=kind,
        summary=summary,
        cause=cause,
        first_bad_step=first_bad,
        events=events,
        episodes=course.episodes,
    )
    return Judgement(
        verdict=verdict,
        problems=problems,
        checkpoints=checkpoints,
        resume=resume,
        resume_why=_resume_why(first_bad, resume, course, bool(own and own.bad)),
        course=course,
        lr=change,
        collapse=collapse,
        storm_params=params_in(h),
    )


def params_in(h: History | None, start: int | None = None, end: int | None = None) -> list[str]:
    """The parameters the overflow events of steps ``start``-``end`` (all: None) name on at
    least half as many events as the most named one, the most named first: what keeps
    overflowing, not what overflowed once on the way."""
    counts: dict[str, int] = {}
    for e in _events(h, "overflow"):
        if e.data.get("discarded") or (start is not None and not start <= e.step <= end):
            continue
        for p in dict.fromkeys(e.data.get("params") or []):
            if isinstance(p, str):
                counts[p] = counts.get(p, 0) + 1
    if not counts:
        return []
    top = max(counts.values())
    return sorted((p for p in counts if 2 * counts[p] >= top), key=lambda p: -counts[p])


def _clean_end(course: Course) -> bool:
    return all(e.resolved for e in course.episodes)


def _healthy_note(course: Course) -> str:
    skips = [e for e in course.episodes if e.kind in ("isolated", "calibration")]
    if not skips:
        return ""
    n = sum(e.end - e.start + 1 for e in skips)
    steps = ", ".join(str(e.start) for e in skips[:6]) + (" ..." if len(skips) > 6 else "")
    return (
        f": {n} isolated skipped step{'s' if n > 1 else ''} ({steps}), each followed by clean "
        f"steps with the loss on course (fewer than {STORM_MIN} in a row: the scaler backing "
        "off, as dynamic loss scaling does)"
    )
