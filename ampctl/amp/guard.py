"""OverflowGuard: what to do when skipping and halving is not enough.

GradScaler, DeepSpeed, Megatron and fairseq only halve the scale and skip; when that does not
help they die ("Minimum loss scale reached") or train on a collapsed scale. The guard looks at
the overflow history after each step and decides, by the numbered rules of :func:`decide`:

    continue | rollback (restore the last good state, lower the scale) |
    fallback (next precision of the chain, after restoring) | abort | warn

The rules are a pure function of plain numbers (tested without a model);
:class:`ampctl.protect.protection.Protection` carries the decisions out. Nothing here imports
anything but the standard library.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .checks import check, integer, number, one_of

__all__ = [
    "DIVERGENCE_ACTIONS",
    "CourseMemory",
    "DivergenceRules",
    "DivergenceWatch",
    "divergence",
    "divergence_reason",
    "Action",
    "Observation",
    "Decision",
    "GuardRules",
    "decide",
    "next_precision",
    "OverflowGuard",
]


class Action(enum.StrEnum):
    CONTINUE = "continue"
    ROLLBACK = "rollback"
    FALLBACK = "fallback"
    ABORT = "abort"
    WARN = "warn"


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What the loop knows on the host after a step (no device reads beyond the step's one)."""

    step: int
    skipped: bool
    consecutive: int  # skipped steps in a row, this one included
    window_skips: int  # skipped steps among the last `window_len` steps
    window_len: int
    at_floor: bool  # the scale is at min_scale (and scaling is on)
    forward_overflow: bool = False
    rollbacks: int = 0  # rollbacks already made at the current precision
    precision: str = "fp16"
    bf16_ok: bool = True  # the device runs bf16 (a fallback target)


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str = ""
    precision: str | None = None  # target precision for FALLBACK


SKIP_ACTIONS = ("rollback", "fallback", "abort", "warn")
FLOOR_POLICIES = ("fallback", "abort", "warn")


@dataclass(kw_only=True)
class GuardRules:
    """The rules of :func:`decide` (``guard.*`` in a config)."""

    rollback_after: int = 3  # overflows in a row before restoring the last good state (0: never)
    max_rollbacks: int = 5  # rollbacks at one precision, then fall back to the next one
    # more than skip_budget of the last skip_window steps skipped -> skip_action
    skip_budget: float = 0.5
    skip_window: int = 50
    skip_action: str = "rollback"  # rollback | fallback | abort | warn
    # the scale at min_scale and still overflowing: fallback | abort | warn
    floor_policy: str = "fallback"
    fallback_chain: list[str] = field(default_factory=lambda: ["fp16", "bf16", "fp32"])

    def __post_init__(self) -> None:
        check(self, _RULES)
        self.fallback_chain = list(self.fallback_chain)


_RULES = (
    ("rollback_after", integer(ge=0), "an integer >= 0 (0 disables rollback)"),
    ("max_rollbacks", integer(ge=0), "an integer >= 0"),
    ("skip_budget", number(gt=0, le=1), "in (0, 1]"),
    ("skip_window", integer(ge=1), "an integer >= 1"),
    ("skip_action", one_of(SKIP_ACTIONS), f"one of {', '.join(SKIP_ACTIONS)}"),
    ("floor_policy", one_of(FLOOR_POLICIES), f"one of {', '.join(FLOOR_POLICIES)}"),
)


# What a precision that is not in the fallback chain may fall back to: only the chain's entries
# that are safer than it. fp8 runs everything but its fp8 layers in bf16, so fp16 (narrower
# range, loss scaling) is no fallback for it: with the default chain [fp16, bf16, fp32] an fp8
# run falls back fp8 -> bf16 -> fp32. fp16-pure may fall back to fp16 autocast.
_SAFER: dict[str, tuple[str, ...]] = {
    "fp8": ("bf16", "fp32"),
    "fp16-pure": ("fp16", "bf16", "fp32"),
    "fp16": ("bf16", "fp32"),
    "bf16": ("fp32",),
    "fp32": (),
}


def next_precision(current: str, chain: list[str], bf16_ok: bool = True) -> str | None:
    """The precision after ``current`` in ``chain`` (bf16 skipped where unsupported).

    When ``current`` is not in the chain, the first entry of the chain that is safer than it
    (see ``_SAFER``; any entry for a precision not listed there)."""
    if current in chain:
        candidates = chain[chain.index(current) + 1 :]
    else:
        safer = _SAFER.get(current)
        candidates = [p for p in chain if safer is None or p in safer]
    for p in candidates:
        if p == current or (p == "bf16" and not bf16_ok):
            continue
        return p
    return None


def _fallback_or_abort(obs: Observation, rules: GuardRules, why: str) -> Decision:
    target = next_precision(obs.precision, rules.fallback_chain, obs.bf16_ok)
    if target is None:
        return Decision(
            action=Action.ABORT,
            reason=f"{why}, and no precision is left after {obs.precision} in the fallback chain "
            f"{rules.fallback_chain}",
        )
    return Decision(
        action=Action.FALLBACK,
        reason=f"{why}: falling back {obs.precision} -> {target}",
        precision=target,
    )


def _act(action: str, obs: Observation, rules: GuardRules, why: str) -> Decision:
    if action == "fallback":
        return _fallback_or_abort(obs, rules, why)
    if action == "abort":
        return Decision(action=Action.ABORT, reason=why)
    if action == "warn":
        return Decision(action=Action.WARN, reason=why)
    if obs.rollbacks >= rules.max_rollbacks:
        return _fallback_or_abort(
            obs, rules, f"{why}, after {obs.rollbacks} rollbacks at {obs.precision}"
        )
    return Decision(action=Action.ROLLBACK, reason=why)


def decide(obs: Observation, rules: GuardRules) -> Decision:
    """The guard's rules, in order."""
    # 1) a clean step needs nothing.
    if not obs.skipped:
        return Decision(action=Action.CONTINUE)
    # 2) the scale sits at its floor and gradients still overflow: halving cannot help any more.
    if obs.at_floor and not obs.forward_overflow and obs.consecutive >= 2:
        why = f"loss scale at its minimum and still overflowing ({obs.consecutive} in a row)"
        return _act(rules.floor_policy, obs, rules, why)
    # 3) N consecutive overflows: restore the last good state and lower the scale.
    if rules.rollback_after > 0 and obs.consecutive >= rules.rollback_after:
        return _act("rollback", obs, rules, f"{obs.consecutive} consecutive overflows")
    # 4) skip budget: too many of the recent steps were wasted.
    if (
        obs.window_len >= rules.skip_window
        and obs.window_skips > rules.skip_budget * obs.window_len
    ):
        why = f"{obs.window_skips} of the last {obs.window_len} steps skipped (budget {rules.skip_budget:.0%})"
        return _act(rules.skip_action, obs, rules, why)
    # 5) an isolated overflow: the scaler's skip-and-back-off handles it.
    return Decision(action=Action.CONTINUE)


class OverflowGuard:
    """Keeps the host-side overflow history and applies :func:`decide` after each step."""

    def __init__(self, rules: GuardRules) -> None:
        self.rules = rules
        self.window: deque[bool] = deque(maxlen=rules.skip_window)
        self.consecutive = 0
        self.rollbacks = 0  # at the current precision

    def observe(
        self,
        *,
        step: int,
        skipped: bool,
        forward_overflow: bool,
        at_floor: bool,
        precision: str,
        bf16_ok: bool = True,
    ) -> Decision:
        self.window.append(bool(skipped))
        self.consecutive = self.consecutive + 1 if skipped else 0
        obs = Observation(
            step=step,
            skipped=skipped,
            consecutive=self.consecutive,
            window_skips=sum(self.window),
            window_len=len(self.window),
            at_floor=at_floor,
            forward_overflow=forward_overflow,
            rollbacks=self.rollbacks,
            precision=precision,
            bf16_ok=bf16_ok,
        )
        return decide(obs, self.rules)

    def after_rollback(self) -> None:
        self.rollbacks += 1
        self.consecutive = 0
        self.window.clear()

    def after_fallback(self) -> None:
        self.rollbacks = 0
        self.consecutive = 0
        self.window.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": [int(x) for x in self.window],
            "consecutive": self.consecutive,
            "rollbacks": self.rollbacks,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.window = deque((bool(x) for x in sd.get("window", [])), maxlen=self.rules.skip_window)
        self.consecutive = int(sd.get("consecutive", 0))
        self.rollbacks = int(sd.get("rollbacks", 0))


# ---------------------------------------------------------------------------- divergence
DIVERGENCE_ACTIONS = ("stop", "rollback", "warn")


@dataclass(kw_only=True)
class DivergenceRules:
    """When a run has diverged, judged from its log rows' loss (each the mean of its interval),
    smoothed as the median of ``patience`` rows so that one row -- noisy, or holding a spike --
    decides nothing.

    The run has diverged when the last ``patience`` rows are all non-finite, or when their median
    is above ``factor`` times the lowest median of ``patience`` rows in a row so far, or when the
    run had made real progress -- its first rows' mean down to that lowest, more than four times
    the rows' own noise (the median change from one row to the next) -- and has given back three
    quarters of it. A run that never made progress beyond its noise (a noisy toy, a run at a
    plateau) can only trip the factor. Rows before ``warmup`` are only watched.

    The factor also holds against the run's first loss (the model's before any update) when it
    is known: a run that jumps at its first update (an lr far too high) has no healthy row to
    compare with, but no healthy run ends up ``factor`` times above where it started."""

    factor: float = 5.0
    patience: int = 3
    warmup: int = 1
    action: str = "stop"


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def divergence_reason(
    losses: list[float], rules: DivergenceRules, start: float | None = None
) -> str | None:
    """Why the rows ``losses`` (oldest first) show a divergence, or None (the rule of
    :class:`DivergenceRules`, a pure function of the numbers). ``start``: the run's first loss,
    before any update (None: unknown)."""
    found = divergence(losses, rules, start)
    return None if found is None else found[0]


@dataclass(frozen=True)
class CourseMemory:
    """What the divergence rule keeps of the run's course before its current rows (rows set aside
    by an earlier divergence, a checkpoint's resume): the first and the lowest median of
    ``patience`` rows, and the rows' noise (the median change from one row to the next)."""

    first: float
    lowest: float
    noise: float = 0.0

    def merged(self, other: CourseMemory | None) -> CourseMemory:
        if other is None:
            return self
        return CourseMemory(other.first, min(self.lowest, other.lowest), other.noise)


def course_memory(losses: list[float], k: int) -> CourseMemory | None:
    """The :class:`CourseMemory` of the rows ``losses`` (None: too few finite rows)."""
    finite = [x for x in losses if _finite(x)]
    windows = [_median(finite[i : i + k]) for i in range(len(finite) - k + 1)]
    if not windows:
        return None
    steps = [abs(b - a) for a, b in zip(finite, finite[1:], strict=False)]
    noise = sorted(steps)[len(steps) // 2] if steps else 0.0
    return CourseMemory(windows[0], min(windows), noise)


def divergence(
    losses: list[float],
    rules: DivergenceRules,
    start: float | None = None,
    memory: CourseMemory | None = None,
) -> tuple[str, float, float, float] | None:
    """:func:`divergence_reason` with its figures: ``(reason, now, reference, ratio)``, where
    ``now`` is the median of the last ``patience`` rows the rule judged, ``reference`` the loss
    it was judged against (the run's first loss, or the lowest median of ``patience`` rows) and
    ``ratio`` ``now / reference`` (NaN when the last rows are not finite). None: no divergence.
    ``memory``: the course before ``losses`` (a resumed run's, rows an earlier divergence set
    aside): its lowest and first medians count as the rows' own, and the rows are judged from
    the first on (a resume of a few rows would otherwise end before ``patience`` rows)."""
    k = rules.patience
    if memory is not None:
        k = min(k, len(losses))
    if not losses or len(losses) < (k if memory is not None else max(k, rules.warmup + 1)):
        return None
    last = losses[-k:]
    finite = [x for x in losses[:-k] if _finite(x)]
    windows = [_median(finite[i : i + k]) for i in range(len(finite) - k + 1)]
    if memory is not None:
        windows = [memory.first, memory.lowest, *windows]
    if not any(_finite(x) for x in last):
        ref = min(windows, default=math.nan)  # the lowest course, else the first loss
        ref = start if not _finite(ref) and start is not None and _finite(start) else ref
        return f"the loss is not finite at the last {k} log steps", math.nan, ref, math.nan
    if not all(_finite(x) for x in last):
        return None
    now = _median(last)
    shown = ", ".join(f"{x:.4g}" for x in last)
    if (
        start is not None
        and _finite(start)
        and 0 < start < min(windows, default=math.inf)
        and now > rules.factor * start
    ):
        why = (
            f"the loss diverged: {shown} at the last {k} log steps, {now / start:.1f}x the loss "
            f"the run started from ({start:.4g}, before its first update)"
        )
        return why, now, start, now / start
    if not windows:
        return None
    lowest, first = min(windows), windows[0]
    if lowest > 0 and now > rules.factor * lowest:
        why = (
            f"the loss diverged: {shown} at the last {k} log steps, {now / lowest:.1f}x its lowest "
            f"({lowest:.4g}, the median of {k} rows)"
        )
        return why, now, lowest, now / lowest
    steps = [abs(b - a) for a, b in zip(finite, finite[1:], strict=False)]
    noise = sorted(steps)[len(steps) // 2] if steps else 0.0
    if memory is not None and len(steps) < 2:
        noise = memory.noise  # too few rows of its own: the remembered course's noise
    progress = first - lowest
    if progress > 4 * noise and now > lowest + 0.75 * progress and now > 1.5 * lowest:
        why = (
            f"the loss diverged: {shown} at the last {k} log steps gave back "
            f"{(now - lowest) / progress:.0%} of its progress from {first:.4g} down to {lowest:.4g}"
        )
        return why, now, lowest, now / lowest
    return None


class DivergenceWatch:
    """The host-side course of the loss, one row at a time (no device value: rows are read)."""

    def __init__(self, rules: DivergenceRules) -> None:
        self.rules = rules
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.good_step = 0  # the step of the last row before a divergence began
        self.start: float | None = None  # the run's first loss, before any update (if known)
        # the figures of the last divergence found (divergence()): the median of the rows it
        # judged, the loss it judged them against, their ratio
        self.judged = self.reference = self.ratio = math.nan
        # the run's course before the current rows (a stop or a rollback set them aside; a
        # checkpoint carries it across a resume): a run resumed from its diverged state is
        # judged against the loss it had reached, not against its diverged rows
        self.memory: CourseMemory | None = None

    def observe(self, step: int, loss: float) -> Decision:
        """Take one row; a WARN, ROLLBACK or ABORT (stop) decision once the rule holds."""
        self.losses.append(float(loss))
        self.steps.append(int(step))
        found = divergence(self.losses, self.rules, self.start, self.memory)
        if found is None:
            return Decision(action=Action.CONTINUE)
        why, self.judged, self.reference, self.ratio = found
        k = self.rules.patience
        self.good_step = self.steps[-k - 1] if len(self.steps) > k else self.good_step
        action = {"stop": Action.ABORT, "rollback": Action.ROLLBACK, "warn": Action.WARN}[
            self.rules.action
        ]
        if action is Action.WARN:
            self.memory = None  # a warning: the course starts again from its new level
        else:  # stop, rollback: the run's best stays the reference, across a resume too
            mine = course_memory(self.losses[:-k], k)
            if mine is None and self.start is not None and _finite(self.start):
                mine = CourseMemory(self.start, self.start)  # too few rows: where it started
            self.memory = mine.merged(self.memory) if mine is not None else self.memory
        self.losses.clear()  # after a warning or a rollback, the course starts again
        self.steps.clear()
        return Decision(action=action, reason=why)

    @property
    def lowest(self) -> float | None:
        finite = [x for x in self.losses if _finite(x)]
        return min(finite) if finite else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.losses),
            "steps": list(self.steps),
            "good_step": self.good_step,
            "start": self.start,
            "memory": None if self.memory is None else dict(vars(self.memory)),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.losses = [float(x) for x in sd.get("losses", [])]
        self.steps = [int(x) for x in sd.get("steps", [])]
        self.good_step = int(sd.get("good_step", 0))
        start = sd.get("start")
        self.start = None if start is None else float(start)
        mem = sd.get("memory")  # absent from checkpoints written before it was kept
        try:
            self.memory = (
                CourseMemory(float(mem["first"]), float(mem["lowest"]), float(mem["noise"]))
                if isinstance(mem, dict)
                else None
            )
        except (TypeError, ValueError, KeyError):
            self.memory = None
