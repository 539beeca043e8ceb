"""The trial's runner on a node (Ray task, SLURM job): start ``ampctl train``, pass a stop on to
it once, kill it if it does not stop in time, return how it ended.

It imports nothing heavy (no torch): a Ray worker or a submitit job runs it as a plain function.
A stop comes from the sweep as a file (``TrialJob.stop_file``, on the shared sweep folder) or as
a signal to the runner (SLURM's scancel and time limit, submitit's cancel, Ray's cancel); either
way the trial gets one SIGTERM -- it finishes its step, writes a checkpoint and an ``interrupted``
summary -- and is killed after ``grace_s`` if it is still running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ampctl.files import open_append

from .base import Outcome, TrialJob

__all__ = ["run_trial", "start_trial", "FolderNotShared"]

POLL_S = 0.5


class FolderNotShared(RuntimeError):
    """The node does not see the sweep folder: remote trials need a shared filesystem."""


def start_trial(job: TrialJob) -> subprocess.Popen:
    """``job``'s process, its output appended to its log files, in a session of its own: a
    signal reaches it from its runner only (a Ctrl-C on the terminal stops the sweep, which
    stops the trials; a remote runner passes a stop on once)."""
    with open_append(job.stdout) as out, open_append(job.stderr) as err:
        return subprocess.Popen(
            [sys.executable, *job.args],
            cwd=job.cwd,
            env={**os.environ, **job.env},
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def run_trial(job: TrialJob) -> Outcome:
    """Run ``job`` to its end on this node and return its :class:`Outcome` (exit code, host).
    Raises :class:`FolderNotShared` when the sweep folder is not visible here."""
    node = socket.gethostname()
    if not Path(job.sweep_dir).is_dir():
        raise FolderNotShared(
            f"the sweep folder {job.sweep_dir} is not visible on node {node}: remote trials need "
            "it on a filesystem shared by the sweep and the nodes"
        )
    stop = threading.Event()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            old[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        code = _wait(start_trial(job), job, stop)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    return Outcome(exit_code=code, node=node)


def _wait(proc: subprocess.Popen, job: TrialJob, stop: threading.Event) -> int:
    stop_file = Path(job.stop_file)
    asked_at: float | None = None
    while True:
        try:
            code = proc.wait(timeout=POLL_S)
            return code
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:  # Ray's cancel raises it in the task
            stop.set()
        if asked_at is None and (stop.is_set() or stop_file.exists()):
            proc.send_signal(signal.SIGTERM)
            asked_at = time.monotonic()
        elif asked_at is not None and time.monotonic() - asked_at > job.grace_s:
            proc.kill()
