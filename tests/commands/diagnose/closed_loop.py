"""The closed loop of #36: for each broken case of the corpus whose advice diagnose tries (its
own ``ampctl train`` runs, and the HF Trainer's folders with ``config.json``), diagnose it,
follow what it printed, and compare the run's final loss with its healthy twin's at the same
step. An ampctl case pastes the ``Resume:`` line; an HF case reruns the corpus's own Trainer
script with the printed ``yours:`` changes (``TrainingArguments(...)``, a module run in fp32)
from the ``trainer.train(resume_from_checkpoint=...)`` the Resume line names, or afresh. A fault
planted to make a case (a weight multiplied at a step) stands in for an event of the run and is
not planted again, as the ampctl cases' Resume lines do not plant it.

    python -m tests.commands.diagnose.closed_loop [OUT_DIR]     # prints README's table

``tests/commands/diagnose/test_closed_loop.py`` asserts every row holds: the run ends ``ok``
with a final loss within :data:`TOLERANCE` of the twin's.
"""

from __future__ import annotations

import json
import re
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

#: The broken cases whose advice is tried and followed (an ``ampctl train`` run, fp8 needs
#: torchao; an HF Trainer folder; the HF forward overflow is a slow case of the corpus).
RERUNNABLE = (
    "ampctl/lr",
    "ampctl/forward-overflow",
    "ampctl/floor",
    "ampctl/underflow",
    "ampctl/fp8-saturated",
    "hf/lr-1.0",
    "hf/lr-0.3",
    "hf/lr-0.3-ckpt20",
    "hf/backward-nan",
    "hf/backward-nan-ckpt30",
    "hf/forward-overflow",
)


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
    if case.fmt == "HF Trainer":
        return _close_hf(corpus, name, work)
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


#: The printed changes an HF case follows: the numbers of ``TrainingArguments(key=value)`` (the
#: optim.* overrides; a precision change is not part of a resume, as ampctl's Resume line).
_ARG = re.compile(r"yours: TrainingArguments\((\w+)=([0-9.e-]+)\)")
_FP32 = re.compile(r"yours: run (\S+) in fp32")


def _close_hf(corpus: Corpus, name: str, work: Path) -> Loop:
    """An HF case: diagnose the folder, rerun the corpus's Trainer script with what was printed
    (the twin's settings, the ``yours:`` changes, the Resume line's checkpoint)."""
    from .corpus import hf

    case = BY_NAME[name]
    got = CliRunner().invoke(app, ["diagnose", str(corpus.target(case))], env={"COLUMNS": "400"})
    resume = _printed(got.output, "Resume: ")
    probe = next((ln.strip() for ln in got.output.splitlines() if "probe" in ln[:12]), None)
    assert resume is not None, got.output
    args = {k: float(v) for k, v in _ARG.findall(got.output)}
    lr = args.pop("learning_rate", None)
    args = {k: int(v) if k.endswith("steps") else v for k, v in args.items()}
    where = re.search(r'resume_from_checkpoint="([^"]+)"', resume)
    out = work / name.replace("/", "-")
    if out.exists():
        shutil.rmtree(out)
    hf.trainer_run(
        out,
        **({"lr": lr} if lr is not None else {"lr": _RUN_LR.get(case.run, 1e-3)}),
        resume=Path(where.group(1)) if where else None,
        fp32_modules=tuple(m for ms in _FP32.findall(got.output) for m in ms.split(",")),
        **args,
    )
    mine, twin = _hf_losses(out), _hf_losses(corpus.run(BY_NAME[case.twin].run))
    step = max(mine) if mine else None
    return Loop(
        name, resume, probe, "ok" if mine else "no rows", mine.get(step), twin.get(step), step
    )


#: The lr each HF run was written with (the corpus's ``hf.RUNS``), kept when no lr is advised.
_RUN_LR = {"hf-lr-1.0": 1.0, "hf-lr-0.3": 0.3}


def _hf_losses(output_dir: Path) -> dict[int, float]:
    """The logged loss per step of an HF output_dir (its newest checkpoint's trainer_state)."""
    from ampctl.commands.diagnose.readers.hf import checkpoints_of

    state = checkpoints_of(output_dir)[0] / "trainer_state.json"
    rows = json.loads(state.read_text())["log_history"]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


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
