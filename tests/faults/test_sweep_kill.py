"""A sweep killed with SIGKILL, its trials too (as a scheduler ends a job: every process group of
it at once): the same command again continues -- the finished trial untouched, the killed one
resumed from its checkpoint -- and ends with the results of an uninterrupted sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.faults.conftest import TINY, ampctl_here, env

GRID = "scaler.init_scale=1024,4096"
FIRST, SECOND = "init_scale=1024", "init_scale=4096"


def _args(runs: Path, name: str, jobs: int = 1) -> list[str]:
    """One thread per trial: --jobs 1 and --jobs 2 then give bit-identical losses."""
    return [
        "sweep-scale", *TINY, GRID, "trainer.log_every=4", "trainer.ckpt_every=4",
        f"trainer.runs_dir={runs}", "--steps", "48", "--no-baseline", "--jobs", str(jobs),
        "--cpus-per-trial", "1", "--name", name, "--plain",
    ]  # fmt: skip


def _trial_pids(sweep_dir: Path) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if p.name.isdigit() and " train " in cmd and str(sweep_dir) in cmd:
            pids.append(int(p.name))
    return pids


def _kill_all(sweep: subprocess.Popen, sweep_dir: Path) -> None:
    """SIGKILL to the sweep's process group and to each trial's (a trial runs in a session of
    its own), as a scheduler ends every process of a job."""
    groups = {os.getpgid(sweep.pid)}
    for pid in _trial_pids(sweep_dir):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for g in groups:
        os.killpg(g, signal.SIGKILL)
    sweep.wait()


def _outcome(sweep_dir: Path) -> dict:
    doc = json.loads((sweep_dir / "results.json").read_text())
    return {
        "ranking": [r["trial"] for r in doc["trials"] if r.get("rank") is not None],
        "recommendation": doc["recommendation"]["command"],
        "trials": {
            r["trial"]: (r["status"], r["final_loss"], r["skipped"], r["final_scale"])
            for r in doc["trials"]
        },
    }


def _kill_once_second_has_a_checkpoint(sweep: subprocess.Popen, sdir: Path) -> None:
    deadline = time.time() + 240
    second = sdir / SECOND / "checkpoints"
    while time.time() < deadline and sweep.poll() is None:
        if second.is_dir() and any(p.name.startswith("step_") for p in second.iterdir()):
            break
        time.sleep(0.01)
    _kill_all(sweep, sdir)


def test_a_killed_sweep_continues_where_it_was(tmp_path):
    runs = (tmp_path / "runs").resolve()
    sdir = runs / "s"
    sweep = subprocess.Popen(
        [sys.executable, "-m", "ampctl", *_args(runs, "s")],
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # the sweep runs its trials one at a time (one core); on the other, the uninterrupted sweep
    # to compare with runs here meanwhile (both trials at once), while a thread kills the sweep
    # once its second trial has written a checkpoint
    killer = threading.Thread(target=_kill_once_second_has_a_checkpoint, args=(sweep, sdir))
    killer.start()
    ref = ampctl_here(*_args(runs, "ref", jobs=2))
    killer.join(timeout=300)
    assert not killer.is_alive() and sweep.poll() is not None
    assert ref.exit_code == 0, ref.output
    assert _trial_pids(sdir) == []
    assert (sdir / FIRST / "summary.json").is_file()  # finished before the kill
    assert not (sdir / SECOND / "summary.json").exists()  # killed part way
    first_files = {p: p.read_bytes() for p in (sdir / FIRST).rglob("*") if p.is_file()}

    again = ampctl_here(*_args(runs, "s"))  # the same command again
    assert again.exit_code == 0, again.output
    assert "Resumed: 1 trial(s) found done, 1 continued from their checkpoint" in again.output
    assert "took over the stale lock" in again.output  # the killed sweep's lock
    piece = json.loads((sdir / SECOND / "sweep_trial.json").read_text())["pieces"][-1]
    assert piece["resumed_from_step"] >= 4 and "--resume" in piece["command"]
    assert not list(sdir.glob("*.incomplete-*"))  # nothing run again from scratch
    assert {p: p.read_bytes() for p in first_files} == first_files  # the finished one untouched
    assert _outcome(sdir) == _outcome(runs / "ref")  # as the uninterrupted sweep ended
