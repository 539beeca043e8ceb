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
                        "branches": [folder], "parent": {...}|null,    # ampctl run folders
                        "resumes": int},                   # resume events in events.jsonl
      "files": [{"file", "read": bool, "why"}],          # what was read, what was not and why
      "notes": [str],
      "healthy": bool,                      # true when "problems" holds no error or warning
      "verdict": {"status": "healthy"|"recovered"|"broken",   # exit 0, 0, 1
                  "kind": str|null,                      # the first problem's kind (the cause)
                  "summary": str, "cause": str|null,     # one line each, in the user's terms
                  "first_bad_step": int|null,            # the first sign of unresolved trouble
                  "events": [str],                       # what the run went through, in words
                  "episodes": [{"kind", "start", "end", "resolved", "text"}]},
      "problems": [{"kind", "severity": "error"|"warning"|"note", "message",
                    "step", "module", "tensors", "params", "modules", "layers", "file"}],
                                                         # the details: those that apply
      "state": {
        "weights":   {"tensors", "elements", "amax", "limit", "bad": [BadTensor]},
        "master":    {... same ...} | null,              # fp32 masters (fp16-pure, ZeRO)
        "optimizer": {"tensors", "elements", "bad": [BadTensor]} | null,
        "names": {"method": str|null, "note": str|null}, # how optimizer entries were named
        "scaler": null | {"kind": "ampctl"|"GradScaler"|"deepspeed", "enabled", "scale",
                   "min_scale", "max_scale", "at_floor", "growth_interval", "growth_factor",
                   "backoff_factor", "growth_tracker", "hysteresis", "skipped_total",
                   "forward_overflows", "consecutive_overflows", "updates",
                   "recent_window", "recent_skips", "spikes"}   # spikes: ampctl's, when saved
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
        "overflow_params": [param],                      # named by the overflow events
        "skipped_steps": [step],                         # as recorded (scaler, events, HF's
                                                         # grad_norm inf/nan rows)
        "resumes": [{"step", "from"}],                   # resume events of the run folder
        "status": str,                                   # summary.json's (run folders only)
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
        "backward_first_bad": {... same; fp32_finite: the fp32 backward was} | null,
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
      "checkpoints": [{"path", "step", "healthy", "problems": [kind],   # this one first
                       "after_trouble": true}],           # only when written after the first
                                                          # sign of trouble: no resume point
      "resume": {"checkpoint": str|null, "command": str,  # in the writing tool's terms
                 "why": str,                              # when the history chose it
                 "probe": str}                            # the advice tried: held or not, or
                                                          # why it was not tried (diagnose/probe.py)
    }

``ampctl diagnose --json`` on bad input (exit code 2) prints ``{"error": "the one line"}``.

BadTensor: ``{"name", "param", "key", "nan", "posinf", "neginf", "above_limit", "amax",
"limit"}`` (``param``/``key`` name the parameter and the optimizer-state entry, e.g.
``exp_avg_sq``; for weights ``param`` is the tensor name and ``key`` is null).

Problem kinds: ``bad_scale``, ``scale_collapsed``, ``nonfinite_weights``, ``extreme_weights``,
``nonfinite_master``, ``extreme_master``, ``nonfinite_optimizer_state``,
``extreme_optimizer_state``, ``scale_at_floor``, ``refused_file``, ``unreadable_file``,
``unreadable_history`` (a note, which never changes the verdict or the exit code: ``history: FILE
unreadable: WHY``, a history file that is there but a symlink out of its folder, not JSON, pickle
or binary bytes ...; a history is never refused for its size, and a line or entry over the
per-line cap is skipped and counted in the history's notes),
``nan_loss`` (non-finite to the end of the record), ``lr_divergence`` (the loss left its course
while the updates were applied, and did not come back or went non-finite: :mod:`.course`),
``overflow_storm`` (``STORM_MIN`` skipped steps in a row, still going), ``grad_norm_explosion``,
``overflow_after_growth``, ``forward_overflow``, ``forward_nonfinite_fp32``, ``nonfinite_loss``,
``backward_nonfinite`` (the backward of one module leaves the precision's range while the
forward is clean and the scale fits), ``backward_nonfinite_fp32``, ``backward_overflow`` (the
scale more than 2^3 above S*), ``gradient_underflow``, ``activation_headroom``, ``run_aborted``,
``fp8_nonfinite`` (an fp8 cast
went non-finite), ``fp8_headroom`` (fp8 layers with headroom below 2^1, or saturating / flushing
to zero above the run's ``guard.fp8_sat_threshold`` / ``guard.fp8_under_threshold``: see
:mod:`ampctl.commands.diagnose.fp8`; the recommendation is ``precision.fp8_exclude=[...]``);
the loop's own mistakes, each with its fix in the loop's terms (:mod:`.loops`):
``scheduler_on_skipped_steps``, ``scale_at_ceiling``, ``fp16_weights_under_scaler``,
``unchecked_update``, ``poisoned_checkpoint``.

A run folder without checkpoints (e.g. written by :class:`ampctl.integrations.ProtectedRun`):
``checkpoint.step`` is null, ``checkpoints`` is empty, ``state`` holds no tensors, and the
history and the replay's reason are what is reported.

Exit codes of ``ampctl diagnose``: 0 healthy or recovered (no problem; notes allowed), 1 problems found (the
verdict is ``broken``), 2 bad input.
"""

from __future__ import annotations

from .common import SCHEMA, jsonable
from .readers.base import Found
from .stages import (
    Branch,
    CheckpointHealth,
    CheckpointInfo,
    Fp8Section,
    History,
    Problem,
    Recommendation,
    Replay,
    Report,
    Resume,
    StateHealth,
    Verdict,
    to_json,
)

__all__ = ["SCHEMA", "build_report", "report_json"]


def build_report(
    found: Found,
    *,
    state: StateHealth,
    history: History | None,
    replay: Replay,
    fp8: Fp8Section | None,
    problems: list[Problem],
    recommendations: list[Recommendation],
    checkpoints: list[CheckpointHealth],
    resume: Resume,
    branch: Branch | None,
    verdict: Verdict,
) -> Report:
    """The report of one diagnosis. Pure."""
    return Report(
        schema=SCHEMA,
        format=found.format,
        checkpoint=CheckpointInfo(
            path=str(found.path),
            step=found.step,
            precision=found.precision,
            precision_source=found.precision_source,
            fp32_modules=list(found.fp32_modules),
            run_dir=str(found.run_dir) if history is not None and found.run_dir else None,
        ),
        branch=branch,
        files=[f.as_dict() for f in found.files],
        notes=list(found.notes),
        healthy=not [p for p in problems if p.severity != "note"],
        problems=problems,
        state=state,
        history=history,
        replay=replay,
        fp8=fp8,
        recommendations=recommendations,
        checkpoints=checkpoints,
        resume=resume,
        verdict=verdict,
    )


def report_json(report: Report) -> dict:
    """The report as strict JSON values (the ``--json`` document)."""
    return jsonable(to_json(report))
