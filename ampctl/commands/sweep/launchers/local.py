"""``--launcher local`` (the default): each trial is a child process of the sweep, ``--jobs`` at a
time, the machine's cores shared out between them."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from .base import Launcher, LauncherOptions, Outcome, TrialJob
from .process import start_trial

__all__ = ["LocalLauncher", "threads_per_trial", "cores"]


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def threads_per_trial(
    jobs: int, n_cores: int | None = None, env: dict[str, str] | None = None
) -> int:
    """CPU threads for each trial so that ``jobs x threads <= cores``; an ``OMP_NUM_THREADS``
    already set in the environment is an upper bound (a shared machine's limit stays)."""
    n_cores = n_cores or cores()
    n = max(1, n_cores // max(jobs, 1))
    cap = (env if env is not None else os.environ).get("OMP_NUM_THREADS", "")
    if cap.isdigit() and int(cap) >= 1:
        n = min(n, int(cap))
    return n


@dataclass
class _Proc:
    proc: subprocess.Popen


class LocalLauncher(Launcher):
    name = "local"

    def __init__(self, opts: LauncherOptions) -> None:
        super().__init__(opts)
        self.cores = cores()

    def in_flight(self, jobs: int | None, queued: int) -> int:
        return max(1, min(jobs if jobs is not None else 1, self.cores, max(queued, 1)))

    def threads(self, jobs: int) -> int:
        return self.opts.cpus_per_trial or threads_per_trial(jobs, self.cores)

    def describe(self, jobs: int) -> str:
        n = self.threads(jobs)
        return f"{jobs} at a time, {n} CPU thread{'s' if n > 1 else ''} each"

    def submit(self, job: TrialJob) -> _Proc:
        return _Proc(start_trial(job))

    def poll(self, handle: _Proc) -> Outcome | None:
        code = handle.proc.poll()
        return None if code is None else Outcome(exit_code=code, node="local")

    def cancel(self, handle: _Proc, *, force: bool = False) -> None:
        if handle.proc.poll() is not None:
            return
        if force:
            handle.proc.kill()
        else:
            handle.proc.send_signal(signal.SIGTERM)
