"""What the replay found, as problems: a forward overflow (and in which module), a backward that
goes non-finite in one module although its forward is clean and the scale fits, gradients that
overflow or underflow fp16 at the checkpoint's scale, activations close to the precision's max.

Thresholds:

* ``backward_overflow`` (a warning) only when the checkpoint's scale is more than 2^3 above
  S* = 65504 / max|g|: a dynamic scaler a few powers of two too high skips that many steps and
  is back (how dynamic scaling probes after a growth), far too high it wastes steps;
* ``backward_nonfinite``: the first non-finite gradient flows out of a module while the forward
  is finite and the largest scaled gradient fits fp16 (so no scale would cure it): that
  module's own backward leaves fp16's range (e.g. GPT-2's tanh-GELU, whose ``x**3`` overflows
  for |x| > 40), fixed by running it in fp32 or bf16; non-finite in fp32 too, it is not
  precision but the model;
* ``gradient_underflow``: see :data:`~.common.UNDERFLOW_LIMIT` and
  :data:`~.common.ACT_UNDERFLOW_LIMIT`.

Pure functions of the :class:`~.stages.Replay`.
"""

from __future__ import annotations

import math

from .common import ACT_UNDERFLOW_LIMIT, UNDERFLOW_LIMIT
from .stages import Gradients, Problem, Replay

__all__ = ["replay_problems", "BACKWARD_OVERFLOW_LOG2"]

#: Powers of two of the checkpoint's scale above S* from which the backward overflow is a
#: finding (below it the dynamic scaler backs off in as many skipped steps).
BACKWARD_OVERFLOW_LOG2 = 3.0


def _forward_problems(r: Replay) -> list[Problem]:
    prec = r.precision
    fb = r.forward_first_bad
    if fb is None:
        if any(not math.isfinite(v) for v in r.loss):
            return [
                Problem(
                    "nonfinite_loss", f"the {prec} loss is non-finite although no module output is"
                )
            ]
        return []
    if fb.fp32_finite:
        return [
            Problem(
                "forward_overflow",
                f"forward overflow in {prec}: {fb.module} is the first module with a "
                f"non-finite output ({fb.what}, {fb.dtype}) on batch {fb.position}; the "
                "same batch is finite in fp32",
                module=fb.module,
            )
        ]
    return [
        Problem(
            "forward_nonfinite_fp32",
            f"the forward is non-finite in fp32 too (first in {fb.module}, batch "
            f"{fb.position}): not a precision problem, the model has diverged",
            module=fb.module,
        )
    ]


def _backward_problems(r: Replay, g: Gradients | None) -> list[Problem]:
    bb = r.backward_first_bad
    if bb is None or r.forward_first_bad is not None:
        return []
    if bb.fp32_finite is False:
        return [
            Problem(
                "backward_nonfinite_fp32",
                f"the backward is non-finite in fp32 too (first out of {bb.module}, batch "
                f"{bb.position}): not a precision problem (an operation whose gradient is not "
                "defined there, or a model that has diverged)",
                module=bb.module,
            )
        ]
    if g is not None and g.headroom_log2 < 0:
        return []  # the scale is above S*: the overflow is the scale's, see backward_overflow
    return [
        Problem(
            "backward_nonfinite",
            f"the {r.precision} backward goes non-finite in {bb.module} ({bb.what}, {bb.dtype}, "
            f"batch {bb.position}) although the forward is finite"
            + (
                f" and the largest scaled gradient has 2^{g.headroom_log2:.1f} of headroom at "
                f"scale {g.scale:g}: no loss scale cures it"
                if g is not None
                else ""
            )
            + "; its backward leaves the precision's range (finite in fp32)",
            module=bb.module,
        )
    ]


def _gradient_problems(r: Replay) -> list[Problem]:
    g = r.gradients
    if g is None or r.forward_first_bad is not None:
        return []
    problems = []
    bb = r.backward_first_bad
    if g.headroom_log2 < -BACKWARD_OVERFLOW_LOG2:
        halvings = math.ceil(-g.headroom_log2)
        where = f"; first non-finite gradient flows out of {bb.module}" if bb else ""
        problems.append(
            Problem(
                "backward_overflow",
                f"gradients overflow fp16 at scale {g.scale:g}: max|g| x scale = "
                f"{g.max_scaled:.4g} > 65504{where}; {halvings} skipped steps before the "
                f"scaler gets back under S* = {g.ideal_scale:.4g}",
                severity="warning",
                module=bb.module if bb else None,
            )
        )
    act = g.act_grad_underflow_frac  # None: no fp16 activation was counted
    rec_free = g.recommended_init_scale_unbounded
    lost = None if act is None else act - g.act_grad_zero_frac_fp32
    if lost is not None and lost > ACT_UNDERFLOW_LIMIT and rec_free > g.scale:
        sub = act - g.act_grad_zero_frac
        bound = (
            f"; the run's max_scale {g.max_scale:g} keeps it there"
            if g.max_scale < rec_free
            else ""
        )
        problems.append(
            Problem(
                "gradient_underflow",
                f"at scale {g.scale:g}, {act:.1%} of the fp16 activation-gradient elements "
                f"fall below fp16's normal range (2^-14): {sub:.1%} are subnormal (a few bits "
                f"left) and {g.act_grad_zero_frac:.1%} zero in the backward pass; "
                f"S* = {g.ideal_scale:.4g} would lift them{bound}",
            )
        )
    elif (
        g.lost_frac - g.lost_frac_at_recommended > UNDERFLOW_LIMIT
        and g.recommended_init_scale > g.scale
    ):
        problems.append(
            Problem(
                "gradient_underflow",
                f"at scale {g.scale:g}, {g.lost_frac:.1%} of the non-zero gradient "
                f"elements underflow in fp16 (|g| x scale < 2^-24; {g.underflow_frac:.1%} "
                f"with zeros); at {g.recommended_init_scale:g} only "
                f"{g.lost_frac_at_recommended:.1%} would",
            )
        )
    return problems


def replay_problems(r: Replay) -> list[Problem]:
    """Problems the replay found (forward overflow, a backward that goes non-finite, gradient
    under/overflow, tight headroom)."""
    problems = _forward_problems(r) + _backward_problems(r, r.gradients) + _gradient_problems(r)
    if r.forward_first_bad is None:
        low_dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(r.precision or "", "float16")
        tight = [m for m in r.modules if m.dtype == low_dtype and m.headroom_log2 < 1 and not m.bad]
        if tight:
            problems.append(
                Problem(
                    "activation_headroom",
                    f"{len(tight)} module output(s) within a factor 2 of {r.precision}'s max, "
                    f"first {tight[0].name} (max|x| {tight[0].amax:.4g})",
                    severity="warning",
                    modules=[m.name for m in tight],
                )
            )
    return problems
