"""A full disk at a write, made real with a file size limit (``RLIMIT_FSIZE`` in the child: the
kernel refuses the write with EFBIG as a full disk does with ENOSPC). The run stops at the
failing write with one line naming the file and the cause, exit code 1 (a run that could not
finish; 2 is bad input), no traceback; every file it wrote is whole (no half line in a JSONL, the
previous checkpoint loads); ``--resume`` once there is room ends at the uninterrupted run's loss."""

from __future__ import annotations

import json
import subprocess
import sys

from ampctl.train.checkpoint import list_checkpoints, load_checkpoint
from tests.faults.conftest import TINY, ampctl, ampctl_here, env, rows

RUN = ["trainer.max_steps=8", "trainer.log_every=2", "trainer.ckpt_every=2", "trainer.keep_last=10"]


def _one_failure_line(out) -> str:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if "could not write" in line]
    assert len(lines) == 1, text
    return lines[0]


def test_a_checkpoint_that_does_not_fit_stops_the_run_and_resume_finishes_it(tmp_path):
    runs = tmp_path / "runs"
    args = [*TINY, f"trainer.runs_dir={runs}", *RUN, "--quiet"]
    ref = ampctl_here("train", *args, "--name", "ref")
    assert ref.exit_code == 0, ref.output
    sizes = [p.stat().st_size for p in list_checkpoints(runs / "ref" / "checkpoints")]
    assert sizes[-1] > sizes[0] + 200  # the checkpoint grows with the run's history
    limit = (sizes[0] + sizes[-1]) // 2  # the first checkpoint fits, a later one does not
    out = ampctl("train", *args, "--name", "full", limit=limit)
    assert out.returncode == 1, out.stdout + out.stderr
    line = _one_failure_line(out)
    assert "checkpoint in" in line and "File too large" in line and "is intact" in line
    run = runs / "full"
    metrics, events = rows(run / "metrics.jsonl"), rows(run / "events.jsonl")
    assert events[-1]["kind"] == "error" and "File too large" in events[-1]["message"]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    kept = list_checkpoints(run / "checkpoints")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [p.name for p in kept]
    last = load_checkpoint(kept[-1])  # the previous checkpoint loads
    assert 2 <= last["step"] < 8 and metrics[-1]["step"] > last["step"] - 2
    # room again: the resume continues from that checkpoint to the uninterrupted run's end
    res = ampctl_here("train", "--resume", str(run), "--quiet")
    assert res.exit_code == 0, res.output
    want = [(r["step"], r["loss"], r["scale"]) for r in rows(runs / "ref" / "metrics.jsonl")]
    assert [(r["step"], r["loss"], r["scale"]) for r in rows(run / "metrics.jsonl")] == want
    final = json.loads((run / "summary.json").read_text())
    assert (
        final["final_loss"] == json.loads((runs / "ref" / "summary.json").read_text())["final_loss"]
    )


def test_a_metrics_row_that_does_not_fit_stops_the_run_with_whole_lines(tmp_path):
    runs = tmp_path / "runs"
    args = [*TINY, f"trainer.runs_dir={runs}", "trainer.max_steps=8", "trainer.log_every=1"]
    args += ["trainer.ckpt_every=100", "--quiet"]  # a checkpoint (55 KB) only at the end
    limit = 2600  # config.yaml (~2 KB) fits; metrics.jsonl (~500 B a row) reaches it at row 5
    out = ampctl("train", *args, "--name", "m", limit=limit)
    assert out.returncode == 1, out.stdout + out.stderr
    run = runs / "m"
    line = _one_failure_line(out)
    assert f"could not write {run / 'metrics.jsonl'} at step " in line
    assert "File too large" in line
    got = rows(run / "metrics.jsonl")  # whole rows only
    step = int(line.split(" at step ")[1].split(":")[0])
    assert [r["step"] for r in got] == list(range(1, step))
    assert (run / "metrics.jsonl").stat().st_size <= limit
    assert rows(run / "events.jsonl")[-1]["kind"] == "error"


APPEND = """
import json, resource, sys
from pathlib import Path
from ampctl.runlog import RunWriter
run = Path(sys.argv[1])
w = RunWriter(run)
w.summary({"status": "ok", "steps": 1})
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
n = 0
try:
    while True:
        w.event({"step": n, "kind": "warning", "message": "x" * 90})
        n += 1
except OSError as e:
    print(json.dumps({"written": n, "error": str(e), "file": e.filename}))
try:
    w.summary({"status": "failed", "steps": 2, "pad": "y" * 2000})
except OSError as e:
    print(json.dumps({"summary_error": str(e), "file": e.filename}))
"""


def test_an_append_is_a_whole_line_or_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", APPEND, str(run)], env=env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert first["file"] == str(run / "events.jsonl") and "File too large" in first["error"]
    events = rows(run / "events.jsonl")  # the row that did not fit left nothing behind
    assert len(events) == first["written"] > 0
    assert [e["step"] for e in events] == list(range(first["written"]))
    assert second["file"] == str(run / "summary.json")
    assert json.loads((run / "summary.json").read_text()) == {"status": "ok", "steps": 1}
    assert sorted(p.name for p in run.iterdir()) == ["events.jsonl", "summary.json"]  # no temp


def test_a_summary_that_cannot_be_written_is_exit_1_and_a_resume_writes_it(tmp_path):
    """A real failing write without a size limit: the summary's name is taken by a folder
    (EISDIR), so the writer's rename onto it fails after its temp file was written."""
    runs = tmp_path / "runs"
    args = [*TINY, f"trainer.runs_dir={runs}", "trainer.max_steps=4", "trainer.log_every=2"]
    done = ampctl_here("train", *args, "trainer.ckpt_every=2", "--name", "s", "--quiet")
    assert done.exit_code == 0, done.output
    run = runs / "s"
    ok = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    res = ampctl_here("train", "--resume", str(run), "--quiet")  # at the end: only the summary
    assert res.exit_code == 1, res.output
    (line,) = [x for x in res.output.splitlines() if x.startswith("Run folder incomplete: ")]
    assert "summary.json not written: Is a directory" in line
    assert f"ampctl train --resume {run} writes the summary" in line
    assert (run / "summary.json").is_dir() and not list((run / "summary.json").iterdir())
    assert not [p for p in run.iterdir() if p.name.startswith(".summary.json")]  # no temp left
    (run / "summary.json").rmdir()  # the folder can take it again
    again = ampctl_here("train", "--resume", str(run), "--quiet")
    assert again.exit_code == 0, again.output
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["final_loss"]) == (
        "ok",
        4,
        ok["final_loss"],
    )
