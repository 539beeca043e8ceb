"""Each launcher with real trial processes: a trial that dies on its node is recorded as crashed
and the sweep goes on; Ctrl-C stops the trial that is still running (it writes a checkpoint) and
leaves no process behind; the local sweep is then resumed.

Two planted trials, one at a time: ``role=die`` SIGKILLs its own process at its second step,
``role=hold`` runs 1 s a step after its first row while the hold file exists; a helper thread presses Ctrl-C
(``_thread.interrupt_main``) once the held trial has logged a row. Ray runs as a local Ray of
2 CPUs (one module fixture: starting Ray costs seconds); SLURM as submitit's local executor.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ampctl.commands.sweep import LauncherOptions, Outcome, TrialJob
from ampctl.commands.sweep.launchers import parse_time_minutes
from ampctl.commands.sweep.launchers.process import FolderNotShared, run_trial
from ampctl.errors import UsageError
from tests.commands.sweep.conftest import PLANTED, run_sweep_here


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture
def sigint_handled():
    """``_thread.interrupt_main`` does nothing while SIGINT is ignored, as it is in a background
    job (``pytest ... &``): give the test Python's own handler (KeyboardInterrupt)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _ctrl_c_when_logged(metrics: Path, timeout_s: float = 240.0) -> threading.Thread:
    def press():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().strip():
                _thread.interrupt_main()
                return
            time.sleep(0.1)

    th = threading.Thread(target=press, daemon=True)
    th.start()
    return th


def _processes_of(sweep_dir: Path) -> list[str]:
    """Command lines of live processes that run a trial of ``sweep_dir``."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "ampctl" in cmd and str(sweep_dir) in cmd:
            out.append(cmd)
    return out


def _crash_then_ctrl_c(tmp_path, hold_file, launcher: LauncherOptions):
    runs = tmp_path / "runs"
    sdir = (runs / "s").resolve()
    args = (PLANTED, f"+model.hold_file={hold_file}", "+model.role=die,hold")
    th = _ctrl_c_when_logged(sdir / "role=hold" / "metrics.jsonl")
    result, out = run_sweep_here(
        runs, *args, jobs=1, steps=12, baseline=False, name="s", launcher=launcher
    )
    th.join(timeout=5)
    rows = {r["trial"]: r for r in result.rows}
    die, hold = rows["role=die"], rows["role=hold"]
    # the dead trial is recorded as crashed; the sweep went on to the next trial
    assert die["status"] == "crashed" and die["reason"] == "killed by signal 9, no summary.json"
    assert result.launched == ["role=die", "role=hold"]
    # Ctrl-C: the running trial got one SIGTERM, finished its step, wrote a checkpoint
    assert result.interrupted and result.exit_code == 130
    assert hold["status"] == "interrupted"
    tdir = sdir / "role=hold"
    assert json.loads((tdir / "summary.json").read_text())["status"] == "interrupted"
    assert list((tdir / "checkpoints").glob("step_*.pt"))
    piece = json.loads((tdir / "sweep_trial.json").read_text())["pieces"][-1]
    assert piece["exit_code"] == 143 and piece["stopped"] == "ctrl-c"
    assert piece["launcher"] == launcher.launcher and piece["node"]
    assert _processes_of(sdir) == []  # nothing left running
    assert "Resume with: ampctl sweep-scale " in out
    return runs, args, result, out


def test_local_crash_ctrl_c_and_resume(tmp_path, hold_file, sigint_handled):
    runs, args, first, _ = _crash_then_ctrl_c(tmp_path, hold_file, LauncherOptions("local"))
    tdir = runs / "s" / "role=hold"
    before = (tdir / "metrics.jsonl").read_text()
    hold_file.unlink()  # the held trial may finish now
    # both at once (nothing is pressed now): the interrupted trial continues from its
    # checkpoint; the dead one runs again from scratch
    again, out = run_sweep_here(runs, *args, jobs=2, steps=12, baseline=False, name="s")
    assert again.resumed == ["role=hold"] and again.moved_aside == ["role=die.incomplete-1"]
    rows = {r["trial"]: r for r in again.rows}
    assert rows["role=hold"]["status"] == "ok" and rows["role=hold"]["steps_spent"] == 12
    assert rows["role=die"]["status"] == "crashed"
    assert (tdir / "metrics.jsonl").read_text().startswith(before.rsplit("\n", 2)[0])
    assert again.recommendation["trial"] == "role=hold" and again.exit_code == 0


def test_ray_crash_and_ctrl_c(tmp_path, hold_file, local_ray, sigint_handled):
    _, _, result, out = _crash_then_ctrl_c(tmp_path, hold_file, LauncherOptions("ray"))
    assert "Ray tasks on local Ray, 1 in flight, 1 CPU each" in out.splitlines()[0]
    assert local_ray.is_initialized()  # the sweep does not shut down a Ray it did not start


def test_slurm_crash_and_ctrl_c_with_submitits_local_executor(tmp_path, hold_file, sigint_handled):
    pytest.importorskip("submitit")
    opts = LauncherOptions("slurm", slurm_cluster="local", time="10:00")
    runs, _, _, out = _crash_then_ctrl_c(tmp_path, hold_file, opts)
    assert "submitit local executor, 1 in flight" in out.splitlines()[0]
    assert (runs / "s" / "_submitit").is_dir()


def test_runner_refuses_a_sweep_folder_it_cannot_see(tmp_path):
    job = TrialJob(
        name="t",
        args=["-c", "pass"],
        env={},
        cwd=str(tmp_path),
        sweep_dir=str(tmp_path / "not-shared"),
        stdout=str(tmp_path / "o"),
        stderr=str(tmp_path / "e"),
        stop_file=str(tmp_path / "stop"),
    )
    with pytest.raises(FolderNotShared, match="is not visible on node .*shared by the sweep"):
        run_trial(job)
    ok = TrialJob(**{**job.__dict__, "sweep_dir": str(tmp_path), "args": ["-c", "exit(3)"]})
    assert run_trial(ok) == Outcome(exit_code=3, node=os.uname().nodename)


def test_the_runner_imports_no_torch():
    """A Ray worker or a SLURM job imports ``run_trial`` to run it: no torch comes with it (the
    trial's own ``ampctl train`` process imports that)."""
    code = "import sys, ampctl.commands.sweep.launchers.process; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert (out.returncode, out.stdout) == (0, "False\n"), out.stderr


def test_time_limits_and_missing_libraries(monkeypatch, tmp_path):
    assert parse_time_minutes("90") == 90
    assert parse_time_minutes("1:30:00") == 90
    assert parse_time_minutes("2-00") == 2880
    assert parse_time_minutes("10:30") == 11  # MM:SS, rounded up
    with pytest.raises(UsageError, match=r"^--time '0': give a time limit > 0"):
        parse_time_minutes("0")
    import sys

    from ampctl.commands.sweep.launchers import make_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(UsageError, match=r'^--launcher ray needs the ray package: pip install "a'):
        make_launcher(LauncherOptions("ray"), tmp_path)
    monkeypatch.setitem(sys.modules, "submitit", None)
    with pytest.raises(UsageError, match=r"^--launcher slurm needs the submitit package"):
        make_launcher(LauncherOptions("slurm"), tmp_path)
