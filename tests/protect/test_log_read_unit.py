"""The protection's log-read path, driven by hand: what it adds to the log step's one read
(``log_figures``), and what it decides from the values read (``on_log_read``: the spike window, the
waiting decisions, the divergence rule and its stop / warn / rollback), on a recorded device
history and planted loss rows -- exact events, exact state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp.precision import make_precision
from ampctl.protect.figures import DeviceFigures
from ampctl.protect.protection import Protection, Rewind, TrainDiverged
from ampctl.protect.settings import GuardConfig
from tests.protect.recorded import row, scaler_with
from tests.protect.test_protection_unit import Loop

NAN, INF = math.nan, math.inf
CPU = torch.device("cpu")


def _strip(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k != "time"}


class Run:
    """A protection over a tiny model whose scaler holds ``rows``; ``log(step, loss)`` is one log
    step: the protection's figures, one read, then ``on_log_read`` with the row's loss."""

    def __init__(self, rows=None, *, progress=None, **guard) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1)
        scaler = scaler_with(rows if rows is not None else [row(loss=2.0)])
        prec = make_precision("fp16", scaler=scaler)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.emitted: list[dict] = []
        self.prot = Protection(
            self.model,
            self.opt,
            prec,
            config=GuardConfig(**guard),
            emit=self.emitted.append,
            progress_state=progress,
        )

    def values(self, ctx=None) -> dict:
        fig = DeviceFigures(CPU)
        self.prot.log_figures(fig)
        return fig.read(ctx)

    def log(self, step: int, loss: float, n: float = 1.0):
        values = {**self.values(), "loss_sum": loss * n, "loss_n": n}
        return self.prot.on_log_read(step, values)

    def events(self) -> list[dict]:
        return [_strip(e) for e in self.prot.events]


# ------------------------------------------------------------------ log_figures
def test_the_first_read_carries_the_runs_first_loss_once():
    run = Run([row(loss=2.5), row(loss=3.0), row(loss=1.0)], spike=False)
    v = run.values()
    assert v == {"start_loss": [2.5, 1.0]}
    run.prot.on_log_read(3, {**v, "loss_sum": 1.0, "loss_n": 1.0})
    assert run.prot.divergence.start == 2.5
    assert run.values() == {}  # known now: not read again
    run.prot.on_log_read(4, {"start_loss": [9.0, 1.0], "loss_sum": 1.0, "loss_n": 1.0})
    assert run.prot.divergence.start == 2.5  # a start already known is kept


def test_the_first_loss_is_the_mean_over_ranks_of_the_finite_ones():
    class Ranks:
        enabled = True

        def reduce_sum(self, t):
            return t + torch.tensor([3.5, 1.0], dtype=t.dtype)  # the other rank: 3.5

        def reduce_max(self, t):
            return t

    run = Run([row(loss=2.5)], spike=False)
    v = run.values(Ranks())
    assert v["start_loss"] == [6.0, 2.0]
    run.prot.on_log_read(1, {**v, "loss_sum": 1.0, "loss_n": 1.0})
    assert run.prot.divergence.start == 3.0
    bad = Run([row(loss=NAN, skipped=True)], spike=False)
    v = bad.values()
    assert v == {"start_loss": [0.0, 0.0]}  # no finite first loss on this rank
    bad.prot.on_log_read(1, {**v, "loss_sum": 1.0, "loss_n": 1.0})
    assert math.isnan(bad.prot.divergence.start)
    assert bad.values() == {}  # NaN: known to be unknown, not read again


def test_no_first_loss_is_read_without_the_divergence_rule_or_a_record():
    assert Run(spike=False, divergence=False).values() == {}
    assert Run(spike=False, enabled=False).values() == {}
    assert Run([], spike=False).values() == {}  # before the first update
    long = Run([row(loss=1.0)] * 5, spike=False)
    long.prot.scaler._num_updates = long.prot.scaler.history_size + 1  # moved past update 1
    assert long.values() == {}


def test_the_spike_window_and_the_pending_decisions_ride_on_the_read():
    rows = [row(loss=float(i), gnorm=10.0 + i) for i in range(1, 4)]
    run = Run(rows, spike_window=2, spike_min_steps=2)
    v = run.values()
    assert v["spike_window"] == [0.0, 2.0, 12.0, 0.0, 3.0, 13.0]
    assert "pending_decisions" not in v
    run.prot.on_log_read(3, {**v, "loss_sum": 3.0, "loss_n": 1.0})
    assert run.prot.scaler.spike_thresholds == (5.5, 15.5)
    loop = Loop(fused=True)
    loop.step()
    fig = DeviceFigures(CPU)
    loop.prot.log_figures(fig)
    assert "pending_decisions" in fig._vectors
    got = fig.read()["pending_decisions"]
    want = loop.prot.pending_reads()
    assert torch.equal(torch.tensor(got, dtype=torch.float64).nan_to_num(7.0), want.nan_to_num(7.0))


# ------------------------------------------------------------------ on_log_read
def test_the_waiting_decisions_are_taken_at_the_log_read_and_a_rewind_ends_it():
    loop = Loop(fused=True, snapshot_every=1, rollback_after=2, divergence_patience=1)
    loop.step()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    fig = DeviceFigures(CPU)
    loop.prot.log_figures(fig)
    rewind = loop.prot.on_log_read(3, {**fig.read(), "loss_sum": 1e9, "loss_n": 1.0})
    assert isinstance(rewind, Rewind) and (rewind.kind, rewind.to_step) == ("rollback", 0)
    assert [e["kind"] for e in loop.prot.events] == ["overflow", "overflow", "rollback"]
    assert loop.prot.divergence.losses == []  # a rewound interval's loss is not judged


def test_a_clean_read_is_judged_by_the_divergence_rule():
    loop = Loop(fused=True, divergence_patience=1)
    loop.step()
    fig = DeviceFigures(CPU)
    loop.prot.log_figures(fig)
    assert loop.prot.on_log_read(1, {**fig.read(), "loss_sum": 4.0, "loss_n": 2.0}) is None
    assert loop.prot.divergence.losses == [2.0] and loop.prot.divergence.steps == [1]


def test_a_row_without_losses_counts_as_non_finite():
    run = Run(spike=False, divergence_patience=2)
    assert run.prot.on_log_read(1, {"loss_sum": 0.0, "loss_n": 0.0}) is None
    assert [math.isnan(x) for x in run.prot.divergence.losses] == [True]
    with pytest.raises(TrainDiverged) as e:
        run.prot.on_log_read(2, {"loss_sum": 0.0})  # no count at all
    assert str(e.value) == "the loss is not finite at the last 2 log steps"
    assert e.value.since == 0 and e.value.status == "diverged"


def test_without_the_divergence_rule_nothing_is_judged():
    for guard in ({"divergence": False}, {"enabled": False}):
        run = Run(spike=False, divergence_patience=1, **guard)
        for step in range(1, 5):
            assert run.prot.on_log_read(step, {"loss_sum": NAN, "loss_n": 1.0}) is None
        assert run.prot.divergence.losses == [] and run.prot.events == []


# ------------------------------------------------------------------ divergence actions
def test_a_diverged_run_stops_with_the_reason_the_rows_and_the_last_good_step():
    run = Run(spike=False, divergence_patience=2)
    for step, loss in ((10, 1.0), (20, 1.0), (30, 1.0), (40, 9.0)):
        assert run.log(step, loss) is None
    with pytest.raises(TrainDiverged) as e:
        run.log(50, 9.0)
    reason = (
        "the loss diverged: 9, 9 at the last 2 log steps, 9.0x its lowest (1, the median of 2 rows)"
    )
    assert str(e.value) == reason and e.value.since == 30
    assert run.events() == [
        {
            "step": 50,
            "kind": "divergence",
            "message": reason,
            "action": "stop",
            "loss": 9.0,
            "min_loss": 1.0,
            "ratio": 9.0,
            "since": 30,
        }
    ]
    assert run.emitted == run.prot.events


def test_the_first_loss_is_the_lowest_when_the_rows_never_came_down_to_it():
    run = Run([row(loss=0.5)], spike=False, divergence_patience=2)
    for step, loss in ((1, 1.0), (2, 1.0), (3, 1.0)):
        assert run.log(step, loss) is None
    assert run.prot.divergence.start == 0.5
    with pytest.raises(TrainDiverged):
        run.log(4, 9.0)
    ev = run.events()[0]
    assert ev["message"] == (
        "the loss diverged: 1, 9 at the last 2 log steps, 10.0x the loss the run started from "
        "(0.5, before its first update)"
    )
    # the ratio the message names: the median of the last rows (5) over the first loss
    assert (ev["loss"], ev["min_loss"], ev["ratio"], ev["since"]) == (9.0, 0.5, 10.0, 2)


def test_a_first_loss_above_the_rows_is_not_the_lowest():
    run = Run([row(loss=20.0)], spike=False, divergence_patience=2)
    for step, loss in ((1, 1.0), (2, 1.0), (3, 1.0), (4, 9.0)):
        run.log(step, loss)
    with pytest.raises(TrainDiverged):
        run.log(5, 9.0)
    assert run.events()[0]["min_loss"] == 1.0 and run.events()[0]["ratio"] == 9.0


def test_a_divergence_warning_is_recorded_and_the_run_goes_on():
    run = Run(spike=False, divergence_patience=1, divergence_action="warn")
    run.log(1, 1.0)
    run.log(2, 1.0)
    assert run.log(3, 6.0) is None
    assert run.events() == [
        {
            "step": 3,
            "kind": "divergence",
            "message": "the loss diverged: 6 at the last 1 log steps, 6.0x its lowest (1, the "
            "median of 1 rows)",
            "action": "warn",
            "loss": 6.0,
            "min_loss": 1.0,
            "ratio": 6.0,
            "since": 2,
        }
    ]
    assert run.prot.divergence.losses == []  # the course starts again
    assert run.log(4, 6.0) is None and len(run.events()) == 1


def test_a_divergence_rollback_restores_the_last_good_state_with_the_lr_cut():
    pos = {"step": 0}
    run = Run(
        spike=False,
        divergence_patience=1,
        divergence_action="rollback",
        divergence_lr_cut=0.25,
        progress=lambda: dict(pos),
    )
    x = torch.ones(3, 2)
    run.model(x).sum().backward()
    run.opt.step()  # momentum state exists
    pos["step"] = 2
    run.prot.take_snapshot(2)
    kept = {k: v.clone() for k, v in run.model.state_dict().items()}
    buf = run.opt.state_dict()["state"][0]["momentum_buffer"].clone()
    run.log(1, 1.0)
    run.log(2, 1.0)
    for _ in range(2):
        run.opt.zero_grad()
        run.model(x).sum().backward()
        run.opt.step()
    assert not torch.equal(run.model.weight, kept["weight"])
    rewind = run.log(3, 7.0)
    assert rewind == Rewind("rollback", 3, 2, {"step": 2}, lr_factor=0.25)
    assert all(torch.equal(v, kept[k]) for k, v in run.model.state_dict().items())
    assert torch.equal(run.opt.state_dict()["state"][0]["momentum_buffer"], buf)
    assert run.prot.guard.rollbacks == 1
    assert run.events() == [
        {
            "step": 2,
            "kind": "divergence",
            "message": "the loss diverged: 7 at the last 1 log steps, 7.0x its lowest (1, the "
            "median of 1 rows): restored step 2, lr x0.25",
            "action": "rollback",
            "lr_factor": 0.25,
            "to_step": 2,
            "from_step": 3,
            "loss": 7.0,
            "min_loss": 1.0,
            "ratio": 7.0,
            "since": 2,
        }
    ]


@pytest.mark.parametrize("snapshot_at", [None, 3])
def test_a_divergence_rollback_without_a_state_from_before_it_stops(snapshot_at):
    run = Run(spike=False, divergence_patience=1, divergence_action="rollback")
    run.log(1, 1.0)
    run.log(2, 1.0)
    if snapshot_at is not None:
        run.prot.take_snapshot(snapshot_at)  # taken after the last good row (step 2)
    with pytest.raises(TrainDiverged) as e:
        run.log(3, 7.0)
    reason = (
        "the loss diverged: 7 at the last 1 log steps, 7.0x its lowest (1, the median of 1 "
        "rows); no state from step 2 or before is kept to roll back to"
    )
    assert str(e.value) == reason and e.value.since == 2
    assert run.events()[0]["action"] == "stop" and run.events()[0]["message"] == reason


def test_a_snapshot_taken_at_the_last_good_row_is_good_enough():
    run = Run(spike=False, divergence_patience=1, divergence_action="rollback")
    run.log(1, 1.0)
    run.log(2, 1.0)
    run.prot.take_snapshot(2)
    assert run.log(3, 7.0).to_step == 2
