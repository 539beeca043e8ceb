"""The loss scaler's record of every step, kept on the device: one row per ``update()``.

A row is written with one copy (``torch.cat`` into the ring) and holds, as float32,

    ===========  ==============================================================================
    ``scale``    the scale the step used
    ``skipped``  1.0 when the step was skipped (its ``found_inf``: non-finite gradients, or a
                 spike veto), else 0.0
    ``loss_thr`` the loss threshold of the spike rule in force (+inf: none)
    ``gnorm_thr`` the gradient-norm threshold in force (+inf: none)
    ``loss``     the step's loss as ``scale()`` saw it (the sum over its micro-batches; NaN when
                 ``scale()`` got none)
    ``gnorm``    the gradient norm the loop reported (NaN: none)
    ===========  ==============================================================================

The kind of a step follows from its row (:func:`kind`): 0 clean, 1 gradient overflow, 2 forward
overflow (the loss itself was not finite), 3 spike (a finite loss or gradient norm above its
threshold). Counters -- skipped steps, forward overflows, spikes, overflows in a row -- are not
updated per step: they are reductions over the rows (:func:`counts`), folded into a running base
every ``history_size`` steps, so a clean step costs no counter op at all.

Nothing here reads the device on the host unless its docstring says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "COLUMNS",
    "SCALE",
    "SKIPPED",
    "LOSS_THR",
    "GNORM_THR",
    "LOSS",
    "GNORM",
    "CLEAN",
    "GRADIENT",
    "FORWARD",
    "SPIKE",
    "KIND_NAMES",
    "kind",
    "counts",
    "ring_index",
    "from_kinds",
]

COLUMNS = ("scale", "skipped", "loss_thr", "gnorm_thr", "loss", "gnorm")
SCALE, SKIPPED, LOSS_THR, GNORM_THR, LOSS, GNORM = range(len(COLUMNS))

CLEAN, GRADIENT, FORWARD, SPIKE = 0, 1, 2, 3
KIND_NAMES = {CLEAN: "clean", GRADIENT: "gradient", FORWARD: "forward", SPIKE: "spike"}


def kind(row: Sequence[float], *, check_loss: bool = True) -> int:
    """The kind of a step from its row read on the host (see the module docstring).
    ``check_loss=False`` (GradScaler's way): a skipped step is a gradient overflow whatever its
    loss."""
    if row[SKIPPED] <= 0:
        return CLEAN
    loss, gnorm = row[LOSS], row[GNORM]
    if check_loss and not math.isfinite(loss):
        return FORWARD
    if (math.isfinite(loss) and loss > row[LOSS_THR]) or (
        math.isfinite(gnorm) and gnorm > row[GNORM_THR]
    ):
        return SPIKE
    return GRADIENT


def ring_index(num_updates: int, n: int, size: int, device: torch.device) -> torch.Tensor:
    """Ring rows of the last ``n`` records, oldest first (an index tensor on ``device``)."""
    return torch.arange(num_updates - n, num_updates, device=device) % size


def counts(rows: torch.Tensor, *, check_loss: bool = True) -> torch.Tensor:
    """``[skipped, forward overflows, spikes, trailing run of skipped steps, all skipped]`` of
    ``rows`` (``[n, 6]``, oldest first) as a float64 device tensor; the last entry is 1.0 when
    every row was skipped (a run that goes on before them). No host read."""
    dev = rows.device
    n = rows.shape[0]
    if n == 0:
        return torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64, device=dev)
    skipped = rows[:, SKIPPED] > 0
    finite = torch.isfinite(rows[:, LOSS])
    fwd = skipped & ~finite if check_loss else torch.zeros_like(skipped)
    gnorm = rows[:, GNORM]
    # as kind(): a step is a spike by a finite figure above its threshold; a non-finite norm
    # is a gradient overflow
    over = (finite & (rows[:, LOSS] > rows[:, LOSS_THR])) | (
        torch.isfinite(gnorm) & (gnorm > rows[:, GNORM_THR])
    )
    spike = skipped & ~fwd & over
    pos = torch.arange(n, device=dev)
    last_clean = torch.where(skipped, -1, pos).amax()
    return torch.stack(
        [
            skipped.sum(),
            fwd.sum(),
            spike.sum(),
            n - 1 - last_clean,
            (last_clean < 0).long(),
        ]
    ).double()


def from_kinds(kinds: Sequence[int], scales: Sequence[float], losses: Sequence[float] | None):
    """Rows (``[n, 6]`` float32, CPU) standing for a saved history of ``(scale, kind)`` and, when
    saved, the steps' losses: what :meth:`~ampctl.amp.LossScaler.load_state_dict` restores. A
    row's kind reads back as saved (:func:`kind`)."""
    n = len(kinds)
    rows = torch.full((n, len(COLUMNS)), math.nan, dtype=torch.float32)
    if n == 0:
        return rows
    rows[:, SCALE] = torch.tensor(list(scales), dtype=torch.float32)
    k = torch.tensor(list(kinds), dtype=torch.long)
    rows[:, SKIPPED] = (k > 0).float()
    rows[:, LOSS_THR] = math.inf
    rows[:, GNORM_THR] = math.inf
    if losses is not None:
        rows[:, LOSS] = torch.tensor(list(losses), dtype=torch.float32)
    # a saved kind without its loss: a loss that reads back as that kind
    rows[:, LOSS] = torch.where(
        (k == GRADIENT) & ~torch.isfinite(rows[:, LOSS]), 0.0, rows[:, LOSS]
    )
    rows[:, LOSS] = torch.where(k == FORWARD, math.nan, rows[:, LOSS])
    spike = k == SPIKE
    rows[:, LOSS] = torch.where(spike & ~torch.isfinite(rows[:, LOSS]), 0.0, rows[:, LOSS])
    rows[:, LOSS_THR] = torch.where(spike, -math.inf, rows[:, LOSS_THR])
    return rows
