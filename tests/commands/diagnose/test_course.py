"""The course of a run (course.py) as pure functions of numbers: the loss's level and noise, where
it left its course and came back, outlier batches, runs of skipped steps and what they are (a
storm, calibration, isolated), the steps the checkpoints say were skipped, and the first sign of
trouble -- milliseconds; and the departure's O(n log n) search: the same answers as the quadratic
original (kept here as the reference) on random short histories, and a long history costs linear
work.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampctl.amp import records as rec
from ampctl.commands.diagnose import course as C
from ampctl.commands.diagnose.course import (
    STORM_MIN,
    CheckpointFacts,
    Course,
    Departure,
    departure,
    diverged,
    loss_spikes,
    run_course,
    skip_runs,
)
from ampctl.commands.diagnose.stages import (
    Episode,
    History,
    Row,
    ScalerState,
)

from .conftest import dep, history, rows


# ---------------------------------------------------------------------------- the loss
def test_a_falling_loss_with_per_batch_noise_stays_on_course():
    rng = random.Random(0)
    noisy = [0.3 * math.exp(-i / 80) + 0.05 * rng.gauss(0, 1) + 0.15 for i in range(200)]
    assert departure(rows(noisy)) is None


def test_a_loss_that_doubles_at_the_first_updates_departs_and_never_improved():
    d = departure(rows([3.9, 29.9, 30.1, 26.8, 45.8, 37.3]))
    assert d is not None and d.never_improved and d.resolved_at is None
    assert (d.min_loss, d.min_step, d.last_good_step) == (3.9, 1, 1)
    assert (d.peak, d.peak_step) == (45.8, 5)


def test_a_loss_that_rises_later_and_comes_back_is_resolved():
    course = [4.0 - 0.05 * i for i in range(20)]  # 4.0 -> 3.05
    course += [4.5, 4.6, 4.7, 4.6]  # a sustained rise
    course += [3.05, 3.0, 2.95, 2.9, 2.9, 2.9, 2.85]  # back, and lower
    d = departure(rows(course))
    assert d is not None and not d.never_improved and d.resolved_at is not None
    # the level (a median of 5 rows) crosses at the third high row; the last row on course is
    # the one before the rise
    assert (d.step, d.last_good_step, d.min_step) == (23, 20, 20) and d.resolved_at > 24


def test_one_outlier_batch_is_a_spike_not_a_departure():
    course = [1.0 - 0.01 * i for i in range(20)]
    course[10] = 1e21
    assert departure(rows(course)) is None
    (spike,) = loss_spikes(rows(course))
    assert spike.step == 11


# ---------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize(
    ("skipped", "kinds"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], ["calibration"]),  # at the start, then clean: its level
        ([12, 25], ["isolated", "isolated"]),  # growth probing
        (list(range(21, 21 + STORM_MIN)), ["storm"]),  # in a row, then clean: an ended storm
        ([37, 38], ["isolated"]),  # still going at the end, but only two
        ([35, 36, 37, 38, 39, 40], ["storm"]),  # still going at the end, half a storm or more
    ],
)
def test_skipped_steps_are_calibration_isolated_or_a_storm(skipped, kinds):
    h = history([3.0 - 0.01 * i for i in range(40)], skipped)
    course = run_course(h, None, [])
    assert [e.kind for e in course.episodes] == kinds


def test_isolated_skips_leave_no_trouble_and_a_running_storm_is_the_first_sign():
    losses = [3.0 - 0.01 * i for i in range(40)]
    assert run_course(history(losses, [12, 25]), None, []).first_bad_step is None
    course = run_course(history(losses, range(31, 41)), None, [])
    assert course.first_bad_step == 31 and not course.episodes[-1].resolved


def test_checkpoints_tell_which_steps_were_skipped():
    """Adam counts the updates it applied; a skipped step halves the scale."""
    cks = [
        CheckpointFacts("c10", 10, [], scale=65536.0, applied=10),
        CheckpointFacts("c20", 20, [], scale=65536.0, applied=20),
        CheckpointFacts("c30", 30, [], scale=16384.0, applied=28),  # 2 skips, 2 halvings
        CheckpointFacts("c40", 40, [], scale=16.0, applied=28),  # none applied, scale fell
    ]
    course = run_course(None, None, cks)
    (storm,) = course.episodes
    assert (storm.kind, storm.start, storm.end, storm.resolved) == ("storm", 29, 40, False)
    assert course.first_bad_step == 29
    # a checkpoint that applied nothing while its scale stayed (a copy, not a storm): nothing
    same = [cks[0], CheckpointFacts("c100", 100, [], scale=65536.0, applied=10)]
    assert run_course(None, None, same).episodes == []


# =================================================================================== piece by piece
INF, NAN = math.inf, math.nan


def test_the_constants_are_the_documented_ones():
    assert (C.STORM_MIN, C.DEPARTURE, C.RETURN, C.NOISE_K, C.LEVEL_ROWS, C.SPIKE_FACTOR) == (
        8,
        0.25,
        0.05,
        4.0,
        5,
        10.0,
    )


# ---------------------------------------------------------------------------- records
def test_lr_rose_is_a_rise_of_more_than_5_percent_from_the_lowest_row_to_the_peak():
    assert dep(lr_at_min=1.0, lr_peak=1.06).lr_rose is True
    assert dep(lr_at_min=1.0, lr_peak=1.05).lr_rose is False
    assert dep(lr_at_min=1.0, lr_peak=0.5).lr_rose is False
    assert dep(lr_at_min=None, lr_peak=2.0).lr_rose is False
    assert dep(lr_at_min=1.0, lr_peak=None).lr_rose is False
    assert dep(lr_at_min=0.0, lr_peak=2.0).lr_rose is False


def test_a_course_finds_its_unresolved_episode_and_its_episodes_of_a_kind():
    a = Episode("storm", 1, 8, True, "a")
    b = Episode("isolated", 9, 9, True, "b")
    c = Episode("storm", 20, 30, False, "c")
    d = Episode("storm", 40, 50, False, "d")
    course = Course(episodes=[a, b, c, d])
    assert course.unresolved("storm") is c
    assert course.unresolved("isolated") is None
    assert course.unresolved("departure") is None
    assert course.of("storm") == [a, c, d] and course.of("isolated") == [b]
    assert course.of("calibration") == []
    fresh = Course()
    assert (fresh.episodes, fresh.departure, fresh.first_bad_step, fresh.inferred) == (
        [],
        None,
        None,
        [],
    )
    assert (fresh.first_step, fresh.last_step) == (None, None)
    Course().episodes.append(a)
    assert Course().episodes == []  # not a shared default


def test_checkpoint_facts_default_to_no_scale_and_no_update_count():
    c = CheckpointFacts("p", 3, [])
    assert (c.scale, c.applied) == (None, None)


# ---------------------------------------------------------------------------- level and noise
def test_the_level_is_the_median_of_the_last_five_rows():
    # the last row: 5 rows (1, 4, 2, 3, 10) say 3; 4 rows or 6 would say 3.5
    assert C._levels(rows([5, 1, 4, 2, 3, 10])) == [5, 3.0, 4, 3.0, 3, 3]
    assert C._levels(rows([2, 9, 4, 7, 1, 8, 6])) == [2, 5.5, 4, 5.5, 4, 7, 6]
    assert C._levels([]) == []


def test_the_noise_is_each_row_s_distance_from_the_median_centred_on_it():
    r = rows([5, 5, 5, 5, 5, 6, 3, 8, 1])
    # rows 2-6 have a full centred window: distances 0, 0, 0, 1 (6 vs 5), 2 (3 vs 5)
    assert [C._spread(r, j) for j in range(2, 7)] == [0, 0, 0, 1, 2]
    # a falling loss has no noise (a trailing median lags it: 3 at the fifth row, 2 from it)
    fall = rows([10, 9, 8, 7, 6, 5, 4, 3])
    assert [C._spread(fall, j) for j in range(2, 6)] == [0, 0, 0, 0]
    noise = C._RunningNoise()
    for d in (0, 1, 2, 3, 4):
        noise.add(d)
    assert noise.value() == pytest.approx(1.4826 * 2)
    assert C._RunningNoise().value() == 0.0  # nothing known: no noise


# ---------------------------------------------------------------------------- departure
def test_too_few_rows_have_no_course():
    assert departure([]) is None
    assert departure(rows([1.0])) is None
    assert departure(rows([1.0, None, INF, NAN])) is None  # only one finite loss
    d = departure(rows([1.0, 2.0]))  # two rows are enough: level 1.5 > 1.25
    assert (d.step, d.min_step, d.loss, d.never_improved) == (2, 1, 1.5, True)


def test_a_rise_of_exactly_25_percent_stays_on_course_and_more_departs():
    assert departure(rows([4.0] * 5 + [5.0] * 5)) is None
    d = departure(rows([4.0] * 5 + [5.01] * 5))
    # the level (a median of 5) crosses at the third high row; the lowest level is the first
    # row of the flat start; the loss never fell: the row it rose from is the flat start's last
    assert d == Departure(
        step=8,
        last_good_step=5,
        loss=5.01,
        min_loss=4.0,
        min_step=1,
        first_loss=4.0,
        peak=5.01,
        peak_step=6,  # the first row of the rise
        resolved_at=None,
        never_improved=True,
    )


def test_a_negative_loss_is_measured_by_its_size():
    assert departure(rows([-1.0] * 5 + [-0.8] * 5)) is None
    d = departure(rows([-1.0] * 5 + [-0.7] * 5))
    assert (d.step, d.min_loss, d.loss) == (8, -1.0, -0.7)


def test_a_negative_loss_falls_rises_and_comes_back_by_its_size():
    """The bands are fractions of the loss's size: a negative loss is back within 5% of its
    lowest level, on course within 25% of it, and has fallen only 2% below its first level."""
    # flat at -1, up to -0.5, back at -1: it never fell, and it came back
    d = departure(rows([-1.0] * 5 + [-0.5] * 5 + [-1.0] * 6))
    assert (d.step, d.never_improved, d.resolved_at, d.last_good_step) == (8, True, 13, 5)
    # fell 7.5% (to -2.15), rose to -1: the last row on course is the last at the lowest level
    # (step 4): the rows at -2.0 after it were already above it
    d = departure(rows([-2.0, -2.1, -2.2, -2.3] + [-2.0] * 5 + [-1.0] * 6))
    assert (d.step, d.never_improved, d.resolved_at, d.last_good_step) == (12, False, None, 4)
    # fell 1% only: not a fall
    d = departure(rows([-1.0, -1.01, -1.01, -1.01] + [-0.5] * 6))
    assert (d.step, d.never_improved, d.min_step) == (7, True, 3)


def test_the_rows_after_stop_and_non_finite_losses_are_not_read():
    losses = [4.0] * 5 + [None, NAN, INF] + [6.0] * 5
    assert departure(rows(losses)).step == 11
    assert departure(rows(losses), stop=10) is None
    assert departure(rows(losses), stop=11).step == 11  # the row at stop counts


def test_a_loss_that_fell_departs_only_beyond_four_times_its_noise():
    """Once the loss fell (its level below 98% of its first), its per-row noise sets the bar:
    here +-2 around 5 (noise 1.4826 x 2, band 11.86): a level of 15 is noise, 17 is not."""
    base = [10] + [5, 7, 5, 3] * 4
    assert departure(rows(base + [15] * 6)) is None
    d = departure(rows(base + [17] * 6))
    assert (d.step, d.min_step, d.min_loss, d.never_improved) == (20, 5, 5, False)
    assert d.last_good_step == 17  # the last row whose own loss is within 25% of 5


def test_the_loss_has_fallen_only_below_98_percent_of_its_first_level():
    """A level of exactly 98% of the first is not a fall: the 25% bar holds (130 departs);
    below it the noise (+-10, band 59) is the bar and 130 is noise."""
    for low, departs in ((98, True), (97.9, False)):
        losses = [100] + [low, low + 10, low, low - 10] * 4 + [130] * 6
        d = departure(rows(losses))
        assert (d is not None) is departs
        if d is not None:
            # the last row of the flat course at its lowest level (the rise began after it)
            assert (d.step, d.min_step, d.never_improved, d.last_good_step) == (20, 5, True, 17)


def test_the_noise_is_that_of_the_rows_before_the_levels_window():
    # noise over the rows before the window (+-2: band 11.86); counted over the rows of the
    # rise itself too, the bar would be far higher and the rise would hide itself
    base = [10] + [5, 7, 5, 3] * 4 + [5] * 4
    d = departure(rows(base + [18, 18, 18, 5, 18, 18]))
    assert d is not None and d.step == 24


def test_a_crossing_is_confirmed_by_the_next_rows_level_above_half_the_band():
    # levels 4, 5.1 (above 4 + 1), then 4.5: exactly half the band, not confirmed
    assert departure(rows([4.0, 6.2, 4.5, 4.0, 4.0])) is None
    d = departure(rows([4.0, 6.2, 4.51, 4.0, 4.0]))
    assert (d.step, d.loss) == (2, pytest.approx(5.1))


def test_a_non_finite_step_right_after_a_crossing_confirms_it():
    r = rows([4.0, 6.2]) + [Row(step=3, loss=NAN)] + rows([4.5, 4.0, 4.0], start=4)
    d = departure(r)
    assert d is not None and d.step == 2
    # a non-finite step later than the next row does not
    r = rows([4.0, 6.2, 4.5]) + [Row(step=4, loss=INF)] + rows([4.0, 4.0], start=5)
    assert departure(r) is None


def test_a_row_without_a_loss_is_not_a_non_finite_step():
    """A row that logged no loss (an eval row, a row of lr only) confirms nothing: only the
    next row, or a non-finite loss, confirms a crossing."""
    r = rows([4.0, 6.2]) + [Row(step=3, loss=None)] + rows([4.5, 4.0, 4.0], start=4)
    assert departure(r) is None


def test_a_resolved_departure_with_its_lr():
    """Falls to 2.0 (lowest level at step 7) while a warmup raises the lr, rises to 3.x once the
    lr passed 0.875, and comes back within 5% once the lr is cut to 0.5."""
    losses = [4.0, 3.5, 3.0, 2.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    losses += [2.4, 3.0, 3.2, 3.1, 3.0, 3.0] + [2.1] * 6
    lr = [(i + 1) / 8 for i in range(12)] + [1.5] * 4 + [0.5] * 6
    d = departure(rows(losses, lr=lr))
    assert d == Departure(
        step=14,
        last_good_step=11,  # its own loss 2.4 within 25% of 2.0; step 12's 3.0 is not
        loss=3.0,
        min_loss=2.0,
        min_step=7,
        first_loss=4.0,
        peak=3.2,  # the highest row from the last one on course until it came back
        peak_step=13,
        resolved_at=19,  # the levels at 19 and 20 are within 5% of 2.0
        never_improved=False,
        lr_at_min=0.875,
        lr_at_step=1.5,
        lr_peak=1.5,
        lr_peak_step=12,
        lr_back=0.5,
    )
    assert d.lr_rose


def test_coming_back_takes_two_levels_within_5_percent():
    lowest = [4.0, 3.5, 3.0, 2.5] + [2.0] * 6
    rise = [3.0, 3.0, 3.0]
    # one level back at 2.1 (exactly 5% above 2.0, at step 18), then up again: not back
    once = departure(rows(lowest + rise + [2.1, 3.0, 3.0, 2.1, 2.1, 3.0, 3.0, 3.0, 3.0]))
    assert (once.step, once.resolved_at, once.peak) == (13, None, 3.0)
    # two in a row (16 and 17): back at the first of them
    twice = departure(rows(lowest + rise + [2.1] * 4 + [3.0] * 3))
    assert (twice.step, twice.resolved_at) == (13, 16)
    # 2.11 is more than 5% above 2.0: not back
    assert departure(rows(lowest + rise + [2.11] * 6)).resolved_at is None


def test_the_peak_is_the_highest_row_before_it_came_back_and_the_lr_peak_is_up_to_it():
    losses = [4.0, 3.5, 3.0, 2.5] + [2.0] * 6 + [3.0, 3.0, 3.0, 3.5, 3.2] + [2.0] * 6
    lr = [0.1] * 10 + [0.4, 0.3, 0.2, 0.25, 0.9] + [0.9] * 6
    d = departure(rows(losses, lr=lr))
    # the fall (4.0 -> 2.0) is a trend, not noise (#36): the bar is 25% and the crossing at 13,
    # the level's third row of the rise (a trailing median counted the fall as noise: 14)
    assert (d.step, d.peak, d.peak_step, d.resolved_at) == (13, 3.5, 14, 18)
    # the lr after the peak (0.9 at 15) is not the lr the loss rose with
    assert (d.lr_peak, d.lr_peak_step, d.lr_at_min, d.lr_at_step, d.lr_back) == (
        0.4,
        11,
        0.1,
        0.2,
        0.9,
    )
    # rows without an lr are passed over
    lr2 = [0.1] * 10 + [None, 0.3, 0.2, 0.25, 0.9] + [0.9] * 6
    d = departure(rows(losses, lr=lr2))
    assert (d.lr_peak, d.lr_peak_step) == (0.3, 12)
    d = departure(rows(losses))
    assert (d.lr_peak, d.lr_peak_step, d.lr_at_min, d.lr_back) == (None, None, None, None)


def test_a_loss_that_never_fell_rose_from_its_first_row():
    d = departure(rows([3.9, 29.9, 30.1, 26.8, 45.8, 37.3]))
    assert (d.never_improved, d.last_good_step, d.min_step, d.first_loss) == (True, 1, 1, 3.9)
    # a first row already above the band: the first row still is where it rose from
    d = departure(rows([3.9, 3.8, 30.0, 30.0, 30.0]))
    assert (d.never_improved, d.last_good_step, d.min_step) == (True, 2, 2)


# ---------------------------------------------------------------------------- outlier batches
def test_a_spike_is_ten_times_the_level_and_back_below_twice_it_on_the_next_row():
    assert [r.step for r in loss_spikes(rows([1, 1, 1, 10, 1]))] == [4]
    assert loss_spikes(rows([1, 1, 1, 9.99, 1])) == []
    assert loss_spikes(rows([1, 1, 1, 10, 2])) == []  # not back
    assert [r.step for r in loss_spikes(rows([1, 1, 1, 10, 1.99]))] == [4]
    # the level before the spike, not with it
    assert [r.step for r in loss_spikes(rows([1, 10, 1.5]))] == [2]
    # the first row and the last row are no spikes (no level before, no row after)
    assert loss_spikes(rows([10, 0.5, 0.5])) == []
    assert loss_spikes(rows([1, 1, 1, 1, 10])) == []
    # a level of 0 or below has no ratio
    assert loss_spikes(rows([0, 5, -1])) == []
    assert loss_spikes(rows([0, 0, 0])) == []
    # non-finite rows are passed over
    spikes = loss_spikes(rows([1, NAN, 1, 10, None, 1]))
    assert [r.step for r in spikes] == [4]
    assert loss_spikes([]) == []


# ---------------------------------------------------------------------------- skipped steps
def test_skip_runs_groups_consecutive_steps():
    assert skip_runs([5, 3, 4, 4, 9, 10, 1]) == [(1, 1), (3, 5), (9, 10)]
    assert skip_runs([]) == []
    assert skip_runs([7]) == [(7, 7)]


def test_the_scale_in_force_at_a_step():
    h = history(scale=[(1, 65536.0), (5, 32768.0), (9, 16384.0)])
    assert [C._scale_at(h, s) for s in (0, 1, 4, 5, 8, 9, 100)] == [
        None,
        65536.0,
        65536.0,
        32768.0,
        32768.0,
        16384.0,
        16384.0,
    ]
    assert C._scale_at(None, 5) is None


def test_listed_and_span_texts():
    assert C._listed([1, 2, 3, 4, 5, 6]) == "1, 2, 3, 4, 5, 6"
    assert C._listed([1, 2, 3, 4, 5, 6, 7]) == "1, 2, 3, 4, 5, 6 ... (7 in all)"
    assert C._listed([]) == ""
    assert C._span(3, 3) == "3"
    assert C._span(3, 5) == "3–5"


def _kinds(eps):
    return [(e.kind, e.start, e.end, e.resolved, e.text) for e in eps]


def test_a_run_of_skipped_steps_is_non_finite_loss_when_half_or_more_were_forward():
    ep = C._skip_episodes([5, 6, 7, 8], {5, 6}, 1, [20], None)
    assert _kinds(ep) == [("nonfinite_loss", 5, 8, True, "non-finite loss: 4 steps skipped at 5–8")]
    ep = C._skip_episodes([5, 6, 7, 8], {5}, 1, [20], None)
    assert _kinds(ep) == [("isolated", 5, 8, True, "4 steps skipped at 5–8")]
    ep = C._skip_episodes([5], {5}, 1, [20], None)
    assert _kinds(ep) == [("nonfinite_loss", 5, 5, True, "non-finite loss: 1 step skipped at 5")]


def test_skips_at_the_start_that_ended_are_calibration():
    ep = C._skip_episodes([1, 2, 3], set(), 1, [4], None)
    assert _kinds(ep) == [
        (
            "calibration",
            1,
            3,
            True,
            "3 steps skipped at 1–3 at the start while the scale found its level",
        )
    ]
    # the first step after a step-0 row is still the start; the one after that is not
    assert C._skip_episodes([1, 2], set(), 0, [4], None)[0].kind == "calibration"
    assert C._skip_episodes([2, 3], set(), 0, [4], None)[0].kind == "isolated"
    # no first step known: not calibration
    assert C._skip_episodes([1, 2], set(), None, [4], None)[0].kind == "isolated"
    # still going at the end: a storm of half the size or more, not a level found
    ep = C._skip_episodes([1, 2, 3, 4], set(), 1, [], None)
    assert _kinds(ep) == [
        (
            "storm",
            1,
            4,
            False,
            "4 steps skipped at 1–4 in a row, still skipping at the end of the record",
        )
    ]


def test_eight_skips_in_a_row_are_a_storm_and_four_still_going_are_too():
    h = history(scale=[(1, 65536.0), (11, 32768.0), (19, 128.0)])
    ep = C._skip_episodes(list(range(11, 19)), set(), 1, [30], h)
    assert _kinds(ep) == [
        ("storm", 11, 18, True, "8 steps skipped at 11–18 in a row (scale 65536 -> 32768)")
    ]
    ep = C._skip_episodes(list(range(11, 18)), set(), 1, [30], None)
    assert _kinds(ep) == [("isolated", 11, 17, True, "7 steps skipped at 11–17")]
    ep = C._skip_episodes([11, 12, 13, 14], set(), 1, [10], None)
    assert _kinds(ep) == [
        (
            "storm",
            11,
            14,
            False,
            "4 steps skipped at 11–14 in a row, still skipping at the end of the record",
        )
    ]
    ep = C._skip_episodes([11, 12, 13], set(), 1, [10], None)
    assert _kinds(ep) == [
        (
            "isolated",
            11,
            13,
            False,
            "3 steps skipped at 11–13, still skipping at the end of the record",
        )
    ]


def test_a_run_is_over_when_a_clean_step_follows_it():
    # a clean step at the run's last step itself (the scaler's record) ends it too
    assert C._skip_episodes([11, 12, 13], set(), 1, [5, 13], None)[0].resolved is True
    assert C._skip_episodes([11, 12, 13], set(), 1, [5, 12], None)[0].resolved is False
    assert C._skip_episodes([11, 12, 13], set(), 1, [14, 5], None)[0].resolved is True


def test_the_scale_is_named_only_when_it_changed():
    h = history(scale=[(1, 1024.0), (12, 512.0)])
    assert C._skip_episodes([12], set(), 1, [30], h)[0].text == (
        "1 step skipped at 12 (scale 1024 -> 512)"
    )
    assert C._skip_episodes([11], set(), 1, [30], h)[0].text == "1 step skipped at 11"
    h = history(scale=[(5, 1024.0)])
    assert C._skip_episodes([5], set(), 1, [30], h)[0].text == "1 step skipped at 5"


# ---------------------------------------------------------------------------- checkpoints
def test_halvings():
    assert C._halvings(65536.0, 16384.0) == 2.0
    assert C._halvings(8.0, 0.0) == math.inf
    assert C._halvings(0.0, 1.0) == 0.0
    assert C._halvings(-1.0, 1.0) == 0.0
    assert C._halvings(1.0, 4.0) == -2.0


def test_no_update_applied_while_the_scale_fell_means_every_step_was_skipped():
    a = CheckpointFacts("c10", 10, [], scale=1024.0, applied=10)
    b = CheckpointFacts("c20", 20, [], scale=512.0, applied=10)
    assert C._inferred_skips([b, a]) == (
        list(range(11, 21)),
        ["c20: the optimizer applied no update in steps 11-20 (every step skipped)"],
    )
    # the scale stayed: a copy, not a storm; a scale at 0 before and after: it fell to 0
    same = CheckpointFacts("c20", 20, [], scale=1024.0, applied=10)
    assert C._inferred_skips([a, same]) == ([], [])
    z0 = CheckpointFacts("z10", 10, [], scale=0.0, applied=10)
    z1 = CheckpointFacts("z20", 20, [], scale=0.0, applied=10)
    assert C._inferred_skips([z0, z1])[0] == list(range(11, 21))
    # no scale known: nothing said
    n0 = CheckpointFacts("n10", 10, [], applied=10)
    n1 = CheckpointFacts("n20", 20, [], applied=10)
    assert C._inferred_skips([n0, n1]) == ([], [])
    # the same step twice: no steps in between
    twin = CheckpointFacts("t", 10, [], scale=1.0, applied=10)
    assert C._inferred_skips([a, twin]) == ([], [])
    # checkpoints without a step are left out
    assert C._inferred_skips([a, CheckpointFacts("x", None, [], scale=1.0, applied=10)]) == (
        [],
        [],
    )


def test_without_update_counts_a_scale_halved_once_per_step_means_every_step():
    a = CheckpointFacts("a", 10, [], scale=1024.0)
    assert C._inferred_skips([a, CheckpointFacts("b", 14, [], scale=64.0)]) == (
        [11, 12, 13, 14],
        [],
    )
    assert C._inferred_skips([a, CheckpointFacts("b", 15, [], scale=64.0)]) == ([], [])
    assert C._inferred_skips([a, CheckpointFacts("b", 14, [], scale=0.0)])[0] == [11, 12, 13, 14]
    # one side counted, the other not: the scales decide
    b = CheckpointFacts("b", 11, [], scale=512.0, applied=11)
    assert C._inferred_skips([a, b]) == ([11], [])
    assert C._inferred_skips([a, CheckpointFacts("b", 11, [], scale=None)]) == ([], [])
    assert C._inferred_skips([a, CheckpointFacts("b", 10, [], scale=1.0)]) == ([], [])


def test_k_skips_with_k_halvings_are_the_last_k_steps_when_the_storm_goes_on():
    c10 = CheckpointFacts("c10", 10, [], scale=65536.0, applied=10)
    c20 = CheckpointFacts("c20", 20, [], scale=16384.0, applied=18)  # 2 skipped, 2 halvings
    c30 = CheckpointFacts("c30", 30, [], scale=16.0, applied=18)  # none applied, fell
    steps, notes = C._inferred_skips([c10, c20, c30])
    assert steps == [19, 20, *range(21, 31)] and len(notes) == 1
    # the storm did not go on after: which 2 of the 10 steps is not known
    c30ok = CheckpointFacts("c30", 30, [], scale=16384.0, applied=28)
    assert C._inferred_skips([c10, c20, c30ok]) == ([], [])
    # 2 skipped but 3 halvings: not the same storm
    c20b = CheckpointFacts("c20", 20, [], scale=8192.0, applied=18)
    assert C._inferred_skips([c10, c20b, c30])[0] == list(range(21, 31))
    # the last pair: it goes on when the scale ended below 1
    low = CheckpointFacts("c20", 20, [], scale=0.25, applied=18)
    c10s = CheckpointFacts("c10", 10, [], scale=1.0, applied=10)
    assert C._inferred_skips([c10s, low])[0] == [19, 20]
    at1 = CheckpointFacts("c20", 20, [], scale=1.0, applied=18)
    c10t = CheckpointFacts("c10", 10, [], scale=4.0, applied=10)
    assert C._inferred_skips([c10t, at1])[0] == []
    # ... or fell to 0 (infinitely many halvings)
    zero = CheckpointFacts("c20", 20, [], scale=0.0, applied=17)
    assert C._inferred_skips([c10s, zero])[0] == [18, 19, 20]
    # no scale before (0 or unknown), or none after: nothing
    assert C._inferred_skips([CheckpointFacts("a", 10, [], scale=0.0, applied=10), low]) == (
        [],
        [],
    )
    assert C._inferred_skips([c10s, CheckpointFacts("b", 20, [], applied=18)]) == ([], [])
    assert C._inferred_skips([CheckpointFacts("a", 10, [], applied=10), low]) == ([], [])
    # every step applied, or more applied than steps: none skipped
    assert C._inferred_skips([c10s, CheckpointFacts("b", 20, [], scale=0.25, applied=20)]) == (
        [],
        [],
    )
    assert C._inferred_skips([c10s, CheckpointFacts("b", 20, [], scale=0.25, applied=21)]) == (
        [],
        [],
    )
    # not the last pair and the next interval not all skipped: it did not go on
    assert C._inferred_skips([c10s, low, CheckpointFacts("c", 30, [], scale=0.125)]) == ([], [])


# ---------------------------------------------------------------------------- the course
def scaler(rows_, **kw):
    return ScalerState(kind="ampctl", enabled=True, scale=1.0, rows=list(rows_), **kw)


def test_the_scalers_record_gives_the_rows_when_there_is_no_history():
    s = scaler([(1, 1024.0, rec.CLEAN, 3.0), (2, 1024.0, rec.GRADIENT, 2.9)])
    assert C._scaler_rows(s) == [
        Row(step=1, loss=3.0, scale=1024.0),
        Row(step=2, loss=2.9, scale=1024.0),
    ]
    assert C._scaler_rows(None) == []
    assert C._scaler_rows(scaler([])) == []
    # a record that does not start at the first update (a ring buffer that wrapped): not used
    assert C._scaler_rows(scaler([(2, 1024.0, rec.CLEAN, 3.0)])) == []


def test_the_scalers_record_gives_the_skipped_steps_and_the_spikes():
    kinds = [rec.CLEAN] * 4 + [rec.GRADIENT, rec.FORWARD, rec.SPIKE] + [rec.CLEAN] * 3
    s = scaler([(i + 1, 1024.0, k, 3.0) for i, k in enumerate(kinds)])
    course = run_course(None, s, [])
    assert _kinds(course.episodes) == [("isolated", 5, 6, True, "2 steps skipped at 5–6")]
    assert (course.first_step, course.last_step, course.first_bad_step) == (1, 10, None)
    # ... a record that starts later is not read
    late = scaler([(i + 2, 1024.0, k, 3.0) for i, k in enumerate(kinds)])
    course = run_course(None, late, [])
    assert (course.episodes, course.first_step, course.last_step) == ([], None, None)
    # with a history, its skipped steps and its guard events are the record
    h = history([3.0] * 10, skipped=[8])
    course = run_course(h, s, [])
    assert _kinds(course.episodes) == [("isolated", 8, 8, True, "1 step skipped at 8")]
    h = history([3.0] * 10)
    course = run_course(h, s, [])  # no skipped steps in the history: the scaler's
    assert [(e.kind, e.start, e.end) for e in course.episodes] == [("isolated", 5, 6)]
    # a step the checkpoints say was skipped is no overflow when the record says spike
    cks = [
        CheckpointFacts("c6", 6, [], scale=1024.0, applied=6),
        CheckpointFacts("c7", 7, [], scale=512.0, applied=6),
    ]
    course = run_course(None, s, cks)
    assert [(e.kind, e.start, e.end) for e in course.episodes] == [("isolated", 5, 6)]


def test_the_scalers_clean_updates_end_a_run_of_skips():
    kinds = [rec.CLEAN] * 3 + [rec.GRADIENT] * 4 + [rec.CLEAN]
    s = scaler([(i + 1, 1024.0, k, NAN if k else 3.0) for i, k in enumerate(kinds)])
    h = history([3.0, 3.0, 3.0])  # the log ends before the skips
    course = run_course(h, s, [])
    assert [(e.kind, e.start, e.end, e.resolved) for e in course.episodes] == [
        ("isolated", 4, 7, True)
    ]
    # without the record, four skips at the end of the record: a storm still going
    h = history([3.0, 3.0, 3.0], skipped=[4, 5, 6, 7])
    course = run_course(h, None, [])
    assert [(e.kind, e.resolved) for e in course.episodes] == [("storm", False)]
    assert course.first_bad_step == 4


def test_spikes_the_guard_skipped_are_not_overflows():
    h = history([3.0] * 10, skipped=[4, 5], events=[(5, "spike", {})])
    course = run_course(h, None, [])
    assert _kinds(course.episodes) == [("isolated", 4, 4, True, "1 step skipped at 4")]
    # a history's spikes, not the scaler's record, when both are there
    s = scaler([(i + 1, 1.0, rec.SPIKE if i == 3 else rec.CLEAN, 3.0) for i in range(10)])
    course = run_course(history([3.0] * 10, skipped=[4]), s, [])
    assert [e.start for e in course.episodes] == [4]


def test_non_finite_losses_and_forward_overflows_are_skipped_steps():
    r = rows([3.0, 3.0, NAN, INF, 3.0, 3.0])
    h = History(source="run folder", rows=r)
    course = run_course(h, None, [])
    assert _kinds(course.episodes) == [
        ("nonfinite_loss", 3, 4, True, "non-finite loss: 2 steps skipped at 3–4")
    ]
    ev = [
        (5, "overflow", {"overflow": "forward"}),
        (6, "overflow", {"overflow": "forward", "discarded": True}),
        (7, "overflow", {"overflow": "gradient"}),
    ]
    h = history([3.0] * 10, events=ev)
    course = run_course(h, None, [])
    assert _kinds(course.episodes) == [
        ("nonfinite_loss", 5, 5, True, "non-finite loss: 1 step skipped at 5")
    ]
    # a non-finite loss with no row after it: still going, the first sign of trouble
    h = History(source="run folder", rows=rows([3.0, 3.0, 3.0, NAN, NAN]))
    course = run_course(h, None, [])
    assert [(e.kind, e.resolved) for e in course.episodes] == [("nonfinite_loss", False)]
    assert course.first_bad_step == 4


def test_the_course_spans_the_rows_the_skips_and_the_checkpoints():
    h = history([3.0] * 5, skipped=[7], start=3)
    cks = [CheckpointFacts("c", 12, []), CheckpointFacts("x", None, [])]
    course = run_course(h, None, cks)
    assert (course.first_step, course.last_step) == (3, 12)
    assert run_course(None, None, []).first_step is None
    empty = run_course(History(source="x"), None, [])
    assert (empty.episodes, empty.departure, empty.first_bad_step) == ([], None, None)


def test_the_checkpoints_notes_and_steps_join_the_course():
    a = CheckpointFacts("c10", 10, [], scale=1024.0, applied=10)
    b = CheckpointFacts("c20", 20, [], scale=512.0, applied=10)
    course = run_course(history([3.0] * 10), None, [a, b])
    assert course.inferred == [
        "c20: the optimizer applied no update in steps 11-20 (every step skipped)"
    ]
    assert _kinds(course.episodes) == [
        (
            "storm",
            11,
            20,
            False,
            "10 steps skipped at 11–20 in a row, still skipping at the end of the record",
        )
    ]


def test_the_peak_is_where_the_loss_rose_to_not_only_the_rows_after_the_levels_crossing():
    """The level (a median of 5) crosses two rows after the loss rose: the peak the verdict
    names is the highest row after the last one on course, not a row after the crossing."""
    losses = [4.0, 3.5, 3.0, 2.5] + [2.0] * 6 + [3.0] * 3 + [2.1] * 4 + [3.0] * 3
    d = departure(rows(losses))
    assert (d.step, d.last_good_step, d.resolved_at) == (13, 10, 16)
    assert (d.peak, d.peak_step) == (3.0, 11)  # not 2.1 at step 14


def test_the_peak_counts_the_rows_that_raised_the_level_even_before_a_row_on_course():
    """Noisy rows: the level crosses only at the last row, after a row back on course (10).
    The rows that raised the level (8-9, in its window) are the rise: the peak is 10 at step 9,
    not the last row's 4."""
    d = departure(rows([3.0] * 6 + [2.0, 4.0, 10.0, 2.0, 4.0]))
    assert (d.step, d.loss, d.min_loss, d.last_good_step) == (11, 4.0, 3.0, 10)
    assert (d.peak, d.peak_step) == (10.0, 9)


def test_a_departure_and_a_spike_are_episodes_in_step_order():
    losses = [4.0, 3.5, 3.0, 2.5] + [2.0] * 6 + [3.0, 3.0, 3.0, 3.5, 3.2] + [2.0] * 6
    losses[2] = 40.0
    course = run_course(history(losses, skipped=[5]), None, [])
    assert _kinds(course.episodes) == [
        ("loss_spike", 3, 3, True, "a single loss of 40 at step 3"),
        ("isolated", 5, 5, True, "1 step skipped at 5"),
        (
            "departure",
            13,
            18,
            True,
            "the loss rose from 2 (step 7) to 3.5 (step 14), back at step 18",
        ),
    ]
    assert course.first_bad_step is None
    # not back: the episode ends at its peak, unresolved, and the last row on course is the
    # first sign of trouble
    course = run_course(history(losses[:16]), None, [])
    (e,) = course.of("departure")
    assert (e.start, e.end, e.resolved, e.text) == (
        13,
        14,
        False,
        "the loss rose from 2 (step 7) to 3.5 (step 14)",
    )
    assert course.first_bad_step == 10


def test_the_first_row_of_a_run_skipped_from_its_start_is_calibration():
    course = run_course(history([3.0] * 10, skipped=[1, 2, 3]), None, [])
    assert [e.kind for e in course.episodes] == ["calibration"]


# ---------------------------------------------------------------------------- diverged
def _course(d, *eps):
    return Course(episodes=list(eps), departure=d)


def test_diverged_is_a_departure_not_back_or_from_the_start_or_followed_by_non_finite_steps():
    assert diverged(Course()) is False
    assert diverged(_course(dep(resolved_at=None))) is True
    assert diverged(_course(dep(resolved_at=20, never_improved=True))) is True
    assert diverged(_course(dep(resolved_at=20))) is False
    storm = Episode("storm", 11, 19, True, "")
    assert diverged(_course(dep(resolved_at=20), storm)) is True
    assert (
        diverged(_course(dep(resolved_at=20), Episode("nonfinite_loss", 11, 11, True, ""))) is True
    )
    # at the departure's step or before it: not what the rise led to
    assert diverged(_course(dep(resolved_at=20), Episode("storm", 10, 19, True, ""))) is False
    assert diverged(_course(dep(resolved_at=20), Episode("isolated", 11, 11, True, ""))) is False


def test_the_first_bad_step_is_the_earliest_unresolved_trouble():
    storm = Episode("storm", 30, 40, False, "")
    nf = Episode("nonfinite_loss", 25, 26, False, "")
    ended = Episode("storm", 5, 12, True, "")
    iso = Episode("isolated", 3, 3, False, "")
    assert C._first_bad(_course(None, storm, nf, ended, iso)) == 25
    assert C._first_bad(_course(None, ended, iso)) is None
    # a divergence: the last row on course, when it is the earliest
    assert C._first_bad(_course(dep(last_good_step=8), storm)) == 8
    assert C._first_bad(_course(dep(last_good_step=31), storm)) == 30
    # a departure that came back is no trouble
    assert C._first_bad(_course(dep(resolved_at=20, last_good_step=8))) is None


# ---------------------------------------------------------------------------- edges (mutants)
LOWEST = [4.0, 3.5, 3.0, 2.5] + [2.0] * 6  # its level is lowest (2.0) from step 7


def test_a_row_at_exactly_25_percent_above_the_lowest_level_is_still_on_course():
    d = departure(rows(LOWEST + [2.5, 3.0, 3.0, 3.0, 3.0]))
    assert (d.step, d.last_good_step, d.peak, d.peak_step) == (14, 11, 3.0, 12)


def test_back_at_the_last_two_rows_of_the_record():
    d = departure(rows(LOWEST + [3.0] * 3 + [2.1] * 4))
    assert (d.step, d.resolved_at) == (13, 16)  # the levels at 16 and 17, the last
    assert departure(rows(LOWEST + [3.0] * 3 + [2.1] * 3)).resolved_at is None  # one level


def test_once_fallen_a_flat_loss_departs_only_beyond_25_percent():
    # no noise (every full window at 2.0): a 15% rise is on course
    assert departure(rows([4.0] + [2.0] * 12 + [2.3] * 6)) is None
    d = departure(rows([4.0] + [2.0] * 12 + [2.6] * 6))
    assert (d.step, d.never_improved, d.min_step) == (16, False, 3)


def test_a_crossing_at_the_last_but_one_row_needs_the_last_row_to_confirm_it():
    assert departure(rows([4.0, 6.2, 4.5])) is None
    # ... or a non-finite step between them
    r = rows([4.0, 6.2]) + [Row(step=3, loss=NAN), Row(step=4, loss=4.5)]
    assert departure(r).step == 2


def test_the_lr_at_the_peak_row_counts():
    losses = LOWEST + [3.0, 3.0, 3.0, 3.5, 3.2] + [2.0] * 6
    lr = [0.1] * 10 + [0.4, 0.3, 0.2, 0.5, 0.9] + [0.9] * 6
    d = departure(rows(losses, lr=lr))
    assert (d.peak_step, d.lr_peak, d.lr_peak_step) == (14, 0.5, 14)


def test_inferred_skips_edges():
    c10 = CheckpointFacts("c10", 10, [], scale=1024.0, applied=10)
    # one step, no update, the scale fell: that step
    c11 = CheckpointFacts("c11", 11, [], scale=512.0, applied=10)
    assert C._inferred_skips([c10, c11]) == (
        [11],
        ["c11: the optimizer applied no update in steps 11-11 (every step skipped)"],
    )
    # a pair without counts does not end the look at the pairs after it
    bare = CheckpointFacts("b5", 5, [], scale=1024.0)
    assert C._inferred_skips([bare, c10, c11])[0] == [11]
    one = CheckpointFacts("c10", 10, [], scale=1.0, applied=10)
    half = CheckpointFacts("c20", 20, [], scale=0.5, applied=19)  # 1 skipped, 1 halving, < 1
    assert C._inferred_skips([one, half])[0] == [20]
    assert C._inferred_skips([CheckpointFacts("b5", 5, [], scale=1.0), one, half])[0] == [20]
    # a second checkpoint at the same step, without counts, is no interval
    dup = CheckpointFacts("dup", 20, [], scale=0.25)
    low = CheckpointFacts("c20", 20, [], scale=0.25, applied=18)
    assert C._inferred_skips([one, low, dup]) == ([], [])


def test_skip_episode_edges():
    # only the run's own forward steps count: 1 of 4 here
    assert C._skip_episodes([2, 5, 6, 7, 8], {2, 5}, 1, [30], None)[1].kind == "isolated"
    assert C._skip_episodes([5, 6, 7, 8], {5, 9}, 1, [30], None)[0].kind == "isolated"
    # a third forward is less than half
    assert C._skip_episodes([5, 6, 7], {5}, 1, [30], None)[0].kind == "isolated"
    # the scale before the run is the one in force at the step before it
    h = history(scale=[(1, 1024.0), (11, 512.0)])
    assert C._skip_episodes([12], set(), 1, [30], h)[0].text == "1 step skipped at 12"


def test_the_history_and_the_scalers_record_both_say_which_steps_trained():
    # the history's rows after the skips end them, though the record stops before them
    s = scaler([(u, 1024.0, rec.CLEAN, 3.0) for u in range(1, 5)])
    h = history([3.0] * 10, skipped=[5, 6])
    assert [(e.kind, e.resolved) for e in run_course(h, s, []).episodes] == [("isolated", True)]
    # the record's skipped updates at its end are no clean steps
    kinds = [rec.CLEAN] * 3 + [rec.GRADIENT] * 4
    s = scaler([(i + 1, 1024.0, k, 3.0) for i, k in enumerate(kinds)])
    course = run_course(None, s, [])
    assert [(e.kind, e.start, e.resolved) for e in course.episodes] == [("storm", 4, False)]
    assert course.first_bad_step == 4


def test_the_course_names_the_scale_from_the_history():
    h = history([3.0] * 20, skipped=range(5, 13), scale=[(1, 65536.0), (12, 256.0)])
    (e,) = run_course(h, None, []).episodes
    assert e.text == "8 steps skipped at 5–12 in a row (scale 65536 -> 256)"


@pytest.mark.parametrize(
    ("losses", "crossing", "peak_step"),
    [
        ([10.0, 4.0, 10.0], 3, 3),  # not the first row, before the lowest level (step 2)
        ([10.0, 3.0, 10.0, 2.0, 10.0], 5, 3),  # the window's first row (3) counts
        ([5.0, 3.0, 10.0, 1.0, 5.0, 8.0, 8.0], 7, 3),  # window 3-7, all five rows
        # window 8-12: not 10 at step 6 (calm rows first: the noise bar is the 25% one)
        ([3.0] * 3 + [3.0, 2.0, 10.0, 3.0, 5.0, 1.0, 1.0, 5.0, 4.0], 12, 8),
    ],
)
def test_the_peak_is_in_the_levels_window_after_the_lowest_row(losses, crossing, peak_step):
    d = departure(rows(losses))
    assert (d.step, d.peak_step, d.peak) == (crossing, peak_step, losses[peak_step - 1])


# ====================================================================== the departure is O(n log n)
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
