"""fp8 vs bf16 on the GPU: tokens/s and peak memory of conf=bert_large, eager and compiled.

    python tests/gpu/fp8_vs_bf16.py OUT.jsonl [--steps N] [overrides ...]

(the overrides go after ``conf=bert_large trainer.device=cuda``; e.g. ``trainer.device=cpu
model=bert_tiny ...`` tries the script on a CPU)

Runs, one after the other, bf16 and fp8 eager, then bf16 and fp8 under ``trainer.compile=true``
(torchao's float8 needs torch.compile to be fast: eager it runs its casts as separate kernels),
with :func:`ampctl.commands.bench.measure_precisions` (one precision at a time, synchronised
around each step, peak memory from ``torch.cuda.max_memory_allocated``; two untimed warm-up
steps when compiled, so compilation is not timed). Each result is appended to OUT.jsonl as soon
as it is measured, so a run cut short by its time limit keeps what it finished; the last lines
printed compare fp8 with bf16. Called by ``tests/gpu/check.sh``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RUNS = (("eager", "bf16"), ("eager", "fp8"), ("compiled", "bf16"), ("compiled", "fp8"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)

    from ampctl.commands.bench import measure_precisions
    from ampctl.config import load_config

    results: dict[tuple[str, str], dict] = {}
    for mode, precision in RUNS:
        cfg = load_config(
            [
                "conf=bert_large",
                "trainer.device=cuda",
                f"trainer.compile={str(mode == 'compiled').lower()}",
                *args.overrides,
            ]
        )
        t0 = time.perf_counter()
        res = measure_precisions(cfg, args.steps, precisions=(precision,))
        row = res["rows"][precision]
        line = {
            "mode": mode,
            "precision": precision,
            **{k: row[k] for k in ("step_s", "tokens_per_s", "peak_mem_mib", "error")},
            "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
            "steps": args.steps,
            "wall_s": time.perf_counter() - t0,
        }
        results[(mode, precision)] = line
        with args.out.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
    for mode in ("eager", "compiled"):
        b, f8 = results.get((mode, "bf16")), results.get((mode, "fp8"))
        if b and f8 and b["tokens_per_s"] and f8["tokens_per_s"]:
            print(
                f"{mode}: fp8 {f8['tokens_per_s']:,.0f} tok/s vs bf16 {b['tokens_per_s']:,.0f} "
                f"tok/s = {f8['tokens_per_s'] / b['tokens_per_s']:.2f}x; peak memory "
                f"{f8['peak_mem_mib']:,.0f} vs {b['peak_mem_mib']:,.0f} MiB",
                flush=True,
            )
    bad = [v for v in results.values() if v["error"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
