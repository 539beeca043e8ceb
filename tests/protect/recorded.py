"""A loss scaler holding a recorded device history, for the log-read tests of the protection.

The records are what a real scaler writes (one row per update, the columns of
:data:`ampctl.amp.records.COLUMNS`); :func:`scaler_with` loads them through the scaler's own
``load_state_dict`` (the path a resumed run takes) and creates its device state, so
``recent_records``, ``first_loss``, ``loss_since`` and the counters read them as they would read a
run's.
"""

from __future__ import annotations

import math

import torch

from ampctl.amp import records as rec
from ampctl.amp.scaler import LossScaler

NAN = math.nan
INF = math.inf


def row(
    *,
    scale: float = 1024.0,
    skipped: bool = False,
    loss: float = 1.0,
    gnorm: float = NAN,
    loss_thr: float = INF,
    gnorm_thr: float = INF,
) -> list[float]:
    """One step record, as ``update()`` writes it."""
    r = [NAN] * len(rec.COLUMNS)
    r[rec.SCALE], r[rec.SKIPPED] = scale, 1.0 if skipped else 0.0
    r[rec.LOSS_THR], r[rec.GNORM_THR] = loss_thr, gnorm_thr
    r[rec.LOSS], r[rec.GNORM] = loss, gnorm
    return r


def scaler_with(rows: list[list[float]], *, enabled: bool = True, **kw) -> LossScaler:
    """A LossScaler whose record holds ``rows`` (oldest first, updates 1..len(rows)) and the
    counters they make, its device state created on the CPU."""
    s = LossScaler(init_scale=1024.0, enabled=enabled, **kw)
    t = torch.tensor(rows, dtype=torch.float32).reshape(-1, len(rec.COLUMNS))
    c = [int(x) for x in rec.counts(t, check_loss=s.check_loss).tolist()]
    s.load_state_dict(
        {
            "scale": 1024.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
            "num_updates": len(rows),
            "skipped_total": c[0],
            "forward_overflows": c[1],
            "spikes": c[2],
            "consecutive_overflows": c[3],
            "records": t,
        }
    )
    s.init_state("cpu")
    return s


def strip_time(ev: dict) -> dict:
    """An event without its wall-clock ``time`` (for comparing events word for word)."""
    return {k: v for k, v in ev.items() if k != "time"}


class Ranks:
    """A stand-in for the loop's dist context on one rank: ``all_gather_object`` returns the
    other ranks' planted objects, then this rank's."""

    enabled = True

    def __init__(self, others: list) -> None:
        self.others = others

    def all_gather_object(self, obj):
        return [*self.others, obj]
