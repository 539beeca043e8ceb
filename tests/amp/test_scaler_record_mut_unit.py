"""The step record's corners that the mutation run found untested (issue 31): ``mark_applied``
on the right row and its messages, ``loss_since`` at the threshold and after ``mark_applied``,
the first loss after loading fewer records than updates, the rows and update values before the
state exists, whatever torch's default dtype -- a 2-parameter model, milliseconds each."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.scale_rule import _new_scale_tensor
from ampctl.amp.scaler import CallOrderError, LossScaler

INF, NAN = math.inf, math.nan


class Run:
    """A scaler over a 2-parameter model with planted losses and gradients."""

    def __init__(self, **kw) -> None:
        torch.manual_seed(0)
        self.s = LossScaler(**{"init_scale": 64.0, **kw})
        self.model = nn.Linear(1, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def step(self, grad: float = 1.0, loss: float = 1.0) -> None:
        self.s.scale(torch.tensor(loss))
        for p in self.model.parameters():
            p.grad = torch.full_like(p, grad)
        self.s.step(self.opt)
        self.s.update()

    def kinds(self) -> list[int]:
        return [int(k) for _, _, k in self.s.history()]


def _state(**kw) -> dict:
    return {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
            "_growth_tracker": 0, **kw}  # fmt: skip


# ------------------------------------------------------------------ mark_applied
def test_mark_applied_clears_the_last_record_only():
    r = Run(history_size=4)
    r.step(grad=INF)
    r.step(grad=INF)
    r.s.mark_applied()
    assert [skipped for _, _, skipped in r.s.history()] == [True, False]
    assert r.s.skipped_steps == 1 and r.s.consecutive_overflows == 0
    assert not r.s.last_step_skipped


def test_mark_applied_on_a_wrapped_ring():
    r = Run(history_size=2)
    for _ in range(3):
        r.step(grad=INF)
    r.s.mark_applied()  # update 3 lives in row 0 of the ring
    assert [skipped for _, _, skipped in r.s.history()] == [True, False]


def test_mark_applied_messages_word_for_word():
    s = LossScaler()
    with pytest.raises(ValueError) as e:
        s.mark_applied()
    assert str(e.value) == "LossScaler.mark_applied: no step has been recorded yet"
    s.load_state_dict(_state(num_updates=3))  # updates recorded, but no state yet
    with pytest.raises(CallOrderError) as e:
        s.mark_applied()
    assert str(e.value).startswith("LossScaler.mark_applied() was called before scale()")


# ------------------------------------------------------------------ loss_since
def test_loss_since_keeps_an_overflows_loss_at_exactly_the_threshold():
    r = Run()
    r.s.set_spike_thresholds(loss=5.0)
    r.step(grad=INF, loss=5.0)  # a gradient overflow, its loss at (not above) the threshold
    r.step(loss=2.0)
    total, n = r.s.loss_since(0, without_spikes=True)
    assert (total.item(), n.item()) == (7.0, 2.0)


def test_loss_since_keeps_a_vetoed_loss_once_the_step_was_applied():
    r = Run()
    r.s.set_spike_thresholds(loss=5.0)
    r.step(loss=2.0)
    r.step(loss=9.0)  # vetoed
    assert r.s.loss_since(0, without_spikes=True)[0].item() == 2.0
    r.s.mark_applied()  # rerun clean and applied: a step of the run's course after all
    total, n = r.s.loss_since(0, without_spikes=True)
    assert (total.item(), n.item()) == (11.0, 2.0)


# ------------------------------------------------------------------ first_loss after a load
def test_the_first_loss_is_none_when_the_loaded_records_start_after_update_one():
    src = Run(history_size=2)
    for loss in (1.0, 2.0, 3.0, 4.0, 5.0):
        src.step(loss=loss)
    sd = src.s.state_dict()
    assert sd["num_updates"] == 5 and sd["records"].shape[0] == 2
    dst = LossScaler(history_size=10)
    dst.load_state_dict(sd)
    dst.init_state("cpu")
    assert dst.first_loss() is None  # update 1's loss is not among the records kept
    assert dst.recent_records(10)[:, rec.LOSS].tolist() == [4.0, 5.0]


def test_the_first_loss_after_loading_every_record():
    src = Run(history_size=4)
    for loss in (1.0, 2.0, 3.0):
        src.step(loss=loss)
    dst = LossScaler(history_size=4)
    dst.load_state_dict(src.s.state_dict())
    dst.init_state("cpu")
    assert dst.first_loss().item() == 1.0


# ------------------------------------------------------------------ dtypes
def test_saved_history_rows_are_float32_whatever_the_default_dtype(float64_default):
    rows = rec.from_kinds([0, 1, 2, 3], [8.0, 4.0, 4.0, 4.0], None)
    assert rows.dtype == torch.float32 and rows.shape == (4, 6)
    assert [rec.kind(r) for r in rows.tolist()] == [0, 1, 2, 3]
    assert rec.from_kinds([], [], None).dtype == torch.float32


def test_a_new_scale_is_a_float32_scalar_whatever_it_was_given(float64_default):
    for given in (3, 3.0, torch.tensor([3.0], dtype=torch.float64)):
        v = _new_scale_tensor(given)
        assert v.dtype == torch.float32 and v.shape == () and v.item() == 3.0
