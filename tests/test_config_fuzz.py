"""Property tests: arbitrary overrides and values give a valid config or a clean ConfigError."""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ampctl.config import ConfigError, RunConfig, _all_keys, load_config

KEYS = _all_keys()
VALUES = st.one_of(
    st.integers(-10, 10**9).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "true",
            "false",
            "null",
            "[]",
            "[1,2]",
            "{}",
            "abc",
            "''",
            "???",
            "${oops}",
            "${data.seq_len}",
            "1e400",
            "-0",
        ]
    ),
    st.text(string.printable, max_size=12),
)


def _check(overrides: list[str]) -> None:
    try:
        cfg = load_config(overrides)
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg.strip(), msg
        return
    assert isinstance(cfg, RunConfig)


def _examples(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# Each example composes a config (~0.2 s): the default suite draws a few dozen per property,
# `pytest -m slow` ten times as many (the same properties, the same strategies).
KNOWN_KEYS = st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3)
STRINGS = st.lists(st.text(string.printable, min_size=0, max_size=30), min_size=1, max_size=3)
FORMS = (
    st.sampled_from(["+", "~", ""]),
    st.sampled_from(KEYS + ["model.x", "nope", "trainer", "scaler"]),
    VALUES,
)


def _form(prefix: str, key: str, value: str) -> list[str]:
    return [f"{prefix}{key}" if prefix == "~" else f"{prefix}{key}={value}"]


@_examples(30)
@given(KNOWN_KEYS)
def test_known_keys_with_arbitrary_values(pairs):
    _check([f"{k}={v}" for k, v in pairs])


@_examples(80)  # most random strings fail at the parser, before any compose: cheap
@given(STRINGS)
def test_arbitrary_override_strings(tokens):
    _check(tokens)


@_examples(20)
@given(*FORMS)
def test_add_delete_forms(prefix, key, value):
    _check(_form(prefix, key, value))


@pytest.mark.slow
@_examples(300)
@given(KNOWN_KEYS)
def test_known_keys_with_arbitrary_values_long(pairs):
    _check([f"{k}={v}" for k, v in pairs])


@pytest.mark.slow
@_examples(200)
@given(*FORMS)
def test_add_delete_forms_long(prefix, key, value):
    _check(_form(prefix, key, value))
