"""records.counts (the device reduction the log step reads) and records.kind (the host reading
of one row) agree on every kind of step: a skipped step whose gradient norm is not finite is a
gradient overflow, never a spike, even with a spike threshold in force."""

from __future__ import annotations

import math

import torch

from ampctl.amp import records as rec

INF, NAN = math.inf, math.nan


def _row(skipped, loss, gnorm, loss_thr=INF, gnorm_thr=INF, scale=1024.0):
    r = [0.0] * len(rec.COLUMNS)
    r[rec.SCALE], r[rec.SKIPPED], r[rec.LOSS], r[rec.GNORM] = scale, skipped, loss, gnorm
    r[rec.LOSS_THR], r[rec.GNORM_THR] = loss_thr, gnorm_thr
    return r


ROWS = [
    (_row(0, 2.0, 1.0, 5.0, 3.0), rec.CLEAN),
    (_row(1, 2.0, INF, 5.0, 3.0), rec.GRADIENT),  # inf grads under a live threshold
    (_row(1, 2.0, NAN, 5.0, 3.0), rec.GRADIENT),
    (_row(1, 40.0, 1.0, 5.0, 3.0), rec.SPIKE),  # the loss above its threshold
    (_row(1, 2.0, 30.0, 5.0, 3.0), rec.SPIKE),  # the norm above its threshold
    (_row(1, NAN, NAN, 5.0, 3.0), rec.FORWARD),
    (_row(1, 2.0, 1.0), rec.GRADIENT),  # no threshold in force
]


def test_every_row_reads_back_as_its_kind():
    assert [rec.kind(r) for r, _ in ROWS] == [k for _, k in ROWS]


def test_counts_agree_with_the_kinds_of_the_rows():
    rows = torch.tensor([r for r, _ in ROWS], dtype=torch.float32)
    skipped, fwd, spikes, trailing, all_skipped = rec.counts(rows).tolist()
    kinds = [k for _, k in ROWS]
    assert skipped == sum(k != rec.CLEAN for k in kinds) == 6
    assert fwd == kinds.count(rec.FORWARD) == 1
    assert spikes == kinds.count(rec.SPIKE) == 2  # the two non-finite norms are no spikes
    assert (trailing, all_skipped) == (6, 0)


def test_mark_applied_makes_the_last_skipped_step_read_clean():
    from ampctl.amp import LossScaler

    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = LossScaler(init_scale=1024.0)
    try:
        scaler.mark_applied()
        raise AssertionError("mark_applied before any step must raise")
    except ValueError as e:
        assert str(e) == "LossScaler.mark_applied: no step has been recorded yet"
    for planted in (False, True, True):
        opt.zero_grad()
        scaler.scale((w * 2).sum()).backward()
        if planted:
            w.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
    assert (scaler.skipped_steps, scaler.consecutive_overflows) == (2, 2)
    scaler.mark_applied()  # the last one was rerun clean and applied
    assert (scaler.skipped_steps, scaler.consecutive_overflows) == (1, 0)
    assert [skipped for _, _, skipped in scaler.history()] == [False, True, False]
