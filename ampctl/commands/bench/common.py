"""What the bench sections share: the step plan, the clock, the error, the goal."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ampctl.errors import UsageError

SECTIONS = ("overhead", "device_ops", "overflow_check", "host_reads", "precision")
OVERHEAD_GOAL = 1.02
_MEMORY_STEPS = 2

Progress = Callable[[str], None]


class BenchError(UsageError):
    """The bench could not measure what it was asked to (bad steps, a loop that stopped)."""


# ---------------------------------------------------------------------------- helpers
def plan(steps: int) -> dict[str, int]:
    """Step counts of every section for ``--steps``: the default 20 gives 40 timed overhead
    pairs after 4 warm-up steps, 20 steps whose device ops are counted, 10 timed steps per
    precision, 2 counted steps per host-read path and 20 overflow-check repeats."""
    return {
        "overhead_pairs": max(2, 2 * steps),
        "overhead_warmup": max(2, steps // 5),
        "precision_steps": max(2, steps // 2),
        "host_read_steps": max(2, steps // 10),
        "overflow_repeats": max(5, steps),
        "device_op_steps": max(2, steps),
    }


def _clock(device: torch.device) -> float:
    """``perf_counter`` after waiting for the device (**syncs** on CUDA, by design: timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
