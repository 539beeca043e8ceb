"""The rows of a history kept in memory bounded independently of its length.

A history is read in one pass and its rows handed to a :class:`RowKeeper`. Up to
:data:`ROW_CAP` distinct steps it keeps every row (a later row of a step logged again after a
rollback replaces the earlier one), so the verdict on an ordinary history is the verdict on all of
it. Past the cap it keeps:

* the first :data:`HEAD` rows and the last :data:`TAIL` rows exactly;
* every *marked* row exactly, up to :data:`MARK_CAP` of them (the rest are counted and merged
  like any other): a non-finite loss or grad norm, a change of the skipped-steps count or of the
  scale, a loss :data:`~.course.SPIKE_FACTOR` times the level of the rows before it (a spike
  candidate);
* the :data:`CONTEXT` rows before the first non-finite loss exactly (the rows before the break);
* the rows in between merged into at most :data:`MIDDLE_CAP` rows of equal width: a merged row
  carries the step of its first row, the mean of its finite losses and grad norms (a non-finite
  one wins: it is never averaged away, and the merged row then carries its step), the largest learning rate and grad amax, the last scale
  and skipped count. When the merged rows fill their cap, neighbours are merged pairwise and the
  width doubles (amortised O(1) a row).

So :meth:`RowKeeper.rows` gives at most about ``HEAD + TAIL + MARK_CAP + MIDDLE_CAP + CONTEXT``
rows, sorted by step, whatever the history's length; each row is handled in O(1) amortised time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .stages import Row

__all__ = ["ROW_CAP", "HEAD", "TAIL", "MARK_CAP", "MIDDLE_CAP", "CONTEXT", "RowKeeper"]

#: Distinct steps kept whole: a history this long or shorter is judged on every row.
ROW_CAP = 20_000
#: Past the cap: the first and the last rows kept exactly.
HEAD = 2_000
TAIL = 2_000
#: Marked rows (non-finite, skipped, scale changes, spike candidates) kept exactly.
MARK_CAP = 4_000
#: Merged rows of the middle at most (halved by pairwise merging when full).
MIDDLE_CAP = 8_000
#: Rows before the first non-finite loss kept exactly.
CONTEXT = 64
#: A loss this many times the median of the rows before it is a spike candidate (as the course's
#: SPIKE_FACTOR: kept exactly, so the course still sees it).
_SPIKE = 10.0
_LEVEL = 5


def _fin(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


@dataclass
class _Mean:
    """One figure of merged rows: the mean of its finite values, or its first non-finite one
    (never averaged away)."""

    total: float = 0.0
    n: int = 0
    bad: float | None = None

    def add(self, x: float | None) -> bool:
        """Take ``x`` (None: not logged); True when it is the first non-finite value."""
        if x is None:
            return False
        if math.isfinite(x):
            self.total += x
            self.n += 1
            return False
        if self.bad is not None:
            return False
        self.bad = x
        return True

    def merge(self, o: _Mean) -> None:
        self.total += o.total
        self.n += o.n
        self.bad = self.bad if self.bad is not None else o.bad

    def value(self) -> float | None:
        if self.bad is not None:
            return self.bad
        return self.total / self.n if self.n else None


@dataclass
class _Merged:
    """Rows merged into one (see the module docstring)."""

    step: int
    last: int
    n: int = 0
    loss: _Mean = field(default_factory=_Mean)
    gn: _Mean = field(default_factory=_Mean)
    bad_step: int | None = None  # the first row with a non-finite loss or grad norm
    amax: float | None = None
    lr: float | None = None
    scale: float | None = None
    skipped: object = None

    @classmethod
    def of(cls, r: Row) -> _Merged:
        m = cls(step=r.step, last=r.step)
        m.add(r)
        return m

    def add(self, r: Row) -> None:
        self.n += 1
        self.last = r.step
        for mean, x in ((self.loss, r.loss), (self.gn, r.grad_norm)):
            if mean.add(x) and self.bad_step is None:
                self.bad_step = r.step
        self.amax = _larger(self.amax, r.grad_amax)
        self.lr = _larger(self.lr, r.learning_rate)
        if r.scale is not None:
            self.scale = r.scale
        if r.skipped is not None:
            self.skipped = r.skipped

    def merge(self, o: _Merged) -> None:
        self.n += o.n
        self.last = o.last
        self.loss.merge(o.loss)
        self.gn.merge(o.gn)
        self.bad_step = self.bad_step if self.bad_step is not None else o.bad_step
        self.amax = _larger(self.amax, o.amax)
        self.lr = _larger(self.lr, o.lr)
        self.scale = o.scale if o.scale is not None else self.scale
        self.skipped = o.skipped if o.skipped is not None else self.skipped

    def row(self) -> Row:
        return Row(
            step=self.step if self.bad_step is None else self.bad_step,  # a bad value: its step
            loss=self.loss.value(),
            scale=self.scale,
            skipped=self.skipped,
            grad_norm=self.gn.value(),
            grad_amax=self.amax,
            learning_rate=self.lr,
        )


def _larger(a: float | None, b: float | None) -> float | None:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a
    return b if a is None or b > a else a


def _median(xs) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class RowKeeper:
    """Rows of a history in bounded memory (see the module docstring). Feed rows with
    :meth:`add` in the order they were logged; :meth:`rows` gives what was kept, by step."""

    def __init__(
        self,
        *,
        cap: int | None = None,
        head: int | None = None,
        tail: int | None = None,
        mark_cap: int | None = None,
        middle_cap: int | None = None,
        context: int | None = None,
        by_step: bool = True,
    ) -> None:
        """The sizes default to the module's constants (read when the keeper is made).
        ``by_step``: a step logged again replaces its earlier row and the rows come out by step
        (ampctl's metrics); else every row is kept in the order it came while under the cap
        (another tool's log, as it wrote it)."""
        cap = ROW_CAP if cap is None else cap
        head = HEAD if head is None else head
        tail = TAIL if tail is None else tail
        mark_cap = MARK_CAP if mark_cap is None else mark_cap
        middle_cap = MIDDLE_CAP if middle_cap is None else middle_cap
        context = CONTEXT if context is None else context
        if not (head >= 1 and tail >= max(context, _LEVEL) and middle_cap >= 2):
            raise ValueError("RowKeeper: head >= 1, tail >= context, middle_cap >= 2")
        self.cap, self.head_n, self.tail_n = cap, head, tail
        self.mark_cap, self.middle_cap, self.context_n = mark_cap, middle_cap, context
        self.seen = 0  # rows handed in
        self.visits = 0  # rows handled (a row is handled once on its way through)
        self.marks_over = 0  # marked rows past MARK_CAP (merged like the others)
        self.width = 1  # rows per merged row of the middle
        self.by_step = by_step
        self._all: dict[int, Row] | list[Row] | None = {} if by_step else []  # under the cap
        self._head: list[Row] = []
        self._middle: list[_Merged] = []
        self._marked: dict[int, Row] = {}
        self._context: dict[int, Row] = {}
        self._recent: deque[tuple[Row, bool]] = deque()  # (row, marked)
        self._last_step: int | None = None
        self._prev: Row | None = None
        self._losses: deque[float] = deque(maxlen=_LEVEL)  # the last finite losses taken
        self._break: tuple[int, int] | None = None  # steps kept as the rows before the break

    # ------------------------------------------------------------------ feeding
    def add(self, r: Row) -> None:
        self.seen += 1
        if self._all is not None:
            self.visits += 1
            if self.by_step:
                self._all[r.step] = r
            else:
                self._all.append(r)
            if len(self._all) > self.cap:
                self._bound()
            return
        self._take(r)

    @property
    def bounded(self) -> bool:
        """Whether rows were merged (the history was longer than the cap)."""
        return self._all is None

    def _bound(self) -> None:
        """Past the cap: the rows so far go through the bounded path, in step order."""
        rows = self._exact()
        self._all = None
        for r in rows:
            self._take(r)

    def _take(self, r: Row) -> None:
        self.visits += 1
        if self._last_step is not None and r.step <= self._last_step:
            self._relogged(r.step)
        mark = self._is_marked(r)
        self._prev, self._last_step = r, r.step
        if len(self._head) < self.head_n and not self._middle and not self._recent:
            self._head.append(r)
            return
        if self._break is None and _fin_not(r.loss):
            ctx = [x for x, _ in list(self._recent)[-self.context_n :]]
            self._break = (ctx[0].step if ctx else r.step, r.step)
        self._recent.append((r, mark))
        if len(self._recent) > self.tail_n:
            self._retire(*self._recent.popleft())

    def _is_marked(self, r: Row) -> bool:
        p = self._prev
        if _fin_not(r.loss) or _fin_not(r.grad_norm) or r.loss == 0.0:
            return True  # (a loss of exactly 0.0: how the HF Trainer's NaN filter logs a NaN)
        if p is not None and (r.skipped != p.skipped or r.scale != p.scale):
            return True
        if _fin(r.loss):
            spike = bool(self._losses) and 0 < _median(self._losses) <= r.loss / _SPIKE
            self._losses.append(r.loss)
            return spike
        return False

    def _retire(self, r: Row, mark: bool) -> None:
        if self._break is not None and self._break[0] <= r.step <= self._break[1]:
            self._context[r.step] = r
            return
        if mark:
            if len(self._marked) < self.mark_cap:
                self._marked[r.step] = r
                return
            self.marks_over += 1
        m = self._middle
        if m and m[-1].n < self.width:
            m[-1].add(r)
        else:
            m.append(_Merged.of(r))
        if len(m) > self.middle_cap:
            merged = []
            for i in range(0, len(m), 2):
                a = m[i]
                if i + 1 < len(m):
                    a.merge(m[i + 1])
                merged.append(a)
            self._middle = merged
            self.width *= 2

    def _relogged(self, step: int) -> None:
        """A step logged again (a rollback): the rows from it on are replaced by the new line."""
        while self._recent and self._recent[-1][0].step >= step:
            self._recent.pop()
        while self._middle and self._middle[-1].step >= step:
            self._middle.pop()
        while self._head and self._head[-1].step >= step:
            self._head.pop()
        for d in (self._marked, self._context):
            for s in [s for s in d if s >= step]:
                del d[s]
        self._prev = self._recent[-1][0] if self._recent else None
        self._losses.clear()

    # ------------------------------------------------------------------ reading
    def rows(self) -> list[Row]:
        """The kept rows, sorted by step (every row when under the cap)."""
        if self._all is not None:
            return self._exact()
        out = list(self._head) + [m.row() for m in self._middle]
        out += list(self._marked.values()) + list(self._context.values())
        out += [r for r, _ in self._recent]
        return sorted(out, key=lambda r: r.step)

    def _exact(self) -> list[Row]:
        if isinstance(self._all, dict):
            return [self._all[s] for s in sorted(self._all)]
        return list(self._all)

    def note(self, what: str) -> str | None:
        """One line saying how the rows were kept, or None when every row was."""
        if self._all is not None:
            return None
        over = f", {self.marks_over:,} more merged" if self.marks_over else ""
        return (
            f"{what}: {self.seen:,} rows read in one pass; kept the first {len(self._head):,} and "
            f"the last {len(self._recent):,} whole, {len(self._marked):,} marked rows (non-finite, "
            f"skipped, scale changes, spikes{over}) and the rest merged {self.width} to a row"
        )


def _fin_not(x: float | None) -> bool:
    return x is not None and not math.isfinite(x)
