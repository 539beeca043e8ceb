"""What the MLflow and W&B sinks cost: opening one (in a fresh temporary run folder) and each
log row after that, in this process. ``python scripts/sink_cost.py mlflow|wandb [rows]``.

Run one process per sink: the first open also pays for importing the library (and for MLflow, a
new store's schema migrations), which is what a new ``ampctl train`` run pays once.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

ROW = {
    "loss": 4.1,
    "scale": 65536.0,
    "skipped": 0,
    "forward_overflows": 0,
    "consecutive_overflows": 0,
    "overflow_rate": 0.0,
    "lr": 1e-3,
    "precision": "fp16",
    "tokens_per_s": 2000.0,
    "elapsed_s": 1.0,
    "max_steps": 300,
    "grad_norm": 3.0,
    "grad_amax": 0.5,
    "grad_underflow_frac": 0.001,
    "nonfinite_grads": 0,
    "act_grad_underflow_frac": 0.4,
    "act_grad_zero_frac": 0.4,
}


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) > 1 else "mlflow"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    run_dir = Path(tempfile.mkdtemp(prefix="ampctl-sink-cost-"))
    params = {"trainer": {"max_steps": 300}, "optim": {"lr": 1e-3}}
    try:
        t0 = time.perf_counter()
        if kind == "mlflow":
            from ampctl.ui.mlflow_sink import MlflowSink

            sink = MlflowSink(
                run_dir, uri=None, experiment="ampctl", run_name="cost", params=params
            )
        elif kind == "wandb":
            from ampctl.ui.wandb_sink import WandbSink

            sink = WandbSink(
                run_dir, mode="offline", project="ampctl", run_name="cost", params=params
            )
        else:
            print(f"sink_cost.py: {kind!r} is not a sink: use mlflow or wandb", file=sys.stderr)
            return 2
        t1 = time.perf_counter()
        for i in range(rows):
            sink.metrics({**ROW, "step": 10 * (i + 1)})
        t2 = time.perf_counter()
        sink.close("ok")
        print(
            f"{kind}: open {t1 - t0:.2f} s, {(t2 - t1) / rows * 1000:.1f} ms per row "
            f"({rows} rows), close {time.perf_counter() - t2:.2f} s"
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
