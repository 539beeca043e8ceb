"""``ampctl train --name x`` twice at once: the two processes are held at one line and let go
together, so both reach the folder's creation at the same moment. Exactly one creates and owns
it (the folder is made with one ``mkdir``, atomic on every filesystem) and trains to its end;
the other is refused with one line and exit code 2 before it writes anything, so nothing in the
folder interleaves."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.faults.conftest import TINY, env, rows

# waits for the go file, then runs the CLI as `ampctl` would (torch imported before the wait)
HELD = """
import sys, time
from pathlib import Path
import torch  # noqa: F401  (the slow import happens before the start line)
from ampctl.cli import app
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.002)
app(sys.argv[2:], prog_name="ampctl")
"""


def test_two_trains_with_one_name_at_once_one_owns_the_folder(tmp_path):
    runs, go = tmp_path / "runs", tmp_path / "go"
    args = ["train", *TINY, f"trainer.runs_dir={runs}", "trainer.max_steps=6"]
    args += ["trainer.log_every=1", "--name", "x", "--quiet"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HELD, str(go), *args],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(0.5)
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    (err,) = [e for p, (_, e) in zip(procs, outs, strict=True) if p.returncode == 2]
    assert err == (
        f"ampctl: error: run folder {str(runs / 'x')!r} exists already: pick another --name, "
        f"or continue it with --resume {runs / 'x'}\n"
    )
    # one run's rows, each once, in order: nothing interleaved
    assert [r["step"] for r in rows(runs / "x" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in runs.iterdir()) == ["x"]
