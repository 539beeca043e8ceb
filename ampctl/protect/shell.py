"""The run shell: what every loop around a :class:`~ampctl.protect.protection.Protection` shares,
and what a run writes, one writer each: the metrics row, the summary and ``config.yaml``.

ampctl's :class:`~ampctl.train.trainer.Trainer` and :class:`~ampctl.integrations.ProtectedRun`
(and the Lightning, Accelerate and HF Trainer integrations on it) keep only their loops; the shell
owns the rest of a run, so a row or a summary has the same keys whichever loop wrote it:

* the log step (:meth:`RunShell.log_step`): every figure of the interval gathered on the device
  (:func:`~ampctl.protect.figures.gather_log_figures`), the **one** host read, the window swap,
  the guard's decisions on the read (a rewind goes back to the loop; a divergence stops the run
  after its row), the metrics row (:data:`ROW_KEYS`) and the loggers;
* the accounting: tokens and wall time, carried across resumes (:meth:`RunShell.accounts`);
* the summary (:data:`SUMMARY_KEYS`) and the end-of-run plot (:meth:`RunShell.plot`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ampctl.amp.actgrad import ROW_KEYS as ACT_GRAD_KEYS
from ampctl.amp.precision import match_modules
from ampctl.protect.figures import DeviceFigures, LogWindow, Probe, gather_log_figures
from ampctl.protect.logger import RunLogger
from ampctl.protect.protection import Protection, Rewind, TrainDiverged
from ampctl.runlog import RunWriter

__all__ = ["GRAD_KEYS", "ROW_KEYS", "SUMMARY_KEYS", "RunShell", "Shelled", "write_config"]

#: The gradient figures of a row (None on a row without gradient statistics).
GRAD_KEYS = ("grad_norm", "grad_amax", "grad_underflow_frac", "nonfinite_grads")

#: The keys of every metrics.jsonl row, in order (probes may add their own after these).
ROW_KEYS = (
    *("step", "loss", "scale", "skipped", "forward_overflows", "spikes", "consecutive_overflows"),
    *("overflow_rate", "lr", "precision", "tokens_per_s", "elapsed_s", "max_steps"),
    *(*GRAD_KEYS, *ACT_GRAD_KEYS),
)

#: The keys of every summary.json (a precision plugin may add its own, e.g. fp8's demotions).
SUMMARY_KEYS = (
    *("status", "framework", "final_loss", "steps", "max_steps", "skipped", "forward_overflows"),
    *("spikes", "overflow_rate", "final_scale", "precision", "promoted_modules", "fp32_modules"),
    *("events", "wall_time_s", "tokens_per_s", "run_dir"),
)


def write_config(run_dir: str | Path, config: Mapping[str, Any]) -> None:
    """Write the run's ``config.yaml`` atomically from a plain mapping of resolved values (a
    reader sees the old file or the new one, never half of one)."""
    RunWriter(run_dir).write_config(OmegaConf.to_yaml(OmegaConf.create(dict(config))))


class Shelled:
    """The views a loop gives of its protection: the precision in use (a fallback replaces it),
    its scaler and the optimizer (a fallback may rebuild it)."""

    protection: Protection
    precision = property(lambda self: self.protection.precision)
    scaler = property(lambda self: self.protection.scaler)
    optimizer = property(lambda self: self.protection.optimizer)


class RunShell(Shelled):
    """The log step, the accounting, the summary and the plot of one run (module docstring).

    Args:
        protection: the run's protection (its precision, scaler and model are the run's).
        run_dir: the run folder.
        framework: the loop's name in the summary (``ampctl``, ``loop``, ``lightning`` ...).
        max_steps: the planned number of optimizer steps (rows, summary), or None.
        overflow_window: the steps a row's ``overflow_rate`` covers.
        on_rewind: carries out in the loop a rewind that a decision taken at the log read
            returned (a late rollback, a fallback); returns whether it put the loop's position
            back, so the interval's steps run again and its row is not written.
        log: the run's logger (None until the loop opens it: set :attr:`log`).
    """

    def __init__(
        self,
        protection: Protection,
        run_dir: str | Path,
        *,
        framework: str,
        max_steps: int | None,
        overflow_window: int,
        on_rewind: Callable[[Rewind], bool],
        log: RunLogger | None = None,
    ) -> None:
        self.protection = protection
        self.run_dir = Path(run_dir)
        self.framework = framework
        self.max_steps = max_steps
        self.overflow_window = overflow_window
        self.on_rewind = on_rewind
        self.log = log
        self.window = LogWindow(first_update=self.scaler.num_updates)
        self.last_row: dict[str, Any] = {}
        self.tokens = 0  # tokens of the whole run (a resume goes on from the checkpoint's)
        self.wall_before = 0.0  # wall time of the run before this process (resumes)
        self.t0 = time.perf_counter()

    # ------------------------------------------------------------------ accounting
    def elapsed(self) -> float:
        """Wall time of the run: before this process, and since :attr:`t0`."""
        return self.wall_before + time.perf_counter() - self.t0

    def add_tokens(self, n: int) -> None:
        """A step's tokens, to the run's total and the log interval's."""
        self.tokens += n
        self.window.tokens += n

    def accounts(self) -> dict[str, Any]:
        """The run's tokens and wall time so far, for a checkpoint (plain numbers)."""
        return {"tokens": self.tokens, "wall_s": self.elapsed()}

    def load_accounts(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`accounts` of a checkpoint (missing keys: nothing spent yet)."""
        self.tokens = int(state.get("tokens", 0))
        self.wall_before = float(state.get("wall_s", 0.0))

    def open(self, step: int, config: dict[str, Any]) -> None:
        """Open the logger's sinks with the run's ``config``; starting a sink (an MLflow store,
        W&B's process) is not training time, so the clock and the interval's skip it."""
        assert self.log is not None
        t = time.perf_counter()
        self.log.open(step, config)
        opened = time.perf_counter() - t
        self.t0 += opened
        self.window.t0 += opened

    # ------------------------------------------------------------------ the log step
    def log_step(
        self,
        step: int,
        fig: DeviceFigures,
        *,
        stats: dict[str, Any] | None,
        lr: Any,
        probes: list[Probe] | tuple[()] = (),
        ctx: Any = None,
        sharded: bool = False,
        on_read: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any] | None:
        """Gather the interval's figures into ``fig`` (which may hold the loop's own), read them
        in one transfer (``ctx``: the process group's reductions), hand the values to
        ``on_read``, start the next interval, take the guard's decisions on the read, then write
        the row. Returns the row, or None when a rewind put the loop back (``on_rewind``). A
        divergence raises :class:`TrainDiverged` after its row is written. **Syncs** once."""
        gather_log_figures(
            fig,
            window=self.window,
            stats=stats,
            scaler=self.scaler,
            overflow_window=self.overflow_window,
            lr=lr,
            probes=probes,
            protection=self.protection,
            sharded=sharded,
        )
        values = fig.read(ctx)  # the log read
        if on_read is not None:
            on_read(values)
        window, self.window = self.window, LogWindow(first_update=self.scaler.num_updates)
        diverged = None
        try:
            rewind = self.protection.on_log_read(step, values)
        except TrainDiverged as e:  # the row the rule held on is written, then the run stops
            rewind, diverged = None, e
        if rewind is not None and self.on_rewind(rewind):
            return None  # a late rollback discarded the interval's steps
        self.last_row = row = self.row(values, step, window, probes)
        assert self.log is not None
        self.log.metrics(row)
        if diverged is not None:
            raise diverged
        self.protection.after_log(step)  # fp8 layer demotions from the probe's figures
        return row

    def row(
        self, values: Mapping[str, Any], step: int, window: LogWindow, probes: Any = ()
    ) -> dict[str, Any]:
        """One metrics.jsonl row (:data:`ROW_KEYS`) from the host ``values`` of the log read
        (the names :func:`~ampctl.protect.figures.gather_log_figures` gave them) and the
        interval's ``window`` (its tokens and wall time; ``tokens_per_s`` is None when no tokens
        were counted). Gradient figures are None on a row without gradient statistics; the
        activation-gradient fractions are None unless a probe measured them. No device read."""
        v, sc = values, self.scaler
        seconds = time.perf_counter() - window.t0
        row: dict[str, Any] = {
            "step": step,
            "loss": v["loss_sum"] / v["loss_n"] if v["loss_n"] > 0 else math.nan,
            "scale": v["scale"] if sc.is_enabled() else 1.0,
            "skipped": int(v["skipped_total"]),
            "forward_overflows": int(v["forward_overflows"]),
            "spikes": int(v.get("spikes", 0)),  # steps the spike rule skipped (guard.spike)
            "consecutive_overflows": int(v["consecutive_overflows"]),
            "overflow_rate": v["recent_skips"] / max(min(self.overflow_window, sc.num_updates), 1),
            "lr": v["lr"],
            "precision": self.precision.name,
            "tokens_per_s": window.tokens / max(seconds, 1e-9) if window.tokens else None,
            "elapsed_s": self.elapsed(),
            "max_steps": self.max_steps,
            **dict.fromkeys((*GRAD_KEYS, *ACT_GRAD_KEYS)),
        }
        if "grad_norm_sq" in v:
            row.update(
                grad_norm=math.sqrt(max(v["grad_norm_sq"], 0.0)),
                grad_amax=v["grad_amax"],
                grad_underflow_frac=v["grad_underflow"] / max(v["grad_elems"], 1),
                nonfinite_grads=int(v["nonfinite_grads"]),
            )
        for probe in probes:
            row.update(probe.row(v))
        return row

    # ------------------------------------------------------------------ the end
    def summary(self, status: str, steps: int) -> dict[str, Any]:
        """summary.json (:data:`SUMMARY_KEYS`) of the run at ``steps``: its outcome, its scaler's
        counters, the modules kept in fp32 (those the guard promoted apart) and the precision's
        own keys. **Syncs** once (the scaler's counters)."""
        assert self.log is not None
        precision, model = self.precision, self.protection.model
        wall_s, st = self.elapsed(), precision.scaler.stats()
        configured = set(match_modules(model, precision.fp32_modules))
        return {
            "status": status,
            "framework": self.framework,
            "final_loss": self.last_row.get("loss"),
            "steps": steps,
            "max_steps": self.max_steps,
            "skipped": st["skipped_total"],
            "forward_overflows": st["forward_overflows"],
            "spikes": st.get("spikes", 0),
            "overflow_rate": st["skipped_total"] / max(st["steps"], 1),
            "final_scale": st["scale"],
            "precision": precision.name,
            "promoted_modules": [m for m in precision.in_fp32 if m not in configured],
            "fp32_modules": list(precision.in_fp32),
            "events": dict(self.log.event_counts()),
            "wall_time_s": wall_s,
            "tokens_per_s": self.tokens / max(wall_s, 1e-9) if self.tokens else None,
            "run_dir": str(self.run_dir),
            **precision.summary(model),
        }

    def write_summary(self, summary: dict[str, Any]) -> str | None:
        """Write ``summary`` (to the run folder and the sinks); a failed write is one line,
        returned and kept in the summary as ``summary_error``."""
        assert self.log is not None
        err = self.log.summary(summary)
        if err:
            summary["summary_error"] = err
        return err

    def plot(self) -> Path | str:
        """``plot.png`` into the run folder, and to the sinks; a one-line reason instead when
        there is none (no matplotlib, nothing to draw, a failed write). No device read."""
        from ampctl.ui.plot.run_figure import maybe_plot_run

        got = maybe_plot_run(self.run_dir)
        if isinstance(got, Path) and self.log is not None:
            self.log.artifact(got)
        return got
