"""A checkpoint is data: ``ampctl diagnose`` (text and --json, as real subprocesses) never
imports a ``_target_`` from a checkpoint's config that does not ship with ampctl, and never
evaluates an interpolation in it; it still reports state health and says why the replay was
skipped, naming the target and ``--trust-code``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampctl.commands.diagnose import diagnose
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-value-that-must-not-leak"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A real ampctl checkpoint of the shipped tiny BERT (3 steps)."""
    from ampctl.config import load_config

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trust")
    cfg = load_config(
        [*FAST, f"trainer.runs_dir={root}", "trainer.max_steps=3", "trainer.ckpt_every=3"]
    )
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "r"))
    return res.run_dir / "checkpoints" / "step_00000003.pt"


def edited(ckpt: Path, dest: Path, edit) -> Path:
    ck = torch.load(ckpt, weights_only=True)
    edit(ck["config"])
    dest.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ck, dest)
    return dest


def cli(cwd: Path, *runs: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """``ampctl diagnose ARGS`` for each ARGS of ``runs``, all at once (one core each)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SOME_SECRET": SECRET, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ampctl", "diagnose", *args, "--device", "cpu", "-b", "1"],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args in runs
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out, err)
        for p, (out, err) in zip(procs, outs, strict=True)
    ]


def test_code_targets_are_never_called(ckpt, tmp_path):
    marker = tmp_path / "MARKER"
    victim = tmp_path / "victim"
    victim.mkdir()
    cmd = edited(
        ckpt,
        tmp_path / "a" / "cmd.pt",
        lambda c: c.update(model={"_target_": "subprocess.getoutput", "cmd": f"touch {marker}"}),
    )
    rm = edited(
        ckpt,
        tmp_path / "b" / "rm.pt",
        lambda c: c.update(model={"_target_": "shutil.rmtree", "path": str(victim)}),
    )
    text, as_json = cli(tmp_path, (str(cmd),), (str(rm), "--json"))
    assert not marker.exists() and victim.is_dir()  # nothing ran
    for res in (text, as_json):
        assert res.returncode == 0, res.stderr  # healthy state; the replay was skipped
        assert "Traceback" not in res.stderr
    assert "1. State health" in text.stdout
    skipped = next(line for line in text.stdout.splitlines() if "Replay skipped" in line)
    assert "model._target_='subprocess.getoutput'" in skipped and "--trust-code" in skipped
    rep = json.loads(as_json.stdout)
    assert rep["replay"]["ran"] is False and rep["state"]["weights"]["bad"] == []
    assert "model._target_='shutil.rmtree'" in rep["replay"]["reason"]
    assert "--trust-code" in rep["replay"]["reason"]


def test_interpolations_are_never_evaluated(ckpt, tmp_path):
    def edit(c):
        c["optim"]["lr"] = "${oc.env:SOME_SECRET}"
        c["model"]["hidden_size"] = "${oc.env:SOME_SECRET}"

    path = edited(ckpt, tmp_path / "secret.pt", edit)
    for res in cli(tmp_path, (str(path),), (str(path), "--json")):
        assert res.returncode == 0, res.stderr
        assert SECRET not in res.stdout and SECRET not in res.stderr
        assert "interpolation" in res.stdout and "Traceback" not in res.stderr
    # --trust-code allows imports, never evaluation
    os.environ["SOME_SECRET"] = SECRET
    try:
        rep = diagnose(path, batches=1, device="cpu", trust_code=True)
    finally:
        del os.environ["SOME_SECRET"]
    assert SECRET not in json.dumps(rep) and "interpolation" in rep["replay"]["reason"]
