"""Protection, pieces the other unit tests leave open (mutation survivors of issue #31): the
divergence rule judges the course loss (spikes left out) over the interval's loss, decisions wait
when a log read carries no pending figures, the events of a spike decided late or discarded, the
spike message at its threshold, a kept scale below 1, and the discarded steps of a rollback."""

from __future__ import annotations

import math

import torch

from ampctl.amp import records as rec
from ampctl.amp.guard import Action, Decision
from ampctl.protect.protection import Rewind, _Pending
from tests.protect.recorded import row, strip_time
from tests.protect.test_log_read_unit import Run
from tests.protect.test_protection_unit import Loop

NAN, INF = math.nan, math.inf


# ------------------------------------------------------------------ on_log_read
def test_the_divergence_rule_judges_the_course_loss_when_the_read_has_it():
    run = Run(spike=False)
    values = {"course_loss_sum": 6.0, "course_loss_n": 3.0, "loss_sum": 100.0, "loss_n": 4.0}
    assert run.prot.on_log_read(1, values) is None
    assert run.prot.divergence.losses == [2.0]  # 6 / 3, not 100 / 4
    # every loss of the interval a spike: the course is empty, its finite losses are judged
    values = {"course_loss_sum": 0.0, "course_loss_n": 0.0, "loss_sum": 100.0, "loss_n": 4.0}
    assert run.prot.on_log_read(2, values) is None
    assert run.prot.divergence.losses == [2.0, 25.0]


def test_waiting_decisions_wait_for_a_read_that_carries_their_figures():
    loop = Loop(fused=True, divergence_patience=1)
    loop.step(plant=("head.weight",))
    assert len(loop.prot._pending) == 1
    # a log read without the protection's figures: nothing to decide from, the decision waits
    assert loop.prot.on_log_read(1, {"loss_sum": 2.0, "loss_n": 1.0}) is None
    assert len(loop.prot._pending) == 1 and loop.prot.events == []
    assert loop.prot.divergence.losses == [2.0]
    loop.sync()
    assert loop.prot._pending == [] and [e["kind"] for e in loop.prot.events] == ["overflow"]
    assert loop.prot.events[0]["step"] == 1


# ------------------------------------------------------------------ spike events
def test_a_spike_decided_late_says_at_which_step():
    run = Run(spike=False)
    spike = row(scale=1024.0, skipped=True, loss=9.0, loss_thr=5.0)
    assert run.prot._observe(5, kind=rec.SPIKE, record=spike, scale_after=1024.0, late_by=2) is None
    ev = strip_time(run.prot.events[-1])
    assert ev["kind"] == "spike" and ev["step"] == 5 and ev["decided_at_step"] == 7
    assert ev["message"] == "spike, step skipped: loss 9 > 5"


def test_a_discarded_spike_is_written_with_its_own_record():
    run = Run(spike=False)
    run.prot._read_step = 7
    spike = row(scale=1024.0, skipped=True, loss=9.0, loss_thr=5.0, gnorm=1.5, gnorm_thr=4.0)
    run.prot._discarded_event(_Pending(update=1, step=5, batches=None), {1: spike}, 512.0)
    assert strip_time(run.prot.events[-1]) == {
        "step": 5,
        "kind": "spike",
        "message": "spike, step skipped: loss 9 > 5; the step was discarded by a rollback "
        "decided later",
        "loss": 9.0,
        "loss_threshold": 5.0,
        "grad_norm": 1.5,
        "grad_norm_threshold": 4.0,
        "scale": 512.0,
        "decided_at_step": 7,
        "discarded": True,
    }


def test_a_loss_at_its_threshold_is_not_the_spike_the_grad_norm_is():
    run = Run(spike=False)
    r = row(scale=1024.0, skipped=True, loss=5.0, loss_thr=5.0, gnorm=7.0, gnorm_thr=6.0)
    run.prot._spike_event(4, r, 1024.0, None)
    assert run.prot.events[-1]["message"] == "spike, step skipped: grad norm 7 > 6"


# ------------------------------------------------------------------ the kept scale
def test_a_backed_off_scale_below_one_is_put_back_too():
    # GradScaler's bounds (min_scale=0): the scale can go below 1
    run = Run(spike=False)
    sc = run.prot.scaler
    sc.set_bounds(0.0, INF)
    sc.update(new_scale=0.25)
    assert sc.get_scale() == 0.25
    assert run.prot._keep_scale(0.5, 0.25) == 0.5
    assert sc.get_scale() == 0.5
    assert run.prot._keep_scale(0.5, 0.5) == 0.5  # not backed off: nothing to put back
    assert sc.get_scale() == 0.5


# ------------------------------------------------------------------ _apply
def test_a_rollback_decided_late_hands_back_the_steps_it_discards():
    loop = Loop(snapshot_every=1)
    loop.step()
    decision = Decision(action=Action.ROLLBACK, reason="planted")
    rewind = loop.prot._apply(decision, 4, 1024.0, ran_after=2)
    assert rewind == Rewind("rollback", 4, 1, {"step": 1, "seen": 8}, 2, skip_batches=0)
    assert loop.prot.events[-1]["discarded_steps"] == 2
    assert torch.equal(loop.prot.snapshot.scale, torch.tensor(1024.0))
