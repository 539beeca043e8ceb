"""The divergence rule as a pure function of the log rows' losses (ampctl.amp.guard), on courses
taken from real runs: each diverging course beside the healthy one it must not be confused with.
The runs themselves are in tests/protect/test_guard_faults.py (ampctl's loop) and
tests/integrations/test_transformers.py (the HF Trainer)."""

from __future__ import annotations

import math

import pytest

from ampctl.amp.guard import Action, DivergenceRules, DivergenceWatch, divergence_reason

RULES = DivergenceRules()  # factor 5, patience 3

# the HF Trainer's tiny GPT-2 at lr 1.0: the first update already wrecked it (rows at steps 2,
# 4, 6 ...), while its loss before any update was 3.898; and the same model at lr 1e-3
HF_LR1 = [15.98, 45.82, 30.0, 18.29, 24.1, 41.02]
HF_HEALTHY = [3.89, 3.9, 3.92, 3.92, 3.91, 3.91, 3.9, 3.9, 3.85, 3.88, 3.86, 3.83]


def test_a_run_wrecked_by_its_first_update_is_caught_against_its_first_loss():
    assert divergence_reason(HF_LR1[:2], RULES, start=3.898) is None  # patience: 3 rows
    why = divergence_reason(HF_LR1[:3], RULES, start=3.898)
    assert why == (
        "the loss diverged: 15.98, 45.82, 30 at the last 3 log steps, 7.7x the loss the run "
        "started from (3.898, before its first update)"
    )
    # without the first loss it has no healthy row to compare with: never caught
    assert all(divergence_reason(HF_LR1[:n], RULES) is None for n in range(1, len(HF_LR1) + 1))


def test_a_healthy_run_is_never_called_diverged():
    for n in range(1, len(HF_HEALTHY) + 1):
        assert divergence_reason(HF_HEALTHY[:n], RULES, start=4.16) is None
        assert divergence_reason(HF_HEALTHY[:n], RULES) is None


@pytest.mark.parametrize("start", [math.nan, math.inf, 0.0, -1.0, None])
def test_a_first_loss_that_is_not_a_positive_number_is_ignored(start):
    assert divergence_reason(HF_LR1[:3], RULES, start=start) is None


def test_the_first_loss_is_a_floor_only_below_every_row_window():
    # a run that starts high and comes down (the first loss above the lowest rows) is judged
    # against its lowest rows, as before: 4.4 is not 5x 1.0's ...
    course = [3.0, 1.2, 1.0, 1.0, 1.1, 1.2]
    assert divergence_reason(course, RULES, start=8.0) is None
    # ... and 6x its lowest median is
    why = divergence_reason([*course, 6.0, 6.5, 7.0], RULES, start=8.0)
    assert why is not None and "its lowest (1, the median of 3 rows)" in why


def test_the_factor_against_the_lowest_rows_and_the_progress_given_back():
    falling = [10.0, 8.0, 6.0, 4.0, 2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0]
    assert divergence_reason(falling, RULES) is None
    why = divergence_reason([*falling, 11.0, 12.0, 13.0], RULES)
    assert why is not None and why.startswith("the loss diverged: 11, 12, 13") and "6.0x" in why
    # gave back over 3/4 of its progress (8 -> 2, medians of 3 rows), far more than its noise
    # (the median change from row to row, 0.2): diverged below 5x its lowest
    why = divergence_reason([*falling, 6.8, 7.0, 7.2], RULES)
    assert why == (
        "the loss diverged: 6.8, 7, 7.2 at the last 3 log steps gave back 83% of its progress "
        "from 8 down to 2"
    )
    assert divergence_reason([*falling, 6.0, 6.2, 6.4], RULES) is None  # 70%: not yet
    # a noisy plateau that never made progress beyond its noise: only the factor can trip it
    plateau = [2.0, 3.0, 2.0, 3.0, 2.0, 3.0, 4.0, 4.0, 4.0]
    assert divergence_reason(plateau, RULES) is None


def test_non_finite_rows():
    assert divergence_reason([2.0, 2.0, math.nan, math.nan, math.nan], RULES) == (
        "the loss is not finite at the last 3 log steps"
    )
    assert divergence_reason([2.0, 2.0, 2.0, math.nan, 30.0, 30.0], RULES) is None  # one finite


def test_the_watch_keeps_its_first_loss_across_a_decision_and_a_checkpoint():
    watch = DivergenceWatch(DivergenceRules(action="warn"))
    watch.start = 3.898
    decisions = [watch.observe(2 * (i + 1), x) for i, x in enumerate(HF_LR1[:3])]
    assert [d.action for d in decisions] == [Action.CONTINUE, Action.CONTINUE, Action.WARN]
    assert watch.losses == [] and watch.start == 3.898  # the course restarts, the start stays
    again = DivergenceWatch(RULES)
    again.load_state_dict(watch.state_dict())
    assert again.start == 3.898
    legacy = DivergenceWatch(RULES)
    legacy.load_state_dict({"losses": [1.0], "steps": [2], "good_step": 0})  # before the start
    assert legacy.start is None and legacy.losses == [1.0]


def test_the_figures_are_the_ones_the_reason_names():
    from ampctl.amp.guard import divergence

    rules = DivergenceRules(factor=5.0, patience=3, warmup=0)
    rows = [4.0, 3.0, 2.0, 2.2, 2.1, 30.0, 40.0, 50.0]
    why, now, ref, ratio = divergence(rows, rules)
    assert (now, ref) == (40.0, 2.1) and ratio == pytest.approx(40.0 / 2.1)
    assert why == divergence_reason(rows, rules) and f"{ratio:.1f}x its lowest ({ref:.4g}," in why
    why, now, ref, ratio = divergence([4.0, 30.0, 40.0, 50.0], rules, start=3.9)
    assert (now, ref) == (40.0, 3.9) and "(3.9, before its first update)" in why
    assert divergence([4.0, 3.0, 2.0, 2.2, 2.1, 2.0], rules) is None
    why, now, ref, ratio = divergence([4.0, math.nan, math.nan, math.nan], rules, start=3.9)
    assert why == "the loss is not finite at the last 3 log steps" and ref == 3.9
    assert math.isnan(now) and math.isnan(ratio)
