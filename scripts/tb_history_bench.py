"""diagnose's streamed TensorBoard history reader against tensorboard's EventAccumulator, on
one event file written here (N steps x 4 scalars). Prints time and peak Python memory of each
and their ratios, measured in one process (#40).

    python scripts/tb_history_bench.py [N]       # default 20000 steps
"""

from __future__ import annotations

import sys
import tempfile
import time
import tracemalloc
from pathlib import Path


def measure(fn):
    tracemalloc.start()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return out, 0.0, peak


def main(n: int) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from ampctl.commands.diagnose.readers.tb_history import read_tensorboard

    with tempfile.TemporaryDirectory() as root:
        d = Path(root) / "tb"
        with SummaryWriter(str(d), max_queue=10000) as w:
            for s in range(n):
                for tag in ("lm loss", "grad-norm", "learning-rate", "loss-scale"):
                    w.add_scalar(tag, 1.0 / (s + 1), s)
        size = sum(f.stat().st_size for f in d.iterdir())

        def accumulate():
            acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
            acc.Reload()
            return {t: len(acc.Scalars(t)) for t in acc.Tags()["scalars"]}

        t = time.perf_counter()
        h = read_tensorboard(d)
        t_ours = time.perf_counter() - t
        t = time.perf_counter()
        acc = accumulate()
        t_acc = time.perf_counter() - t
        _, _, m_ours = measure(lambda: read_tensorboard(d))  # memory: traced runs, apart
        _, _, m_acc = measure(accumulate)
    assert len(h.rows) == n and all(v == n for v in acc.values())
    print(f"{n} steps x 4 scalars, {size / 2**20:.1f} MiB of events (measured under load)")
    print(f"  streamed reader : {t_ours:6.2f} s, peak {m_ours / 2**20:7.1f} MiB (rows kept)")
    print(f"  EventAccumulator: {t_acc:6.2f} s, peak {m_acc / 2**20:7.1f} MiB")
    print(f"  ratio ours/accumulator: time {t_ours / t_acc:.2f}, memory {m_ours / m_acc:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20_000)
