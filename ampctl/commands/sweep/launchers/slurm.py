"""``--launcher slurm``: each trial is a SLURM job submitted through submitit, running
``ampctl train`` on its node.

Options: ``--partition``, ``--time`` (SLURM's forms), ``--cpus-per-trial`` (cpus_per_task, also
the trial's thread count; default 1), ``--gpus-per-trial`` (gpus_per_node) and any other sbatch
parameter as ``--slurm-param KEY=VALUE`` (repeatable). submitit's files are kept in
``<sweep>/_submitit/``. A job that dies (node failure, time limit, OOM kill) is recorded as
crashed. Without a SLURM cluster, submitit's local executor runs the same jobs on this machine
(``slurm_cluster="local"`` in the library API; the tests use it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ampctl.errors import UsageError, first_line

from .base import Launcher, LauncherOptions, Outcome, TrialJob, import_for, parse_time_minutes
from .process import run_trial

__all__ = ["SlurmLauncher"]

INSTALL_HINT = 'pip install "ampctl[slurm]" (or pip install "submitit>=1.5")'
LOCAL_TIMEOUT_MIN = 7 * 24 * 60  # submitit's local executor kills a job after 2 min by default


class SlurmLauncher(Launcher):
    name = "slurm"

    def __init__(self, opts: LauncherOptions, sweep_dir: Path) -> None:
        submitit = self.submitit = import_for("slurm", "submitit", INSTALL_HINT)
        super().__init__(opts)
        folder = Path(sweep_dir) / "_submitit"
        try:
            self.executor = submitit.AutoExecutor(folder=folder, cluster=opts.slurm_cluster)
        except Exception as e:  # noqa: BLE001 - submitit words "no SLURM here" in several ways
            raise UsageError(
                f"--launcher slurm: submitit cannot submit to {opts.slurm_cluster}: "
                f"{first_line(e)} (is sbatch on PATH?)"
            ) from None
        params: dict[str, Any] = {
            "name": f"ampctl-{Path(sweep_dir).name}",
            "nodes": 1,
            "tasks_per_node": 1,
            "cpus_per_task": self.cpus,
        }
        if opts.gpus_per_trial:
            params["gpus_per_node"] = int(opts.gpus_per_trial)
        if opts.time is not None:
            params["timeout_min"] = parse_time_minutes(opts.time)
        elif opts.slurm_cluster == "local":
            params["timeout_min"] = LOCAL_TIMEOUT_MIN
        if opts.partition is not None:
            params["slurm_partition"] = opts.partition
        if opts.slurm_params:
            params["slurm_additional_parameters"] = dict(p.split("=", 1) for p in opts.slurm_params)
        try:
            self.executor.update_parameters(**params)
        except (ValueError, TypeError) as e:
            raise UsageError(f"--launcher slurm: {first_line(e)}") from None

    def describe(self, jobs: int) -> str:
        where = "submitit local executor" if self.opts.slurm_cluster == "local" else "SLURM"
        part = f" partition {self.opts.partition}," if self.opts.partition else ""
        return f"{where},{part} {jobs} in flight, {self.cpus} CPU(s) each"

    def submit(self, job: TrialJob) -> Any:
        return self.executor.submit(run_trial, job)

    def poll(self, handle: Any) -> Outcome | None:
        if not handle.done():
            return None
        try:
            return handle.result()
        except Exception as e:  # noqa: BLE001 - FailedJobError, UncompletedJobError, the runner's
            return Outcome(exit_code=None, error=f"job {handle.job_id}: {_why(e)}")

    def cancel(self, handle: Any, *, force: bool = False) -> None:
        # graceful: the stop file (written by the sweep); force: scancel (SIGTERM then SIGKILL to
        # every process of the job) / the local executor's SIGINT then SIGKILL
        if force:
            try:
                handle.cancel(check=False)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _why(e: BaseException) -> str:
    """The last meaningful line of a submitit failure (its message holds the job's traceback)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "killed" in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else type(e).__name__
