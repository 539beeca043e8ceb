"""A run folder's picture (``plot.png``): read for drawing (:mod:`.run_data`, reduced to the
figure's resolution by :mod:`.decimate`) and drawn (:mod:`.run_figure`) on matplotlib's Agg
canvas, imported lazily. What ``ampctl plot`` draws of a run, and what every run draws at its end
(:func:`maybe_plot_run`, from :meth:`ampctl.protect.shell.RunShell.plot`); see
:mod:`ampctl.commands.plot`. No device reads."""

from __future__ import annotations

from pathlib import Path

from ampctl.errors import UsageError

from . import decimate, run_data
from .common import HINT, PlotUnavailable
from .run_data import RunData, SkipMark
from .run_figure import plot_run

__all__ = [
    "HINT",
    "PlotUnavailable",
    "RunData",
    "SkipMark",
    "decimate",
    "maybe_plot_run",
    "run_data",
]


def maybe_plot_run(run_dir: str | Path) -> Path | str:
    """What a run calls at its end (and after Ctrl-C) when ``logging.plot`` is true: writes
    ``<run>/plot.png`` and returns its path, or returns a one-line message instead of raising
    when matplotlib is missing, there is nothing to draw yet (no metrics rows), or the PNG cannot
    be written (OSError: disk full, read-only folder): a finished run never fails because of its
    picture. No device reads."""
    try:
        return plot_run(run_dir)
    except PlotUnavailable as e:
        return str(e)
    except UsageError as e:
        return f"no plot: {e}"
    except OSError as e:
        return f"no plot: writing {Path(run_dir) / 'plot.png'} failed: {e.strerror or e}"
