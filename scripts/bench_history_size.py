"""``ampctl diagnose`` on histories of the sizes users run: a 10^6-row ``metrics.jsonl`` (~500 MB,
an ampctl run folder) and a 10^5-entry ``trainer_state.json`` (an HF Trainer checkpoint), each
diagnosed in a subprocess; wall time, peak RSS and lines (entries) per second, and the ratio to
a bare ``json.loads`` loop over the same file in this process (the floor any reader pays).

    python scripts/bench_history_size.py [--rows 1000000] [--entries 100000] [--keep DIR]

The run folder starts as a real one: a tiny ``ampctl train`` of a few steps (its config.yaml,
events.jsonl, summary.json and its metrics rows with ampctl's own keys); its checkpoints are
removed (the folder is then judged on its whole history, as a ProtectedRun folder is) and its
metrics.jsonl is extended to ``--rows`` rows with the last row's keys, a falling loss with
per-batch noise, a scale that grows every 2000 steps and an isolated skipped step now and then.
A broken twin of each (a NaN planted at 90% of the history, to the end) must come out broken.
The big files are deleted at the end (unless ``--keep``).

Goal (issue #35): <= 60 s and <= 1 GB peak RSS for 10^6 rows on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = [
    "trainer.max_steps=8",
    "trainer.log_every=1",
    "trainer.ckpt_every=8",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.vocab_size=64",
    "model.hidden_size=32",
    "model.ffn_size=64",
    "model.num_heads=2",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


#: Runs ``python -m ampctl ARGS`` and writes its own peak RSS (VmHWM of /proc/self/status: the
#: process's own memory; a child's ru_maxrss would start at this process's RSS at the fork).
WRAP = """
import atexit, os, runpy, sys
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(os.environ["HWM_FILE"], "w").write(line.split()[1])
atexit.register(hwm)
sys.argv = ["ampctl", *sys.argv[1:]]
runpy.run_module("ampctl", run_name="__main__")
"""


def run_child(args: list[str], cwd: Path | None = None) -> tuple[int, float, float, str]:
    """(exit code, wall seconds, its own peak RSS in MB, stdout) of ``ampctl ARGS`` run in a
    subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        hwm = Path(tmp) / "hwm"
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-c", WRAP, *args],
            cwd=cwd,
            env={**_env(), "HWM_FILE": str(hwm)},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - t0
        rss = int(hwm.read_text()) / 1024 if hwm.exists() else math.nan
    return p.returncode, wall, rss, p.stdout.decode("utf-8", errors="replace")


def real_run(root: Path) -> Path:
    """A real run folder from a tiny ``ampctl train``."""
    code, wall, _rss, _ = run_child(["train", *TRAIN, f"trainer.runs_dir={root}"], cwd=root)
    if code != 0:
        raise SystemExit(f"ampctl train failed ({code})")
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    print(f"real run folder from ampctl train: {run.name} ({wall:.1f} s)")
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    return run


def extend_metrics(run: Path, rows: int, nan_from: int | None = None) -> int:
    """metrics.jsonl extended to ``rows`` rows, after the real ones, with their keys."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    real = [json.loads(x) for x in lines if x.strip()]
    last = dict(real[-1])
    rng = random.Random(0)
    start = int(last["step"]) + 1
    skipped = int(last.get("skipped") or 0)
    scale = float(last.get("scale") or 1024.0)
    base_loss = float(last["loss"])
    t0 = float(last.get("elapsed_s") or 0.0)
    with open(run / "metrics.jsonl", "w") as f:
        for x in lines:
            f.write(x + "\n")
        for i, step in enumerate(range(start, start + rows - len(real))):
            r = dict(last)
            frac = i / rows
            bad = nan_from is not None and step >= nan_from
            if bad:
                skipped += 1
                r.update(loss="nan", grad_norm="nan", consecutive_overflows=step - nan_from + 1)
            else:
                if i % 2000 == 1999:
                    scale = min(scale * 2, 2.0**24)
                if rng.random() < 2e-4:  # an isolated overflow: skipped, the scale halved
                    skipped += 1
                    scale /= 2
                loss = (base_loss - 1.5) * math.exp(-4 * frac) + 1.5 + 0.05 * rng.gauss(0, 1)
                r.update(
                    loss=max(loss, 0.01),
                    grad_norm=abs(1.0 + 0.2 * rng.gauss(0, 1)),
                    grad_amax=abs(0.05 + 0.01 * rng.gauss(0, 1)),
                    consecutive_overflows=0,
                )
            r.update(step=step, skipped=skipped, scale=scale, elapsed_s=t0 + 0.05 * i)
            f.write(json.dumps(r) + "\n")
    if nan_from is not None:
        s = json.loads((run / "summary.json").read_text())
        s["status"] = "aborted"
        (run / "summary.json").write_text(json.dumps(s))
    return rows


def trainer_state(ckpt: Path, entries: int, nan_from: int | None = None) -> None:
    """An HF Trainer checkpoint folder: tiny weights and a trainer_state.json of ``entries``
    log entries (logging_steps=1), as the Trainer writes it (indent=2, sorted keys)."""
    import torch

    ckpt.mkdir(parents=True)
    torch.save({"w": torch.zeros(4)}, ckpt / "pytorch_model.bin")
    rng = random.Random(1)
    log = []
    for i in range(1, entries + 1):
        e = {
            "epoch": i / entries,
            "grad_norm": abs(1.0 + 0.2 * rng.gauss(0, 1)),
            "learning_rate": 5e-5 * (1 - i / entries),
            "loss": 1.5 + 2.0 * math.exp(-4 * i / entries) + 0.05 * rng.gauss(0, 1),
            "step": i,
        }
        if nan_from is not None and i >= nan_from:
            e.update(loss=0.0, grad_norm=math.nan)  # the Trainer's NaN filter
        log.append(e)
    state = {"epoch": 1.0, "global_step": entries, "log_history": log, "max_steps": entries}
    (ckpt / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))


def bare_jsonl(path: Path) -> float:
    """Seconds of a bare ``json.loads`` of every line (the floor of any JSONL reader)."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        for line in f:
            json.loads(line)
    return time.perf_counter() - t0


def bare_json(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        json.load(f)
    return time.perf_counter() - t0


def diagnose(path: Path) -> tuple[int, float, float, dict]:
    code, wall, rss, out = run_child(["diagnose", str(path), "--json", "--device", "cpu"])
    try:
        rep = json.loads(out)
    except json.JSONDecodeError:
        rep = {}
    return code, wall, rss, rep


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--keep", type=Path, default=None)
    a = ap.parse_args()
    root = a.keep or Path(tempfile.mkdtemp(prefix="ampctl-hist-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    table = []
    try:
        (root / "runs").mkdir()
        run = real_run(root / "runs")
        # the baseline: the real folder as it came (its few rows): what starting diagnose costs
        code, wall, rss, rep = diagnose(run)
        n = sum(1 for _ in open(run / "metrics.jsonl"))
        status = (rep.get("verdict") or {}).get("status")
        size = (run / "metrics.jsonl").stat().st_size
        table.append(("the real run (baseline)", n, size, wall, rss, n / wall, 0.0, status, "ok"))
        twin = root / "broken-run"
        shutil.copytree(run, twin)
        t0 = time.perf_counter()
        extend_metrics(run, a.rows)
        extend_metrics(twin, a.rows, nan_from=int(0.9 * a.rows))
        size = (run / "metrics.jsonl").stat().st_size
        print(
            f"wrote 2 x {a.rows:,} rows ({size / 1e6:.0f} MB each) in "
            f"{time.perf_counter() - t0:.0f} s"
        )
        hf_ok, hf_bad = root / "hf" / "checkpoint-ok", root / "hf-bad" / "checkpoint-bad"
        trainer_state(hf_ok, a.entries)
        trainer_state(hf_bad, a.entries, nan_from=int(0.9 * a.entries))
        cases = [
            ("metrics.jsonl", run, run / "metrics.jsonl", a.rows, 0, bare_jsonl),
            ("metrics.jsonl, NaN at 90%", twin, twin / "metrics.jsonl", a.rows, 1, bare_jsonl),
            ("trainer_state.json", hf_ok, hf_ok / "trainer_state.json", a.entries, 0, bare_json),
            (
                "trainer_state.json, NaN at 90%",
                hf_bad,
                hf_bad / "trainer_state.json",
                a.entries,
                1,
                bare_json,
            ),
        ]
        for name, path, file, n, want, bare in cases:
            floor = bare(file)
            code, wall, rss, rep = diagnose(path)
            status = (rep.get("verdict") or {}).get("status")
            ok = "ok" if code == want else f"WRONG (exit {code}, wanted {want})"
            table.append((name, n, file.stat().st_size, wall, rss, n / wall, floor, status, ok))
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(
        "| history | rows | size | diagnose wall | peak RSS | rows/s past the baseline | "
        "bare json.loads | its time / diagnose's | verdict |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    start = table[0][3] if table else 0.0
    for name, n, size, wall, rss, _rate, floor, status, ok in table:
        past = f"{n / (wall - start):,.0f}" if floor and wall > start else "-"
        ratio = f"{floor / wall:.2f}x" if floor else "-"
        print(
            f"| {name} | {n:,} | {size / 1e6:.1f} MB | {wall:.1f} s | {rss:.0f} MB | "
            f"{past} | {floor:.1f} s | {ratio} | {status} ({ok}) |"
        )
    return 0 if all(r[-1] == "ok" for r in table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
