"""The divergence rule at its boundaries (issue #31: mutants of ampctl.amp.guard that the rule's
own tests left alive). Pure numbers, no model."""

from __future__ import annotations

import math

import pytest

from ampctl.amp.guard import DivergenceRules, DivergenceWatch, divergence

NAN = math.nan


def test_warmup_rows_are_only_watched_even_when_not_finite():
    # 4 rows, warmup 5: fewer than warmup + 1 rows, nothing is judged
    assert divergence([NAN] * 4, DivergenceRules(warmup=5)) is None
    assert divergence([NAN] * 6, DivergenceRules(warmup=5))[0] == (
        "the loss is not finite at the last 3 log steps"
    )


def test_non_finite_rows_are_judged_against_the_lowest_course_before_the_first_loss():
    why, now, ref, ratio = divergence([1, 1, 1, NAN, NAN, NAN], DivergenceRules(), start=2.0)
    assert why == "the loss is not finite at the last 3 log steps"
    assert math.isnan(now) and math.isnan(ratio)
    assert ref == 1


def test_non_finite_rows_without_a_course_are_judged_against_the_first_loss():
    found = divergence([NAN, NAN, NAN], DivergenceRules(), start=2.0)
    assert found[2] == 2.0
    found = divergence([NAN, NAN, NAN], DivergenceRules(), start=None)
    assert math.isnan(found[2])


def test_a_first_loss_equal_to_the_lowest_course_is_judged_as_the_lowest():
    why, now, ref, ratio = divergence([1, 1, 1, 6, 6, 6], DivergenceRules(), start=1.0)
    assert why == (
        "the loss diverged: 6, 6, 6 at the last 3 log steps, 6.0x its lowest "
        "(1, the median of 3 rows)"
    )
    assert (now, ref, ratio) == (6, 1, 6.0)


def test_exactly_factor_times_the_first_loss_is_not_a_divergence():
    assert divergence([2, 2, 2, 5, 5, 5], DivergenceRules(), start=1.0) is None
    why, now, ref, ratio = divergence([2, 2, 2, 5.01, 5.01, 5.01], DivergenceRules(), start=1.0)
    assert why.endswith("the loss the run started from (1, before its first update)")
    assert ref == 1.0


def test_a_lowest_course_of_zero_trips_no_factor():
    assert divergence([0, 0, 0, 1, 1, 1], DivergenceRules()) is None


def test_the_median_of_an_odd_patience_is_the_middle_row():
    why, now, ref, ratio = divergence([1] * 5 + [10, 20, 30, 40, 50], DivergenceRules(patience=5))
    assert (now, ref, ratio) == (30, 1, 30.0)


one = DivergenceRules(patience=1)


@pytest.mark.parametrize(
    "losses",
    [
        [10, 2, 3, 2, 5, 2, 9],  # row-to-row changes 8, 1, 1, 3, 3: noise 3, progress 8 < 12
        [10, 2, 6, 2, 6, 2, 9],  # changes 8, 4, 4, 4, 4: noise 4
        [10, 8, 6, 4, 2, 9],  # changes 2, 2, 2, 2: noise 2, progress 8 = 4 x noise
    ],
)
def test_progress_within_the_rows_noise_is_no_progress(losses):
    assert divergence(losses, one) is None


def test_progress_beyond_four_times_the_noise_given_back_is_a_divergence():
    # changes 8, 1.8, 1.8, 1.8, 1.8: noise 1.8, progress 8 > 7.2
    why, now, ref, ratio = divergence([10, 2, 3.8, 2, 3.8, 2, 9], one)
    assert why == (
        "the loss diverged: 9 at the last 1 log steps gave back 88% of its progress "
        "from 10 down to 2"
    )
    assert (now, ref, ratio) == (9, 2, 4.5)


def test_giving_back_progress_has_strict_bounds():
    # exactly three quarters of the progress given back: not yet
    assert divergence([10, 2, 2, 2, 2, 2, 8], one) is None
    # exactly 1.5 x the lowest: not yet; just below it: neither
    assert divergence([6, 4, 4, 4, 4, 6], one) is None
    assert divergence([6, 4, 4, 4, 4, 5.9], one) is None
    # all of it given back, 2.5 x the lowest (below the factor 5)
    why, now, ref, ratio = divergence([10, 4, 4, 4, 4, 4, 10], one)
    assert (now, ref, ratio) == (10, 4, 2.5)


def test_a_fresh_watch_has_no_figures_yet():
    w = DivergenceWatch(DivergenceRules())
    assert math.isnan(w.judged) and math.isnan(w.reference) and math.isnan(w.ratio)
