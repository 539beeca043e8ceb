"""Number formats of mixed-precision training and the one definition of the recommended scale.

fp16: max 65504, smallest normal 2**-14, smallest subnormal 2**-24, ~3 decimal digits.
bf16: fp32's range, ~2 decimal digits. FP8: e4m3 (max 448, forward) and e5m2 (max 57344,
gradients). Pure Python and torch only.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP16_MAX",
    "FP16_TINY",
    "FP16_SUBNORMAL",
    "E4M3_MAX",
    "E5M2_MAX",
    "dtype_max",
    "ideal_scale",
    "recommended_init_scale",
]

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # smallest normal
FP16_SUBNORMAL = 2.0**-24  # smallest subnormal
E4M3_MAX = 448.0
E5M2_MAX = 57344.0


def dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of a floating dtype."""
    return float(torch.finfo(dtype).max)


def ideal_scale(max_abs_grad: float, limit: float = FP16_MAX) -> float:
    """``S* = limit / max|g|``: the loss scale that puts the largest scaled gradient exactly at
    the format's max (fp16's 65504 by default). ``inf`` when ``max|g|`` is 0 or not finite."""
    if not (isinstance(max_abs_grad, int | float) and math.isfinite(max_abs_grad)):
        return math.inf
    if max_abs_grad <= 0:
        return math.inf
    return limit / max_abs_grad


def recommended_init_scale(
    max_abs_grad: float,
    *,
    limit: float = FP16_MAX,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> float:
    """The ``init_scale`` ampctl recommends for gradients whose largest magnitude is
    ``max_abs_grad``: ``S*`` rounded down to a power of two, then halved as a 2x margin (so the
    largest scaled gradient sits between a quarter and a half of fp16's max), clamped to
    ``[min_scale, max_scale]``. Used by ``diagnose`` and ``sweep-scale`` alike.

    >>> recommended_init_scale(1.0)  # S* = 65504 -> 32768 -> 16384
    16384.0
    """
    ideal = ideal_scale(max_abs_grad, limit)
    if not math.isfinite(ideal):
        return float(max_scale)
    rec = 2.0 ** math.floor(math.log2(ideal)) / 2
    return float(min(max(rec, min_scale), max_scale))
