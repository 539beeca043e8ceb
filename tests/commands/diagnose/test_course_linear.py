"""The course's departure is O(n log n): the same answers as the quadratic original (kept here
as the reference) on random short histories, and a long history costs linear work."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ampctl.commands.diagnose import course as C
from ampctl.commands.diagnose.stages import Row


# ---------------------------------------------------------------------------- the reference
def _old_noise(vals, k):
    """The median distance of each row before ``k`` from the median of the rows centred on it."""
    h = C.LEVEL_ROWS // 2
    d = sorted(
        abs(vals[j].loss - sorted(r.loss for r in vals[j - h : j + h + 1])[h]) for j in range(h, k)
    )
    return 1.4826 * d[len(d) // 2] if d else 0.0


def old_departure(rows, stop=None):
    """``course.departure`` as it was before it streamed (a sort of all earlier rows and a scan
    of all rows for every row)."""
    vals = [
        r
        for r in rows
        if r.loss is not None and math.isfinite(r.loss) and (stop is None or r.step <= stop)
    ]
    if len(vals) < 2:
        return None
    levels = C._levels(vals)
    low = 0
    improved = False
    for i in range(1, len(vals)):
        lv, base = levels[i], levels[low]
        if improved:
            k = max(0, i - C.LEVEL_ROWS + 1)
            band = max(C.DEPARTURE * abs(base), C.NOISE_K * _old_noise(vals, k))
        else:
            band = C.DEPARTURE * abs(base)
        if lv > base + band:
            nxt = levels[i + 1] if i + 1 < len(vals) else None
            gap = i + 1 < len(vals) and any(
                x.step > vals[i].step
                and x.step < vals[i + 1].step
                and x.loss is not None
                and not math.isfinite(x.loss)
                for x in rows
            )
            if nxt is None or gap or nxt > base + band / 2:
                return C._departure(vals, levels, i, low, rows)
        if lv < base:
            low = i
            improved = improved or lv < levels[0] - C.RETURN / 2.5 * abs(levels[0])
    return None


# ---------------------------------------------------------------------------- the property
_loss = st.one_of(
    st.floats(0.01, 10.0),
    st.sampled_from([math.nan, math.inf, None, 1.0, 2.0, 0.5]),
)


_FACTORS = (0.7, 0.8, 1.2, 1.3, 1.4, 1.6)
_NONFINITE = (math.nan, math.inf, None)


@st.composite
def histories(draw):
    """A loss whose level steps up and down (by as much as the 25% band, around it) under noise
    of a drawn size (so the noise band, not only the 25% one, decides), with non-finite and
    missing losses, repeated steps and a learning rate now and then."""
    noise = draw(st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.2]))
    # per row: step gap, what happens (0: not finite, 1-2: the level moves), which factor/noise
    spec = draw(
        st.lists(
            st.tuples(st.integers(0, 2), st.integers(0, 19), st.integers(0, 5), st.integers(-2, 2)),
            min_size=15,
            max_size=50,
        )
    )
    level, step, rows = 2.0, 0, []
    for gap, kind, f, u in spec:
        step += gap
        if kind == 0:
            loss = _NONFINITE[f % 3]
        else:
            if kind <= 2:
                level *= _FACTORS[f]
            loss = level * (1 + noise * u / 2)
        rows.append(Row(step=step, loss=loss, learning_rate=1e-3 * (1 + f) if u > 0 else None))
    stop = draw(st.one_of(st.none(), st.integers(0, step + 1)))
    return rows, stop


@settings(max_examples=120, deadline=None)
@given(histories())
def test_departure_is_the_quadratic_original(h):
    rows, stop = h
    assert C.departure(rows, stop) == old_departure(rows, stop)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=40))
def test_running_noise_is_noise_of_the_prefix(ds):
    run = C._RunningNoise()
    for i, d in enumerate(ds):
        run.add(d)
        ref = sorted(ds[: i + 1])
        assert run.value() == 1.4826 * ref[len(ref) // 2]


def test_departure_found_in_a_rising_run_and_on_a_falling_one_none():
    fall = [Row(step=i, loss=2.0 - i / 100) for i in range(100)]
    assert C.departure(fall) is None
    rise = fall + [Row(step=100 + i, loss=1.0 + i / 10) for i in range(30)]
    d = C.departure(rise)
    assert d is not None and d == old_departure(rise)


def test_the_noise_is_work_linear_in_the_rows(monkeypatch):
    """Counted, not timed: each row's distance enters the running noise once (the original
    sorted every earlier row again for every row: n^2 / 2 entries for n rows)."""
    added = []
    orig = C._RunningNoise.add
    monkeypatch.setattr(C._RunningNoise, "add", lambda self, d: (added.append(d), orig(self, d)))
    for n in (2_000, 8_000):
        added.clear()
        # a falling loss with noise, then flat: the loss improved, the noise is used every row
        rows = [Row(step=i, loss=2.0 / (1 + i / 50) + 0.01 * ((i * 7) % 5)) for i in range(n)]
        assert C.departure(rows) is None
        assert len(added) <= n


def test_the_gap_index_finds_only_steps_strictly_between():
    bad = [3, 7, 7, 12]
    assert C._nonfinite_between(bad, 2, 4) and C._nonfinite_between(bad, 6, 8)
    assert not C._nonfinite_between(bad, 3, 7) and not C._nonfinite_between(bad, 12, 99)
    assert not C._nonfinite_between([], 0, 10) and not C._nonfinite_between(bad, 8, 12)


def test_the_noise_is_of_the_rows_before_the_window():
    """A short case where one row more or less in the noise changes the answer (the band at the
    rise of step 7 is the noise's)."""
    losses = [2.1, 1.95, 1.9, 1.95, 2.1, 2.05, 2.535, 2.47, 2.47]
    rows = [Row(step=i + 1, loss=v) for i, v in enumerate(losses)]
    assert C.departure(rows) == old_departure(rows)
    assert C.departure(rows[:-1]) == old_departure(rows[:-1])
