"""Mistakes in how a training loop drives mixed precision, as users report them upstream (#40):
each a problem named in the loop's own terms, with the fix there (the line of a plain loop, the
Trainer argument, the Lightning flag; a plain loop's when the checkpoint does not say whose).

* ``scheduler_on_skipped_steps`` (pytorch #55585, transformers #11106): the logged lr moved on
  every step of a run of steps the GradScaler skipped, by half again or more beyond one step's
  change (a loop that steps its scheduler whatever ``scaler.step`` did holds it on none);
* ``scale_at_ceiling`` (pytorch #98828): a GradScaler scale at 2^64 or more (far past what any
  fp16 gradient needs: 65504 / 2^64 ~ 3.6e-15), up to float32's 2^127 where torch caps it;
* ``fp16_weights_under_scaler`` (LLaVA #363, bitsandbytes #945): a GradScaler over weights the
  optimizer trains in float16 (its moments' dtype; with none yet, every weight float16);
* ``unchecked_update`` (pytorch #157436): non-finite weights although a GradScaler, which skips
  every step it finds non-finite, checked each step;
* ``poisoned_checkpoint`` (marin #7271): non-finite weights in a checkpoint of a run without a
  scaler, written at or after a NaN backward its history shows (a finite loss, a non-finite
  gradient norm: the first non-finite step), as a loop that saves on, or as it stops, writes it.

Pure functions of what the earlier stages found: dtypes, counts and the history, no tensor read.
"""

from __future__ import annotations

import math

import torch

from .common import finite
from .course import skip_runs
from .readers.base import Found
from .readers.lazy import tensor_sources
from .stages import History, Problem, Row, StateHealth

__all__ = ["loop_problems", "CEILING_LOG2", "SCHEDULE_DRIFT"]

#: A GradScaler scale at 2^this or above is a finding (see the module docstring).
CEILING_LOG2 = 64
#: The factor the lr may drift over a run of skipped steps beyond its one legitimate change.
SCHEDULE_DRIFT = 1.5

_FIX = {
    "scheduler_on_skipped_steps": {
        "plain": "step the scheduler only when the optimizer stepped: `scale_before = "
        "scaler.get_scale(); scaler.step(optimizer); scaler.update()`, then `if "
        "scaler.get_scale() >= scale_before: scheduler.step()` (pytorch #55585)",
        "hf-trainer": "upgrade transformers: the Trainer skips the scheduler step of a step its "
        "GradScaler skipped since v4.5 (transformers #11144)",
        "lightning": "Lightning steps a step-interval scheduler after a skipped step too: "
        "override `lr_scheduler_step` in your LightningModule to skip it when the scale "
        "dropped, or train with ampctl's AmpctlCallback (it does)",
        "accelerate": "pass the scheduler through `accelerator.prepare`: its wrapper skips the "
        "scheduler step of an optimizer step that was skipped",
    },
    "scale_at_ceiling": {
        "plain": "keep GradScaler's default `torch.amp.GradScaler(growth_interval=2000)`; "
        "gradients that never overflow need no loss scaling: bf16 or fp32, without a GradScaler",
        "hf-trainer": "drop the custom GradScaler (TrainingArguments(fp16=True) keeps "
        "growth_interval=2000), or TrainingArguments(bf16=True)",
        "lightning": 'keep growth_interval=2000 in MixedPrecision("16-mixed", device, '
        'scaler=torch.amp.GradScaler(...)), or Trainer(precision="bf16-mixed")',
        "accelerate": "Accelerator(kwargs_handlers=[GradScalerKwargs(growth_interval=2000)]), "
        'or Accelerator(mixed_precision="bf16")',
    },
    "fp16_weights_under_scaler": {
        "plain": "`model.float()` (or `p.data = p.data.float()` for the parameters you train) "
        "before building the optimizer; `torch.autocast(device_type, dtype=torch.float16)` "
        "runs the fp16 compute and GradScaler unscales fp32 gradients",
        "hf-trainer": "load the model in float32 for TrainingArguments(fp16=True) (no "
        "torch_dtype=torch.float16), or cast the parameters you train (LoRA, a projector) to "
        "float32 after loading; or TrainingArguments(bf16=True)",
        "lightning": 'keep the weights you train in float32 under Trainer(precision="16-mixed") '
        '(no .half(), no torch_dtype=torch.float16 for them), or Trainer(precision="bf16-mixed")',
        "accelerate": "keep the weights you train in float32 under Accelerator(mixed_precision="
        '"fp16") (no .half(), no torch_dtype=torch.float16 for them)',
    },
    "unchecked_update": {
        "plain": "average the gradients before `scaler.unscale_(optimizer)` (DistributedDataParallel "
        "does it inside `backward()`; DistributedDataParallel(model, find_unused_parameters=True) "
        "when some ranks leave parameters without a gradient), so that every rank's GradScaler "
        "checks the gradients it applies (or all-reduce its found-inf, as FSDP's "
        "ShardedGradScaler does)",
    },
    "poisoned_checkpoint": {
        "plain": "fail instead of saving: `torch.nn.utils.clip_grad_norm_(params, max_norm, "
        "error_if_nonfinite=True)` (or `if not torch.isfinite(grad_norm): raise`) before "
        "`optimizer.step()`, and raise on a non-finite loss rather than break to the final save",
    },
}


def _fix(kind: str, terms: str) -> str:
    fixes = _FIX[kind]
    return "; fix: " + fixes.get(terms, fixes["plain"])


def loop_problems(found: Found, state: StateHealth, h: History | None, terms: str) -> list[Problem]:
    """The problems of the loop (see the module docstring), each with its fix in ``terms``."""
    out = [
        _scheduler_on_skips(h, terms),
        _ceiling(state, h, terms),
        _fp16_trained(found, state, terms),
        _unchecked(state, h),
        _poisoned(found, state, h),
    ]
    return [p for p in out if p is not None]


# ---------------------------------------------------------------------------- the schedule
def _scheduler_on_skips(h: History | None, terms: str) -> Problem | None:
    """The logged lr changed at every step of a window around a run of skipped steps that
    ended (from the row before it, when logged, to the row after it; two changes at least),
    by :data:`SCHEDULE_DRIFT` or more beyond its largest change: a scheduler held on skipped
    steps changes the lr across one of them at most, whether a loop logs the lr a step used or
    the one after it; one isolated skip in a decay moves it by a step's worth (no finding)."""
    if h is None or not h.skipped_steps:
        return None
    lr = {r.step: r.learning_rate for r in h.rows if finite(r.learning_rate) and r.learning_rate}
    moved: list[tuple[int, int, float, float]] = []
    for a, b in skip_runs(h.skipped_steps):
        window = [lr.get(s) for s in range(a - 1 if a - 1 in lr else a, b + 2)]
        if None in window or len(window) < 3:
            continue
        logs = [abs(math.log(y / x)) for x, y in zip(window, window[1:], strict=False)]
        if min(logs) > 1e-6 and sum(logs) - max(logs) >= math.log(SCHEDULE_DRIFT):
            moved.append((a, b, window[0], window[-1]))
    if not moved:
        return None
    n = sum(b - a + 1 for a, b, *_ in moved)
    span = ", ".join(f"{a}–{b}" if b > a else str(a) for a, b, *_ in moved[:4])
    a, b, lo, hi = moved[0]
    return Problem(
        "scheduler_on_skipped_steps",
        f"the lr scheduler stepped on {n} step(s) the GradScaler skipped ({span}): the lr moved "
        f"from {lo:.3g} to {hi:.3g} across steps {a}–{b + 1} although no update was applied "
        "there, so the schedule runs ahead of the updates (a warmup spent on skipped steps)"
        + _fix("scheduler_on_skipped_steps", terms),
        step=a,
    )


# ---------------------------------------------------------------------------- the scaler
def _ceiling(state: StateHealth, h: History | None, terms: str) -> Problem | None:
    """A GradScaler (or DeepSpeed) scale at 2^:data:`CEILING_LOG2` or above, in the checkpoint or,
    without one, in the history's scale trajectory."""
    sc = state.scaler
    if sc is not None and sc.kind == "ampctl":
        return None  # ampctl's LossScaler has a max_scale (2^24 by default)
    scale = sc.scale if sc is not None and sc.enabled else None
    if scale is None and h is not None and h.scale_trajectory:
        scale = max(s for _, s in h.scale_trajectory)
    if scale is None or math.isnan(scale) or not scale >= 2.0**CEILING_LOG2:
        return None
    gi = sc.growth_interval if sc is not None else None
    every = f"every {gi} step(s)" if gi else "every growth_interval steps"
    return Problem(
        "scale_at_ceiling",
        f"the GradScaler scale grew to {scale:.4g} (2^{math.log2(scale):.0f}): at float32's "
        "largest power of two, 2^127, torch caps it since 2.1 (before, it overflowed to inf: "
        f"pytorch #98828); it doubles {every} without an overflow and these gradients never "
        "overflow, so nothing held it back" + _fix("scale_at_ceiling", terms),
    )


def _fp16_trained(found: Found, state: StateHealth, terms: str) -> Problem | None:
    """Weights the optimizer trains in float16 under a GradScaler: by the dtype of their
    optimizer state, or, with no state yet (a run that failed at its first step), every
    floating weight of the checkpoint in float16."""
    sc, opt = state.scaler, found.optimizer
    if sc is None or sc.kind != "GradScaler" or not sc.enabled or not isinstance(opt, dict):
        return None
    moments = [
        t
        for st in (opt.get("state") or {}).values()
        if isinstance(st, dict)
        for k, t in st.items()
        if k != "step" and getattr(t, "dtype", None) is not None and t.dtype.is_floating_point
    ]
    ids = [i for g in opt.get("param_groups") or [] for i in g.get("params", [])]
    if moments:
        half = sum(1 for t in moments if t.dtype == torch.float16)
        what = f"{half} of the optimizer's {len(moments)} state tensors are float16"
    else:
        floating = tensor_sources(found.weights)
        half = len(floating) if ids and all(s.dtype == torch.float16 for s in floating) else 0
        what = (
            f"every one of the {half} weight tensors is float16 (first {floating[0].name}) and "
            f"the optimizer trains {len(ids)} of them"
            if half
            else ""
        )
    if not half:
        return None
    return Problem(
        "fp16_weights_under_scaler",
        f"the weights the optimizer trains are float16 ({what}) under a GradScaler, which "
        'refuses to unscale fp16 gradients ("Attempting to unscale FP16 gradients": LLaVA '
        "#363, bitsandbytes #945): no step can be taken; keep the trained weights in float32 "
        "and let autocast compute in fp16" + _fix("fp16_weights_under_scaler", terms),
    )


def _nonfinite_state(state: StateHealth) -> bool:
    return any(p.kind in ("nonfinite_weights", "nonfinite_master") for p in state.problems)


def _halvings(state: StateHealth, h: History | None) -> str:
    """How a scale that fell to the end of the record got there: one halving per skipped
    step, from the highest scale of the last fall."""
    pts = [s for _, s in (h.scale_trajectory if h else [])]
    end = state.scaler.scale if state.scaler is not None else None
    if pts and finite(end) and end < pts[-1]:
        pts.append(end)
    i = len(pts) - 1
    while i > 0 and pts[i - 1] > pts[i]:
        i -= 1
    if len(pts) - i < 3 or not pts[-1] > 0:
        return ""
    n = round(math.log2(pts[i] / pts[-1]))
    return (
        f"; then every step was skipped and the scale halved on each, {pts[i]:g} to "
        f"{pts[-1]:.3g}: {n} halvings, one per skipped step, not one jump"
    )


def _unchecked(state: StateHealth, h: History | None) -> Problem | None:
    """Non-finite weights although a GradScaler (which skips any step it finds non-finite)
    checked every step: what it checked was not what was applied."""
    sc = state.scaler
    if sc is None or sc.kind != "GradScaler" or not sc.enabled or not _nonfinite_state(state):
        return None
    return Problem(
        "unchecked_update",
        "the weights hold inf/NaN although a GradScaler checked every step, and it skips any "
        "step whose gradients are not finite: the NaN came in gradients it did not check, "
        "changed after `scaler.unscale_` -- averaged across ranks after it, when each rank's "
        "GradScaler judges its own gradients and a rank whose gradient is None or finite applies "
        "the average that holds another rank's inf (pytorch #157436) -- or in an update that is "
        "not finite from finite gradients"
        + _halvings(state, h)
        + _fix("unchecked_update", "plain"),
        step=h.first_nan_loss_step if h else None,
    )


def _poisoned(found: Found, state: StateHealth, h: History | None) -> Problem | None:
    """A checkpoint of an unscaled run that holds non-finite weights, written at or after the
    first step its history logs non-finite, when that step's loss was finite and its gradient
    norm not: a backward that made the NaN, which the optimizer applied (a loss that went NaN
    first is a divergence or bad data, named by the others)."""
    scaled = found.scaler is not None or found.format == "ampctl"
    if scaled or h is None or found.step is None or not _nonfinite_state(state):
        return None
    r = next((r for r in h.rows if r.step <= found.step and _nonfinite_row(r)), None)
    if r is None or not finite(r.loss):
        return None
    return Problem(
        "poisoned_checkpoint",
        f"this checkpoint (step {found.step}) holds inf/NaN weights, written after the backward "
        f"of step {r.step} made the NaN (its loss finite, {r.loss:.4g}, its gradient norm "
        f"{r.grad_norm}) and optimizer.step() applied it (without a GradScaler nothing checks "
        "the gradients): a loop that saves on, or as it stops, publishes it as its result and "
        "reports success (marin #7271)" + _fix("poisoned_checkpoint", "plain"),
        step=r.step,
    )


def _nonfinite_row(r: Row) -> bool:
    return (r.loss is not None and not finite(r.loss)) or (
        r.grad_norm is not None and not finite(r.grad_norm)
    )
