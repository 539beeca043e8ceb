"""Part 4 of a diagnosis: the verdict on the whole run, its cause, and where to resume.

The verdict uses everything the earlier stages found: the checkpoint's state, the run's course
(:mod:`.course`: the history, the other checkpoints of the run, the scaler's record), the guard's
events and the replay. It is

* ``broken`` (exit code 1) when there is a problem, listed cause first (:data:`ORDER`): an lr
  divergence before the non-finite steps it led to, a broken state, the module whose forward or
  backward leaves the precision's range, a collapsed scale with what made it collapse (an
  overflow storm, or a bad floor or backoff), an overflow storm still going, ...;
* ``recovered`` (exit code 0) when an intervention restored the course -- a rollback, a
  promotion, a fallback, a demotion, a rerun, a divergence the guard acted on -- or the run left
  its course and came back (a storm that ended), with those events named;
* ``healthy`` otherwise. Isolated skipped steps whose scale recovered while the loss kept its
  course are how dynamic loss scaling works, and skipped spikes on a clean course how the spike
  rule works: no problem, no advice, each listed as a note (docs/diagnose.md, "Healthy,
  recovered, broken").

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
    ScalerState,
    Verdict,
)

__all__ = [
    "ORDER",
    "STATE_KINDS",
    "Judgement",
    "LrChange",
    "judge",
    "history_problems",
    "lr_change",
]

#: Problem kinds, cause first: the verdict's kind is the first problem's.
ORDER = (
    ("refused_file", "unreadable_file"),
    ("lr_divergence",),
    ("unchecked_update", "poisoned_checkpoint", "fp16_weights_under_scaler"),
    ("nonfinite_weights", "nonfinite_master", "extreme_weights", "extreme_master"),
    ("nonfinite_optimizer_state", "extreme_optimizer_state"),
    ("forward_overflow", "forward_nonfinite_fp32", "nonfinite_loss"),
    ("backward_nonfinite", "backward_nonfinite_fp32"),
    ("fp8_nonfinite",),
    ("bad_scale", "scale_collapsed", "scale_at_floor", "scale_at_ceiling"),
    ("overflow_storm",),
    ("nan_loss",),
    ("run_aborted",),
    ("grad_norm_explosion",),
    ("scheduler_on_skipped_steps",),
    ("gradient_underflow",),
)
_RANK = {k: i for i, kinds in enumerate(ORDER) for k in kinds}

#: Share of the recorded steps that growth probing may waste before it is a finding.
GROWTH_WASTE = 0.10
#: Guard events that make a run "recovered" once it went on clean after them.
_RECOVERIES = ("rollback", "fallback", "promotion", "demotion", "spike", "rerun", "divergence")
#: (a skipped spike alone makes no run recovered: see :func:`_intervened`)


@dataclass
class Judgement:
    """The verdict and what the recommendations need from it."""

    verdict: Verdict
    problems: list[Problem]
    checkpoints: list[CheckpointHealth]
    resume: str | None
    resume_why: str | None
    course: Course
    #: the lr to use (worked out from the history) when the lr is the cause
    lr: LrChange | None = None
    #: the cause of a collapsed scale: "overflow" | "floor" | "backoff" | None
    collapse: str | None = None
    storm_params: list[str] = field(default_factory=list)
    #: non-finite state that no update explains (:func:`_unexplained`): no change but a resume
    unexplained: bool = False


# ---------------------------------------------------------------------------- lr
@dataclass(frozen=True)
class LrChange:
    """The learning rate to use, worked out from the run's history (no fixed factor): ``lr``
    the recommended ``optim.lr`` (None: none can be worked out), ``why`` in words, ``ladder``
    the candidates a probe tries (highest first, ``lr`` first), ``known`` whether the run went
    on well at ``lr`` (else it is only below the lr the trouble began at)."""

    lr: float | None
    why: str
    ladder: list[float] = field(default_factory=list)
    known: bool = False


def lr_change(course: Course, h: History | None, lr: float | None) -> LrChange | None:
    """The learning rate the run should use, from its history:

    * the guard's divergence rule rolled back and cut the lr (an ``lr_factor``): the highest lr
      the run went on clean at after it (the rows after the rollback), else the cut lr;
    * else :func:`ampctl.protect.advice.lr_advice` on the logged rows: the lr at which the loss
      last fell (after the trouble too: a decay that brought the run back shows the lr that
      works), with a warmup below the lr of the first bad row (the lr of the row before it, or
      of the first update);
    * no lr logged: the configured one is the only one known to be too high (an unchecked
      ladder below it, for the probe).

    ``lr``: the run's configured lr."""
    from ampctl.protect.advice import fmt_lr, lr_advice

    rows = h.rows if h is not None else []
    ev = next((e for e in _events(h, "divergence") if _number(e.data.get("lr_factor"))), None)
    if ev is not None:
        f = float(ev.data["lr_factor"])
        f = f if f < 1 else 1 / f
        why = f"the guard's divergence rule rolled back at step {_at(ev)} and cut the lr {1 / f:g}x"
        after = [r.learning_rate for r in rows if r.step > _at(ev) and _number(r.learning_rate)]
        if after and _clean_end(course) and lr and lr > 1.05 * max(after):
            top = max(after)
            return LrChange(top, f"{why}; the run went on clean at lr {fmt_lr(top)}", [top], True)
        if lr:
            return LrChange(lr * f, why, [lr * f * f**k for k in range(3)], False)
        return LrChange(None, why)
    d = course.departure
    trouble = course.first_bad_step
    if d is not None:
        trouble = d.step if trouble is None else min(trouble, d.step)
    stop = next(iter(_events(h, "divergence")), None)
    if trouble is None and stop is not None:
        since = stop.data.get("since")
        trouble = int(since) + 1 if _number(since) else stop.step
    start = d.first_loss if d is not None else None
    adv = lr_advice([(r.step, r.loss, r.learning_rate) for r in rows], trouble=trouble, start=start)
    if adv is not None and adv.ladder:
        return LrChange(adv.lr, adv.why, list(adv.ladder), adv.known)
    if adv is not None:
        top = adv.bad_lr
    elif lr:
        top = lr
    else:
        return None
    # nothing below the bad lr is known: an unchecked ladder below it (halvings), for a probe
    why = (adv.why if adv is not None else f"the run diverged at its lr {fmt_lr(top)}") + (
        ": lower it"
    )
    return LrChange(top / 2, why, [top / 2**k for k in range(1, 5)], False)


def _at(e: GuardEvent) -> int:
    """The step a divergence event was found at (a rollback's event is written at the step it
    restored, its ``from_step`` is where the rule fired)."""
    at = e.data.get("from_step", e.step)
    return int(at) if _number(at) else e.step


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
#: Problem kinds of a checkpoint's own non-finite state (what :func:`_unexplained` accepts).
_NONFINITE_STATE = {"nonfinite_weights", "nonfinite_optimizer_state", "nonfinite_master"}


def _unexplained(problems: list[Problem], course: Course, h: History | None, scaled: bool) -> bool:
    """Non-finite weights or optimizer state that no update explains: the loss scaler checked
    every step's gradients (a non-finite one is skipped), and the logged course up to the
    checkpoint is clean (no skipped step, no departure, no outlier loss, no grad-norm
    explosion). Then neither the lr nor the precision is the cause, and the state's problem says
    so: resume from a healthy checkpoint unchanged (the probe checks that it holds)."""
    kinds = {p.kind for p in problems}
    if not kinds & _NONFINITE_STATE or kinds - _NONFINITE_STATE or not scaled:
        return False
    if h is None or not h.rows:
        return False
    if course.episodes or course.departure is not None:
        return False
    gn = h.grad_norm
    norm = (
        f", grad norm {gn.peak:.4g} at its highest = {gn.ratio:.3g}x its earlier median"
        if gn is not None
        else ""
    )
    p = next(p for p in problems if p.kind in _NONFINITE_STATE)
    p.message += (
        f"; the loss and the gradients were normal up to step {course.last_step} (no skipped "
        f"step, no rise of the loss{norm}) and the loss scaler checked every step's gradients, "
        "so no update put it there: not the lr nor the precision, but a fault outside the "
        "training arithmetic (memory, storage, or code that writes into the weights)"
    )
    return True


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
#: A checkpoint whose largest weight is this many times the run's earliest checkpoint's has
#: weights that exploded (finite, but orders of magnitude off): the trouble began before it.
WEIGHT_GROWTH = 100.0


def weights_trouble(facts: list[CheckpointFacts]) -> int | None:
    """The first step of trouble the checkpoints' weights show: the step after the last
    checkpoint before the first whose largest |w| is :data:`WEIGHT_GROWTH` times the earliest
    checkpoint's (its weights exploded; the loss there may be huge yet finite). None: none did.
    Reads the checkpoints' own figures only (no history needed)."""
    known = sorted(
        (c for c in facts if c.step is not None and c.weight_amax is not None),
        key=lambda c: c.step,
    )
    known = [c for c in known if math.isfinite(c.weight_amax)]
    if len(known) < 2 or not known[0].weight_amax > 0:
        return None
    base = known[0].weight_amax
    for before, c in zip(known, known[1:], strict=False):
        if c.weight_amax >= WEIGHT_GROWTH * base:
            return before.step + 1
    return None


def _blown_weights(facts: list[CheckpointFacts], blown: int) -> Problem:
    known = sorted(
        (c for c in facts if c.step is not None and c.weight_amax is not None),
        key=lambda c: c.step,
    )
    first, top = known[0], max(known, key=lambda c: c.weight_amax)
    return Problem(
        "extreme_weights",
        f"the largest weight grew from {first.weight_amax:.4g} (step {first.step}) to "
        f"{top.weight_amax:.4g} (step {top.step}), {top.weight_amax / first.weight_amax:.3g}x: "
        f"the weights exploded after step {blown - 1} (finite, but the updates ran away)",
        step=blown,
    )


def _earliest(*steps: int | None) -> int | None:
    known = [s for s in steps if s is not None]
    return min(known) if known else None


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
    unexplained = _unexplained(problems, course, h, scaled)
    if not scaled:
        for p in problems:
            if p.kind in ("nonfinite_weights", "nonfinite_master"):
                p.message += (
                    "; nothing checked the gradients before the optimizer applied them (no loss "
                    "scaler): one non-finite step is enough"
                )
    # the checkpoints' weights grown by orders of magnitude: without a logged loss they are the
    # course (the growth is the problem); with one the history judges the run (a fault the guard
    # cured by a promotion is no false alarm), but the resume point still comes before the growth
    # unless the run came back from it
    blown = weights_trouble(facts)
    logged = h is not None and bool(h.rows)
    own_blown = blown is not None and own is not None and own.step is not None and own.step >= blown
    if own_blown and not logged and not problems:  # the growth is the only sign: the problem
        problems.append(_blown_weights(facts, blown))
    if logged and not problems and _clean_end(course):
        blown = None
    problems = _ordered(problems)
    first_bad = _earliest(course.first_bad_step, blown)
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
    elif _intervened(events, h):
        status, kind, cause = "recovered", None, None
        summary = (
            "recovered: " + ", ".join(events) + (", clean since" if _clean_end(course) else "")
        )
    else:  # isolated skipped steps and skipped spikes on a clean course: how protection works
        status, kind, cause = "healthy", None, None
        summary = "healthy" + _healthy_note(course, h)
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
        unexplained=unexplained,
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


def _intervened(events: list[str], h: History | None) -> bool:
    """Whether the story holds more than skipped spikes: an intervention (a rollback, a
    promotion, a fallback, a demotion, a rerun, a divergence the guard acted on) or an episode
    that left the course. Skipped spikes alone, on a clean course, are a healthy run's notes."""
    spikes = _spikes(h)
    return any(e != spikes for e in events)


def _healthy_note(course: Course, h: History | None = None) -> str:
    """The notes of a healthy run: every isolated skipped step and every skipped spike."""
    notes = []
    skips = [e for e in course.episodes if e.kind in ("isolated", "calibration")]
    if skips:
        n = sum(e.end - e.start + 1 for e in skips)
        steps = ", ".join(str(e.start) for e in skips[:6]) + (" ..." if len(skips) > 6 else "")
        notes.append(
            f"{n} isolated skipped step{'s' if n > 1 else ''} ({steps}), each followed by clean "
            f"steps with the loss on course (fewer than {STORM_MIN} in a row: the scaler backing "
            "off, as dynamic loss scaling does)"
        )
    spikes = _spikes(h)
    if spikes is not None:
        notes.append(
            f"{spikes}, the loss on course after each (the spike rule skipping an outlier step, "
            "as it should: no intervention was needed)"
        )
    return (": " + "; ".join(notes)) if notes else ""
