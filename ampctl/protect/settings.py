"""The protection's own config groups: ``guard.*`` (:class:`GuardConfig`) and ``logging.*``
(:class:`LoggingConfig`).

Plain dataclasses validated in ``__post_init__``; this module imports the numeric core only, never
the runtime that uses them, so :class:`~ampctl.config.RunConfig` composes them without importing
the loops (config flows one way).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ampctl.amp.checks import is_finite, is_int, need
from ampctl.amp.fp8 import DemoteRules
from ampctl.amp.guard import DIVERGENCE_ACTIONS, DivergenceRules, GuardRules
from ampctl.amp.precision import PRECISIONS

__all__ = ["GuardConfig", "LoggingConfig", "WANDB_MODES"]

#: ``logging.wandb_mode``: offline (nothing leaves the machine) or online.
WANDB_MODES = ("offline", "online")


@dataclass(kw_only=True)
class GuardConfig(GuardRules):
    """``guard.*``: the rules of :class:`~ampctl.amp.guard.GuardRules` plus how they are carried
    out (attribution, forward locate and promotion, rollback's scale cut, snapshots)."""

    enabled: bool = True
    attribution: bool = True
    attribution_limit: int = 5
    locate_forward: bool = True
    promote: bool = True
    rollback_backoff: float = 0.25
    snapshot_every: int = 10
    fp8_demote: bool = True
    fp8_sat_threshold: float = 0.10
    fp8_under_threshold: float = 0.01
    fp8_patience: int = 3
    # the spike rule (protect/spike.py): skip a step whose loss (or grad norm) is more than
    # spike_z standard deviations above the mean of the last spike_window clean steps
    spike: bool = True
    spike_z: float = 6.0
    spike_window: int = 128
    spike_min_steps: int | None = 32  # clean steps before the rule acts (None: spike_window)
    spike_grad_norm: bool = True
    # the divergence rule (amp/guard.py DivergenceRules), judged on the log rows' loss
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
        for f, allowed in (
            ("fp8_sat_threshold", "a fraction in [0, 1]"),
            ("fp8_under_threshold", "a fraction in [0, 1]"),
        ):
            v = getattr(self, f)
            need(is_finite(v) and 0 <= v <= 1, self, f, v, allowed)
        need(
            is_int(self.fp8_patience) and self.fp8_patience >= 1,
            self,
            "fp8_patience",
            self.fp8_patience,
            "an integer >= 1 (log steps in a row above a threshold)",
        )
        need(
            is_int(self.attribution_limit) and self.attribution_limit >= 1,
            self,
            "attribution_limit",
            self.attribution_limit,
            "an integer >= 1",
        )
        need(
            is_finite(self.rollback_backoff) and 0 < self.rollback_backoff <= 1,
            self,
            "rollback_backoff",
            self.rollback_backoff,
            "in (0, 1]",
        )
        bad = [p for p in self.fallback_chain if p not in PRECISIONS]
        need(
            not bad,
            self,
            "fallback_chain",
            list(self.fallback_chain),
            f"a list of {', '.join(PRECISIONS)}",
        )
        need(isinstance(self.spike, bool), self, "spike", self.spike, "true or false")
        need(
            is_finite(self.spike_z) and self.spike_z > 0,
            self,
            "spike_z",
            self.spike_z,
            "a number > 0 (standard deviations above the window's mean)",
        )
        need(
            is_int(self.spike_window) and 2 <= self.spike_window <= 4096,
            self,
            "spike_window",
            self.spike_window,
            "an integer in [2, 4096] (clean steps; at most scaler.history_size are kept)",
        )
        need(
            self.spike_min_steps is None
            or (is_int(self.spike_min_steps) and 2 <= self.spike_min_steps <= self.spike_window),
            self,
            "spike_min_steps",
            self.spike_min_steps,
            f"null or an integer in [2, spike_window={self.spike_window}]",
        )
        need(
            isinstance(self.spike_grad_norm, bool),
            self,
            "spike_grad_norm",
            self.spike_grad_norm,
            "true or false",
        )
        for f in ("divergence", "rerun"):
            need(isinstance(getattr(self, f), bool), self, f, getattr(self, f), "true or false")
        need(
            is_finite(self.divergence_factor) and self.divergence_factor > 1,
            self,
            "divergence_factor",
            self.divergence_factor,
            "a number > 1 (times the lowest log-row loss)",
        )
        need(
            is_int(self.divergence_patience) and self.divergence_patience >= 1,
            self,
            "divergence_patience",
            self.divergence_patience,
            "an integer >= 1 (log rows in a row)",
        )
        need(
            self.divergence_action in DIVERGENCE_ACTIONS,
            self,
            "divergence_action",
            self.divergence_action,
            f"one of {', '.join(DIVERGENCE_ACTIONS)}",
        )
        need(
            is_finite(self.divergence_lr_cut) and 0 < self.divergence_lr_cut < 1,
            self,
            "divergence_lr_cut",
            self.divergence_lr_cut,
            "in (0, 1) (the lr multiplier of a rollback for divergence)",
        )
        need(
            is_int(self.skip_batches) and self.skip_batches >= 0,
            self,
            "skip_batches",
            self.skip_batches,
            "an integer >= 0 (0: no data skipped after a rollback)",
        )
        need(
            is_int(self.snapshot_every) and self.snapshot_every >= 0,
            self,
            "snapshot_every",
            self.snapshot_every,
            "an integer >= 0 (0: no snapshots)",
        )

    @property
    def rules(self) -> GuardRules:
        return GuardRules(**{f.name: getattr(self, f.name) for f in dataclasses.fields(GuardRules)})

    @property
    def divergence_rules(self) -> DivergenceRules:
        return DivergenceRules(
            factor=self.divergence_factor,
            patience=self.divergence_patience,
            action=self.divergence_action,
            lr_cut=self.divergence_lr_cut,
        )

    @property
    def fp8_rules(self) -> DemoteRules:
        return DemoteRules(
            sat_threshold=self.fp8_sat_threshold,
            under_threshold=self.fp8_under_threshold,
            patience=self.fp8_patience,
        )


@dataclass(kw_only=True)
class LoggingConfig:
    """``logging.*``: extra sinks (TensorBoard, MLflow, W&B), the end-of-run plot, and the
    log-step activation-gradient underflow probe (:mod:`ampctl.amp.actgrad`; fp16 tensors only).
    ``mlflow_uri`` None: a SQLite store in the run folder; ``wandb_mode`` offline: nothing
    leaves the machine (:mod:`ampctl.ui.mlflow_sink`, :mod:`ampctl.ui.wandb_sink`)."""

    tensorboard: bool = False
    mlflow: bool = False
    mlflow_uri: str | None = None
    mlflow_experiment: str = "ampctl"
    wandb: bool = False
    wandb_mode: str = "offline"
    wandb_project: str = "ampctl"
    plot: bool = True
    act_grads: bool = True
    # leaf modules the probe hooks per log step, in turn (0: all of them, every log step)
    act_grad_layers: int = 8

    def __post_init__(self) -> None:
        for k in ("tensorboard", "mlflow", "wandb", "plot", "act_grads"):
            v = getattr(self, k)
            need(isinstance(v, bool), self, k, v, "true or false")
        u = self.mlflow_uri
        need(
            u is None or (isinstance(u, str) and u.strip() != ""),
            self,
            "mlflow_uri",
            u,
            "null (a store in the run folder) or a tracking URI",
        )
        for k in ("mlflow_experiment", "wandb_project"):
            v = getattr(self, k)
            need(isinstance(v, str) and v.strip() != "", self, k, v, "a non-empty name")
        need(
            self.wandb_mode in WANDB_MODES,
            self,
            "wandb_mode",
            self.wandb_mode,
            " or ".join(WANDB_MODES),
        )
        need(
            is_int(self.act_grad_layers) and self.act_grad_layers >= 0,
            self,
            "act_grad_layers",
            self.act_grad_layers,
            "an integer >= 0 (0: every leaf module on every log step)",
        )
