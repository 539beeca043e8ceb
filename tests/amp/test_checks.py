"""The config checks every component's config runs (ampctl.amp.checks): a rule table checked in
order, the first field that breaks its row named with its value and what is allowed."""

from __future__ import annotations

import dataclasses

import pytest

from ampctl.amp.checks import FieldError


def test_check_names_the_first_field_that_breaks_its_row():
    """A rule table is checked in order; a list field is shown as a list; the allowed text may
    be a function of the config (a bound that is another field)."""
    from ampctl.amp.checks import check, integer

    @dataclasses.dataclass
    class C:
        a: int = 1
        b: list = dataclasses.field(default_factory=list)

    rules = (
        ("a", integer(ge=1), "an integer >= 1"),
        ("b", lambda v, c: len(v) <= c.a, lambda c: f"at most a={c.a} items"),
    )
    check(C(), rules)
    with pytest.raises(FieldError) as e:
        check(C(a=0, b=(1, 2)), rules)
    assert str(e.value) == "C: a=0 is not allowed: a must be an integer >= 1"
    with pytest.raises(FieldError) as e:
        check(C(a=1, b=(1, 2)), rules)
    assert str(e.value) == "C: b=[1, 2] is not allowed: b must be at most a=1 items"
    assert (e.value.field, e.value.value) == ("b", [1, 2])
