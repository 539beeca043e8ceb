"""Where the trials run: one small interface, one file per launcher.

A launcher takes a :class:`TrialJob` (an ``ampctl train`` command line, its environment and log
files) and runs it somewhere: ``local`` as a child process of the sweep, ``ray`` as a Ray task,
``slurm`` as a SLURM job through submitit. The sweep only ever calls

* ``submit(job) -> handle``,
* ``poll(handle) -> Outcome | None`` (None while it runs; never blocks),
* ``cancel(handle, force=False)``: ask the trial to stop (it finishes its step, writes a
  checkpoint and exits); ``force=True`` kills it.

Remote launchers need the sweep folder on a filesystem that the sweep and every node share: the
trials write their run folders there, the sweep reads them live (table, divergence stop), a
graceful stop is a file the trial's runner watches there (:mod:`.process`), and a trial continued
on the next rung resumes from its own checkpoint there, on whichever node runs it.

``ray`` and ``submitit`` are imported only by their launcher, with an install hint when missing.
"""

from __future__ import annotations

from pathlib import Path

from .base import (
    KILL_GRACE_S,
    LAUNCHERS,
    Launcher,
    LauncherOptions,
    Outcome,
    TrialJob,
    import_for,
    parse_time_minutes,
)

__all__ = [
    "KILL_GRACE_S",
    "LAUNCHERS",
    "TrialJob",
    "Outcome",
    "Launcher",
    "LauncherOptions",
    "make_launcher",
    "parse_time_minutes",
    "import_for",
]


def make_launcher(opts: LauncherOptions, sweep_dir: Path) -> Launcher:
    """The launcher for ``opts`` (validated first). Starting it may connect to a cluster; a
    missing library or an unreachable cluster is a UsageError naming what to do."""
    opts.validate()
    if opts.launcher == "ray":
        from .ray import RayLauncher

        return RayLauncher(opts)
    if opts.launcher == "slurm":
        from .slurm import SlurmLauncher

        return SlurmLauncher(opts, sweep_dir)
    from .local import LocalLauncher

    return LocalLauncher(opts)
