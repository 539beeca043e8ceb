"""The launcher interface the launchers implement (see the package docstring), the trial's
job and outcome, the command-line options; the package only chooses a launcher."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

from ampctl.errors import UsageError

LAUNCHERS = ("local", "ray", "slurm")
KILL_GRACE_S = 15.0  # after a stop request a trial writes a checkpoint; then it is killed


@dataclass(frozen=True)
class TrialJob:
    """One ``ampctl train`` process to run, as the node sees it."""

    name: str  # the trial's name (unique in the sweep)
    args: list[str]  # after the Python interpreter: ["-m", "ampctl", "train", ...]
    env: dict[str, str]  # added to the node's environment (thread counts)
    cwd: str  # where to run it (the sweep's working directory: relative paths keep meaning)
    sweep_dir: str
    stdout: str  # log files (in the sweep folder)
    stderr: str
    stop_file: str  # created by the sweep to ask the trial to stop (remote launchers)
    grace_s: float = KILL_GRACE_S


@dataclass
class Outcome:
    """How a trial's process ended."""

    exit_code: int | None  # negative: killed by that signal; None: it never ran or is unknown
    error: str = ""  # one line when the trial or its node died under the launcher
    node: str = ""  # the host it ran on, when known


class Launcher:
    """Runs trial processes; see the module docstring. Subclasses implement the three calls."""

    name = "launcher"

    def __init__(self, opts: LauncherOptions) -> None:
        self.opts = opts
        self.cpus = opts.cpus_per_trial or 1  # per trial, by default 1

    def threads(self, jobs: int) -> int:
        """CPU threads each trial gets (OMP_NUM_THREADS)."""
        return self.cpus

    def in_flight(self, jobs: int | None, queued: int) -> int:
        """How many trials to keep submitted at once (``--jobs``; default: all, the cluster
        queues them)."""
        return max(1, jobs if jobs is not None else queued)

    def describe(self, jobs: int) -> str:
        return f"{self.name}, {jobs} at a time, {self.threads(jobs)} CPU thread(s) each"

    def submit(self, job: TrialJob) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def poll(self, handle: Any) -> Outcome | None:  # pragma: no cover - interface
        raise NotImplementedError

    def cancel(self, handle: Any, *, force: bool = False) -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        """Release what the launcher started (a local Ray it started, for instance)."""


def import_for(launcher: str, package: str, hint: str) -> Any:
    """``package``, which ``--launcher launcher`` needs; a UsageError with ``hint`` (how to
    install it) when it is missing."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise UsageError(f"--launcher {launcher} needs the {package} package: {hint}") from None


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?\Z")


def parse_time_minutes(text: str) -> int:
    """SLURM's ``--time`` forms (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``) as whole minutes (rounded up). Raises UsageError for anything else."""
    m = _TIME.match(text.strip())
    if not m:
        raise UsageError(
            f"--time {text!r}: use minutes, HH:MM:SS or D-HH:MM:SS (SLURM's --time forms)"
        )
    d, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if d is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        secs = int(d) * 86400 + h * 3600 + mi * 60 + s
    elif len(parts) == 3:
        secs = parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif len(parts) == 2:
        secs = parts[0] * 60 + parts[1]
    else:
        secs = parts[0] * 60
    if secs <= 0:
        raise UsageError(f"--time {text!r}: give a time limit > 0")
    return -(-secs // 60)


@dataclass(frozen=True)
class LauncherOptions:
    """The launcher and its options, as the command line gives them."""

    launcher: str = "local"
    address: str | None = None  # ray: join this cluster (default: start a local Ray)
    cpus_per_trial: int | None = None
    gpus_per_trial: float | None = None
    partition: str | None = None  # slurm
    time: str | None = None  # slurm: --time
    slurm_params: tuple[str, ...] = ()  # slurm: extra sbatch parameters k=v
    slurm_cluster: str = "slurm"  # submitit cluster; "local" runs its local executor (tests)
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise UsageError (one line) for an option that does not apply or is out of range."""
        if self.launcher not in LAUNCHERS:
            raise UsageError(f"--launcher {self.launcher!r}: use one of {', '.join(LAUNCHERS)}")
        need = {"--address": ("ray", self.address is not None)}
        need["--gpus-per-trial"] = ("ray slurm", self.gpus_per_trial is not None)
        need["--partition"] = ("slurm", self.partition is not None)
        need["--time"] = ("slurm", self.time is not None)
        need["--slurm-param"] = ("slurm", bool(self.slurm_params))
        for opt, (allowed, given) in need.items():
            if given and self.launcher not in allowed.split():
                where = " or ".join(f"--launcher {a}" for a in allowed.split())
                raise UsageError(f"{opt} applies to {where}, not --launcher {self.launcher}")
        if self.cpus_per_trial is not None and self.cpus_per_trial < 1:
            raise UsageError(f"--cpus-per-trial {self.cpus_per_trial}: give an integer >= 1")
        if self.gpus_per_trial is not None and not self.gpus_per_trial >= 0:
            raise UsageError(f"--gpus-per-trial {self.gpus_per_trial}: give a number >= 0")
        for p in self.slurm_params:
            k, sep, _v = p.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", k):
                raise UsageError(
                    f"--slurm-param {p!r}: give KEY=VALUE with an sbatch option name, "
                    "e.g. --slurm-param account=myproj --slurm-param qos=high"
                )
        if self.time is not None:
            parse_time_minutes(self.time)

    def args(self) -> list[str]:
        """The command-line options that give these settings (for the resume command)."""
        out: list[str] = []
        if self.launcher != "local":
            out += ["--launcher", self.launcher]
        pairs = [
            ("--address", self.address),
            ("--cpus-per-trial", self.cpus_per_trial),
            ("--gpus-per-trial", self.gpus_per_trial),
            ("--partition", self.partition),
            ("--time", self.time),
        ]
        for opt, v in pairs:
            if v is not None:
                out += [opt, str(v)]
        for p in self.slurm_params:
            out += ["--slurm-param", p]
        return out
