"""A disk that is really full: a 160 KiB tmpfs mounted in a private mount namespace
(``unshare --mount``, or ``--user --map-root-user`` where the tests do not run as root), so the
kernel refuses a write with ENOSPC, not a size limit's EFBIG. The run stops at the write that
did not fit with one line naming the file and "No space left on device", exit code 1; every
file it wrote is whole; once the filesystem is grown (``mount -o remount,size=``: room freed),
``--resume`` ends where the uninterrupted run ends. Skipped where no mount namespace can be
made (a container that forbids it): ``tests/faults/test_full_disk.py`` covers the same paths
with ``RLIMIT_FSIZE`` everywhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.faults.conftest import TINY, ampctl_here, env, rows

RUN = ["trainer.max_steps=8", "trainer.log_every=2", "trainer.ckpt_every=2", "trainer.keep_last=10"]

# In the namespace: mount, train until the disk is full, grow it, resume; report as JSON.
CHILD = r"""
import json, subprocess, sys
from pathlib import Path
mnt, args = Path(sys.argv[1]), sys.argv[2:]
def sh(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)
sh("mount", "-t", "tmpfs", "-o", "size=160k", "tiny", str(mnt))
runs = mnt / "runs"
full = subprocess.run([sys.executable, "-m", "ampctl", "train", *args,
                       f"trainer.runs_dir={runs}", "--name", "full", "--quiet"],
                      capture_output=True, text=True)
run = runs / "full"
files = {str(p.relative_to(run)): p.read_bytes().decode("latin-1")
         for p in run.rglob("*") if p.is_file() and p.suffix != ".pt"}
ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
from ampctl.train.checkpoint import list_checkpoints, load_checkpoint
kept = list_checkpoints(run / "checkpoints")
last_step = load_checkpoint(kept[-1])["step"] if kept else None
sh("mount", "-o", "remount,size=8m", str(mnt))   # room again
res = subprocess.run([sys.executable, "-m", "ampctl", "train", "--resume", str(run), "--quiet"],
                     capture_output=True, text=True)
print(json.dumps({
    "code": full.returncode, "out": full.stdout + full.stderr, "files": files,
    "ckpts": ckpts, "kept": [p.name for p in kept], "last_step": last_step,
    "resume_code": res.returncode, "resume_out": res.stdout + res.stderr,
    "metrics": (run / "metrics.jsonl").read_text(), "summary": (run / "summary.json").read_text(),
}))
"""


def _namespace() -> list[str] | None:
    """The ``unshare`` prefix that gives this user a private mount namespace, or None."""
    if not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        probe = subprocess.run(
            [*prefix, "sh", "-c", "mount -t tmpfs -o size=64k t /mnt 2>/dev/null || exit 1"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return prefix
    return None


def test_a_really_full_disk_stops_the_run_and_resume_finishes_it(tmp_path):
    prefix = _namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare --mount refused): no tmpfs to fill")
    args = [*TINY, *RUN]
    ref = ampctl_here("train", *args, f"trainer.runs_dir={tmp_path / 'runs'}", "--name", "ref",
                      "--quiet")  # fmt: skip
    assert ref.exit_code == 0, ref.output
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = subprocess.run(
        [*prefix, sys.executable, "-c", CHILD, str(mnt), *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    text = got["out"]
    assert got["code"] == 1 and "Traceback" not in text, text
    (line,) = [x for x in text.splitlines() if "could not write" in x]
    assert "No space left on device" in line
    # every file whole: JSONL lines end, the summary parses and says failed, no temp file left
    for name, body in got["files"].items():
        if name.endswith(".jsonl"):
            assert body == "" or body.endswith("\n"), name
            [json.loads(x) for x in body.splitlines()]
    assert json.loads(got["files"]["summary.json"])["status"] == "failed"
    assert got["ckpts"] == got["kept"] and got["kept"], got  # no half-written checkpoint
    assert 2 <= got["last_step"] < 8
    # room again: the resume ends at the uninterrupted run's rows and final loss
    assert got["resume_code"] == 0, got["resume_out"]
    want = [(r["step"], r["loss"], r["scale"]) for r in rows(tmp_path / "runs/ref/metrics.jsonl")]
    resumed = [json.loads(x) for x in got["metrics"].splitlines()]
    assert [(r["step"], r["loss"], r["scale"]) for r in resumed] == want
    ref_summary = json.loads((tmp_path / "runs/ref/summary.json").read_text())
    assert json.loads(got["summary"])["final_loss"] == ref_summary["final_loss"]
