"""Pictures of a run or a sweep: ``ampctl plot RUN_OR_SWEEP``.

A run: one PNG with aligned panels over the step axis -- loss (a baseline run's loss overlaid),
loss scale on a log2 axis with the skipped steps marked, the windowed overflow rate with a tick
per overflow event, gradient norm and underflow fraction (two y-axes) -- and a vertical marker
for every guard decision (rollback, promotion, fallback, abort, interrupt) across all panels.

A sweep (a folder with ``results.json`` from ``ampctl sweep-scale``): a heat map of a ranking
metric over init_scale x growth_interval (failed trials marked), and every trial's scale and loss
trajectory overlaid.

Everything is read from the folder alone (``metrics.jsonl``, ``events.jsonl``, ``summary.json``,
and the latest checkpoint's scaler history when there is one), so plots work on runs copied from
another machine. Skipped steps come from that history (exact steps) when the checkpoint is there
and agrees with the events; otherwise from differences of the cumulative ``skipped`` counter in
the metrics (one marker per log interval that had skips).

Each file is read in one streaming pass and reduced to the figure's resolution (``decimate``):
a run of any length draws every row up to 2,000, beyond that first/min/max/last per pixel
column, skip marks and events one by one up to a cap and then counted per column, memory
bounded by the figure, never by the run. Values that are not numbers are gaps; a sweep's trial
names may only point inside the sweep folder.

Nothing here touches a device: checkpoints are memory-mapped on the CPU. matplotlib is imported
lazily and only its Agg canvas is used (no pyplot, no display); without matplotlib the
functions raise :class:`PlotUnavailable` with an install hint, and :func:`maybe_plot_run` (what
every run calls at its end) returns that hint instead of raising.

A run's drawing lives in :mod:`ampctl.ui.plot` (below the commands: the run shell draws it at the
end of every loop's run); this command adds the sweep figure and other tools' histories (#40).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

from ampctl.errors import UsageError
from ampctl.ui.plot import decimate, run_data
from ampctl.ui.plot import run_figure as _run_figure
from ampctl.ui.plot.common import HINT, PlotUnavailable, _mpl
from ampctl.ui.plot.run_data import RunData, SkipMark
from ampctl.ui.plot.run_figure import maybe_plot_run

from .foreign import foreign_run_data
from .sweep_figure import SWEEP_METRICS, build_sweep_figure, plot_sweep

__all__ = [
    "HINT",
    "PlotUnavailable",
    "RunData",
    "SkipMark",
    "load_run_data",
    "build_run_figure",
    "build_sweep_figure",
    "plot_run",
    "plot_sweep",
    "maybe_plot_run",
    "run_plot",
    "SWEEP_METRICS",
    "decimate",
    "run_data",
]


# a run as drawn by ampctl.ui.plot, or another tool's history beside a folder without
# metrics.jsonl (#40)
load_run_data = partial(run_data.load_run_data, foreign=foreign_run_data)
build_run_figure = partial(_run_figure.build_run_figure, foreign=foreign_run_data)
plot_run = partial(_run_figure.plot_run, foreign=foreign_run_data)


def run_plot(path: Path, out: Path | None = None, baseline: Path | list[Path] | None = None) -> int:
    """``ampctl plot PATH [--out FILE] [--baseline RUN ...]``: a sweep folder (has results.json)
    or a run folder. Prints the written path; returns 0. Bad input -> UsageError (exit 2)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"{str(path)!r} does not exist: give a run folder (with metrics.jsonl) or a sweep folder (with results.json)"
        )
    _mpl()  # the install hint before any reading
    if path.is_dir() and (path / "results.json").is_file():
        if baseline:  # None or [] (the CLI's default): no baseline
            raise UsageError(
                f"--baseline applies to a run folder; {str(path)!r} is a sweep folder (it has results.json)"
            )
        written = plot_sweep(path, out)
    else:
        notes: list[str] = []
        written = plot_run(path, out, baseline=baseline, notes=notes)
        for line in notes:
            print(f"note: {line}", file=sys.stderr)
    print(f"wrote {written}")
    return 0
