"""The run shell: what every loop around a :class:`~ampctl.protect.protection.Protection` shares.

ampctl's :class:`~ampctl.train.trainer.Trainer` and :class:`~ampctl.integrations.ProtectedRun`
(and the Lightning, Accelerate and HF Trainer integrations on it) keep only their loops; the shell
owns the rest of a run:

* the log step (:meth:`RunShell.log_step`): every figure of the interval gathered on the device,
  the **one** host read, the window swap, the guard's decisions on the read (a rewind goes back to
  the loop; a divergence stops the run after its row), the metrics row and the loggers;
* the accounting: tokens and wall time, carried across resumes (:meth:`RunShell.accounts`);
* the summary (:meth:`RunShell.summary`, :meth:`RunShell.write_summary`) and the end-of-run
  plot (:meth:`RunShell.plot`).

Rows and summaries come from :mod:`ampctl.protect.records` (one writer each), so a row has the
same keys whichever loop wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampctl.amp.precision import Precision
from ampctl.amp.scaler import LossScaler
from ampctl.protect.figures import DeviceFigures, LogWindow, Probe, gather_log_figures
from ampctl.protect.logger import RunLogger
from ampctl.protect.protection import Protection, Rewind, TrainDiverged
from ampctl.protect.records import metrics_row, run_summary

__all__ = ["RunShell", "Shelled"]


class Shelled:
    """The views a loop gives of its protection: the precision in use (a fallback replaces it),
    its scaler and the optimizer (a fallback may rebuild it)."""

    protection: Protection

    @property
    def precision(self) -> Precision:
        """The precision plugin in use (a fallback replaces it)."""
        return self.protection.precision

    @property
    def scaler(self) -> LossScaler:
        return self.precision.scaler

    @property
    def optimizer(self) -> Any:
        return self.protection.optimizer


class RunShell:
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

    @property
    def precision(self) -> Precision:
        return self.protection.precision

    @property
    def scaler(self) -> LossScaler:
        return self.precision.scaler

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
        row = metrics_row(
            values,
            step=step,
            scaler=self.scaler,
            precision=self.precision.name,
            overflow_window=self.overflow_window,
            max_steps=self.max_steps,
            tokens=window.tokens,
            seconds=time.perf_counter() - window.t0,
            elapsed_s=self.elapsed(),
            probes=probes,
        )
        self.last_row = row
        assert self.log is not None
        self.log.metrics(row)
        if diverged is not None:
            raise diverged
        self.protection.after_log(step)  # fp8 layer demotions from the probe's figures
        return row

    # ------------------------------------------------------------------ the end
    def summary(self, status: str, steps: int) -> dict[str, Any]:
        """summary.json of the run at ``steps`` (:func:`~ampctl.protect.records.run_summary`).
        **Syncs** once (the scaler's counters)."""
        assert self.log is not None
        return run_summary(
            status,
            framework=self.framework,
            model=self.protection.model,
            precision=self.precision,
            final_loss=self.last_row.get("loss"),
            steps=steps,
            max_steps=self.max_steps,
            events=self.log.event_counts(),
            wall_s=self.elapsed(),
            tokens=self.tokens,
            run_dir=self.run_dir,
        )

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
        from ampctl.ui.plot import maybe_plot_run

        got = maybe_plot_run(self.run_dir)
        if isinstance(got, Path) and self.log is not None:
            self.log.artifact(got)
        return got
