"""The README's corpus table (kinds x formats, the verdict of each case), from the corpus.

    python -m tests.commands.diagnose.corpus.table               # write every run, diagnose
                                                                 # every case, print the table
    python -m tests.commands.diagnose.corpus.table --write README.md   # ... and put it there
    python -m tests.commands.diagnose.corpus.table --root DIR    # keep the runs in DIR

Exit code 1 when a verdict differs from its case's (the table is not written then).
``tests/commands/diagnose/test_corpus.py`` checks that README's table is :func:`table` of the
corpus.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from .cases import CASES, FORMATS, KINDS, Case, Corpus, mismatches, missing_library

BEGIN = "<!-- corpus-table: python -m tests.commands.diagnose.corpus.table --write README.md -->"
END = "<!-- /corpus-table -->"


def cell(case: Case) -> str:
    """One case's verdict as a table cell: ``name``: exit code, the first problem's kind (or
    healthy / recovered), the resume checkpoint, the keys the advice sets."""
    e = case.expect
    what = f"`{e.kind}`" if e.kind else e.status
    resume = e.resume.rsplit("/", 1)[-1] if e.resume else "none"
    advice = f", sets {' '.join(f'`{k}`' for k in sorted(e.advice))}" if e.advice else ""
    return f"{case.name.split('/', 1)[1]}: {e.exit} {what}, resume {resume}{advice}"


def table(cases: tuple[Case, ...] = CASES) -> str:
    """The markdown table of the cases' verdicts (kinds x formats)."""
    head = "| kind | " + " | ".join(FORMATS) + " |"
    rule = "| --- |" + " --- |" * len(FORMATS)
    rows = [head, rule]
    for kind in KINDS:
        cells = []
        for fmt in FORMATS:
            mine = [c for c in cases if c.kind == kind and c.fmt == fmt]
            cells.append("<br>".join(cell(c) for c in mine) or "")
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    broken = sum(1 for c in cases if c.expect.status == "broken")
    twins = len(cases) - broken
    rows.append("")
    rows.append(
        f"Each cell: case: exit code, the first problem's kind (or healthy / recovered), the "
        f"checkpoint to resume from, the keys the advice sets. {len(cases)} cases, {broken} "
        f"broken runs and {twins} healthy twins or recovered runs (any problem there is a false "
        "alarm)."
    )
    return "\n".join(rows)


def replace_block(text: str, block: str) -> str:
    """``text`` with the table between :data:`BEGIN` and :data:`END` replaced by ``block``."""
    start, end = text.index(BEGIN), text.index(END)
    return text[: start + len(BEGIN)] + "\n" + block + "\n" + text[end:]


def readme_block(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END)
    return text[start + len(BEGIN) : end].strip("\n")


def run_all(root: Path, *, out=sys.stdout) -> int:
    """Diagnose every case (writing the runs into ``root``); the number of wrong verdicts."""
    corpus = Corpus(root)
    wrong = 0
    for case in CASES:
        lib = missing_library(case.run)
        if lib is not None:
            print(f"SKIP {case.name}: needs {lib}", file=out)
            continue
        t0 = time.perf_counter()
        target = corpus.target(case)
        args = ["--trust-code"] if case.trust_code else []
        code, report, err = corpus.diagnose(target, *args)
        bad = mismatches(case, code, report, corpus) if report else [f"exit {code}: {err}"]
        wrong += bool(bad)
        took = time.perf_counter() - t0
        print(
            f"{'ok  ' if not bad else 'WRONG'} {case.name} ({took:.1f} s) {'; '.join(bad)}",
            file=out,
        )
    return wrong


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.commands.diagnose.corpus.table")
    ap.add_argument("--root", type=Path, help="write the runs here (default: a temporary folder)")
    ap.add_argument("--write", type=Path, help="replace the table in this README")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp)
        wrong = run_all(root, out=sys.stderr)
    if wrong:
        print(f"{wrong} verdict(s) differ from the corpus: table not written", file=sys.stderr)
        return 1
    block = table()
    if args.write is not None:
        args.write.write_text(replace_block(args.write.read_text(), block))
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
