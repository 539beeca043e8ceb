"""Property tests: arbitrary overrides and values give a valid config or a clean ConfigError."""

from __future__ import annotations

import string

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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_known_keys_with_arbitrary_values(pairs):
    _check([f"{k}={v}" for k, v in pairs])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(string.printable, min_size=0, max_size=30), min_size=1, max_size=3))
def test_arbitrary_override_strings(tokens):
    _check(tokens)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["+", "~", ""]),
    st.sampled_from(KEYS + ["model.x", "nope", "trainer", "scaler"]),
    VALUES,
)
def test_add_delete_forms(prefix, key, value):
    _check([f"{prefix}{key}" if prefix == "~" else f"{prefix}{key}={value}"])
