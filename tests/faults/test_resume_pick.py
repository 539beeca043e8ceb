"""A truncated newest checkpoint (the machine died while the run folder was being copied):
``--resume RUN`` takes the newest checkpoint that loads, says which and why in one line, and the
run ends as the uninterrupted one did."""

from __future__ import annotations

import shutil

from ampctl.train.checkpoint import list_checkpoints
from tests.faults.conftest import TINY, ampctl_here, rows

RUN = ["trainer.max_steps=8", "trainer.log_every=2", "trainer.ckpt_every=2", "--quiet"]


def test_resume_passes_over_a_truncated_newest_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    done = ampctl_here("train", *TINY, f"trainer.runs_dir={runs}", *RUN, "--name", "ref")
    assert done.exit_code == 0, done.output
    copy = runs / "copy"
    shutil.copytree(runs / "ref", copy)
    newest = list_checkpoints(copy / "checkpoints")[-1]
    assert newest.name == "step_00000008.pt"
    with open(newest, "r+b") as f:  # the copy stopped half way through the newest checkpoint
        f.truncate(newest.stat().st_size // 2)
    cut = newest.stat().st_size
    (copy / "summary.json").unlink()  # and before the summary
    res = ampctl_here("train", "--resume", str(copy), "--quiet")
    assert res.exit_code == 0, res.output
    said = [line for line in res.output.splitlines() if line.startswith("resuming from")]
    assert len(said) == 1, res.output
    assert said[0].startswith("resuming from step_00000006.pt (step 6), the newest checkpoint")
    assert "step_00000008.pt passed over" in said[0] and "truncated or corrupt" in said[0]
    ref = [(r["step"], r["loss"], r["scale"]) for r in rows(runs / "ref" / "metrics.jsonl")]
    got = [(r["step"], r["loss"], r["scale"]) for r in rows(copy / "metrics.jsonl")]
    assert got == ref  # continued from step 6 and finished as the uninterrupted run
    # the unreadable checkpoint is set aside with the history after step 6, not deleted
    (branch,) = (copy / "branches").iterdir()
    assert (branch / "checkpoints" / "step_00000008.pt").stat().st_size == cut


def test_no_loadable_checkpoint_is_one_line_exit_2(tmp_path):
    runs = tmp_path / "runs"
    done = ampctl_here("train", *TINY, f"trainer.runs_dir={runs}", *RUN, "--name", "r")
    assert done.exit_code == 0, done.output
    for p in list_checkpoints(runs / "r" / "checkpoints"):
        p.write_bytes(b"")  # zeroed
    res = ampctl_here("train", "--resume", str(runs / "r"), "--quiet")
    assert res.exit_code == 2
    assert "none of its 3 checkpoint(s) can be read back" in res.output
    assert res.output.count("\n") == 1
