"""Part 3 for fp8 runs: per-layer cast headroom in e4m3/e5m2 terms, from the fp8 replay.

The replay (:mod:`.replay`) converts the model as the run had it (the run's
``precision.fp8_recipe`` / ``precision.fp8_exclude``; the layers the guard had demoted stay
demoted, from the checkpoint's precision state) and opens :func:`ampctl.amp.fp8.record_casts` over
its fp8 pass. This module turns the probe's rows (host numbers) into the report's ``fp8``
section and its problems. Pure functions.

Per converted layer and per cast (``in``: the input, ``w``: the weight, ``go``: the gradient of
the layer's output; e4m3 forward and e5m2 gradient under ``tensorwise``, e4m3 everywhere under
``rowwise``):

* ``amax``: max |x| of the tensor the cast receives;
* ``headroom_log2``: ``log2(format max / amax)``, powers of two between the unscaled tensor and
  the format's max (448 for e4m3, 57344 for e5m2). Below 0 the tensor does not fit the format
  as it is: a cast without scaling would saturate it. torchao's dynamic scaling divides it by
  ``amax / max`` instead, so an outlier that large pushes the rest of the tensor toward
  underflow (``under``);
* ``sat``: the share of values the cast puts at the format's max (with dynamic scaling at
  least the amax element itself: see :mod:`ampctl.amp.fp8`);
* ``under``: the share of the nonzero finite values the cast flushes to zero.

A layer is a finding when a cast is non-finite (an fp8 overflow: the whole cast becomes 0 and
NaN), its headroom is below 1 (within a factor 2 of the format's max, or beyond it), its ``sat``
is above the run's ``guard.fp8_sat_threshold`` or its ``under`` above
``guard.fp8_under_threshold`` (the thresholds of the guard's demotion rules).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ampctl.amp.formats import E4M3_MAX, E5M2_MAX

from .stages import Fp8Layer, Fp8Section, Problem

__all__ = ["HEADROOM_LIMIT", "FORMAT_MAX", "fp8_layers", "fp8_problems", "fp8_findings"]

#: Headroom (powers of two below the format's max) under which a cast is a finding.
HEADROOM_LIMIT = 1.0
FORMAT_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
_ROLES = (("in", "input"), ("w", "weight"), ("go", "gradient"))


def _headroom(fmt: str, amax: float) -> float:
    limit = FORMAT_MAX.get(fmt)
    if limit is None:  # a cast torchao leaves in high precision
        return math.inf
    if not math.isfinite(amax):
        return math.nan
    return math.log2(limit / amax) if amax > 0 else math.inf


def _layer(
    name: str,
    row: Mapping[str, float],
    formats: Mapping[str, str],
    sat_max: float,
    under_max: float,
) -> Fp8Layer:
    why: list[str] = []
    heads = []
    casts: dict[str, float] = {}
    for role, label in _ROLES:
        amax, fmt = float(row[f"{role}_amax"]), formats.get(role, "hp")
        head = _headroom(fmt, amax)
        sat, under = float(row[f"{role}_sat"]), float(row[f"{role}_under"])
        casts.update(
            {
                f"{role}_amax": amax,
                f"{role}_headroom_log2": head,
                f"{role}_sat": sat,
                f"{role}_under": under,
            }
        )
        if not math.isfinite(amax):
            why.append(f"non-finite {label} (amax {amax})")
            continue
        heads.append(head)
        if head < HEADROOM_LIMIT:
            where = "above" if head < 0 else "within a factor 2 of"
            unscaled = ": unscaled it would saturate" if head < 0 else ""
            why.append(
                f"{label} amax {amax:.4g} is {where} {fmt}'s max {FORMAT_MAX[fmt]:g} "
                f"(headroom 2^{head:.1f}{unscaled})"
            )
        if sat > sat_max:
            why.append(f"{label} cast saturates {sat:.1%} of its values")
        if under > under_max:
            why.append(f"{label} cast flushes {under:.1%} of its nonzero values to zero")
    nonfinite = any(not math.isfinite(casts[f"{r}_amax"]) for r, _ in _ROLES)
    return Fp8Layer(
        name=name,
        formats=dict(formats),
        **casts,
        nonfinite=nonfinite,
        headroom_log2=math.nan if nonfinite else min(heads, default=math.inf),
        sat=max(casts[f"{r}_sat"] for r, _ in _ROLES),
        under=max(casts[f"{r}_under"] for r, _ in _ROLES),
        findings=why,
    )


def fp8_layers(
    names: Sequence[str],
    rows: Sequence[Sequence[float]],
    fields: Sequence[str],
    formats: Mapping[str, Mapping[str, str]],
    *,
    sat_threshold: float,
    under_threshold: float,
) -> list[Fp8Layer]:
    """One record per probed layer, non-finite layers first, then least headroom first.

    ``rows``: the probe's host rows, ordered as ``fields`` (:data:`ampctl.amp.fp8.FIELDS`);
    ``formats``: each layer's cast formats (:func:`ampctl.amp.fp8.cast_formats`)."""
    layers = [
        _layer(
            n,
            dict(zip(fields, r, strict=True)),
            formats.get(n, {}),
            sat_threshold,
            under_threshold,
        )
        for n, r in zip(names, rows, strict=True)
    ]
    return sorted(layers, key=lambda m: (not m.nonfinite, 0.0 if m.nonfinite else m.headroom_log2))


def fp8_findings(section: Fp8Section | None) -> list[Fp8Layer]:
    """The layers of an ``fp8`` section that are findings, in the section's order."""
    if section is None or not section.ran:
        return []
    return [m for m in section.layers if m.findings]


def fp8_problems(section: Fp8Section | None) -> list[Problem]:
    """``fp8_nonfinite`` (error) for layers whose cast went non-finite, ``fp8_headroom``
    (warning) for the other findings; each names the layers, worst first."""
    found = fp8_findings(section)
    out = []
    bad = [m for m in found if m.nonfinite]
    if bad:
        out.append(
            Problem(
                "fp8_nonfinite",
                f"fp8 cast non-finite in {len(bad)} layer(s), first {bad[0].name}: "
                f"{bad[0].findings[0]}",
                layers=[m.name for m in bad],
            )
        )
    tight = [m for m in found if not m.nonfinite]
    if tight:
        first = tight[0]
        out.append(
            Problem(
                "fp8_headroom",
                f"{len(tight)} fp8 layer(s) out of {len(section.layers)} with too little "
                f"headroom, first {first.name}: {'; '.join(first.findings)}",
                severity="warning",
                layers=[m.name for m in tight],
            )
        )
    return out
