"""`ampctl plot` on a run of 10^6 logged rows: wall time and peak RSS (issue #35).

    python scripts/bench_plot_size.py                    # 10^6 rows (~560 MB), then deleted
    python scripts/bench_plot_size.py --rows 200000 --keep-png /tmp/big.png

What it does, in one process:

1. trains a real tiny run (``ampctl train``, 8 fp16 steps) to take the keys and value types of
   real metrics rows and its summary;
2. writes a run folder whose ``metrics.jsonl`` extends those rows to ``--rows`` rows (a decaying
   noisy loss with a few spikes, a loss scale that grows and halves at skipped steps, a
   cumulative ``skipped`` counter with a burst, gradient norms with spikes), an ``events.jsonl``
   with an overflow event per skipped step, three rollbacks (the rows after each go back and
   replay, as a real rollback logs them) and a promotion;
3. times a bare streaming parse of that metrics.jsonl in this process (``for line in f:
   json.loads(line)``: the least any reader must do) as the baseline;
4. runs ``ampctl plot RUN --out PNG`` in a subprocess and reports its wall time, its peak RSS
   (``os.wait4``: that process alone) and the ratio of its time to the bare parse;
5. deletes the folder (the PNG too unless ``--keep-png``).

Goal (#35): <= 60 s and <= 1 GB RSS on 2 cores at 10^6 rows.
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

TINY = [
    "trainer.max_steps=8",
    "trainer.log_every=4",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.vocab_size=64",
    "model.hidden_size=32",
    "model.ffn_size=64",
    "model.num_heads=2",
]


def tiny_run(root: Path) -> Path:
    """A real ``ampctl train`` run folder (seconds): the template of every row written."""
    runs = root / "tiny"
    cmd = [sys.executable, "-m", "ampctl", "train", *TINY, f"trainer.runs_dir={runs}", "--quiet"]
    cmd.append("logging.plot=false")
    subprocess.run(
        cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    return run


def write_big_run(tiny: Path, out: Path, rows: int, log_every: int, seed: int = 0) -> dict:
    """The tiny run's folder with metrics.jsonl extended to ``rows`` rows; returns what was
    planted (skipped steps, spikes, rollbacks) for the report."""
    rng = random.Random(seed)
    out.mkdir(parents=True)
    shutil.copy(tiny / "config.yaml", out / "config.yaml")
    template = [json.loads(x) for x in (tiny / "metrics.jsonl").read_text().splitlines()][-1]
    ev_template = {"kind": "overflow", "message": "", "time": 0.0, "overflow": "gradient"}

    spikes = set(rng.sample(range(rows // 10, rows), 8))
    skip_rows = set(rng.sample(range(rows), max(1, rows // 2000)))
    burst = rows * 6 // 10  # a burst of skips: every row of a short stretch has some
    skip_rows |= set(range(burst, burst + 40))
    rollback_rows = {rows // 4, rows // 2, rows * 3 // 4}
    replay = 300  # rows a rollback goes back over
    scale, skipped, elapsed, grow = 65536.0, 0, 0.0, 0
    events: list[dict] = []
    n_rows = 0
    i = 0
    with open(out / "metrics.jsonl", "w") as f:
        while n_rows < rows:
            step = (i + 1) * log_every
            r = dict(template)
            loss = 1.0 + 3.0 * math.exp(-i / (rows / 3)) + rng.gauss(0.0, 0.04)
            gn = math.exp(rng.gauss(0.5, 0.2))
            if i in spikes:
                loss *= 3.0
                gn *= 40.0
            n_skip = 0
            if i in skip_rows:
                n_skip = rng.randint(1, 3)
                for k in range(n_skip):
                    scale = max(scale / 2.0, 1.0)
                    ev = dict(ev_template, step=step - log_every + 1 + k, scale=scale)
                    ev["message"] = f"gradient overflow, step skipped; scale now {scale:g}"
                    events.append(ev)
                grow = 0
            else:
                grow += log_every
                if grow >= 2000 and scale < 2.0**24:
                    scale, grow = scale * 2.0, 0
            skipped += n_skip
            elapsed += 0.05 * log_every
            r.update(
                step=step,
                loss=loss,
                scale=scale,
                skipped=skipped,
                overflow_rate=min(1.0, n_skip / log_every + rng.random() * 0.002),
                grad_norm=gn,
                grad_amax=gn / 10.0,
                grad_underflow_frac=abs(rng.gauss(0.0015, 0.0002)),
                act_grad_underflow_frac=abs(rng.gauss(0.3, 0.05)),
                elapsed_s=elapsed,
                max_steps=rows * log_every,
                lr=1e-3,
            )
            f.write(json.dumps(r) + "\n")
            n_rows += 1
            i += 1
            if i in rollback_rows and n_rows + replay < rows:
                rollback_rows.discard(i)
                back = i - replay
                events.append(
                    {"step": back * log_every, "kind": "rollback", "to_step": back * log_every,
                     "from_step": step, "message": "2 consecutive overflows: restored"}
                )  # fmt: skip
                i = back  # the replayed rows are logged again
    events.append({"step": rows * log_every // 3, "kind": "promotion", "module": "bert.pooler"})
    events.sort(key=lambda e: e["step"])
    with open(out / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    summary = json.loads((tiny / "summary.json").read_text())
    summary.update(steps=i * log_every, max_steps=rows * log_every, skipped=skipped,
                   final_scale=scale, run_dir=str(out))  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return {"skipped": skipped, "skip_rows": len(skip_rows), "spikes": len(spikes),
            "events": len(events)}  # fmt: skip


def bare_parse(path: Path) -> float:
    t = time.perf_counter()
    n = 0
    with open(path, "rb") as f:
        for line in f:
            json.loads(line)
            n += 1
    return time.perf_counter() - t


def run_plot(run: Path, png: Path) -> tuple[float, float, int, str]:
    """``ampctl plot`` in a subprocess: (wall s, peak RSS MiB of that process alone, exit code,
    what it printed)."""
    cmd = [sys.executable, "-m", "ampctl", "plot", str(run), "--out", str(png)]
    with tempfile.TemporaryFile() as log:
        t = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _pid, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read().decode(errors="replace")
    return wall, ru.ru_maxrss / 1024, p.returncode, text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--keep-png", type=Path, default=None, help="copy the figure here")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_plot_", dir=args.dir))
    try:
        t = time.perf_counter()
        tiny = tiny_run(root)
        planted = write_big_run(tiny, root / "big", args.rows, args.log_every)
        size = (root / "big" / "metrics.jsonl").stat().st_size
        print(f"wrote {args.rows:,} rows, {size / 2**20:.1f} MiB metrics.jsonl, "
              f"{planted} in {time.perf_counter() - t:.1f} s")  # fmt: skip
        bare = bare_parse(root / "big" / "metrics.jsonl")
        png = root / "big" / "plot.png"
        wall, rss, rc, out = run_plot(root / "big", png)
        print(out.strip())
        print(f"bare json.loads pass: {bare:.1f} s")
        print(f"ampctl plot: exit {rc}, {wall:.1f} s wall ({wall / bare:.2f}x the bare pass), "
              f"peak RSS {rss:.0f} MiB  [goal <= 60 s, <= 1024 MiB]")  # fmt: skip
        if args.keep_png is not None and png.exists():
            shutil.copy(png, args.keep_png)
            print(f"figure kept at {args.keep_png}")
        return 0 if rc == 0 else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
