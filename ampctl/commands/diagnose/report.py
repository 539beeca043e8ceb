"""The diagnosis report: one JSON schema for every checkpoint format (this docstring is its
documentation; ``ampctl diagnose --help`` points here).

``ampctl diagnose PATH --json`` prints it, :func:`ampctl.commands.diagnose.diagnose` returns it.
Non-finite numbers are written as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON). A
value a format does not record is ``null`` ("unknown"), never 0::

    {
      "schema": "ampctl-diagnose/2",
      "format": "ampctl" | "hf-trainer" | "accelerate" | "lightning" | "dcp" | "deepspeed"
                | "safetensors" | "state-dict",          # which reader read it
      "checkpoint": {"path", "step": int|null, "precision": str|null,
                     "precision_source": str|null,        # where the precision was read
                     "fp32_modules": [module], "run_dir": str|null},
      "branch": null | {"line": "main"|"archived", "text", "forked_at_step": int|null,
                        "branches": [folder], "parent": {...}|null},   # ampctl run folders
      "files": [{"file", "read": bool, "why"}],          # what was read, what was not and why
      "notes": [str],
      "healthy": bool,                                   # true when "problems" is empty
      "problems": [{"kind", "severity": "error"|"warning", "message", ...details}],
      "state": {
        "weights":   {"tensors", "elements", "amax", "limit", "bad": [BadTensor]},
        "master":    {... same ...} | null,              # fp32 masters (fp16-pure, ZeRO)
        "optimizer": {"tensors", "elements", "bad": [BadTensor]} | null,
        "names": {"method": str|null, "note": str|null}, # how optimizer entries were named
        "scaler": null | {"kind": "ampctl"|"GradScaler"|"deepspeed", "enabled", "scale",
                   "min_scale", "max_scale", "at_floor", "growth_interval", "growth_factor",
                   "backoff_factor", "growth_tracker", "hysteresis", "skipped_total",
                   "forward_overflows", "consecutive_overflows", "updates",
                   "recent_window", "recent_skips"}
      },
      "history": null | {
        "source": "run folder" | path of trainer_state.json / metrics.csv / events folder,
        "run_dir", "metrics_rows", "events": {kind: count},
        "first_overflow_step", "first_overflow_source": "events"|"scaler"|"metrics"|null,
        "first_nan_loss_step", "nan_filtered_steps": [step],   # HF: NaN logged as 0.0
        "first_nonfinite_grad_norm_step", "forward_overflows",
        "scale_trajectory": [[step, scale], ...], "bursts": [{"start", "end", "length",
        "scale", "after_growth"}], "scaler_records",
        "break_step", "before_break": [{"step", "loss", "scale", "skipped", "grad_norm",
        "grad_amax", "learning_rate"}],
        "loss": {"first", "first_step", "min", "min_step", "last", "last_step"} | null,
        "grad_norm": {"baseline", "peak", "peak_step", "ratio", "exploded"} | null,
        "promotions": [module], "fallbacks": [{"step", "from", "to"}],
        "aborted": {"step", "message"} | null,           # the guard's abort event
        "notes": [str],
        "unreadable": [[file, why]],                     # metrics/events that are there
                                                         # but could not be read
        "columns": {role: column}                        # other tools' logs only
      },
      "replay": {                                        # skipped: ran, reason, precision, device
        "ran": bool, "reason": str|null, "precision", "device",
        "data": str,                                     # which batches (synthetic is said so)
        "positions": [int], "scale", "limit", "loss": [float], "loss_fp32": [float],
        "modules": [{"name", "dtype", "amax", "headroom_log2", "bad"}],
        "masked_modules": [module],                      # intentional -inf: not a fault
        "forward_first_bad": {"module", "batch", "position", "nan", "posinf", "neginf",
                              "dtype", "fp32_finite"} | null,
        "backward_first_bad": {... same without fp32_finite ...} | null,
        "gradients": {"scale", "max_abs", "max_abs_param", "max_abs_activation",
                      "max_scaled", "headroom_log2", "underflow_frac", "zero_frac",
                      "zero_frac_replay", "lost_frac", "lost_frac_at_recommended",
                      "ideal_scale", "recommended_init_scale", "max_scaled_replay",
                      "recommended_init_scale_unbounded",   # the same without the run's bounds
                      "max_scale",                          # the run's
                      "act_grad_underflow_frac", "act_grad_zero_frac",  # fp16 activation
                      # gradients of the replay: below fp16's normal range / zero (or null)
                      "act_grad_zero_frac_fp32",  # zero in the fp32 pass (structural)
                      "nonfinite_params": [name]} | null,   # fp16 / fp16-pure only
        "exempted": [module], "elapsed_s"
      },
      "fp8": null | {                                    # null unless the replay runs in fp8
        "ran": bool, "reason": str|null,                 # not ran: only these two keys
        "recipe": "tensorwise"|"rowwise", "exclude": [pattern],   # the run's, as replayed
        "converted": [layer], "demoted": {layer: why},   # demotions restored from the checkpoint
        "excluded": {layer: why}, "sat_threshold", "under_threshold",   # the run's guard.fp8_*
        "layers": [{                                     # non-finite first, then least headroom
          "name", "formats": {"in", "w", "go": "e4m3"|"e5m2"|"hp"},
          "in_amax", "w_amax", "go_amax",                # max |x| the input/weight/grad cast got
          "in_headroom_log2", "w_headroom_log2", "go_headroom_log2",  # log2(format max / amax)
          "in_sat", "w_sat", "go_sat",                   # share put at the format's max
          "in_under", "w_under", "go_under",             # share of nonzero values flushed to 0
          "headroom_log2", "sat", "under", "nonfinite": bool,   # worst over the three casts
          "findings": [str]                              # why the layer is a finding ([]: fine)
        }]
      },
      "recommendations": [{"override": "key=value", "reason",
                           "yours": str|null}],           # the same in the writing tool's terms
      "checkpoints": [{"path", "step", "healthy", "problems": [kind]}],  # this one first
      "resume": {"checkpoint": str|null, "command": str}  # in the writing tool's terms
    }

BadTensor: ``{"name", "param", "key", "nan", "posinf", "neginf", "above_limit", "amax",
"limit"}`` (``param``/``key`` name the parameter and the optimizer-state entry, e.g.
``exp_avg_sq``; for weights ``param`` is the tensor name and ``key`` is null).

Problem kinds: ``bad_scale``, ``scale_collapsed``, ``nonfinite_weights``, ``extreme_weights``,
``nonfinite_master``, ``extreme_master``, ``nonfinite_optimizer_state``,
``extreme_optimizer_state``, ``scale_at_floor``, ``refused_file``, ``unreadable_file``,
``unreadable_history`` (a warning: ``history: FILE unreadable: WHY``, a history file that is
there but over the size cap, a symlink out of its folder, not JSON, nested too deeply ...),
``nan_loss``, ``nonfinite_grad_norm``, ``grad_norm_explosion``, ``overflow_after_growth``,
``forward_overflow``, ``forward_nonfinite_fp32``, ``nonfinite_loss``, ``backward_overflow``,
``gradient_underflow``, ``activation_headroom``, ``run_aborted``, ``fp8_nonfinite`` (an fp8 cast
went non-finite), ``fp8_headroom`` (fp8 layers with headroom below 2^1, or saturating / flushing
to zero above the run's ``guard.fp8_sat_threshold`` / ``guard.fp8_under_threshold``: see
:mod:`ampctl.commands.diagnose.fp8`; the recommendation is ``precision.fp8_exclude=[...]``).

A run folder without checkpoints (e.g. written by :class:`ampctl.integrations.ProtectedRun`):
``checkpoint.step`` is null, ``checkpoints`` is empty, ``state`` holds no tensors, and the
history and the replay's reason are what is reported.

Exit codes of ``ampctl diagnose``: 0 healthy, 1 problems found, 2 bad input.
"""

from __future__ import annotations

import math
from typing import Any

from .common import (
    ACT_UNDERFLOW_LIMIT,
    SCHEMA,
    STATE_KINDS,
    UNDERFLOW_LIMIT,
    jsonable,
    problem,
)
from .readers.base import Found

__all__ = ["SCHEMA", "build_report", "replay_problems", "state_kinds_of"]


def state_kinds_of(problems: list[dict[str, Any]]) -> list[str]:
    """The problems that make a checkpoint's own state unhealthy."""
    return sorted({p["kind"] for p in problems if p["kind"] in STATE_KINDS})


def build_report(
    found: Found,
    *,
    state: dict[str, Any],
    history: dict[str, Any] | None,
    replay: dict[str, Any],
    fp8: dict[str, Any] | None = None,
    problems: list[dict[str, Any]],
    recommendations: list[dict[str, Any]],
    checkpoints: list[dict[str, Any]],
    resume: dict[str, Any],
    branch: dict[str, Any] | None,
) -> dict[str, Any]:
    """The report dict, JSON-ready. Pure."""
    report = {
        "schema": SCHEMA,
        "format": found.format,
        "checkpoint": {
            "path": str(found.path),
            "step": found.step,
            "precision": found.precision,
            "precision_source": found.precision_source,
            "fp32_modules": list(found.fp32_modules),
            "run_dir": str(found.run_dir) if history is not None and found.run_dir else None,
        },
        "branch": branch,
        "files": [f.as_dict() for f in found.files],
        "notes": list(found.notes),
        "healthy": not problems,
        "problems": problems,
        "state": state,
        "history": history,
        "replay": replay,
        "fp8": fp8,
        "recommendations": recommendations,
        "checkpoints": checkpoints,
        "resume": resume,
    }
    return jsonable(report)


def _what(d: dict[str, Any]) -> str:
    return "NaN" if d["nan"] else ("+inf" if d["posinf"] else "-inf")


def _forward_problems(r: dict[str, Any]) -> list[dict[str, Any]]:
    prec = r["precision"]
    fb = r["forward_first_bad"]
    if fb is None:
        if any(not math.isfinite(v) for v in r["loss"]):
            return [
                problem(
                    "nonfinite_loss", f"the {prec} loss is non-finite although no module output is"
                )
            ]
        return []
    if fb["fp32_finite"]:
        return [
            problem(
                "forward_overflow",
                f"forward overflow in {prec}: {fb['module']} is the first module with a "
                f"non-finite output ({_what(fb)}, {fb['dtype']}) on batch {fb['position']}; the "
                "same batch is finite in fp32",
                module=fb["module"],
            )
        ]
    return [
        problem(
            "forward_nonfinite_fp32",
            f"the forward is non-finite in fp32 too (first in {fb['module']}, batch "
            f"{fb['position']}): not a precision problem, the model has diverged",
            module=fb["module"],
        )
    ]


def _gradient_problems(r: dict[str, Any]) -> list[dict[str, Any]]:
    g = r["gradients"]
    if g is None or r["forward_first_bad"] is not None:
        return []
    problems = []
    bb = r["backward_first_bad"]
    # A scale up to 2x over S* is the dynamic scaler probing after a growth (one skipped step
    # fixes it); beyond that it was set (or grew) far too high, or the gradients spiked.
    if g["headroom_log2"] < -1:
        halvings = math.ceil(-g["headroom_log2"])
        where = f"; first non-finite gradient flows out of {bb['module']}" if bb else ""
        problems.append(
            problem(
                "backward_overflow",
                f"gradients overflow fp16 at scale {g['scale']:g}: max|g| x scale = "
                f"{g['max_scaled']:.4g} > 65504{where}; {halvings} skipped steps before the "
                f"scaler gets back under S* = {g['ideal_scale']:.4g}",
                severity="warning",
                module=bb["module"] if bb else None,
            )
        )
    act = g["act_grad_underflow_frac"]  # None: no fp16 activation was counted
    rec_free = g["recommended_init_scale_unbounded"]
    lost = None if act is None else act - g["act_grad_zero_frac_fp32"]
    if lost is not None and lost > ACT_UNDERFLOW_LIMIT and rec_free > g["scale"]:
        sub = act - g["act_grad_zero_frac"]
        bound = (
            f"; the run's max_scale {g['max_scale']:g} keeps it there"
            if g["max_scale"] < rec_free
            else ""
        )
        problems.append(
            problem(
                "gradient_underflow",
                f"at scale {g['scale']:g}, {act:.1%} of the fp16 activation-gradient elements "
                f"fall below fp16's normal range (2^-14): {sub:.1%} are subnormal (a few bits "
                f"left) and {g['act_grad_zero_frac']:.1%} zero in the backward pass; "
                f"S* = {g['ideal_scale']:.4g} would lift them{bound}",
            )
        )
    elif (
        g["lost_frac"] - g["lost_frac_at_recommended"] > UNDERFLOW_LIMIT
        and g["recommended_init_scale"] > g["scale"]
    ):
        problems.append(
            problem(
                "gradient_underflow",
                f"at scale {g['scale']:g}, {g['lost_frac']:.1%} of the non-zero gradient "
                f"elements underflow in fp16 (|g| x scale < 2^-24; {g['underflow_frac']:.1%} "
                f"with zeros); at {g['recommended_init_scale']:g} only "
                f"{g['lost_frac_at_recommended']:.1%} would",
            )
        )
    return problems


def replay_problems(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Problems the replay found (forward overflow, gradient under/overflow, tight headroom)."""
    problems = _forward_problems(r) + _gradient_problems(r)
    if r["forward_first_bad"] is None:
        low_dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(r["precision"], "float16")
        tight = [
            m
            for m in r["modules"]
            if m["dtype"] == low_dtype and m["headroom_log2"] < 1 and not m["bad"]
        ]
        if tight:
            problems.append(
                problem(
                    "activation_headroom",
                    f"{len(tight)} module output(s) within a factor 2 of {r['precision']}'s max, "
                    f"first {tight[0]['name']} (max|x| {tight[0]['amax']:.4g})",
                    severity="warning",
                    modules=[m["name"] for m in tight],
                )
            )
    return problems
