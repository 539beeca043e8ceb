"""``--launcher ray``: each trial is a Ray task that runs ``ampctl train`` on a node.

``ray.init()`` starts a local Ray on this machine when no ``--address`` is given (and none is
running in this process already); ``--address`` joins an existing cluster. Each task reserves
``--cpus-per-trial`` CPUs (default 1, also the trial's thread count) and ``--gpus-per-trial`` GPUs.
Tasks are not retried by Ray: a trial whose node or worker dies is recorded as crashed, and a
resumed sweep runs it again. The nodes need ampctl installed and the sweep folder on a shared
filesystem (see :mod:`ampctl.commands.sweep.launchers`).
"""

from __future__ import annotations

from typing import Any

from ampctl.errors import UsageError, first_line

from .base import Launcher, LauncherOptions, Outcome, TrialJob, import_for
from .process import run_trial

__all__ = ["RayLauncher"]

INSTALL_HINT = 'pip install "ampctl[ray]" (or pip install "ray>=2.9")'


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, opts: LauncherOptions) -> None:
        ray = self.ray = import_for("ray", "ray", INSTALL_HINT)
        super().__init__(opts)
        self.started = False
        if not ray.is_initialized():
            try:
                ray.init(
                    address=opts.address,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level="ERROR",
                )
            except (ConnectionError, ValueError, RuntimeError) as e:
                where = f"--address {opts.address}" if opts.address else "a local Ray"
                raise UsageError(
                    f"--launcher ray: could not start {where}: {first_line(e)}"
                ) from None
            self.started = True
        self.remote = ray.remote(run_trial).options(
            num_cpus=self.cpus,
            num_gpus=opts.gpus_per_trial or 0,
            max_retries=0,
            name="ampctl-trial",
        )

    def describe(self, jobs: int) -> str:
        gpus = f", {self.opts.gpus_per_trial} GPU" if self.opts.gpus_per_trial else ""
        where = self.opts.address or "local Ray"
        return f"Ray tasks on {where}, {jobs} in flight, {self.cpus} CPU{gpus} each"

    def submit(self, job: TrialJob) -> Any:
        return self.remote.remote(job)

    def poll(self, handle: Any) -> Outcome | None:
        ready, _ = self.ray.wait([handle], timeout=0)
        if not ready:
            return None
        try:
            return self.ray.get(handle)
        except self.ray.exceptions.TaskCancelledError:
            return Outcome(exit_code=None, error="cancelled by the sweep")
        except self.ray.exceptions.RayTaskError as e:  # raised inside the task
            cause = getattr(e, "cause", None)
            return Outcome(exit_code=None, error=first_line(cause if cause is not None else e))
        except self.ray.exceptions.RayError as e:  # worker or node died
            return Outcome(exit_code=None, error=f"Ray: {first_line(e)}")

    def cancel(self, handle: Any, *, force: bool = False) -> None:
        # graceful: the stop file (written by the sweep), which the runner passes on as one
        # SIGTERM; force: the worker is killed (Ray kills its child processes with it)
        if not force:
            return
        try:
            self.ray.cancel(handle, force=True)
        except Exception:  # noqa: BLE001 - a finished task cannot be cancelled: nothing to do
            pass

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
