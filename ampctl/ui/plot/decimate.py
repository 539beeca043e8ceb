"""A history of any length reduced, in one streaming pass, to what a figure can show.

The run's figure is about :data:`COLUMNS` pixel columns wide. A metrics series of up to
:data:`RAW_LIMIT` points is kept as it is (the figure of an ordinary run is drawn from every
row). Past that, the points go into buckets over the step axis, one bucket per ``width`` steps,
and each bucket keeps, per series, its first, lowest, highest and last point and its first
missing value (the M4 rule that TensorBoard-like tools for long signals use: a line through
those points draws the same pixels as a line through all of them; a gap stays a gap). The last
step is not known until the end, so the width adapts: when the buckets would span more than
``2 x COLUMNS`` widths, the width doubles and neighbouring pairs merge. Memory is bounded by the
bucket count, never by the run's length.

Rolled-back steps (a later row at the same or an earlier step) are kept apart, in buckets of
their own, and drawn dotted as before.

:class:`Marks` does the same for markers (skipped steps, events): every one up to a cap, beyond
it one marker per bucket with the count it stands for.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

COLUMNS = 1000  # the run figure is 10 in at 100 dpi
RAW_LIMIT = 2 * COLUMNS  # points kept as they are up to here
BUCKETS = 2 * COLUMNS  # buckets spanned before the width doubles
MARK_CAP = 1000  # markers kept one by one up to here


def _first_width(lo: float, hi: float, buckets: int) -> float:
    """The smallest power of two ``w`` with ``hi // w - lo // w < buckets``."""
    w = 1.0
    while math.floor(hi / w) - math.floor(lo / w) >= buckets:
        w *= 2.0
    return w


# one series in one bucket: [first_step, first_value, last_step, last_value, min_step, min_value,
# max_step, max_value, nan_step] (nan_step: the first missing value's step, or None)
def _new_stat(s: float, v: float) -> list:
    if v != v:  # NaN: a missing value
        return [None, None, None, None, None, None, None, None, s]
    return [s, v, s, v, s, v, s, v, None]


def _add_stat(st: list, s: float, v: float) -> None:
    if v != v:
        if st[8] is None or s < st[8]:
            st[8] = s
        return
    if st[0] is None:
        st[0:8] = [s, v, s, v, s, v, s, v]
        return
    if s < st[0]:
        st[0], st[1] = s, v
    if s >= st[2]:
        st[2], st[3] = s, v
    if v < st[5]:
        st[4], st[5] = s, v
    if v > st[7]:
        st[6], st[7] = s, v


def _merge_stat(a: list, b: list) -> list:
    out = list(a)
    if b[0] is not None:
        if out[0] is None:
            out[0:8] = b[0:8]
        else:
            if b[0] < out[0]:
                out[0], out[1] = b[0], b[1]
            if b[2] >= out[2]:
                out[2], out[3] = b[2], b[3]
            if b[5] < out[5]:
                out[4], out[5] = b[4], b[5]
            if b[7] > out[7]:
                out[6], out[7] = b[6], b[7]
    if b[8] is not None and (out[8] is None or b[8] < out[8]):
        out[8] = b[8]
    return out


def _stat_points(st: list) -> list[tuple[float, float]]:
    pts = []
    if st[0] is not None:
        pts = [(st[0], st[1]), (st[4], st[5]), (st[6], st[7]), (st[2], st[3])]
    if st[8] is not None:
        pts.append((st[8], math.nan))
    pts.sort(key=lambda p: p[0])
    out: list[tuple[float, float]] = []
    for p in pts:
        if not out or p[0] != out[-1][0] or (p[1] != out[-1][1] and p[1] == p[1]):
            out.append(p)
    return out


class Decimator:
    """Rows of several series sharing one step axis, fed in file order (:meth:`add`), reduced to
    at most a few points per pixel column (:meth:`series`). ``kept`` is False for points a later
    row went back over (a rollback or fallback replayed them)."""

    def __init__(
        self, keys: Sequence[str], *, raw_limit: int | None = None, buckets: int | None = None
    ) -> None:
        self.keys = tuple(keys)
        self.raw_limit = RAW_LIMIT if raw_limit is None else raw_limit
        self.buckets = BUCKETS if buckets is None else buckets
        self.raw: list[tuple[float, tuple[float, ...]]] | None = []
        self.count = 0  # points fed
        self.width = 1.0
        # bucket: [lowest step, highest step, stat per key]; the main line's buckets are in
        # step order (a dict keeps insertion order), rolled-back ones apart
        self.main: dict[int, list] = {}
        self.gone: dict[int, list] = {}
        self.lo: int | None = None
        self.hi: int | None = None
        self.last = -math.inf  # the main line's highest step

    @property
    def decimated(self) -> bool:
        return self.raw is None

    def add(self, step: float, values: tuple[float, ...]) -> None:
        """One row: its step (finite) and one value per key (NaN: missing)."""
        self.count += 1
        if self.raw is not None:
            self.raw.append((step, values))
            if len(self.raw) > self.raw_limit:
                self._to_buckets()
            return
        self._add(step, values)

    def _to_buckets(self) -> None:
        raw, self.raw = self.raw or [], None
        steps = [s for s, _ in raw]
        self.width = _first_width(min(steps), max(steps), self.buckets)
        for s, vals in raw:
            self._add(s, vals)

    def _add(self, step: float, values: tuple[float, ...]) -> None:
        if step <= self.last:  # went back: what the main line holds from here on is discarded
            while self.main:
                idx = next(reversed(self.main))
                b = self.main[idx]
                if b[0] < step:
                    break
                del self.main[idx]
                old = self.gone.get(idx)
                self.gone[idx] = b if old is None else _merge_bucket(old, b)
            self.last = max((b[1] for b in self.main.values()), default=-math.inf)
            self.last = min(self.last, step)
        idx = math.floor(step / self.width)
        if self.lo is None or idx < self.lo or idx > self.hi:
            self.lo = idx if self.lo is None else min(self.lo, idx)
            self.hi = idx if self.hi is None else max(self.hi, idx)
            while self.hi - self.lo >= self.buckets:
                self._double()
            idx = math.floor(step / self.width)
        b = self.main.get(idx)
        if b is None:
            self.main[idx] = [step, step, [_new_stat(step, v) for v in values]]
        else:  # the common case, inlined (_add_stat): this runs once per row and key
            if step < b[0]:
                b[0] = step
            if step > b[1]:
                b[1] = step
            for st, v in zip(b[2], values):  # noqa: B905 - one value per key
                if v != v or st[0] is None:
                    _add_stat(st, step, v)
                    continue
                if step < st[0]:
                    st[0] = step
                    st[1] = v
                if step >= st[2]:
                    st[2] = step
                    st[3] = v
                if v < st[5]:
                    st[4] = step
                    st[5] = v
                elif v > st[7]:
                    st[6] = step
                    st[7] = v
        if step > self.last:
            self.last = step

    def _double(self) -> None:
        self.width *= 2.0
        for name in ("main", "gone"):
            merged: dict[int, list] = {}
            for idx, b in getattr(self, name).items():
                j = idx // 2
                merged[j] = b if j not in merged else _merge_bucket(merged[j], b)
            setattr(self, name, merged)
        self.lo //= 2
        self.hi //= 2

    def points(self) -> int:
        """How many points :meth:`series` gives per key at most (what is held)."""
        if self.raw is not None:
            return len(self.raw)
        return 5 * (len(self.main) + len(self.gone))

    def series(self, key: str) -> tuple[list[float], list[float], list[bool]]:
        """(steps, values, kept) of one key: every row while it is short, else the buckets'
        points in step order, each rolled-back run placed after the kept point before it."""
        k = self.keys.index(key)
        if self.raw is not None:
            from .common import _kept

            xs = [s for s, _ in self.raw]
            return xs, [v[k] for _, v in self.raw], _kept(xs)
        xs, ys = [], []
        for b in self.main.values():
            for s, v in _stat_points(b[2][k]):
                xs.append(s)
                ys.append(v)
        kept = [True] * len(xs)
        runs: list[list[tuple[float, float]]] = []
        prev = None
        for idx in sorted(self.gone):
            pts = _stat_points(self.gone[idx][2][k])
            if prev is not None and idx == prev + 1 and runs:
                runs[-1].extend(pts)
            else:
                runs.append(list(pts))
            prev = idx
        if not runs:
            return xs, ys, kept
        out_x, out_y, out_k = [], [], []
        at = 0
        for run in (r for r in runs if r):
            cut = bisect.bisect_left(xs, run[0][0], lo=at)
            out_x += xs[at:cut]
            out_y += ys[at:cut]
            out_k += kept[at:cut]
            at = cut
            out_x += [p[0] for p in run]
            out_y += [p[1] for p in run]
            out_k += [False] * len(run)
        out_x += xs[at:]
        out_y += ys[at:]
        out_k += kept[at:]
        return out_x, out_y, out_k

    def last_at_or_before(self, key: str, step: float) -> tuple[float, float] | None:
        """The point of ``key`` a branch forked from: the last row (file order) at or before
        ``step`` while rows are kept, else the kept line's last point at or before it."""
        k = self.keys.index(key)
        if self.raw is not None:
            for s, v in reversed(self.raw):
                if s <= step:
                    return s, v[k]
            return None
        xs, ys, kept = self.series(key)
        best = None
        for x, y, kp in zip(xs, ys, kept, strict=True):
            if kp and x <= step:
                best = (x, y)
        return best


def _merge_bucket(a: list, b: list) -> list:
    return [
        min(a[0], b[0]),
        max(a[1], b[1]),
        [_merge_stat(x, y) for x, y in zip(a[2], b[2], strict=True)],
    ]


class Marks:
    """Markers on the step axis (skipped steps, events of one kind), fed in any order: every one
    up to ``cap``; beyond it, one marker per bucket of an adaptive width (the lowest ``y`` of the
    bucket, at its first step) with the count it stands for. Memory is bounded by ``cap``."""

    def __init__(self, cap: int | None = None, buckets: int | None = None) -> None:
        self.cap = MARK_CAP if cap is None else cap
        self.buckets = BUCKETS if buckets is None else buckets
        self.items: list[tuple[float, float, int]] | None = []  # (step, y, count)
        self.width = 1.0
        self.grouped: dict[int, list] = {}  # idx -> [step, y, count]
        self.total = 0  # what the markers stand for (sum of counts)
        self.seen = 0  # markers fed

    @property
    def is_grouped(self) -> bool:
        return self.items is None

    def add(self, step: float, y: float = math.nan, count: int = 1) -> None:
        self.total += count
        self.seen += 1
        if self.items is not None:
            self.items.append((step, y, count))
            if len(self.items) > self.cap:
                items, self.items = self.items, None
                steps = [s for s, _, _ in items]
                self.width = _first_width(min(steps), max(steps), self.buckets)
                for s, yy, c in items:
                    self._group(s, yy, c)
            return
        self._group(step, y, count)

    def _group(self, step: float, y: float, count: int) -> None:
        idx = math.floor(step / self.width)
        g = self.grouped.get(idx)
        if g is None:
            self.grouped[idx] = g = [step, y, count]
            keys = self.grouped.keys()
            while max(keys) - min(keys) >= self.buckets:
                self.width *= 2.0
                merged: dict[int, list] = {}
                for i, m in self.grouped.items():
                    j = i // 2
                    merged[j] = m if j not in merged else _merge_mark(merged[j], m)
                self.grouped = merged
                keys = self.grouped.keys()
            return
        g[:] = _merge_mark(g, [step, y, count])

    def marks(self) -> list[tuple[float, float, int]]:
        """(step, y, count) in step order (file order while every one is kept)."""
        if self.items is not None:
            return list(self.items)
        return [tuple(self.grouped[i]) for i in sorted(self.grouped)]  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.items) if self.items is not None else len(self.grouped)


def _merge_mark(a: list, b: list) -> list:
    ya, yb = a[1], b[1]
    y = yb if ya != ya else ya if yb != yb else min(ya, yb)
    return [min(a[0], b[0]), y, a[2] + b[2]]
