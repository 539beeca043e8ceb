"""The learning rate a diverged run should use, worked out from its own history (no fixed
factor), and the ladder of candidates a probe tries (``ampctl diagnose``'s, :mod:`ampctl.
commands.diagnose.probe`). Pure functions of the logged rows: shared by the trainer's one resume
hint and diagnose's recommendation, so the two never disagree.

The evidence, in order:

1. the lr at which the loss last fell (a row whose loss is below the row before it, the run's
   first loss counting as the row before the first): after the trouble too -- a run whose loss
   came back once a decay brought the lr down shows the lr that works;
2. with a warmup (the lr rising to the first bad row), below the lr of the first bad row: the lr
   of the last row before it, and for the first row the lr of the first update (a linear warmup
   from 0 gives step ``s`` the lr ``s / row_step`` of the row's);
3. the ladder below the recommendation keeps the spacing the history shows (the first bad lr
   over the recommended one), so that a probe can find where the run holds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ABOVE_START", "LrAdvice", "lr_advice", "fmt_lr"]

#: A row whose loss is above this factor times the run's first loss (before any update) is a
#: sign of trouble: a healthy run's rows, each a mean over its interval, stay below where it began.
ABOVE_START = 1.05

#: Rungs of the ladder a probe tries (the recommendation first).
LADDER = 4


@dataclass(frozen=True)
class LrAdvice:
    lr: float  # the recommended optim.lr (the schedule's peak)
    why: str
    bad_lr: float | None  # the lr of the first bad row (None: not logged)
    ladder: list[float] = field(default_factory=list)  # candidates, highest first (lr first)
    known: bool = False  # the loss fell at ``lr`` in this run (else: only below the bad lr)


def _ok(x: float | None) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def fmt_lr(x: float) -> str:
    """Two significant digits, plain: 0.045, 0.0003, 1.5, 30."""
    if not (_ok(x) and x > 0):
        return repr(x)
    digits = 1 - math.floor(math.log10(x))
    v = round(x, digits)
    return f"{v:.{digits}f}".rstrip("0").rstrip(".") if digits > 0 else f"{v:.0f}"


def lr_advice(
    rows: Iterable[tuple[int, float | None, float | None]],
    *,
    trouble: int | None,
    start: float | None = None,
) -> LrAdvice | None:
    """The lr to use from the rows ``(step, loss, lr)`` (oldest first), ``trouble`` the first
    sign of trouble (the first bad row is the first at or after it; None: the last row), and
    ``start`` the run's first loss before any update (None: unknown). None: no lr is logged."""
    pts = [(int(s), float(v), float(lr)) for s, v, lr in rows if _ok(v) and _ok(lr) and lr > 0]
    if not pts:
        return None
    bad_i = next((i for i, p in enumerate(pts) if trouble is not None and p[0] >= trouble), None)
    if bad_i is None:
        bad_i = len(pts) - 1
    if _ok(start):  # a healthy run never goes above the loss it started from
        bad_i = next((i for i, p in enumerate(pts[:bad_i]) if p[1] > ABOVE_START * start), bad_i)
    bad_step, _, bad_lr = pts[bad_i]
    prev = start if _ok(start) else None
    fell: list[tuple[int, float]] = []  # (step, lr) of the rows whose loss fell
    for s, v, lr in pts:
        if prev is not None and v < prev:
            fell.append((s, lr))
        prev = v
    below = [(s, lr) for s, lr in fell if lr < 0.95 * bad_lr]
    after = [(s, lr) for s, lr in below if s > bad_step]
    rec: float | None = None
    why = ""
    known = bool(below)
    if after:  # the run came back once its lr had come down
        s, rec = after[-1]
        why = f"the loss fell again at step {s}, at lr {fmt_lr(rec)}, once the lr had come down"
    elif below:
        s, rec = below[-1]
        why = f"the loss last fell at step {s}, at lr {fmt_lr(rec)}"
    else:
        before = [p for p in pts[:bad_i] if p[2] < 0.95 * bad_lr]
        if before:  # a warmup: the last lr before the first bad row
            s, _, rec = before[-1]
            why = f"the lr was {fmt_lr(rec)} at step {s}, before the first bad row"
        elif bad_i == 0 and bad_step > 1 and len(pts) > 1 and pts[1][2] > 1.05 * bad_lr:
            rec = bad_lr / bad_step  # a linear warmup: the lr of the first update
            why = (
                f"the loss rose from the first updates (lr {fmt_lr(bad_lr)} at step {bad_step}, "
                f"in the warmup): below it, the lr of the first update, {fmt_lr(rec)}"
            )
    if rec is None:
        return LrAdvice(
            lr=math.nan,
            why=f"no lr of this run is known to have worked (the loss rose at lr "
            f"{fmt_lr(bad_lr)}, step {bad_step})",
            bad_lr=bad_lr,
        )
    ratio = bad_lr / rec
    ratio = ratio if ratio > 1.5 else 2.0  # the ladder needs a spacing: at least the history's
    ladder = [rec / ratio**k for k in range(LADDER)]
    return LrAdvice(
        lr=rec,
        why=f"{why} (it rose at lr {fmt_lr(bad_lr)}, step {bad_step})",
        bad_lr=bad_lr,
        ladder=ladder,
        known=known,
    )
