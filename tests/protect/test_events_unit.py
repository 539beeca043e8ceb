"""The protection's skip events, word for word (ampctl.protect.protection): a spike (its figures,
thresholds and z-scores), a skip that a later rollback discarded (fused path), and the scale a
forward overflow or a spike keeps -- from planted step records."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.precision import make_precision
from ampctl.amp.spike import WindowStats
from ampctl.protect.protection import Protection, _Pending
from ampctl.protect.settings import GuardConfig
from tests.protect.recorded import row, scaler_with
from tests.protect.test_protection_unit import Loop

NAN, INF = math.nan, math.inf


def _strip(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k != "time"}


def _prot(precision: str = "fp16", **guard) -> Protection:
    model = nn.Linear(2, 1)
    scaler = scaler_with([row()], enabled=precision in ("fp16", "fp16-pure"))
    prec = make_precision(precision, scaler=scaler)
    return Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec,
                      config=GuardConfig(**guard))  # fmt: skip


# ------------------------------------------------------------------ spikes
def test_a_loss_spike_names_its_loss_the_threshold_and_the_z_score():
    prot = _prot(rollback_after=0)
    prot.spike.loss = WindowStats(2.0, 0.5, 9)
    prot.spike.norm = WindowStats(1.0, 0.25, 9)
    record = row(scale=1024.0, skipped=True, loss=9.0, loss_thr=5.0, gnorm=1.5, gnorm_thr=2.5)
    assert rec.kind(record) == rec.SPIKE
    prot._observe(7, kind=rec.SPIKE, record=record, scale_after=1024.0)
    assert [_strip(e) for e in prot.events] == [
        {
            "step": 7,
            "kind": "spike",
            "message": "spike, step skipped: loss 9 > 5 (z = 14.0)",
            "loss": 9.0,
            "loss_threshold": 5.0,
            "grad_norm": 1.5,
            "grad_norm_threshold": 2.5,
            "scale": 1024.0,
            "loss_z": 14.0,
            "grad_norm_z": 2.0,
        }
    ]
    assert prot.guard.consecutive == 1


def test_a_grad_norm_spike_names_the_norm_and_its_z_score():
    prot = _prot(rollback_after=0)
    prot.spike.norm = WindowStats(1.0, 0.25, 9)
    record = row(skipped=True, loss=1.0, loss_thr=5.0, gnorm=4.0, gnorm_thr=2.5)
    prot._spike_event(3, record, 512.0, None)
    ev = _strip(prot.events[0])
    assert ev["message"] == "spike, step skipped: grad norm 4 > 2.5 (z = 12.0)"
    assert ev["grad_norm_z"] == 12.0 and "loss_z" not in ev and "decided_at_step" not in ev


def test_a_spike_event_without_window_statistics_or_record_has_no_z():
    prot = _prot()
    prot._spike_event(3, row(skipped=True, loss=NAN, gnorm=4.0, gnorm_thr=2.5), 1.0, 0)
    assert prot.events[-1]["message"] == "spike, step skipped: grad norm 4 > 2.5"
    prot.spike.loss = WindowStats(2.0, 0.0, 9)  # no spread: z is inf, not shown
    prot._spike_event(4, row(skipped=True, loss=3.0, loss_thr=2.0), 1.0, None)
    assert prot.events[-1]["message"] == "spike, step skipped: loss 3 > 2"
    assert prot.events[-1]["loss_z"] == INF
    prot._spike_event(5, None, 2.0, None)  # nothing recorded: NaN figures
    ev = _strip(prot.events[-1])
    assert ev["message"] == "spike, step skipped: grad norm nan > nan"
    assert math.isnan(ev["loss"]) and math.isnan(ev["grad_norm_threshold"]) and ev["scale"] == 2.0


def test_a_spike_decided_late_or_discarded_says_so():
    prot = _prot()
    prot.spike.loss = WindowStats(2.0, 0.5, 9)
    prot._spike_event(3, row(skipped=True, loss=9.0, loss_thr=5.0), 8.0, 4)
    assert prot.events[-1]["decided_at_step"] == 7 and "discarded" not in prot.events[-1]
    prot._spike_event(3, row(skipped=True, loss=9.0, loss_thr=5.0), 8.0, 2, discarded=True)
    ev = prot.events[-1]
    assert ev["message"] == (
        "spike, step skipped: loss 9 > 5 (z = 14.0); the step was discarded by a rollback "
        "decided later"
    )
    assert ev["discarded"] is True and ev["decided_at_step"] == 5


# ------------------------------------------------------------------ discarded skips
def test_a_discarded_skip_is_written_with_no_decision_of_its_own():
    prot = _prot()
    prot._read_step = 9
    gradient = row(skipped=True, loss=1.0)
    forward = row(skipped=True, loss=NAN)
    spike = row(skipped=True, loss=9.0, loss_thr=5.0)
    by_update = {2: gradient, 3: forward, 4: spike, 5: row()}
    for update, step in ((2, 5), (3, 6), (4, 7), (5, 8), (6, 8)):
        prot._discarded_event(_Pending(update, step, None), by_update, 256.0)
    got = [_strip(e) for e in prot.events]
    assert got[0] == {
        "step": 5,
        "kind": "overflow",
        "message": "gradient overflow, step skipped, then discarded by a rollback decided later",
        "overflow": "gradient",
        "scale": 256.0,
        "params": None,
        "attribution": "unavailable: with a fused optimizer the skip is read at the next log "
        "step, when this step's gradients are gone",
        "decided_at_step": 9,
        "discarded": True,
    }
    assert got[1]["message"] == (
        "forward overflow, step skipped, then discarded by a rollback decided later"
    )
    assert got[1]["overflow"] == "forward" and got[1]["decided_at_step"] == 9
    assert got[2]["kind"] == "spike" and got[2]["discarded"] is True
    assert got[2]["decided_at_step"] == 9 and got[2]["scale"] == 256.0
    assert len(got) == 3  # the clean step and the unrecorded one write nothing
    assert prot.guard.consecutive == 0  # and none of them was observed


def test_a_discarded_skip_of_a_scaler_that_does_not_check_the_loss_is_a_gradient_overflow():
    model = nn.Linear(2, 1)
    prec = make_precision("fp16", scaler=scaler_with([row()], check_loss=False))
    prot = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec)
    prot._read_step = 4
    prot._discarded_event(_Pending(2, 3, None), {2: row(skipped=True, loss=NAN)}, 8.0)
    assert prot.events[0]["overflow"] == "gradient"


def test_the_fused_path_writes_the_skips_a_rollback_discarded():
    loop = Loop(fused=True, rollback_after=1, snapshot_every=1)
    loop.step(plant=("head.weight",))  # decided: rollback
    loop.step(plant=("head.weight",))  # ran after it: discarded
    loop.step()
    loop.sync()
    assert [e["kind"] for e in loop.prot.events] == ["overflow", "rollback", "overflow"]
    assert loop.prot.events[2]["discarded"] is True and loop.prot.events[2]["step"] == 2
    assert loop.prot.events[2]["decided_at_step"] == 3
    assert "discarded" not in loop.prot.events[0]


# ------------------------------------------------------------------ the kept scale
def test_a_forward_overflow_or_a_spike_puts_the_scales_back_off_back():
    prot = _prot()
    prot.scaler.update(new_scale=512.0)
    assert prot._keep_scale(1024.0, 512.0) == 1024.0 and prot.scaler.get_scale() == 1024.0
    for used, after in ((1024.0, 1024.0), (1024.0, 2048.0), (1024.0, 0.0)):
        assert prot._keep_scale(used, after) == after
    assert prot.scaler.get_scale() == 1024.0
    off = _prot("bf16")
    assert off._keep_scale(8.0, 4.0) == 4.0 and off.scaler.get_scale() == 1.0


@pytest.mark.parametrize("kind, loss", [(rec.FORWARD, NAN), (rec.SPIKE, 9.0)])
def test_observing_a_forward_overflow_or_spike_keeps_the_scale_it_used(kind, loss):
    prot = _prot(rollback_after=0, locate_forward=False)
    prot.scaler.update(new_scale=256.0)
    record = row(scale=1024.0, skipped=True, loss=loss, loss_thr=5.0)
    prot._observe(4, kind=kind, record=record, scale_after=256.0)
    assert prot.scaler.get_scale() == 1024.0
    assert prot.events[-1]["scale"] == 1024.0


def test_a_gradient_overflow_keeps_the_back_off():
    prot = _prot(rollback_after=0)
    prot.scaler.update(new_scale=256.0)
    prot._observe(4, kind=rec.GRADIENT, record=row(scale=1024.0, skipped=True), scale_after=256.0)
    assert prot.scaler.get_scale() == 256.0 and prot.events[-1]["scale"] == 256.0
