"""The typed records that pass between the stages of a diagnosis::

    read (Found) -> health (StateHealth) -> history (History) -> replay (Replay, Fp8Section)
      -> verdict (Verdict, problems, checkpoints, resume) -> recommend (Recommendation)
      -> report (Report) -> render / --json

Each key of the report's JSON (:mod:`.report` documents the schema) is a field name here, spelled
once: :func:`to_json` writes a record as the JSON object of its fields, in field order. A field
marked :data:`OPTIONAL` is left out while it is ``None``; one marked :data:`INTERNAL` is a
stage's working data and never written. Pure data: no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

__all__ = [
    "OPTIONAL",
    "INTERNAL",
    "to_json",
    "Problem",
    "BadTensor",
    "TensorSection",
    "OptimizerNames",
    "ScalerState",
    "StateHealth",
    "Burst",
    "Row",
    "LossTrend",
    "GradNormTrend",
    "Fallback",
    "Aborted",
    "GuardEvent",
    "History",
    "FirstBad",
    "ModuleRow",
    "Gradients",
    "Replay",
    "Fp8Layer",
    "Fp8Section",
    "Recommendation",
    "CheckpointHealth",
    "Resume",
    "Episode",
    "Verdict",
    "CheckpointInfo",
    "Branch",
    "Report",
]

_OPT = {"optional": True}
_INT = {"internal": True}


def OPTIONAL(default: Any = None) -> Any:  # noqa: N802 - reads as a field marker
    """A field left out of the JSON while it is None."""
    return field(default=default, metadata=_OPT)


def INTERNAL(factory: Any = list) -> Any:  # noqa: N802
    """A stage's working data, never written to the JSON."""
    return field(default_factory=factory, metadata=_INT, repr=False)


def to_json(x: Any) -> Any:
    """A record (and everything it holds) as plain JSON values. Non-finite floats stay floats
    here (the report's writer turns them into strings)."""
    if hasattr(x, "json_fields"):
        return {k: to_json(v) for k, v in x.json_fields().items()}
    if is_dataclass(x) and not isinstance(x, type):
        out = {}
        for f in fields(x):
            if f.metadata.get("internal"):
                continue
            v = getattr(x, f.name)
            if v is None and f.metadata.get("optional"):
                continue
            out[f.name] = to_json(v)
        return out
    if isinstance(x, list | tuple):
        return [to_json(v) for v in x]
    if isinstance(x, dict):
        return {k: to_json(v) for k, v in x.items()}
    return x


# ---------------------------------------------------------------------------- problems
@dataclass
class Problem:
    """A finding. ``severity``: ``error`` (the run is broken here), ``warning``, or ``note``
    (named in the report, never changes the verdict: a history that could not be read). The details
    name what it is about (a step, a module, tensors, parameters, layers, a file)."""

    kind: str
    message: str
    severity: str = "error"
    step: int | None = OPTIONAL()
    module: str | None = OPTIONAL()
    tensors: list[str] | None = OPTIONAL()
    params: list[str] | None = OPTIONAL()
    modules: list[str] | None = OPTIONAL()
    layers: list[str] | None = OPTIONAL()
    file: str | None = OPTIONAL()

    def json_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "severity": self.severity}
        out["message"] = self.message
        for f in fields(self)[3:]:
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = v
        return out


# ---------------------------------------------------------------------------- 1. state
@dataclass
class BadTensor:
    name: str
    param: str | None
    key: str | None
    nan: int
    posinf: int
    neginf: int
    above_limit: int
    amax: float
    limit: float

    @property
    def nonfinite(self) -> bool:
        return bool(self.nan or self.posinf or self.neginf)


@dataclass
class TensorSection:
    tensors: int
    elements: int
    amax: float | None = OPTIONAL()  # not for the optimizer state
    bad: list[BadTensor] = field(default_factory=list)
    limit: float | None = OPTIONAL()  # weights and masters


@dataclass
class OptimizerNames:
    method: str | None = None
    note: str | None = None


@dataclass
class ScalerState:
    """The loss scaler's state whatever wrote it (None: the format does not record it)."""

    kind: str  # ampctl | GradScaler | deepspeed
    enabled: bool
    scale: float | None
    min_scale: float | None = None
    max_scale: float | None = None
    at_floor: bool | None = None
    growth_interval: int | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_tracker: int | None = None
    hysteresis: int | None = None
    skipped_total: int | None = None
    forward_overflows: int | None = None
    consecutive_overflows: int | None = None
    updates: int | None = None
    recent_window: int | None = None
    recent_skips: int | None = None
    spikes: int | None = OPTIONAL()
    #: ampctl's per-update record: (update, scale used, kind 0 clean / 1 gradient / 2 forward /
    #: 3 spike, loss)
    rows: list[tuple[int, float, int, float]] = INTERNAL()


@dataclass
class StateHealth:
    weights: TensorSection
    master: TensorSection | None
    optimizer: TensorSection | None
    names: OptimizerNames
    scaler: ScalerState | None
    problems: list[Problem] = INTERNAL()

    @property
    def empty(self) -> bool:
        return not self.weights.tensors and self.master is None and self.optimizer is None


# ---------------------------------------------------------------------------- 2. history
@dataclass
class Burst:
    """A run of consecutive skipped (overflowed) steps."""

    start: int
    end: int
    length: int
    scale: float | None
    after_growth: bool


@dataclass
class Row:
    """One logged step, in every tool's terms (None: not logged)."""

    step: int
    loss: float | None = None
    scale: float | None = None
    skipped: Any = None  # ampctl: the skipped-steps count so far; others: None
    grad_norm: float | None = None
    grad_amax: float | None = None
    learning_rate: float | None = None


@dataclass
class LossTrend:
    first: float
    first_step: int
    min: float
    min_step: int
    last: float
    last_step: int


@dataclass
class GradNormTrend:
    baseline: float
    peak: float
    peak_step: int
    ratio: float
    exploded: bool


@dataclass
class Fallback:
    step: int | None
    from_precision: str | None = field(default=None, metadata={"key": "from"})
    to: str | None = None

    def json_fields(self) -> dict[str, Any]:
        return {"step": self.step, "from": self.from_precision, "to": self.to}


@dataclass
class Aborted:
    step: int | None
    message: str


@dataclass
class GuardEvent:
    """A guard decision the run recorded (``events.jsonl``): what the verdict names."""

    step: int
    kind: str  # overflow, spike, rollback, fallback, promotion, promotion_undone, rerun, ...
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class History:
    """What the run recorded before the checkpoint (see :mod:`.history`)."""

    source: str
    run_dir: str | None = None
    metrics_rows: int = 0
    events: dict[str, int] = field(default_factory=dict)
    first_overflow_step: int | None = None
    first_overflow_source: str | None = None
    first_nan_loss_step: int | None = None
    nan_filtered_steps: list[int] = field(default_factory=list)
    first_nonfinite_grad_norm_step: int | None = None
    forward_overflows: int = 0
    scale_trajectory: list[list[float]] = field(default_factory=list)
    bursts: list[Burst] = field(default_factory=list)
    scaler_records: int = 0
    break_step: int | None = None
    before_break: list[Row] = field(default_factory=list)
    loss: LossTrend | None = None
    grad_norm: GradNormTrend | None = None
    promotions: list[str] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    aborted: Aborted | None = None
    #: parameters the overflow events named (non-finite gradients), the most often named first
    overflow_params: list[str] = field(default_factory=list)
    #: steps the run skipped, as recorded (scaler record, events, non-finite grad norm rows)
    skipped_steps: list[int] = field(default_factory=list)
    #: resumes the run folder recorded: [{"step", "from"}]
    resumes: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unreadable: list[list[str]] = field(default_factory=list)
    columns: dict[str, str] | None = OPTIONAL()  # other tools' logs only
    status: str | None = OPTIONAL()  # summary.json's status (ok, aborted, diverged ...)
    rows: list[Row] = INTERNAL()  # every logged step up to the checkpoint
    guard_events: list[GuardEvent] = INTERNAL()


# ---------------------------------------------------------------------------- 3. replay
@dataclass
class FirstBad:
    """The first module with a non-finite output (forward) or gradient (backward)."""

    module: str
    batch: int
    position: int
    nan: bool
    posinf: bool
    neginf: bool
    dtype: str
    fp32_finite: bool | None = OPTIONAL()  # forward only: the same batch in fp32

    @property
    def what(self) -> str:
        return "NaN" if self.nan else ("+inf" if self.posinf else "-inf")


@dataclass
class ModuleRow:
    name: str
    dtype: str
    amax: float
    bad: bool
    headroom_log2: float = math.inf

    def json_fields(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "amax": self.amax,
            "headroom_log2": self.headroom_log2,
            "bad": self.bad,
        }


@dataclass
class Gradients:
    scale: float
    max_abs: float
    max_abs_param: float
    max_abs_activation: float
    max_scaled: float
    headroom_log2: float
    max_scaled_replay: float
    underflow_frac: float
    zero_frac: float
    zero_frac_replay: float
    lost_frac: float
    lost_frac_at_recommended: float
    ideal_scale: float
    recommended_init_scale: float
    recommended_init_scale_unbounded: float
    max_scale: float
    act_grad_underflow_frac: float | None
    act_grad_zero_frac: float | None
    act_grad_zero_frac_fp32: float | None
    nonfinite_params: list[str]


@dataclass
class Replay:
    """Part 3. Skipped: only ``ran``, ``reason``, ``precision`` and ``device`` are written."""

    ran: bool
    reason: str | None
    precision: str | None
    device: str
    data: str | None = None
    positions: list[int] = field(default_factory=list)
    scale: float | None = None
    limit: float | None = None
    loss: list[float] = field(default_factory=list)
    loss_fp32: list[float] = field(default_factory=list)
    modules: list[ModuleRow] = field(default_factory=list)
    masked_modules: list[str] = field(default_factory=list)
    forward_first_bad: FirstBad | None = None
    backward_first_bad: FirstBad | None = None
    gradients: Gradients | None = None
    #: the modules the replay ran in fp32 (Precision.in_fp32); the JSON key keeps its old name
    exempted: list[str] = field(default_factory=list)
    elapsed_s: float | None = None

    def json_fields(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not self.ran:
            return {k: out[k] for k in ("ran", "reason", "precision", "device")}
        return out


@dataclass
class Fp8Layer:
    """One fp8 layer's casts (``in`` input, ``w`` weight, ``go`` output gradient)."""

    name: str
    formats: dict[str, str]
    in_amax: float
    in_headroom_log2: float
    in_sat: float
    in_under: float
    w_amax: float
    w_headroom_log2: float
    w_sat: float
    w_under: float
    go_amax: float
    go_headroom_log2: float
    go_sat: float
    go_under: float
    nonfinite: bool
    headroom_log2: float
    sat: float
    under: float
    findings: list[str]

    def cast(self, role: str, what: str) -> float:
        """``cast("go", "amax")``: one cast's figure."""
        return getattr(self, f"{role}_{what}")


@dataclass
class Fp8Section:
    ran: bool
    reason: str | None
    recipe: str | None = None
    exclude: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    demoted: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    sat_threshold: float | None = None
    under_threshold: float | None = None
    layers: list[Fp8Layer] = field(default_factory=list)

    def json_fields(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out if self.ran else {"ran": False, "reason": self.reason}


# ---------------------------------------------------------------------------- 4. verdict
@dataclass
class Recommendation:
    override: str  # an ampctl override, key=value
    reason: str
    yours: str | None = None  # the same in the writing tool's terms

    @property
    def key(self) -> str:
        return self.override.split("=", 1)[0]


@dataclass
class CheckpointHealth:
    path: str
    step: int | None
    healthy: bool
    problems: list[str]
    #: why the checkpoint is not a resume point although its state is fine (written after the
    #: first sign of trouble)
    after_trouble: bool = OPTIONAL()


@dataclass
class Resume:
    checkpoint: str | None
    command: str
    why: str | None = OPTIONAL()
    #: whether the advice held when tried (:mod:`.probe`), or why it was not tried
    probe: str | None = OPTIONAL()


@dataclass
class Episode:
    """A stretch of the run that left its healthy course, and how it ended."""

    kind: str  # storm, calibration, isolated, departure, nonfinite_loss, spike, rollback ...
    start: int
    end: int  # its last step (a departure: where it came back, or its peak)
    resolved: bool  # False: still going at the end of the record
    text: str


@dataclass
class Verdict:
    """What the whole run says: ``healthy``, ``recovered`` (it left its course and came back:
    exit 0, the events named) or ``broken`` (exit 1)."""

    status: str
    kind: str | None  # the first problem's kind (the cause), None when not broken
    summary: str  # one line, in the user's terms
    cause: str | None = None
    first_bad_step: int | None = None  # the first sign of trouble that did not resolve
    events: list[str] = field(default_factory=list)  # what the run went through, in words
    episodes: list[Episode] = field(default_factory=list)


# ---------------------------------------------------------------------------- the report
@dataclass
class CheckpointInfo:
    path: str
    step: int | None
    precision: str | None
    precision_source: str | None
    fp32_modules: list[str]
    run_dir: str | None


@dataclass
class Branch:
    line: str  # main | archived
    text: str
    forked_at_step: int | None
    branches: list[str]
    parent: dict[str, Any] | None
    resumes: int = 0  # resume events in the folder's events.jsonl


@dataclass
class Report:
    schema: str
    format: str
    checkpoint: CheckpointInfo
    branch: Branch | None
    files: list[dict[str, Any]]
    notes: list[str]
    healthy: bool
    problems: list[Problem]
    state: StateHealth
    history: History | None
    replay: Replay
    fp8: Fp8Section | None
    recommendations: list[Recommendation]
    checkpoints: list[CheckpointHealth]
    resume: Resume
    verdict: Verdict

    @property
    def exit_code(self) -> int:
        """0 healthy or recovered, 1 broken."""
        return 1 if self.verdict.status == "broken" else 0
