"""The guard's pure rules (``decide``), their config (``GuardRules``) and the host-side history
(``OverflowGuard``): every rule at its boundary, every reason word for word."""

from __future__ import annotations

import pytest

from ampctl.amp.checks import FieldError
from ampctl.amp.guard import (
    Action,
    Decision,
    GuardRules,
    Observation,
    OverflowGuard,
    decide,
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
