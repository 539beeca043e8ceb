"""Resuming never destroys a run's history: branches set aside, forks into new folders."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.runlog import (
    RunLayout,
    fork_into,
    list_branches,
    prepare_resume,
    read_jsonl,
)
from ampctl.runlog.branches import split_lines
from ampctl.train.checkpoint import load_checkpoint
from tests.conftest import FAST


def _fake_run(root: Path, steps=(10, 20, 30), rows_to=30) -> RunLayout:
    lay = RunLayout(root)
    lay.checkpoints_dir.mkdir(parents=True)
    for s in steps:
        lay.checkpoint(s).write_bytes(f"ckpt {s}".encode())
    lay.metrics.write_text(
        "".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, rows_to + 1))
    )
    lay.events.write_text(
        json.dumps({"step": 5, "kind": "overflow"})
        + "\n"
        + "{cut by a crash\n"
        + json.dumps({"step": 25, "kind": "rollback"})
        + "\n"
    )
    lay.summary.write_text(json.dumps({"status": "ok", "steps": rows_to}))
    lay.config.write_text("trainer:\n  max_steps: 30\n")
    return lay


def test_resume_from_an_earlier_checkpoint_sets_the_later_history_aside(tmp_path):
    lay = _fake_run(tmp_path / "x")
    before = {p: p.read_bytes() for p in (lay.metrics, lay.events)}
    info = prepare_resume(lay, lay.checkpoint(10), 10)
    assert info is not None and info.forked_at_step == 10 and info.last_step == 30 and info.complete
    arch = RunLayout(info.path)
    assert info.path == lay.branches_dir / "001-step10"
    # the main line now ends at step 10 and its newest checkpoint is step 10
    assert [r["step"] for r in read_jsonl(lay.metrics)] == list(range(1, 11))
    assert [p.name for p in lay.checkpoints()] == ["step_00000010.pt"]
    assert not lay.summary.exists() and lay.config.exists()
    # nothing is lost: main + archive hold every line of the original files, in order
    for main, archived, orig in (
        (lay.metrics, arch.metrics, before[lay.metrics]),
        (lay.events, arch.events, before[lay.events]),
    ):
        assert main.read_text() + archived.read_text() == orig.decode()
    assert [p.name for p in arch.checkpoints()] == ["step_00000020.pt", "step_00000030.pt"]
    assert arch.checkpoint(30).read_bytes() == b"ckpt 30"
    assert json.loads(arch.summary.read_text())["steps"] == 30
    # a second fork gets the next number; both are listed oldest first
    info2 = prepare_resume(lay, lay.checkpoint(10), 5)
    assert info2.path.name == "002-step5"
    assert [b.name for b in list_branches(lay)] == ["001-step10", "002-step5"]


def test_resume_from_the_newest_checkpoint_only_drops_the_crash_tail(tmp_path):
    lay = _fake_run(tmp_path / "x", steps=(10, 20), rows_to=27)  # crashed at 27
    assert prepare_resume(lay, lay.checkpoint(20), 20) is None
    assert [r["step"] for r in read_jsonl(lay.metrics)][-1] == 20
    assert not lay.branches_dir.exists() and lay.summary.exists()


def test_a_bad_line_goes_with_its_neighbour_and_is_never_dropped(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{bad\n{"step": 9}\nnot json\n')
    keep, later = split_lines(p, 5)
    assert keep == ['{"step": 1}', "{bad"] and later == ['{"step": 9}', "not json"]
    rows = read_jsonl(p)
    assert [r["step"] for r in rows] == [1, 9] and rows.bad_lines == [2, 4]
    assert rows.note(p) == f"{p}: skipped 2 unreadable line(s) (2, 4)"


def test_fork_into_a_new_folder_leaves_the_parent_untouched(tmp_path):
    parent = _fake_run(tmp_path / "x")
    snapshot = {p: p.read_bytes() for p in parent.root.rglob("*") if p.is_file()}
    new = RunLayout(tmp_path / "y")
    new.root.mkdir()
    got = fork_into(new, parent.checkpoint(20), 20)
    assert got == parent
    assert {p: p.read_bytes() for p in parent.root.rglob("*") if p.is_file()} == snapshot
    assert json.loads(new.parent.read_text())["step"] == 20
    assert [r["step"] for r in read_jsonl(new.metrics)] == list(range(1, 21))


def _ampctl(cwd: Path, *args: str) -> SimpleNamespace:
    """``ampctl train ARGS`` run from ``cwd``, in this process (the CLI's own code path; a
    process start per call would only add torch's import time)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, ["train", *args])
    finally:
        os.chdir(here)
    return SimpleNamespace(returncode=r.exit_code, stderr=r.stderr)


def test_resume_branches_end_to_end(tmp_path):
    """The measurement of issue 21 at small scale: a finished run, a resume from an earlier
    checkpoint, then --resume RUN_DIR continues the new branch, not the stale one."""
    common = [*FAST, "trainer.runs_dir=runs", "trainer.keep_last=10", "logging.plot=false", "-q"]
    first = _ampctl(
        tmp_path, *common, "trainer.max_steps=18", "trainer.ckpt_every=6", "--name", "x"
    )
    assert first.returncode == 0, first.stderr
    run = RunLayout(tmp_path / "runs" / "x")
    original_rows = run.metrics.read_text()
    r = _ampctl(tmp_path, "--resume", str(run.checkpoint(6)), "trainer.max_steps=8", "-q")
    assert r.returncode == 0, r.stderr
    (branch,) = list_branches(run)
    assert branch.forked_at_step == 6 and branch.last_step == 18
    arch = RunLayout(branch.path)
    # every row of the original run is on disk, once
    kept = [line for line in run.metrics.read_text().splitlines() if json.loads(line)["step"] <= 6]
    assert "\n".join(kept + arch.metrics.read_text().splitlines()) + "\n" == original_rows
    assert [p.name for p in arch.checkpoints()] == ["step_00000012.pt", "step_00000018.pt"]
    assert json.loads(arch.summary.read_text())["steps"] == 18
    assert [e["kind"] for e in read_jsonl(run.events) if e["kind"] == "branch"] == ["branch"]
    # plot names the line it draws and overlays the set-aside branch
    from ampctl.commands.plot import build_run_figure

    fig = build_run_figure(run.root)
    assert "main line (resumed from step 6; 1 set-aside branch(es)" in fig._suptitle.get_text()
    gids = {line.get_gid() for ax in fig.axes for line in ax.lines}
    assert "branch:001-step6" in gids
    fig = build_run_figure(branch.path)
    assert "archived branch 001-step6 of" in fig._suptitle.get_text()
    # the newest branch is the main line: --resume RUN_DIR continues from step 8, trains 2 steps
    r = _ampctl(tmp_path, "--resume", str(run.root), "trainer.max_steps=10", "-q")
    assert r.returncode == 0, r.stderr
    assert load_checkpoint(run.root)["step"] == 10
    assert [row["step"] for row in read_jsonl(run.metrics)][-1] == 10
    # a checkpoint of the archived branch is refused without --name, and forks with it
    r = _ampctl(tmp_path, "--resume", str(arch.checkpoint(18)), "trainer.max_steps=20", "-q")
    assert (
        r.returncode == 2 and "archived branch 001-step6" in r.stderr and "--name NEW" in r.stderr
    )
    assert "Traceback" not in r.stderr
    r = _ampctl(
        tmp_path, "--resume", str(arch.checkpoint(18)), "trainer.max_steps=20", "--name", "y", "-q"
    )
    assert r.returncode == 0, r.stderr
    y = RunLayout(tmp_path / "runs" / "y")
    assert json.loads(y.parent.read_text())["step"] == 18
    # its history: the main line to step 6, the archived branch to 18, then its own steps
    assert [row["step"] for row in read_jsonl(y.metrics)] == [4, 8, 12, 16, 18, 20]
    assert load_checkpoint(y.root)["step"] == 20
