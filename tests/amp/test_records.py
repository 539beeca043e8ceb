"""The step record (ampctl.amp.records): the kind of a row at every boundary, the counters of
hand-made rows, and the rows that stand for a saved history -- pure, milliseconds. records.counts
(the device reduction the log step reads) and records.kind (the host reading of one row) agree on
every kind of step: a skipped step whose gradient norm is not finite is a gradient overflow, never
a spike, even with a spike threshold in force.
"""

from __future__ import annotations

import math

import pytest
import torch

from ampctl.amp import records as rec

INF, NAN = math.inf, math.nan


def _row(skipped=1.0, loss=1.0, gnorm=NAN, loss_thr=INF, gnorm_thr=INF, scale=8.0):
    r = [0.0] * len(rec.COLUMNS)
    r[rec.SCALE], r[rec.SKIPPED], r[rec.LOSS_THR], r[rec.GNORM_THR] = (
        scale,
        skipped,
        loss_thr,
        gnorm_thr,
    )
    r[rec.LOSS], r[rec.GNORM] = loss, gnorm
    return r


def test_the_columns_and_kinds():
    assert rec.COLUMNS == ("scale", "skipped", "loss_thr", "gnorm_thr", "loss", "gnorm")
    assert (rec.SCALE, rec.SKIPPED, rec.LOSS_THR, rec.GNORM_THR, rec.LOSS, rec.GNORM) == tuple(
        range(6)
    )
    assert (rec.CLEAN, rec.GRADIENT, rec.FORWARD, rec.SPIKE) == (0, 1, 2, 3)
    assert rec.KIND_NAMES == {0: "clean", 1: "gradient", 2: "forward", 3: "spike"}


@pytest.mark.parametrize(
    "row, check_loss, kind",
    [
        (_row(skipped=0.0, loss=NAN, gnorm=9.0, gnorm_thr=1.0), True, rec.CLEAN),
        (_row(skipped=-1.0), True, rec.CLEAN),
        (_row(loss=NAN), True, rec.FORWARD),
        (_row(loss=INF), True, rec.FORWARD),
        (_row(loss=NAN), False, rec.GRADIENT),  # GradScaler's way: every skip a gradient one
        (_row(loss=NAN, loss_thr=-INF), False, rec.GRADIENT),
        (_row(loss=5.0, loss_thr=4.0), True, rec.SPIKE),  # the loss alone
        (_row(loss=4.0, loss_thr=4.0), True, rec.GRADIENT),  # at the threshold: not above
        (_row(loss=1.0, gnorm=3.0, gnorm_thr=2.0), True, rec.SPIKE),  # the norm alone
        (_row(loss=1.0, gnorm=2.0, gnorm_thr=2.0), True, rec.GRADIENT),
        (_row(loss=1.0, gnorm=1.0, gnorm_thr=5.0), True, rec.GRADIENT),  # a norm below it
        (_row(loss=1.0, gnorm=INF, gnorm_thr=5.0), True, rec.GRADIENT),  # not a finite norm
        (_row(loss=1.0), True, rec.GRADIENT),
    ],
)
def test_the_kind_of_a_row(row, check_loss, kind):
    assert rec.kind(row, check_loss=check_loss) == kind


def test_the_kind_checks_the_loss_by_default():
    assert rec.kind(_row(loss=NAN)) == rec.FORWARD


def test_ring_index_is_the_last_n_rows_oldest_first():
    assert rec.ring_index(7, 3, 4, torch.device("cpu")).tolist() == [0, 1, 2]
    assert rec.ring_index(5, 4, 4, torch.device("cpu")).tolist() == [1, 2, 3, 0]
    assert rec.ring_index(2, 0, 4, torch.device("meta")).device.type == "meta"


def _counts(rows, **kw) -> list[float]:
    t = torch.tensor(rows, dtype=torch.float32).reshape(-1, len(rec.COLUMNS))
    out = rec.counts(t, **kw)
    assert out.dtype == torch.float64 and out.shape == (5,)
    return out.tolist()


def test_counts_of_no_rows_say_a_run_before_them_goes_on():
    out = rec.counts(torch.zeros(0, len(rec.COLUMNS)))
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0] and out.dtype == torch.float64
    assert rec.counts(torch.zeros(0, 6, device="meta")).device.type == "meta"


def test_counts_by_kind_and_the_trailing_run():
    rows = [
        _row(skipped=1.0, loss=NAN),  # forward
        _row(skipped=0.0),
        _row(loss=5.0, loss_thr=4.0),  # spike by loss
        _row(loss=4.0, loss_thr=4.0),  # gradient: at the threshold
        _row(loss=1.0, gnorm=3.0, gnorm_thr=2.0),  # spike by norm
        _row(loss=1.0, gnorm=2.0, gnorm_thr=2.0),  # gradient
        _row(loss=NAN, loss_thr=-INF),  # forward, not a spike
    ]
    assert _counts(rows) == [6.0, 2.0, 2.0, 5.0, 0.0]
    # without checking the loss every skip is a gradient overflow or a spike
    assert _counts(rows, check_loss=False) == [6.0, 0.0, 2.0, 5.0, 0.0]


def test_the_all_skipped_flag_needs_every_row_skipped():
    assert _counts([_row(), _row()]) == [2.0, 0.0, 0.0, 2.0, 1.0]
    assert _counts([_row(skipped=0.0), _row(), _row()]) == [2.0, 0.0, 0.0, 2.0, 0.0]
    assert _counts([_row(), _row(skipped=0.0)]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert rec.counts(torch.tensor([_row()], device="meta")).device.type == "meta"


def test_rows_of_a_saved_history_read_back_as_saved():
    rows = rec.from_kinds([0, 1, 2, 3], [8.0, 4.0, 4.0, 2.0], None)
    assert rows.dtype == torch.float32 and rows.shape == (4, 6)
    assert [rec.kind(r) for r in rows.tolist()] == [0, 1, 2, 3]
    assert rows[:, rec.SCALE].tolist() == [8.0, 4.0, 4.0, 2.0]
    assert rows[:, rec.SKIPPED].tolist() == [0.0, 1.0, 1.0, 1.0]
    loss = rows[:, rec.LOSS].tolist()
    assert math.isnan(loss[0]) and loss[1] == 0.0 and math.isnan(loss[2]) and loss[3] == 0.0
    assert rows[:, rec.LOSS_THR].tolist() == [INF, INF, INF, -INF]
    assert rows[:, rec.GNORM_THR].tolist() == [INF] * 4
    assert all(math.isnan(x) for x in rows[:, rec.GNORM].tolist())


def test_rows_of_a_saved_history_with_its_losses():
    rows = rec.from_kinds([0, 1, 2, 3, 1], [8.0] * 5, [1.5, 2.5, 3.5, 4.5, NAN])
    loss = rows[:, rec.LOSS].tolist()
    assert loss[:2] == [1.5, 2.5] and math.isnan(loss[2]) and loss[3] == 4.5 and loss[4] == 0.0
    assert [rec.kind(r) for r in rows.tolist()] == [0, 1, 2, 3, 1]


def test_one_and_no_saved_rows():
    one = rec.from_kinds([1], [16.0], None)
    assert one.shape == (1, 6) and rec.kind(one[0].tolist()) == rec.GRADIENT
    assert one[0, rec.SCALE].item() == 16.0
    none = rec.from_kinds([], [], None)
    assert none.shape == (0, 6) and none.dtype == torch.float32


# ====================================================== counts and kind agree on every kind of step
def _step_row(skipped, loss, gnorm, loss_thr=INF, gnorm_thr=INF, scale=1024.0):
    r = [0.0] * len(rec.COLUMNS)
    r[rec.SCALE], r[rec.SKIPPED], r[rec.LOSS], r[rec.GNORM] = scale, skipped, loss, gnorm
    r[rec.LOSS_THR], r[rec.GNORM_THR] = loss_thr, gnorm_thr
    return r


ROWS = [
    (_step_row(0, 2.0, 1.0, 5.0, 3.0), rec.CLEAN),
    (_step_row(1, 2.0, INF, 5.0, 3.0), rec.GRADIENT),  # inf grads under a live threshold
    (_step_row(1, 2.0, NAN, 5.0, 3.0), rec.GRADIENT),
    (_step_row(1, 40.0, 1.0, 5.0, 3.0), rec.SPIKE),  # the loss above its threshold
    (_step_row(1, 2.0, 30.0, 5.0, 3.0), rec.SPIKE),  # the norm above its threshold
    (_step_row(1, NAN, NAN, 5.0, 3.0), rec.FORWARD),
    (_step_row(1, 2.0, 1.0), rec.GRADIENT),  # no threshold in force
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
