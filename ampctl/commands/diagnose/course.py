"""The course of a run: where it left its healthy course, and whether it came back.

The verdict judges a checkpoint with its whole run: the logged steps (loss, grad norm, scale),
the steps the run skipped (the scaler's record, the guard's events, a non-finite grad norm in
another tool's log), and the other checkpoints of the run (their state, scale and the optimizer
updates they applied). From these, :func:`run_course` finds the *episodes*:

* ``calibration``: skipped steps at the very start that ended (a scaler finding its level);
* ``isolated``: a few skipped steps in a row (fewer than :data:`STORM_MIN`) followed by clean
  steps: the scale grew into overflow, backed off, and training went on. This is how dynamic
  loss scaling works, never a problem;
* ``storm``: :data:`STORM_MIN` or more skipped steps in a row (the scale fell 2^8-fold), or half
  that many still going at the end of the record;
* ``nonfinite_loss``: steps whose loss itself was not finite (forward overflow);
* ``departure``: the loss left its course: its *level* (the median of the last
  :data:`LEVEL_ROWS` logged losses: per-batch noise and a single outlier batch move it little)
  more than :data:`DEPARTURE` (25%) above the lowest level before it and, once the loss has
  fallen, more than :data:`NOISE_K` times the loss's per-row noise; confirmed by the next row
  (or by a non-finite step after it). It is resolved when the level comes back within
  :data:`RETURN` (5%) of that minimum for two rows in a row;
* ``loss_spike``: a single logged loss :data:`SPIKE_FACTOR` times its level, back on the next
  row (an outlier batch).

An episode still going at the end of the record is unresolved. The *first sign of trouble*
(:attr:`Course.first_bad_step`) is the first step whose weights are suspect, of the unresolved
trouble: for a departure, the row of the loss's lowest level before it rose (the updates after
it raised the loss, a slow creep too); for skipped steps, the first of them (a skipped step leaves the weights as they
were). A checkpoint is a resume point only when it was written before it. Pure functions.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from ampctl.amp import records as rec

from .stages import Episode, History, Row, ScalerState

__all__ = [
    "STORM_MIN",
    "DEPARTURE",
    "RETURN",
    "CheckpointFacts",
    "Departure",
    "Course",
    "run_course",
    "departure",
    "loss_spikes",
    "skip_runs",
]

#: Skipped steps in a row that make a storm (the scale fell 2^8-fold).
STORM_MIN = 8
#: The loss this much above its running minimum has left its course.
DEPARTURE = 0.25
#: ... and is back when within this much of that minimum again (two rows in a row).
RETURN = 0.05
#: ... and more than this many times the loss's per-row noise (its median distance from its
#: level, once the loss has fallen: before that, its first value is the bar)
NOISE_K = 4.0
#: The loss's level at a row: the median of this many rows up to it.
LEVEL_ROWS = 5
#: A single logged loss this many times its level, back on the next row: an outlier batch.
SPIKE_FACTOR = 10.0


@dataclass
class CheckpointFacts:
    """What one checkpoint of the run says about it."""

    path: str
    step: int | None
    bad: list[str]  # problem kinds of its own state
    scale: float | None = None
    applied: int | None = None  # optimizer updates applied (Adam's step count)
    weight_amax: float | None = None  # the largest |w| of its weights (None: not read)


@dataclass
class Departure:
    """Where the loss left its course (:func:`departure`)."""

    step: int  # the first logged row above the band
    last_good_step: int  # the last logged row before it (still on course)
    loss: float
    min_loss: float
    min_step: int
    first_loss: float
    peak: float
    peak_step: int
    resolved_at: int | None  # the row where it came back, None: it did not
    never_improved: bool  # the loss had not fallen below its first value before it rose
    lr_at_min: float | None = None
    lr_at_step: float | None = None
    #: the highest lr logged from the lowest row to the loss's peak, and its step
    lr_peak: float | None = None
    lr_peak_step: int | None = None
    lr_back: float | None = None  # the lr at the row where it came back

    @property
    def lr_rose(self) -> bool:
        """The lr grew (a warmup) between the loss's lowest row and its peak."""
        return bool(self.lr_at_min and self.lr_peak and self.lr_peak > 1.05 * self.lr_at_min)


@dataclass
class Course:
    episodes: list[Episode] = field(default_factory=list)
    departure: Departure | None = None
    first_step: int | None = None
    last_step: int | None = None
    first_bad_step: int | None = None
    #: checkpoint intervals whose every step was skipped (from the optimizer's update count)
    inferred: list[str] = field(default_factory=list)

    def unresolved(self, kind: str) -> Episode | None:
        return next((e for e in self.episodes if e.kind == kind and not e.resolved), None)

    def of(self, kind: str) -> list[Episode]:
        return [e for e in self.episodes if e.kind == kind]


# ---------------------------------------------------------------------------- the loss
def _levels(vals: list[Row]) -> list[float]:
    """The loss's level at each row: the median of the last :data:`LEVEL_ROWS` rows (a
    per-batch outlier moves it little; a sustained rise moves it)."""
    out = []
    for i in range(len(vals)):
        window = sorted(r.loss for r in vals[max(0, i - LEVEL_ROWS + 1) : i + 1])
        n = len(window)
        out.append(window[n // 2] if n % 2 else (window[n // 2 - 1] + window[n // 2]) / 2)
    return out


def _spread(vals: list[Row], j: int) -> float:
    """Row ``j``'s distance from the median of the :data:`LEVEL_ROWS` rows centred on it: its
    noise, with the trend taken out (a trailing median lags a falling loss and would count the
    fall as noise, hiding a rise after it)."""
    h = LEVEL_ROWS // 2
    window = sorted(r.loss for r in vals[j - h : j + h + 1])
    return abs(vals[j].loss - window[len(window) // 2])


class _RunningNoise:
    """The loss's per-row noise as a standard deviation, of a growing prefix of the rows: 1.4826
    times the median :func:`_spread` (1.4826 makes a median absolute deviation a standard
    deviation for normal noise), kept as they come: the distances in two heaps (the lower
    ``n // 2 + 1`` of them in a max-heap, the rest in a min-heap), so the median distance is the
    lower heap's top. ``add`` is O(log n)."""

    def __init__(self) -> None:
        self._low: list[float] = []  # negated: a max-heap
        self._high: list[float] = []

    def add(self, d: float) -> None:
        if not self._low or d <= -self._low[0]:
            heapq.heappush(self._low, -d)
        else:
            heapq.heappush(self._high, d)
        want = (len(self._low) + len(self._high)) // 2 + 1
        while len(self._low) > want:
            heapq.heappush(self._high, -heapq.heappop(self._low))
        while len(self._low) < want and self._high:
            heapq.heappush(self._low, -heapq.heappop(self._high))

    def value(self) -> float:
        return 1.4826 * -self._low[0] if self._low else 0.0


def _nonfinite_between(bad: list[int], a: int, b: int) -> bool:
    """Whether a step of the sorted ``bad`` steps lies strictly between ``a`` and ``b``."""
    k = bisect.bisect_right(bad, a)
    return k < len(bad) and bad[k] < b


def departure(rows: list[Row], stop: int | None = None) -> Departure | None:
    """The first step where the logged loss left its course (see the module docstring), using
    the rows up to ``stop`` (the end of the record when None). O(n log n) in the rows: the
    noise grows with the rows (:class:`_RunningNoise`), the non-finite steps are looked up in
    a sorted index."""
    vals = [
        r
        for r in rows
        if r.loss is not None and math.isfinite(r.loss) and (stop is None or r.step <= stop)
    ]
    if len(vals) < 2:
        return None
    levels = _levels(vals)
    bad = sorted(x.step for x in rows if x.loss is not None and not math.isfinite(x.loss))
    noise = _RunningNoise()
    added = LEVEL_ROWS // 2  # the next row whose distance the noise takes in
    low = 0  # the row of the lowest level so far
    improved = False
    for i in range(1, len(vals)):
        lv, base = levels[i], levels[low]
        k = max(0, i - LEVEL_ROWS + 1)
        while added < k:  # the noise of the rows before this level's window (not the rise)
            noise.add(_spread(vals, added))
            added += 1
        if improved:
            band = max(DEPARTURE * abs(base), NOISE_K * noise.value())
        else:  # before the loss ever fell, its noise is not known: its first value is the bar
            band = DEPARTURE * abs(base)
        if lv > base + band:
            nxt = levels[i + 1] if i + 1 < len(vals) else None
            gap = i + 1 < len(vals) and _nonfinite_between(bad, vals[i].step, vals[i + 1].step)
            if nxt is None or gap or nxt > base + band / 2:
                return _departure(vals, levels, i, low, rows)
        if lv < base:
            low = i
            improved = improved or lv < levels[0] - RETURN / 2.5 * abs(levels[0])
    return None


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _departure(
    vals: list[Row], levels: list[float], i: int, low: int, rows: list[Row]
) -> Departure:
    r, base = vals[i], levels[low]
    # the last row still on course: the last row at the lowest level before the rise, or before
    # it the last whose own loss is within the band (a slow creep began at the lowest level, long
    # before it crossed the band; a rise from a flat course, at the flat's end)
    never = base >= levels[0] - RETURN / 2.5 * abs(levels[0])
    band_ = base + DEPARTURE * abs(base)
    at_low = max(j for j in range(low, i + 1) if levels[j] <= base)
    on_course = [x for x in vals[: at_low + 1] if x.loss <= band_]
    back = None
    band = base + RETURN * abs(base)
    for j in range(i, len(vals) - 1):
        if levels[j] <= band and levels[j + 1] <= band:
            back = vals[j].step
            break
    # the rise: every row after the last one on course, and the rows of the level's window
    # (after its lowest row): the level crosses rows after the loss rose
    last_good = (on_course or vals[:1])[-1].step
    w0 = vals[max(low + 1, i - LEVEL_ROWS + 1)].step
    until = [
        x for x in vals if (x.step > last_good or x.step >= w0) and (back is None or x.step < back)
    ]
    peak = max(until, key=lambda x: x.loss)
    lrs = [x for x in vals[low:] if x.step <= peak.step and x.learning_rate is not None]
    top = max(lrs, key=lambda x: x.learning_rate, default=None)
    at_back = next((x.learning_rate for x in vals if x.step == back), None)
    return Departure(
        step=r.step,
        last_good_step=last_good,
        loss=levels[i],
        min_loss=base,
        min_step=vals[low].step,
        first_loss=levels[0],
        peak=peak.loss,
        peak_step=peak.step,
        resolved_at=back,
        never_improved=never,
        lr_at_min=vals[low].learning_rate,
        lr_at_step=r.learning_rate,
        lr_peak=top.learning_rate if top is not None else None,
        lr_peak_step=top.step if top is not None else None,
        lr_back=at_back,
    )


def loss_spikes(rows: list[Row]) -> list[Row]:
    """Single logged losses :data:`SPIKE_FACTOR` times their level or more that the next row
    is back from (an outlier batch). Pure."""
    vals = [r for r in rows if _finite(r.loss)]
    levels = _levels(vals)
    out = []
    for i in range(1, len(vals) - 1):
        base = levels[i - 1]
        if base > 0 and vals[i].loss >= SPIKE_FACTOR * base and vals[i + 1].loss < 2 * base:
            out.append(vals[i])
    return out


# ---------------------------------------------------------------------------- skipped steps
def skip_runs(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps: ``[(first, last)]``. Pure."""
    runs: list[tuple[int, int]] = []
    for s in sorted(set(steps)):
        if runs and runs[-1][1] == s - 1:
            runs[-1] = (runs[-1][0], s)
        else:
            runs.append((s, s))
    return runs


def _scale_at(h: History | None, step: int) -> float | None:
    """The scale in force at ``step`` from the history's scale trajectory."""
    return _ScaleAt(h)(step)


class _ScaleAt:
    """:func:`_scale_at` for many steps: the trajectory's steps indexed once (a bisection per
    look-up when they are in order, as the history writes them; a scan when not)."""

    def __init__(self, h: History | None) -> None:
        self.points = list(h.scale_trajectory) if h is not None else []
        self.steps = [s for s, _ in self.points]
        self.ordered = all(a <= b for a, b in zip(self.steps, self.steps[1:], strict=False))

    def __call__(self, step: int) -> float | None:
        if self.ordered:
            k = bisect.bisect_right(self.steps, step)
            return self.points[k - 1][1] if k else None
        scale = None
        for s, v in self.points:
            if s <= step:
                scale = v
        return scale


def _listed(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:6])
    return shown + (f" ... ({len(steps)} in all)" if len(steps) > 6 else "")


def _span(a: int, b: int) -> str:
    return f"{a}" if a == b else f"{a}–{b}"


def _skip_episodes(
    skipped: list[int],
    nonfinite: set[int],
    first: int | None,
    clean: list[int],
    h: History | None,
) -> list[Episode]:
    """``clean``: the steps known to have trained normally (a logged row that was not skipped,
    a clean record of the scaler): a run of skipped steps with none after it is still going."""
    out = []
    last_clean = max(clean) if clean else None
    scale_at = _ScaleAt(h)
    for a, b in skip_runs(skipped):
        n = b - a + 1
        ongoing = last_clean is None or last_clean < b
        span = f"{n} step{'s' if n > 1 else ''} skipped at {_span(a, b)}"
        forward = sum(1 for s in range(a, b + 1) if s in nonfinite)
        s0, s1 = scale_at(a - 1), scale_at(b)
        scales = (
            f" (scale {s0:g} -> {s1:g})" if s0 is not None and s1 is not None and s0 != s1 else ""
        )
        if 2 * forward >= n:
            kind, text = "nonfinite_loss", f"non-finite loss: {span}"
        elif first is not None and a <= first + 1 and not ongoing:
            kind, text = "calibration", f"{span} at the start while the scale found its level"
        elif n >= STORM_MIN or (ongoing and n >= STORM_MIN // 2):
            kind, text = "storm", f"{span} in a row{scales}"
        else:
            kind, text = "isolated", f"{span}{scales}"
        if ongoing:
            text += ", still skipping at the end of the record"
        out.append(Episode(kind, a, b, not ongoing, text))
    return out


def _inferred_skips(cks: list[CheckpointFacts]) -> tuple[list[int], list[str]]:
    """Steps skipped between checkpoints, from what each applied (Adam counts the updates it
    applied; a skipped step is not one) and how its scale fell (each skip halves it):

    * no update applied in between while the scale fell: every step in between was skipped;
    * ``k`` steps skipped and the scale halved exactly ``k`` times, and the storm goes on after
      (the next interval was all skipped, or the scale ended below 1): the last ``k`` steps."""
    known = sorted((c for c in cks if c.step is not None), key=lambda c: c.step)
    spans: list[tuple[int, int]] = []
    spanned: set[tuple[int, int]] = set()  # the same, to look up
    notes: list[str] = []
    pairs = list(zip(known, known[1:], strict=False))
    for prev, cur in pairs:
        n = cur.step - prev.step
        scales = prev.scale is not None and cur.scale is not None
        fell = scales and (cur.scale < prev.scale or cur.scale == prev.scale == 0)
        if prev.applied is None or cur.applied is None:
            # no update count (a bare scaler state): a scale halved once per step, every step
            halvings = _halvings(prev.scale, cur.scale) if scales else 0
            if n > 0 and halvings >= n:
                spans.append((prev.step + 1, cur.step))
                spanned.add(spans[-1])
            continue
        done = cur.applied - prev.applied
        if n > 0 and done == 0 and fell:
            spans.append((prev.step + 1, cur.step))
            spanned.add(spans[-1])
            notes.append(
                f"{cur.path}: the optimizer applied no update in steps {prev.step + 1}-"
                f"{cur.step} (every step skipped)"
            )
    for i, (prev, cur) in enumerate(pairs):
        if prev.applied is None or cur.applied is None:
            continue
        k = (cur.step - prev.step) - (cur.applied - prev.applied)
        if k <= 0 or (prev.step + 1, cur.step) in spanned or not prev.scale or cur.scale is None:
            continue
        halvings = _halvings(prev.scale, cur.scale)
        goes_on = (
            (cur.step + 1, pairs[i + 1][1].step) in spanned if i + 1 < len(pairs) else cur.scale < 1
        )
        if goes_on and (math.isinf(halvings) or round(halvings) == k):
            spans.append((cur.step - k + 1, cur.step))
            spanned.add(spans[-1])
    steps = sorted({s for a, b in spans for s in range(a, b + 1)})
    return steps, notes


def _halvings(before: float, after: float) -> float:
    """How many times a scale was halved to get from ``before`` to ``after`` (inf: to 0)."""
    if before <= 0:
        return 0.0
    return math.log2(before / after) if after > 0 else math.inf


# ---------------------------------------------------------------------------- the course
def _scaler_rows(scaler: ScalerState | None) -> list[Row]:
    """Rows from ampctl's per-update record (when the checkpoint is read without its run
    folder's metrics)."""
    if scaler is None or not scaler.rows or scaler.rows[0][0] != 1:
        return []
    return [Row(step=u, loss=lo, scale=v) for u, v, _k, lo in scaler.rows]


def run_course(
    h: History | None, scaler: ScalerState | None, checkpoints: list[CheckpointFacts]
) -> Course:
    """The episodes of a run and its first sign of trouble (see the module docstring)."""
    rows = h.rows if h is not None and h.rows else _scaler_rows(scaler)
    skipped = list(h.skipped_steps) if h is not None else []
    if not skipped and scaler is not None and scaler.rows and scaler.rows[0][0] == 1:
        skipped = [u for u, _v, k, _lo in scaler.rows if k in (rec.GRADIENT, rec.FORWARD)]
    spikes = {e.step for e in (h.guard_events if h else []) if e.kind == "spike"}
    if scaler is not None and h is None:
        spikes |= {u for u, _v, k, _lo in scaler.rows if k == rec.SPIKE}
    inferred, notes = _inferred_skips(checkpoints)
    skipped = sorted((set(skipped) | set(inferred)) - spikes)
    nonfinite = {r.step for r in rows if r.loss is not None and not math.isfinite(r.loss)}
    nonfinite |= {
        e.step
        for e in (h.guard_events if h else [])
        if e.kind == "overflow"
        and e.data.get("overflow") == "forward"
        and not e.data.get("discarded")
    }
    skipped = sorted(set(skipped) | nonfinite)
    steps = [r.step for r in rows] + skipped + [c.step for c in checkpoints if c.step is not None]
    course = Course(
        first_step=min(steps) if steps else None,
        last_step=max(steps) if steps else None,
        inferred=notes,
    )
    skip_set = set(skipped)
    clean = [r.step for r in rows if r.step not in skip_set and _finite(r.loss)]
    if scaler is not None and scaler.rows and scaler.rows[0][0] == 1:
        clean += [u for u, _v, k, _lo in scaler.rows if k == rec.CLEAN]
    course.episodes = _skip_episodes(skipped, nonfinite, course.first_step, clean, h)
    course.departure = departure(rows)
    d = course.departure
    if d is not None:
        text = (
            f"the loss rose from {d.min_loss:.4g} (step {d.min_step}) to {d.peak:.4g} (step "
            f"{d.peak_step})"
            + (f", back at step {d.resolved_at}" if d.resolved_at is not None else "")
        )
        course.episodes.append(
            Episode(
                "departure", d.step, d.resolved_at or d.peak_step, d.resolved_at is not None, text
            )
        )
    for r in loss_spikes(rows):
        course.episodes.append(
            Episode(
                "loss_spike",
                r.step,
                r.step,
                True,
                f"a single loss of {r.loss:.4g} at step {r.step}",
            )
        )
    course.episodes.sort(key=lambda e: e.start)
    course.first_bad_step = _first_bad(course)
    return course


def diverged(course: Course) -> bool:
    """The updates took the run off course (too large a learning rate): the loss left its
    course and did not come back, or it rose at the very first updates (before it ever fell:
    overshooting from the start, even if it came back later), or non-finite steps followed."""
    d = course.departure
    if d is None:
        return False
    if d.resolved_at is None or d.never_improved:
        return True
    return any(e.kind in ("storm", "nonfinite_loss") and e.start > d.step for e in course.episodes)


def _first_bad(course: Course) -> int | None:
    """The first step of the unresolved trouble whose weights are suspect."""
    marks = [
        e.start for e in course.episodes if not e.resolved and e.kind in ("storm", "nonfinite_loss")
    ]
    if diverged(course):
        marks.append(course.departure.last_good_step)
    return min(marks) if marks else None
