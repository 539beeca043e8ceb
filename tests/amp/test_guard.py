"""The guard's pure rules (ampctl.amp.guard): ``decide``, their config (``GuardRules``) and the
host-side history (``OverflowGuard``), every rule at its boundary, every reason word for word; the
divergence rule as a pure function of the log rows' losses, at its boundaries and on courses taken
from real runs, each diverging course beside the healthy one it must not be confused with (the
runs themselves are in tests/protect/test_guard_faults.py, ampctl's loop, and
tests/integrations/test_transformers.py, the HF Trainer). Pure numbers, no model.
"""

from __future__ import annotations

import math

import pytest

from ampctl.amp.checks import FieldError
from ampctl.amp.guard import (
    Action,
    Decision,
    DivergenceRules,
    DivergenceWatch,
    GuardRules,
    Observation,
    OverflowGuard,
    decide,
    divergence,
    divergence_reason,
    next_precision,
)


def obs(**kw) -> Observation:
    base = dict(step=7, skipped=True, consecutive=1, window_skips=1, window_len=4, at_floor=False)
    base.update(kw)
    return Observation(**base)


RULES = GuardRules(rollback_after=3, max_rollbacks=2, skip_budget=0.5, skip_window=10)


# ---------------------------------------------------------------------------- GuardRules
@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("rollback_after", -1, "an integer >= 0 (0 disables rollback)"),
        ("rollback_after", 1.0, "an integer >= 0 (0 disables rollback)"),
        ("max_rollbacks", -1, "an integer >= 0"),
        ("max_rollbacks", True, "an integer >= 0"),
        ("skip_budget", 0, "in (0, 1]"),
        ("skip_budget", 1.5, "in (0, 1]"),
        ("skip_budget", float("nan"), "in (0, 1]"),
        ("skip_window", 0, "an integer >= 1"),
        ("skip_window", 2.0, "an integer >= 1"),
        ("skip_action", "retry", "one of rollback, fallback, abort, warn"),
        ("floor_policy", "rollback", "one of fallback, abort, warn"),
    ],
)
def test_rules_refuse_a_bad_field_naming_it_and_what_is_allowed(field, value, allowed):
    with pytest.raises(FieldError) as e:
        GuardRules(**{field: value})
    shown = repr(value) if isinstance(value, str) else str(value)
    assert str(e.value) == f"GuardRules: {field}={shown} is not allowed: {field} must be {allowed}"
    assert (e.value.owner, e.value.field, e.value.allowed) == ("GuardRules", field, allowed)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rollback_after", 0),
        ("max_rollbacks", 0),
        ("skip_budget", 1),
        ("skip_budget", 1e-9),
        ("skip_window", 1),
        ("skip_action", "warn"),
        ("floor_policy", "abort"),
    ],
)
def test_rules_accept_the_boundaries(field, value):
    assert getattr(GuardRules(**{field: value}), field) == value


def test_rules_copy_the_fallback_chain_into_a_list():
    chain = ("fp16", "fp32")
    rules = GuardRules(fallback_chain=chain)
    assert rules.fallback_chain == ["fp16", "fp32"]
    assert GuardRules().fallback_chain == ["fp16", "bf16", "fp32"]


# ---------------------------------------------------------------------------- next_precision
@pytest.mark.parametrize(
    "current, chain, bf16_ok, expected",
    [
        ("fp16", ["fp16", "bf16", "fp32"], True, "bf16"),
        ("fp16", ["fp16", "bf16", "fp32"], False, "fp32"),
        ("bf16", ["fp16", "bf16", "fp32"], True, "fp32"),
        ("fp32", ["fp16", "bf16", "fp32"], True, None),
        ("fp16-pure", ["fp16", "bf16", "fp32"], True, "fp16"),  # not in the chain: from the top
        ("fp16-pure", ["bf16", "fp32"], False, "fp32"),
        ("fp16", ["fp16", "fp16", "bf16"], True, "bf16"),  # the current one is never the target
        ("fp16", ["fp16", "bf16"], False, None),
    ],
)
def test_next_precision(current, chain, bf16_ok, expected):
    assert next_precision(current, chain, bf16_ok) == expected


def test_next_precision_allows_bf16_by_default():
    assert next_precision("fp16", ["fp16", "bf16", "fp32"]) == "bf16"


# ---------------------------------------------------------------------------- decide
def test_rule_1_a_clean_step_continues_whatever_else_holds():
    d = decide(
        obs(skipped=False, consecutive=9, window_skips=9, window_len=10, at_floor=True), RULES
    )
    assert d == Decision(action=Action.CONTINUE)


def test_rule_2_the_floor_needs_two_overflows_in_a_row():
    assert decide(obs(at_floor=True, consecutive=1), RULES) == Decision(action=Action.CONTINUE)
    d = decide(obs(at_floor=True, consecutive=2), RULES)
    assert d == Decision(
        action=Action.FALLBACK,
        reason="loss scale at its minimum and still overflowing (2 in a row): falling back "
        "fp16 -> bf16",
        precision="bf16",
    )


def test_rule_2_ignores_forward_overflows_at_the_floor():
    d = decide(obs(at_floor=True, consecutive=2, forward_overflow=True), RULES)
    assert d.action is Action.CONTINUE


@pytest.mark.parametrize(
    "policy, action, reason",
    [
        ("abort", Action.ABORT, "loss scale at its minimum and still overflowing (2 in a row)"),
        ("warn", Action.WARN, "loss scale at its minimum and still overflowing (2 in a row)"),
    ],
)
def test_rule_2_floor_policies(policy, action, reason):
    d = decide(obs(at_floor=True, consecutive=2), GuardRules(floor_policy=policy))
    assert d == Decision(action=action, reason=reason)


def test_rule_2_with_nothing_left_aborts_naming_the_chain():
    d = decide(obs(at_floor=True, consecutive=2, precision="fp32"), RULES)
    assert d == Decision(
        action=Action.ABORT,
        reason="loss scale at its minimum and still overflowing (2 in a row), and no precision "
        "is left after fp32 in the fallback chain ['fp16', 'bf16', 'fp32']",
    )


def test_rule_3_rolls_back_at_exactly_rollback_after():
    assert decide(obs(consecutive=2), RULES).action is Action.CONTINUE
    assert decide(obs(consecutive=3), RULES) == Decision(
        action=Action.ROLLBACK, reason="3 consecutive overflows"
    )


def test_rule_3_with_rollback_after_one_rolls_back_every_overflow():
    d = decide(obs(consecutive=1), GuardRules(rollback_after=1))
    assert d == Decision(action=Action.ROLLBACK, reason="1 consecutive overflows")


def test_rule_3_off_with_rollback_after_zero():
    rules = GuardRules(rollback_after=0)
    assert decide(obs(consecutive=50), rules).action is Action.CONTINUE


def test_rule_3_falls_back_once_the_rollbacks_are_spent():
    assert decide(obs(consecutive=3, rollbacks=1), RULES).action is Action.ROLLBACK
    d = decide(obs(consecutive=3, rollbacks=2), RULES)
    assert d == Decision(
        action=Action.FALLBACK,
        reason="3 consecutive overflows, after 2 rollbacks at fp16: falling back fp16 -> bf16",
        precision="bf16",
    )
    d = decide(obs(consecutive=4, rollbacks=2, precision="bf16", bf16_ok=True), RULES)
    assert d.precision == "fp32" and d.action is Action.FALLBACK


def test_rule_3_without_bf16_falls_back_to_fp32():
    d = decide(obs(consecutive=3, rollbacks=2, bf16_ok=False), RULES)
    assert (d.action, d.precision) == (Action.FALLBACK, "fp32")


def test_rule_4_skip_budget_needs_a_full_window_and_more_than_the_budget():
    full = dict(consecutive=1, window_len=10)
    assert decide(obs(**full, window_skips=5), RULES).action is Action.CONTINUE  # at the budget
    assert decide(obs(consecutive=1, window_len=9, window_skips=9), RULES).action is (
        Action.CONTINUE
    )
    d = decide(obs(**full, window_skips=6), RULES)
    assert d == Decision(
        action=Action.ROLLBACK, reason="6 of the last 10 steps skipped (budget 50%)"
    )


@pytest.mark.parametrize(
    "skip_action, action, precision",
    [
        ("abort", Action.ABORT, None),
        ("warn", Action.WARN, None),
        ("fallback", Action.FALLBACK, "bf16"),
        ("rollback", Action.ROLLBACK, None),
    ],
)
def test_rule_4_takes_the_skip_action(skip_action, action, precision):
    rules = GuardRules(skip_budget=0.25, skip_window=8, skip_action=skip_action, rollback_after=0)
    d = decide(obs(consecutive=1, window_len=8, window_skips=3), rules)
    assert (d.action, d.precision) == (action, precision)
    assert d.reason.startswith("3 of the last 8 steps skipped (budget 25%)")


def test_rule_5_an_isolated_overflow_continues():
    assert decide(obs(consecutive=1, window_skips=1, window_len=10), RULES) == Decision(
        action=Action.CONTINUE
    )


# ---------------------------------------------------------------------------- OverflowGuard
def _observe(g: OverflowGuard, skipped: bool, **kw) -> Decision:
    args = dict(step=1, skipped=skipped, forward_overflow=False, at_floor=False, precision="fp16")
    args.update(kw)
    return g.observe(**args)


def test_guard_counts_consecutive_and_windowed_skips():
    g = OverflowGuard(GuardRules(rollback_after=0, skip_window=4, skip_budget=0.5))
    assert _observe(g, True).action is Action.CONTINUE
    assert g.consecutive == 1
    _observe(g, False)
    assert g.consecutive == 0
    _observe(g, True)
    assert g.state_dict() == {"window": [1, 0, 1], "consecutive": 1, "rollbacks": 0}
    # a full window of 4 with 3 skips is over the 50% budget
    d = _observe(g, True)
    assert d == Decision(
        action=Action.ROLLBACK, reason="3 of the last 4 steps skipped (budget 50%)"
    )
    assert g.state_dict() == {"window": [1, 0, 1, 1], "consecutive": 2, "rollbacks": 0}
    _observe(g, False)  # the window keeps the last 4 only
    assert g.state_dict()["window"] == [0, 1, 1, 0]


def test_guard_passes_what_it_was_told_to_the_rules():
    g = OverflowGuard(GuardRules(rollback_after=0))
    assert _observe(g, True, at_floor=True).action is Action.CONTINUE  # one in a row
    d = _observe(g, True, at_floor=True)  # bf16 is a target unless told otherwise
    assert (d.action, d.precision) == (Action.FALLBACK, "bf16")
    d = _observe(g, True, at_floor=True, bf16_ok=True)
    assert (d.action, d.precision) == (Action.FALLBACK, "bf16")
    d = _observe(g, True, at_floor=True, bf16_ok=False)
    assert (d.action, d.precision) == (Action.FALLBACK, "fp32")
    d = _observe(g, True, at_floor=True, precision="bf16")
    assert (d.action, d.precision) == (Action.FALLBACK, "fp32")
    assert _observe(g, True, at_floor=True, forward_overflow=True).action is Action.CONTINUE
    assert _observe(g, True, at_floor=False).action is Action.CONTINUE


def test_guard_counts_rollbacks_until_a_fallback():
    g = OverflowGuard(GuardRules(rollback_after=2, max_rollbacks=1))
    _observe(g, True)
    assert _observe(g, True).action is Action.ROLLBACK
    g.after_rollback()
    assert g.state_dict() == {"window": [], "consecutive": 0, "rollbacks": 1}
    _observe(g, True)
    d = _observe(g, True)
    assert d.action is Action.FALLBACK and "after 1 rollbacks at fp16" in d.reason
    g.after_rollback()
    assert g.rollbacks == 2
    g.after_fallback()
    assert g.state_dict() == {"window": [], "consecutive": 0, "rollbacks": 0}


def test_guard_state_round_trip_and_defaults():
    rules = GuardRules(skip_window=3)
    g = OverflowGuard(rules)
    g.load_state_dict({"window": [1, 0, 1, 1], "consecutive": 2, "rollbacks": 4})
    assert g.state_dict() == {"window": [0, 1, 1], "consecutive": 2, "rollbacks": 4}
    assert g.window.maxlen == 3
    assert list(g.window) == [False, True, True]
    g.load_state_dict({})
    assert g.state_dict() == {"window": [], "consecutive": 0, "rollbacks": 0}
    assert g.window.maxlen == 3
    fresh = OverflowGuard(rules)
    assert (fresh.window.maxlen, fresh.consecutive, fresh.rollbacks) == (3, 0, 0)
    assert fresh.rules is rules


# ============================================================ decide over a full window of 10 steps
def obs_of_10(**kw):
    base = dict(step=10, skipped=True, consecutive=1, window_skips=1, window_len=10, at_floor=False)
    base.update(kw)
    return Observation(**base)


@pytest.mark.parametrize(
    "o, action",
    [
        (obs_of_10(skipped=False, consecutive=0), Action.CONTINUE),
        (obs_of_10(consecutive=1), Action.CONTINUE),  # an isolated overflow: the scaler handles it
        (obs_of_10(consecutive=3), Action.ROLLBACK),
        (obs_of_10(consecutive=3, rollbacks=2), Action.FALLBACK),  # rollbacks used up
        (obs_of_10(consecutive=3, rollbacks=2, precision="fp32"), Action.ABORT),  # nothing left
        (obs_of_10(consecutive=2, at_floor=True), Action.FALLBACK),  # floor policy default
        (obs_of_10(consecutive=2, at_floor=True, forward_overflow=True), Action.CONTINUE),
        (obs_of_10(consecutive=1, window_skips=6), Action.ROLLBACK),  # skip budget
        (obs_of_10(consecutive=1, window_skips=5), Action.CONTINUE),  # exactly at budget
        (
            obs_of_10(consecutive=1, window_skips=6, window_len=9),
            Action.CONTINUE,
        ),  # window not full
    ],
)
def test_decide_rules(o, action):
    assert decide(o, RULES).action is action


def test_floor_policies_and_chain():
    o = obs_of_10(consecutive=2, at_floor=True)
    assert decide(o, GuardRules(floor_policy="abort")).action is Action.ABORT
    assert decide(o, GuardRules(floor_policy="warn")).action is Action.WARN
    d = decide(o, GuardRules(floor_policy="fallback"))
    assert d.precision == "bf16" and "fp16 -> bf16" in d.reason
    assert next_precision("fp16", ["fp16", "bf16", "fp32"], bf16_ok=False) == "fp32"
    assert next_precision("fp16-pure", ["fp16", "bf16", "fp32"]) == "fp16"
    assert next_precision("fp32", ["fp16", "bf16", "fp32"]) is None


# ============================================== the divergence rule on courses taken from real runs
DIVERGENCE = DivergenceRules()  # factor 5, patience 3

# the HF Trainer's tiny GPT-2 at lr 1.0: the first update already wrecked it (rows at steps 2,
# 4, 6 ...), while its loss before any update was 3.898; and the same model at lr 1e-3
HF_LR1 = [15.98, 45.82, 30.0, 18.29, 24.1, 41.02]
HF_HEALTHY = [3.89, 3.9, 3.92, 3.92, 3.91, 3.91, 3.9, 3.9, 3.85, 3.88, 3.86, 3.83]


def test_a_run_wrecked_by_its_first_update_is_caught_against_its_first_loss():
    assert divergence_reason(HF_LR1[:2], DIVERGENCE, start=3.898) is None  # patience: 3 rows
    why = divergence_reason(HF_LR1[:3], DIVERGENCE, start=3.898)
    assert why == (
        "the loss diverged: 15.98, 45.82, 30 at the last 3 log steps, 7.7x the loss the run "
        "started from (3.898, before its first update)"
    )
    # without the first loss it has no healthy row to compare with: never caught
    assert all(divergence_reason(HF_LR1[:n], DIVERGENCE) is None for n in range(1, len(HF_LR1) + 1))


def test_a_healthy_run_is_never_called_diverged():
    for n in range(1, len(HF_HEALTHY) + 1):
        assert divergence_reason(HF_HEALTHY[:n], DIVERGENCE, start=4.16) is None
        assert divergence_reason(HF_HEALTHY[:n], DIVERGENCE) is None


@pytest.mark.parametrize("start", [math.nan, math.inf, 0.0, -1.0, None])
def test_a_first_loss_that_is_not_a_positive_number_is_ignored(start):
    assert divergence_reason(HF_LR1[:3], DIVERGENCE, start=start) is None


def test_the_first_loss_is_a_floor_only_below_every_row_window():
    # a run that starts high and comes down (the first loss above the lowest rows) is judged
    # against its lowest rows, as before: 4.4 is not 5x 1.0's ...
    course = [3.0, 1.2, 1.0, 1.0, 1.1, 1.2]
    assert divergence_reason(course, DIVERGENCE, start=8.0) is None
    # ... and 6x its lowest median is
    why = divergence_reason([*course, 6.0, 6.5, 7.0], DIVERGENCE, start=8.0)
    assert why is not None and "its lowest (1, the median of 3 rows)" in why


def test_the_factor_against_the_lowest_rows_and_the_progress_given_back():
    falling = [10.0, 8.0, 6.0, 4.0, 2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0]
    assert divergence_reason(falling, DIVERGENCE) is None
    why = divergence_reason([*falling, 11.0, 12.0, 13.0], DIVERGENCE)
    assert why is not None and why.startswith("the loss diverged: 11, 12, 13") and "6.0x" in why
    # gave back over 3/4 of its progress (8 -> 2, medians of 3 rows), far more than its noise
    # (the median change from row to row, 0.2): diverged below 5x its lowest
    why = divergence_reason([*falling, 6.8, 7.0, 7.2], DIVERGENCE)
    assert why == (
        "the loss diverged: 6.8, 7, 7.2 at the last 3 log steps gave back 83% of its progress "
        "from 8 down to 2"
    )
    assert divergence_reason([*falling, 6.0, 6.2, 6.4], DIVERGENCE) is None  # 70%: not yet
    # a noisy plateau that never made progress beyond its noise: only the factor can trip it
    plateau = [2.0, 3.0, 2.0, 3.0, 2.0, 3.0, 4.0, 4.0, 4.0]
    assert divergence_reason(plateau, DIVERGENCE) is None


def test_non_finite_rows():
    assert divergence_reason([2.0, 2.0, math.nan, math.nan, math.nan], DIVERGENCE) == (
        "the loss is not finite at the last 3 log steps"
    )
    assert (
        divergence_reason([2.0, 2.0, 2.0, math.nan, 30.0, 30.0], DIVERGENCE) is None
    )  # one finite


def test_the_watch_keeps_its_first_loss_across_a_decision_and_a_checkpoint():
    watch = DivergenceWatch(DivergenceRules(action="warn"))
    watch.start = 3.898
    decisions = [watch.observe(2 * (i + 1), x) for i, x in enumerate(HF_LR1[:3])]
    assert [d.action for d in decisions] == [Action.CONTINUE, Action.CONTINUE, Action.WARN]
    assert watch.losses == [] and watch.start == 3.898  # the course restarts, the start stays
    again = DivergenceWatch(DIVERGENCE)
    again.load_state_dict(watch.state_dict())
    assert again.start == 3.898
    legacy = DivergenceWatch(DIVERGENCE)
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


# ================================================ the divergence rule at its boundaries (issue #31)
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
