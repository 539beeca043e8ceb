"""Small helpers and the thresholds shared by the parts of a diagnosis."""

from __future__ import annotations

import math
from typing import Any

from ampctl.runlog import as_number, is_finite_number
from ampctl.runlog.writers import jsonable

__all__ = [
    "SCHEMA",
    "UNDERFLOW_LIMIT",
    "EXPLOSION_FACTOR",
    "TREND_ROWS",
    "RECENT_WINDOW",
    "MAX_LISTED",
    "STATE_KINDS",
    "pow2",
    "plain",
    "fmt",
    "finite",
    "as_number",
    "jsonable",
    "ACT_UNDERFLOW_LIMIT",
]

SCHEMA = "ampctl-diagnose/2"
#: Non-zero gradient elements lost to underflow (and recoverable by a larger scale) above which
#: the scale is called too small.
UNDERFLOW_LIMIT = 0.01
#: Share of fp16 activation-gradient elements below fp16's normal range, beyond the share that
#: is zero in fp32 too (masked-LM positions without a label: zero at any scale), above which the
#: scale is called too small. Measured on conf=underflow: ~100% unscaled, ~12% under ampctl.
ACT_UNDERFLOW_LIMIT = 0.25
#: Peak grad norm / earlier median above which the grad norm is called exploding.
EXPLOSION_FACTOR = 10.0
#: Logged rows shown (and searched for the peak) before the break.
TREND_ROWS = 5
#: Scaler records that count as "recent".
RECENT_WINDOW = 50
#: Bad tensors listed per section.
MAX_LISTED = 10
#: Problems that make a checkpoint's own state unhealthy (not worth resuming from).
STATE_KINDS = frozenset(
    {
        "bad_scale",
        "scale_collapsed",
        "nonfinite_weights",
        "extreme_weights",
        "nonfinite_master",
        "extreme_master",
        "nonfinite_optimizer_state",
        "extreme_optimizer_state",
    }
)


def finite(x: Any) -> bool:
    return is_finite_number(x) and not isinstance(x, str)


def pow2(x: float) -> str:
    if finite(x) and x > 0:
        e = math.log2(x)
        if e == int(e):
            return f"{x:g} (2^{int(e)})"
    return f"{x:g}"


def plain(x: float) -> str:
    """A number as an override value: integers without a decimal point or exponent."""
    return str(int(x)) if finite(x) and float(x).is_integer() else repr(float(x))


def fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    v = as_number(x)
    if v is not None and not isinstance(x, bool):
        if isinstance(x, int):
            return str(x)
        return format(v, spec) if math.isfinite(v) else str(v)
    return str(x)
