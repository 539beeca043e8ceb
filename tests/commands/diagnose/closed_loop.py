"""The closed loop of #36: for each broken case of the corpus that ampctl can rerun (its own
``ampctl train`` runs), diagnose it, paste the ``Resume:`` line as printed, run it, and compare
the run's final loss with its healthy twin's at the same step.

    python -m tests.commands.diagnose.closed_loop [OUT_DIR]     # prints README's table

``tests/commands/diagnose/test_closed_loop.py`` asserts every row holds: the run ends ``ok``
with a final loss within :data:`TOLERANCE` of the twin's.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from ampctl.cli import app

from .corpus.cases import BY_NAME, Corpus

#: A resumed run's final loss may be this much above its twin's (relative).
TOLERANCE = 0.10

#: The broken cases ampctl can rerun (an ``ampctl train`` run; fp8 needs torchao).
RERUNNABLE = ("ampctl/lr", "ampctl/forward-overflow", "ampctl/floor", "ampctl/underflow")


@dataclass
class Loop:
    case: str
    resume: str  # the Resume line as printed
    probe: str | None  # diagnose's probe line
    status: str
    final: float | None
    twin: float | None
    step: int | None

    @property
    def held(self) -> bool:
        return (
            self.status == "ok"
            and self.final is not None
            and self.twin is not None
            and self.final <= (1 + TOLERANCE) * self.twin
        )


def _printed(out: str, head: str) -> str | None:
    lines = [ln for ln in out.splitlines() if ln.startswith(head)]
    return lines[-1][len(head) :].strip() if lines else None


def _rows(run: Path) -> list[dict]:
    p = run / "metrics.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []


def close_loop(corpus: Corpus, name: str, work: Path) -> Loop:
    """Diagnose a copy of the case's run (the resume sets history aside in its folder), run its
    Resume line from ``work`` (relative paths as printed), and the twin's loss at the step the
    resumed run ended at."""
    case = BY_NAME[name]
    src = corpus.run(case.run)
    run = work / src.name
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(src, run)
    cli = CliRunner()
    got = cli.invoke(app, ["diagnose", str(run)], env={"COLUMNS": "400"})
    resume = _printed(got.output, "Resume: ")
    probe = next((ln.strip() for ln in got.output.splitlines() if "probe" in ln[:12]), None)
    assert resume is not None and resume.startswith("ampctl train"), got.output
    argv = shlex.split(resume.split("   #", 1)[0])[2:]  # "ampctl train" ... (a comment after)
    runs_dir = Path(json.loads((run / "summary.json").read_text())["run_dir"]).parent
    before = set(runs_dir.iterdir()) if runs_dir.is_dir() else set()
    trained = cli.invoke(app, ["train", "--quiet", *argv], env={"COLUMNS": "400"})
    summary_dir = run
    if "--resume" not in argv:  # a fresh start: the new folder under the run's runs_dir
        new = sorted(set(runs_dir.iterdir()) - before)
        assert new, trained.output
        summary_dir = new[-1]
    summary = json.loads((summary_dir / "summary.json").read_text())
    step = summary.get("steps")
    twin_rows = _rows(corpus.run(BY_NAME[case.twin].run))
    twin = next((r["loss"] for r in twin_rows if r["step"] == step), None)
    final = summary.get("final_loss")
    final = final if isinstance(final, int | float) else None
    del trained
    return Loop(name, resume, probe, summary["status"], final, twin, step)


def table(loops: list[Loop]) -> str:
    out = [
        "| case | Resume line (as printed) | final loss | twin's | held |",
        "|---|---|---|---|---|",
    ]
    for x in loops:
        fin = f"{x.final:.4g}" if x.final is not None else "-"
        twin = f"{x.twin:.4g}" if x.twin is not None else "-"
        out.append(
            f"| {x.case} | `{x.resume}` | {fin} ({x.status}, step {x.step}) | {twin} | "
            f"{'yes' if x.held else 'NO'} |"
        )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    import tempfile

    import torch

    torch.set_num_threads(1)
    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="closed-loop-"))
    corpus = Corpus(root / "corpus")
    (root / "corpus").mkdir(parents=True, exist_ok=True)
    work = root / "work"
    work.mkdir(exist_ok=True)
    loops = []
    for n in RERUNNABLE:
        loops.append(close_loop(corpus, n, work))
        print(loops[-1], flush=True)
    print(table(loops))
    for x in loops:
        print(f"{x.case}: {x.probe}")
    return 0 if all(x.held for x in loops) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
