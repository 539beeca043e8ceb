"""Crashes: SIGKILL at any moment leaves a loadable latest checkpoint and resume reproduces the
uninterrupted run; a failing checkpoint write is a clear error that keeps the previous one."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.runlog.writers import new_run_dir
from ampctl.train import checkpoint as ckpt_mod
from ampctl.train.checkpoint import list_checkpoints, load_checkpoint
from ampctl.train.trainer import train
from tests.conftest import FAST, ampctl_main, forked, read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(runs, *extra):
    return [
        sys.executable,
        "-m",
        "ampctl",
        "train",
        *FAST,
        f"trainer.runs_dir={runs}",
        "trainer.max_steps=24",
        "trainer.ckpt_every=1",
        "trainer.keep_last=2",
        "logging.plot=false",  # no test here reads plot.png (matplotlib: seconds a process)
        "--quiet",
        *extra,
    ]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def test_sigkill_at_random_moments_then_resume_matches(tmp_path):
    """The victim and its resumes are processes forked from the session's forkserver (torch
    and ampctl imported there once), so the kills land in training, not in an interpreter's
    imports."""
    runs = tmp_path / "runs"
    torch.set_num_threads(1)  # as the killed processes run
    # 48 steps (~1 s on 2 cores): a process forked in milliseconds must still be training when
    # the kill comes, up to 0.6 s after its first checkpoint
    steps = "trainer.max_steps=48"
    ref = CliRunner().invoke(app, _cmd(runs, "--name", "ref", steps)[3:])  # in-process
    assert ref.exit_code == 0, ref.output
    rng = random.Random(0)
    run_dir = runs / "victim"
    output = str(tmp_path / "output.txt")  # what the processes print
    proc = forked(ampctl_main, *_cmd(runs, "--name", "victim", steps)[3:], output=output)
    kills = 0
    while True:
        # wait until training has really started, then kill at a random moment
        deadline = time.time() + 120
        while (
            not list_checkpoints(run_dir / "checkpoints")
            and proc.is_alive()
            and time.time() < deadline
        ):
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.6))
        if not proc.is_alive():
            break
        proc.kill()  # SIGKILL
        proc.join()
        kills += 1
        ck = load_checkpoint(run_dir)  # the latest complete checkpoint always loads
        assert ck["step"] >= 1
        for p in (run_dir / "checkpoints").iterdir():
            assert p.name.startswith("step_") or p.name.endswith(".tmp")
        if kills >= 3:
            break
        proc = forked(ampctl_main, "train", "--resume", str(run_dir), "--quiet", output=output)
    if proc.is_alive() or kills >= 3:
        done = forked(ampctl_main, "train", "--resume", str(run_dir), "--quiet", output=output)
        done.join(timeout=300)
        assert done.exitcode == 0, Path(output).read_text()
    assert kills >= 1
    a = [(r["step"], r["loss"], r["scale"]) for r in read_jsonl(runs / "ref" / "metrics.jsonl")]
    b = [(r["step"], r["loss"], r["scale"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert a == b
    wa = load_checkpoint(runs / "ref")["model"]
    wb = load_checkpoint(run_dir)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_disk_full_keeps_the_previous_checkpoint(fast_cfg, monkeypatch):
    cfg = fast_cfg("trainer.ckpt_every=4")
    real_save = torch.save
    calls = {"n": 0}

    def flaky_save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint: disk full halfway through
            f.write(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", flaky_save)
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "full"))
    assert res.status == "failed" and res.exit_code == 1
    ckpts = list_checkpoints(res.run_dir / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000004.pt"]
    assert load_checkpoint(ckpts[0])["step"] == 4
    assert not [p for p in (res.run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    ev = read_jsonl(res.run_dir / "events.jsonl")[-1]
    assert ev["kind"] == "error"
    assert "could not write the step-8 checkpoint" in ev["message"]
    assert (
        "No space left on device" in ev["message"] and "step_00000004.pt is intact" in ev["message"]
    )


def test_ctrl_c_finishes_the_step_saves_and_says_how_to_resume(tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        _cmd(runs, "--name", "int", "trainer.ckpt_every=1000", "trainer.max_steps=400", "--plain"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (runs / "int" / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"Resume with: ampctl train --resume {runs / 'int'}" in out
    ck = load_checkpoint(runs / "int")
    assert 0 < ck["step"] < 400
    assert read_jsonl(runs / "int" / "events.jsonl")[-1]["kind"] == "interrupt"
    assert '"status": "interrupted"' in (runs / "int" / "summary.json").read_text()
