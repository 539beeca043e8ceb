"""The protection's own config groups: ``guard.*`` (:class:`GuardConfig`) and ``logging.*``
(:class:`LoggingConfig`).

Plain dataclasses validated in ``__post_init__``; this module imports the numeric core only, never
the runtime that uses them, so :class:`~ampctl.config.RunConfig` composes them without importing
the loops (config flows one way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ampctl.amp.checks import boolean, check, integer, is_int, nonblank, number, one_of, optional
from ampctl.amp.fp8 import DemoteRules
from ampctl.amp.guard import DIVERGENCE_ACTIONS, DivergenceRules, GuardRules
from ampctl.amp.precision import PRECISIONS

__all__ = ["GuardConfig", "LoggingConfig", "WANDB_MODES"]

#: ``logging.wandb_mode``: offline (nothing leaves the machine) or online.
WANDB_MODES = ("offline", "online")


@dataclass(kw_only=True)
class GuardConfig(GuardRules):
    """``guard.*``: the rules of :class:`~ampctl.amp.guard.GuardRules` plus how they are carried
    out (attribution, forward locate and promotion, rollback's scale cut, snapshots), the fp8
    demotion, spike, divergence and rerun rules. Each field's default is the one ampctl runs with
    (``guard=default``); ``conf/guard/off.yaml`` lists what ``guard=off`` turns off."""

    enabled: bool = True  # the whole guard (false: the scaler's skip-and-back-off only)
    attribution: bool = True  # name the parameters with non-finite gradients on skipped steps,
    attribution_limit: int = 5  # ... at most this many
    locate_forward: bool = True  # replay a forward overflow with hooks: the first bad module
    promote: bool = True  # move that module to fp32 and go on
    rollback_backoff: float = 0.25  # the scale is multiplied by this after a rollback
    snapshot_every: int = 10  # clean steps between in-memory good-state snapshots (0: none)
    # precision=fp8: demote a layer to bf16 when its casts go non-finite (a skipped step is
    # replayed with the cast probe to find it) or when, at log steps, the share of a cast's
    # values at the fp8 max (sat) or of its nonzero values flushed to 0 (under) is above its
    # threshold at fp8_patience log steps in a row
    fp8_demote: bool = True
    fp8_sat_threshold: float = 0.10
    fp8_under_threshold: float = 0.01
    fp8_patience: int = 3
    # the spike rule (protect/spike.py): skip a step whose loss (or grad norm) is more than
    # spike_z standard deviations above the mean of the last spike_window clean steps (OLMo-core's
    # rule and factor), once spike_min_steps clean steps are in the window (None: spike_window)
    spike: bool = True
    spike_z: float = 6.0
    spike_window: int = 128
    spike_min_steps: int | None = 32
    # also the gradient norm, where the loop reports it unclipped (a clipped step is judged by
    # its loss: its size is bounded whatever its norm)
    spike_grad_norm: bool = True
    # the divergence rule (amp/guard.py DivergenceRules), judged on the log rows' loss: the
    # median of the last divergence_patience rows above divergence_factor x its lowest, or
    # giving back 3/4 of real progress; then divergence_action: stop (status diverged, exit 1)
    # | rollback (with the lr multiplied by divergence_lr_cut) | warn
    divergence: bool = True
    divergence_factor: float = 5.0
    divergence_patience: int = 3
    divergence_action: str = "stop"
    divergence_lr_cut: float = 0.5
    # rerun a skipped step once from the same state and batch: transient or reproducible
    rerun: bool = False
    # after a rollback, move the data this many batches past the batch that caused it (ampctl's
    # loop; the positions skipped are an event, so a resume and a rerun of the run repeat them)
    skip_batches: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self, _GUARD_RULES)

    def _rules(self, cls: type, prefix: str) -> Any:
        """``cls`` from the fields named ``prefix`` + one of its fields (a field without one
        keeps its default: DivergenceRules' ``warmup``)."""
        names = [f.name for f in dataclasses.fields(cls) if hasattr(self, prefix + f.name)]
        return cls(**{n: getattr(self, prefix + n) for n in names})

    # the rules the protection applies, from the fields above
    rules = property(lambda self: self._rules(GuardRules, ""))
    divergence_rules = property(lambda self: self._rules(DivergenceRules, "divergence_"))
    fp8_rules = property(lambda self: self._rules(DemoteRules, "fp8_"))


@dataclass(kw_only=True)
class LoggingConfig:
    """``logging.*``: extra sinks (TensorBoard, MLflow, W&B), the end-of-run plot, and the
    log-step activation-gradient underflow probe (:mod:`ampctl.amp.actgrad`; fp16 tensors only).
    ``mlflow_uri`` None: a SQLite store in the run folder; ``wandb_mode`` offline: nothing
    leaves the machine (:mod:`ampctl.ui.mlflow_sink`, :mod:`ampctl.ui.wandb_sink`)."""

    tensorboard: bool = False  # needs the tensorboard package
    mlflow: bool = False  # needs ampctl[mlflow]; a SQLite store in the run folder unless:
    mlflow_uri: str | None = None  # http://host:5000, sqlite:///runs/mlruns.db, databricks
    mlflow_experiment: str = "ampctl"
    wandb: bool = False  # needs ampctl[wandb]; written under the run folder (wandb/), no network
    wandb_mode: str = "offline"  # offline | online (needs `wandb login` or WANDB_API_KEY)
    wandb_project: str = "ampctl"
    plot: bool = True  # write plot.png at the end when matplotlib is installed
    act_grads: bool = True  # sample the underflow on log steps (hooks; no extra host read)
    # leaf modules the probe hooks per log step, in turn (0: all of them, every log step)
    act_grad_layers: int = 8

    def __post_init__(self) -> None:
        check(self, _LOGGING_RULES)


_FRACTION = (number(ge=0, le=1), "a fraction in [0, 1]")
_GUARD_RULES = (
    ("fp8_sat_threshold fp8_under_threshold", *_FRACTION),
    ("fp8_patience", integer(ge=1), "an integer >= 1 (log steps in a row above a threshold)"),
    ("attribution_limit", integer(ge=1), "an integer >= 1"),
    ("rollback_backoff", number(gt=0, le=1), "in (0, 1]"),
    (
        "fallback_chain",
        lambda v, _: all(p in PRECISIONS for p in v),
        f"a list of {', '.join(PRECISIONS)}",
    ),
    ("spike", boolean, "true or false"),
    ("spike_z", number(gt=0), "a number > 0 (standard deviations above the window's mean)"),
    (
        "spike_window",
        integer(ge=2, le=4096),
        "an integer in [2, 4096] (clean steps; at most scaler.history_size are kept)",
    ),
    (
        "spike_min_steps",
        optional(lambda v, c: is_int(v) and 2 <= v <= c.spike_window),
        lambda c: f"null or an integer in [2, spike_window={c.spike_window}]",
    ),
    ("spike_grad_norm divergence rerun", boolean, "true or false"),
    ("divergence_factor", number(gt=1), "a number > 1 (times the lowest log-row loss)"),
    ("divergence_patience", integer(ge=1), "an integer >= 1 (log rows in a row)"),
    ("divergence_action", one_of(DIVERGENCE_ACTIONS), f"one of {', '.join(DIVERGENCE_ACTIONS)}"),
    (
        "divergence_lr_cut",
        number(gt=0, lt=1),
        "in (0, 1) (the lr multiplier of a rollback for divergence)",
    ),
    ("skip_batches", integer(ge=0), "an integer >= 0 (0: no data skipped after a rollback)"),
    ("snapshot_every", integer(ge=0), "an integer >= 0 (0: no snapshots)"),
)
_LOGGING_RULES = (
    ("tensorboard mlflow wandb plot act_grads", boolean, "true or false"),
    ("mlflow_uri", optional(nonblank), "null (a store in the run folder) or a tracking URI"),
    ("mlflow_experiment wandb_project", nonblank, "a non-empty name"),
    ("wandb_mode", one_of(WANDB_MODES), " or ".join(WANDB_MODES)),
    (
        "act_grad_layers",
        integer(ge=0),
        "an integer >= 0 (0: every leaf module on every log step)",
    ),
)
