"""Count the places where device values are read on the host (tests and ``ampctl bench``).

Counting is done by wrapping the ``torch.Tensor`` methods that copy a device value into Python:
``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``. On CUDA each of these is a
CPU-GPU sync; on CPU they are the same calls, so the count is the same on both.

One exclusion: reads that torch's optimizers make of their own *CPU* ``step`` counters
(non-fused, non-capturable optimizers keep ``state["step"]`` on the CPU even on a GPU run
precisely so that reading it is not a sync). They are not counted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch

_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__")
_TORCH_OPTIM = os.path.join("torch", "optim") + os.sep


def _is_optimizer_cpu_counter(t: torch.Tensor) -> bool:
    if t.device.type != "cpu":
        return False
    frame = sys._getframe(2)
    return _TORCH_OPTIM in frame.f_code.co_filename


class HostReads:
    """A running count of host reads, by method name."""

    def __init__(self) -> None:
        self.by_method: dict[str, int] = dict.fromkeys(_METHODS, 0)

    @property
    def total(self) -> int:
        return sum(self.by_method.values())

    def reset(self) -> None:
        for k in self.by_method:
            self.by_method[k] = 0


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Within the block, count every host read of a tensor value (not thread-safe)."""
    counter = HostReads()
    originals = {m: getattr(torch.Tensor, m) for m in _METHODS}
    depth = [0]

    def wrap(name, fn):
        def inner(self, *a, **k):
            # nested calls (e.g. __bool__ -> item) count once
            if depth[0] == 0 and not _is_optimizer_cpu_counter(self):
                counter.by_method[name] += 1
            depth[0] += 1
            try:
                return fn(self, *a, **k)
            finally:
                depth[0] -= 1

        return inner

    try:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        yield counter
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)
