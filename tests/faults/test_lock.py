"""Two owners of one folder: two processes racing for a run folder's lock, a resume while the
run is live, two sweeps with one name, two ProtectedRuns on one run_dir -- exactly one owns the
folder, the others are refused with one line (exit 2) before they write anything; a stale lock
(its process is dead) is taken over with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from ampctl.commands.sweep import sweep
from ampctl.integrations import ProtectedRun
from ampctl.runlog.lock import LOCK_NAME, RunLockedError, lock_run
from tests.conftest import ampctl_main, forked
from tests.faults.conftest import TINY, ampctl_here, env, rows

RACER = """
import sys, time
from pathlib import Path
from ampctl.runlog.lock import RunLockedError, lock_run
folder, go, release = map(Path, sys.argv[1:4])
while not go.exists():
    time.sleep(0.005)
try:
    lock = lock_run(folder)
except RunLockedError as e:
    print("refused", e, flush=True)
    sys.exit(2)
with open(folder / "owners.log", "a") as f:  # what the owner writes while it owns the folder
    f.write(f"{sys.argv[4]} start\\n")
print("owner", flush=True)
while not release.exists():
    time.sleep(0.005)
with open(folder / "owners.log", "a") as f:
    f.write(f"{sys.argv[4]} end\\n")
lock.release()
"""


def test_processes_racing_for_one_folder_one_owns_it(tmp_path):
    folder, go, release = tmp_path / "run", tmp_path / "go", tmp_path / "release"
    folder.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(folder), str(go), str(release), str(i)],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    time.sleep(0.3)  # all three waiting at the line
    go.touch()
    deadline = time.time() + 60
    while sum(p.poll() is not None for p in procs) < 2 and time.time() < deadline:
        time.sleep(0.01)
    release.touch()  # the refused two have ended; now the owner may end
    outs = [p.communicate(timeout=60) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2, 2], outs
    owner = next(str(i) for i, p in enumerate(procs) if p.returncode == 0)
    pid = procs[int(owner)].pid
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode == 2:  # one line naming the owner
            assert out.count("\n") == 1 and err == ""
            assert f"is in use by pid {pid} on host {socket.gethostname()}" in out
    assert (folder / "owners.log").read_text() == f"{owner} start\n{owner} end\n"
    assert not (folder / LOCK_NAME).exists()  # a clean end removes the lock file


def _tiny_run(runs, name, *extra):
    res = ampctl_here(
        "train", *TINY, f"trainer.runs_dir={runs}", "trainer.max_steps=4", "trainer.log_every=2",
        "trainer.ckpt_every=2", *extra, "--name", name, "--quiet",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    return runs / name


PLANTED = "model._target_=tests.commands.sweep.planted.Planted"


def test_a_resume_while_the_run_is_live_is_refused(tmp_path):
    runs, hold = tmp_path / "runs", tmp_path / "hold"
    hold.touch()  # the planted model sleeps 1 s a forward from step 5 while this file exists
    run = runs / "x"
    output = tmp_path / "live.txt"  # the live run's stdout and stderr
    live = forked(
        ampctl_main,
        "train", *TINY, PLANTED, f"+model.hold_file={hold}", "+model.role=hold",
        f"trainer.runs_dir={runs}", "trainer.max_steps=20", "trainer.log_every=2",
        "trainer.ckpt_every=4", "--name", "x", "--quiet",
        output=str(output),
    )  # fmt: skip
    try:
        deadline = time.time() + 240
        while not (run / "checkpoints" / "step_00000004.pt").exists() and time.time() < deadline:
            assert live.is_alive(), output.read_text()
            time.sleep(0.02)
        rows_before = (run / "metrics.jsonl").read_bytes()
        # the same model override: the resume may build it (it never gets that far); in this
        # process (no interpreter to start while the live run is held), a lock of another one
        out = ampctl_here("train", "--resume", str(run), PLANTED, "--quiet")
    finally:
        hold.unlink()  # the live run may finish now
    live.join(timeout=240)
    assert out.exit_code == 2, out.output
    line = f"ampctl: error: run folder {run} is in use by pid {live.pid} on host "
    assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    assert "Traceback" not in out.output
    assert (run / "metrics.jsonl").read_bytes().startswith(rows_before)  # not trimmed
    assert live.exitcode == 0, output.read_text()  # the live run went on, undisturbed
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == list(range(2, 21, 2))
    assert rows(run / "events.jsonl") == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_stale_lock_of_a_dead_pid_is_taken_over_with_one_line(tmp_path):
    run = _tiny_run(tmp_path / "runs", "x")
    dead = _dead_pid()
    (run / LOCK_NAME).write_text(f"pid={dead} host=elsewhere since={time.time():.0f}\n")
    res = ampctl_here("train", "--resume", str(run), "trainer.max_steps=6", "--quiet")
    assert res.exit_code == 0, res.output
    said = [line for line in res.output.splitlines() if "stale lock" in line]
    assert len(said) == 1 and f"of pid {dead} on host elsewhere" in said[0], res.output
    assert [r["step"] for r in rows(run / "metrics.jsonl")] == [2, 4, 6]
    assert not (run / LOCK_NAME).exists()


def test_two_sweeps_with_one_name(tmp_path):
    runs = tmp_path / "runs"
    sdir = runs / "s"
    sdir.mkdir(parents=True)
    args = [*TINY, f"trainer.runs_dir={runs}", "scaler.init_scale=1024,4096"]
    with lock_run(sdir, what="sweep folder"):  # the live sweep
        with pytest.raises(RunLockedError, match=f"sweep folder {sdir} is in use by pid"):
            sweep(args, steps=2, baseline=False, name="s", mode="quiet")
        res = ampctl_here("sweep-scale", *args, "--steps", "2", "--no-baseline", "--name", "s")
    assert res.exit_code == 2 and "is in use by pid" in res.output
    assert sorted(p.name for p in sdir.iterdir()) == []  # nothing written: no sweep.json, no trial


def _loop_run(run_dir, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, ProtectedRun(model, opt, run_dir=run_dir, precision="fp32", **kw)


def test_two_protected_runs_on_one_run_dir(tmp_path):
    model, opt, first = _loop_run(tmp_path / "run", log_every=1)
    first.start()
    _, _, second = _loop_run(tmp_path / "run", log_every=1)
    with pytest.raises(RunLockedError, match=f"is in use by pid {os.getpid()}"):
        second.start()
    for step in range(1, 3):
        opt.zero_grad()
        first.scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        first.scaler.step(opt)
        first.scaler.update()
        first.after_step(step=step, loss=torch.tensor(1.0))
    first.finish()
    assert [r["step"] for r in rows(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    _, _, third = _loop_run(tmp_path / "run", log_every=1)
    third.start(step=2)  # the folder is free again: a resume takes it
    third.finish()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
