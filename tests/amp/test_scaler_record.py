"""The loss scaler's record read back and restored (ampctl.amp.scaler_record) and its spike veto
(``set_spike_thresholds``, ``report_grad_norm``, ``restore_scale``): exact counters, kinds,
thresholds and saved states; and the corners the mutation run found untested (issue 31):
``mark_applied`` on the right row and its messages, ``loss_since`` at the threshold and after
``mark_applied``, the first loss after loading fewer records than updates, the rows and update
values before the state exists, whatever torch's default dtype -- a 2-parameter model,
milliseconds each.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.scale_rule import _new_scale_tensor
from ampctl.amp.scaler import CallOrderError, LossScaler

INF, NAN = math.inf, math.nan


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(2, 1)


class Run:
    """A scaler over a tiny model; ``step(kind)`` runs one step of that kind."""

    def __init__(self, **kw) -> None:
        self.s = LossScaler(**{"init_scale": 1024.0, **kw})
        self.model = _model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.0)

    def step(self, kind: str = "clean", norm: float | None = None) -> None:
        self.opt.zero_grad()
        x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        loss = self.model(x).pow(2).mean()
        if kind == "forward":
            loss = loss * NAN
        self.s.scale(loss).backward()
        if kind == "gradient":
            self.model.weight.grad[0, 0] = INF
        self.s.unscale_(self.opt)
        if norm is not None:
            self.s.report_grad_norm(torch.tensor(norm))
        self.s.step(self.opt)
        self.s.update()

    def kinds(self) -> list[int]:
        return [int(k) for _, _, k in self.s.state_dict()["history"].tolist()]


def _state(**kw) -> dict:
    return {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
            "_growth_tracker": 0, **kw}  # fmt: skip


def _rows(*kinds: int, loss: float = 1.0) -> torch.Tensor:
    return rec.from_kinds(list(kinds), [8.0] * len(kinds), [loss] * len(kinds))


# ------------------------------------------------------------------ the spike veto
def test_a_reported_norm_above_its_threshold_vetoes_the_step():
    r = Run()
    r.step(norm=3.0)
    r.s.set_spike_thresholds(grad_norm=2.5)
    r.step(norm=2.5)  # at the threshold: not above
    r.step(norm=2.6)
    r.step(norm=100.0)
    assert r.kinds() == [0, 0, 3, 3]
    g = r.s.recent_records(4)[:, rec.GNORM].tolist()
    assert g == pytest.approx([3.0, 2.5, 2.6, 100.0])
    assert r.s.recent_records(4)[:, rec.GNORM_THR].tolist() == [INF, 2.5, 2.5, 2.5]
    assert r.s.stats()["spikes"] == 2 and r.s.stats()["skipped_total"] == 2


def test_a_norm_is_only_recorded_without_a_threshold():
    r = Run()
    r.step(norm=1e9)
    assert r.kinds() == [0] and r.s.recent_records(1)[0, rec.GNORM].item() == 1e9
    r.step()  # no norm reported: NaN
    assert math.isnan(r.s.recent_records(1)[0, rec.GNORM].item())


def test_the_norm_of_a_sharded_gradient_is_its_full_tensor():
    class Sharded(torch.Tensor):
        def full_tensor(self):
            return torch.tensor([7.0], dtype=torch.float64)

    r = Run()
    r.s.set_spike_thresholds(grad_norm=5.0)
    r.opt.zero_grad()
    r.s.scale(r.model(torch.ones(1, 2)).sum()).backward()
    r.s.unscale_(r.opt)
    r.s.report_grad_norm(torch.tensor(1.0).as_subclass(Sharded))
    assert r.s._gnorm.dtype == torch.float32 and r.s._gnorm.shape == ()
    r.s.step(r.opt)
    r.s.update()
    assert r.kinds() == [3] and r.s.recent_records(1)[0, rec.GNORM].item() == 7.0


def test_a_norm_before_the_state_or_on_a_pass_through_is_not_kept():
    s = LossScaler()
    s.report_grad_norm(torch.tensor(3.0))
    assert s._gnorm is None and s.device is None
    p = LossScaler(enabled=False, check_finite=False)
    p.init_state("cpu")
    p.report_grad_norm(torch.tensor(3.0))
    assert p._gnorm is None


def test_thresholds_are_numbers_and_reach_the_device():
    s = LossScaler()
    for kw, shown in (({"loss": NAN}, "loss=nan"), ({"grad_norm": "x"}, "grad_norm='x'"),
                      ({"loss": None}, "loss=None"), ({"grad_norm": NAN}, "grad_norm=nan")):  # fmt: skip
        with pytest.raises(ValueError) as e:
            s.set_spike_thresholds(**kw)
        assert str(e.value) == f"LossScaler.set_spike_thresholds: {shown} is not a number"
    s.set_spike_thresholds(loss=3, grad_norm=-INF)
    assert s.spike_thresholds == (3.0, -INF) and type(s.spike_thresholds[0]) is float
    s.init_state("cpu")
    assert s._t["vec"][2].item() == 3.0 and s._t["vec"][3].item() == -INF
    s.set_spike_thresholds(loss=5.0, grad_norm=6.0)
    assert s._t["vec"][2].item() == 5.0 and s._t["vec"][3].item() == 6.0
    s.set_spike_thresholds()
    assert s.spike_thresholds == (INF, INF) and s._t["vec"][2].item() == INF


def test_restore_scale_multiplies_within_the_bounds_and_only_a_scaling_scaler():
    s = LossScaler(init_scale=64.0, min_scale=2.0, max_scale=256.0)
    s.restore_scale(4.0)  # no state yet: nothing to change
    assert s.get_scale() == 64.0
    s.init_state("cpu")
    s.restore_scale(2.0)
    assert s.get_scale() == 128.0
    s.restore_scale(1e9)
    assert s.get_scale() == 256.0
    s.restore_scale(1e-9)
    assert s.get_scale() == 2.0
    off = LossScaler(enabled=False)
    off.init_state("cpu")
    off.restore_scale(8.0)
    assert off._t["scale"].item() == 1.0


# ------------------------------------------------------------------ reads
def test_the_skip_flag_is_the_live_found_inf_flag():
    r = Run()
    assert r.s.skip_flag() is None
    r.step("gradient")
    assert r.s.skip_flag() is r.s._t["found"] and r.s.skip_flag().item() == 1.0


def test_the_first_loss_is_update_ones_while_the_record_holds_it():
    r = Run(history_size=3)
    assert r.s.first_loss() is None
    r.s.init_state("cpu")
    assert r.s.first_loss() is None  # before the first update
    r.step()
    first = r.s.recent_records(1)[0, rec.LOSS].item()
    assert r.s.first_loss().item() == first and r.s.first_loss().dtype == torch.float64
    r.step("forward")
    r.step()
    assert r.s.first_loss().item() == first  # update 3 of a ring of 3: still kept
    r.step()
    assert r.s.first_loss() is None  # moved past it


def test_loss_since_sums_the_finite_losses_after_an_update():
    r = Run()
    r.step()
    r.step("forward")
    r.step()
    losses = r.s.recent_records(3)[:, rec.LOSS].tolist()
    s, n = r.s.loss_since(0)
    assert s.dtype == torch.float64 and n.dtype == torch.float64
    assert (s.item(), n.item()) == (pytest.approx(losses[0] + losses[2]), 2.0)
    s, n = r.s.loss_since(2)
    assert (s.item(), n.item()) == (pytest.approx(losses[2]), 1.0)
    s, n = r.s.loss_since(3)
    assert (s.item(), n.item()) == (0.0, 0.0)


def test_device_counters_name_each_count():
    r = Run(init_scale=2.0**20)
    r.step()
    r.step("forward")
    r.s.set_spike_thresholds(grad_norm=1.0)
    r.step(norm=5.0)
    r.step("gradient")
    got = {k: v.item() for k, v in r.s.device_counters().items()}
    assert got == {
        "scale": r.s.get_scale(),
        "skipped_total": 3.0,
        "forward_overflows": 1.0,
        "spikes": 1.0,
        "consecutive_overflows": 3.0,
        "last_skipped": 1.0,
    }


def test_the_history_of_a_scaler_that_does_not_check_the_loss():
    r = Run(check_loss=False)
    r.step("forward")
    assert r.kinds() == [1] and r.s.forward_overflows == 0


def test_state_dict_says_whether_the_last_step_was_skipped():
    r = Run()
    r.step("gradient")
    assert r.s.state_dict()["last_skipped"] == 1
    r.step()
    assert r.s.state_dict()["last_skipped"] == 0


def test_stats_before_the_state_exists_read_the_loaded_rows():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=3, skipped_total=1, records=_rows(0, 1, 0)))
    st = s.stats()
    assert st["last_skipped"] is False and st["skipped_total"] == 1 and st["steps"] == 3
    s.load_state_dict(_state(num_updates=3, skipped_total=2, consecutive_overflows=1,
                             records=_rows(0, 1, 1)))  # fmt: skip
    assert s.stats()["last_skipped"] is True and s.stats()["consecutive_overflows"] == 1


def test_the_last_skip_without_kept_records_comes_from_the_run_before_them():
    for run, last in ((0, False), (1, True), (2, True)):
        s = LossScaler()
        s.load_state_dict(_state(num_updates=5, skipped_total=3, consecutive_overflows=run))
        s.init_state("cpu")
        assert s.stats()["last_skipped"] is last and s.consecutive_overflows == run
        assert s.recent_records(5).shape == (0, 6) and s.history() == []


# ------------------------------------------------------------------ loading
def test_a_state_of_ampctl_0_2_counts_its_updates_from_its_history():
    s = LossScaler()
    s.load_state_dict(_state(history=[[5, 8.0, 0], [6, 4.0, 1], [7, 4.0, 2]], skipped_total=2))
    assert s.num_updates == 7
    assert [k for _, _, k in s.state_dict()["history"].tolist()] == [0.0, 1.0, 2.0]
    t = LossScaler()
    t.load_state_dict(_state(history=[]))
    assert t.num_updates == 0
    u = LossScaler()
    u.load_state_dict(_state(history=[[5, 8.0, 0]], num_updates=12))
    assert u.num_updates == 12


def test_loading_restores_the_spike_thresholds_in_force():
    s = LossScaler()
    s.load_state_dict(_state(spike_thresholds=[3.0, 4.0]))
    assert s.spike_thresholds == (3.0, 4.0)
    s.init_state("cpu")
    assert s._t["vec"][2].item() == 3.0 and s._t["vec"][3].item() == 4.0
    s.load_state_dict(_state())
    assert s.spike_thresholds == (INF, INF)


def test_records_of_a_state_that_counted_no_update_are_dropped():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=0, records=_rows(1, 1)))
    assert s.history() == [] and s.stats()["steps"] == 0
    s.init_state("cpu")
    assert s.recent_records(4).shape == (0, 6)


def test_loaded_records_are_float32_before_and_after_the_state_exists():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=2, records=_rows(0, 0).double()))
    assert s.state_dict()["records"].dtype == torch.float32
    s.init_state("cpu")
    assert s.state_dict()["records"].dtype == torch.float32


def test_loading_clears_the_last_step_loss():
    r = Run()
    r.step()
    assert r.s.last_step_loss is not None
    r.s.load_state_dict(r.s.state_dict())
    assert r.s.last_step_loss is None


def test_loaded_counters_cover_the_steps_before_the_kept_records():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=10, skipped_total=6, forward_overflows=3, spikes=2,
                             consecutive_overflows=3, records=_rows(0, 2, 3, 1)))  # fmt: skip
    assert (s.skipped_steps, s.forward_overflows, s.consecutive_overflows) == (6, 3, 3)
    assert s.stats()["spikes"] == 2
    s.init_state("cpu")
    assert (s.skipped_steps, s.forward_overflows, s.consecutive_overflows) == (6, 3, 3)
    assert s.stats()["spikes"] == 2


def test_a_run_of_skips_that_began_before_the_kept_records_goes_on():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=10, skipped_total=5, consecutive_overflows=5,
                             records=_rows(1, 1, 1)))  # fmt: skip
    assert s.consecutive_overflows == 5
    s.init_state("cpu")
    assert s.consecutive_overflows == 5
    odd = LossScaler()  # a saved run shorter than its own rows (hand-made): no run before them
    odd.load_state_dict(_state(num_updates=3, skipped_total=3, consecutive_overflows=2,
                               records=_rows(1, 1, 1)))  # fmt: skip
    odd.init_state("cpu")
    assert odd.consecutive_overflows == 3


def test_a_scaler_that_does_not_check_the_loss_loads_forward_rows_as_gradient_ones():
    s = LossScaler(check_loss=False)
    s.load_state_dict(_state(num_updates=2, skipped_total=2, forward_overflows=1,
                             records=_rows(2, 1, loss=NAN)))  # fmt: skip
    s.init_state("cpu")
    assert s.forward_overflows == 1 and s.skipped_steps == 2  # the saved count, none added
    t = LossScaler()
    t.load_state_dict(_state(num_updates=2, skipped_total=2, forward_overflows=2,
                             records=_rows(2, 2, loss=NAN)))  # fmt: skip
    t.init_state("cpu")
    assert t.forward_overflows == 2


def test_a_state_without_records_or_history_keeps_no_rows():
    s = LossScaler()
    s.load_state_dict(_state(num_updates=3))
    assert s.history() == [] and s.state_dict()["records"].shape == (0, 6)


# ------------------------------------------------------------------ folding and copies
def test_a_long_run_of_skips_is_counted_across_several_folds():
    r = Run(init_scale=2.0**20, history_size=2)
    for _ in range(7):
        r.step("gradient")
    assert r.s.consecutive_overflows == 7 and r.s.skipped_steps == 7
    r.step()
    assert r.s.consecutive_overflows == 0 and r.s.skipped_steps == 7


def test_folded_forward_rows_of_a_scaler_that_does_not_check_the_loss_count_as_gradient():
    r = Run(init_scale=2.0**20, history_size=2, check_loss=False)
    for _ in range(5):
        r.step("forward")
    assert r.s.forward_overflows == 0 and r.s.skipped_steps == 5


def test_a_copy_keeps_forward_overflows_and_spikes_and_drops_the_step_under_way():
    r = Run(init_scale=2.0**20, history_size=3)
    r.step()
    r.step("forward")
    r.s.set_spike_thresholds(grad_norm=1.0)
    r.step(norm=5.0)
    r.step("forward")
    want = r.s.stats()
    assert (want["forward_overflows"], want["spikes"]) == (2, 1)
    for t in (pickle.loads(pickle.dumps(r.s)), copy.deepcopy(r.s)):
        assert t.stats() == want and t.last_step_loss is None and t._gnorm is None
        t.init_state("cpu")
        assert t.stats() == want
    off = LossScaler(enabled=False)  # a disabled scaler may be copied mid-step
    off.scale(r.model(torch.ones(1, 2)).sum()).backward()
    off.unscale_(r.opt)
    off.report_grad_norm(torch.tensor(2.0))
    assert copy.deepcopy(off)._gnorm is None


# ==================================================== the corners the mutation run found (issue 31)
class Planted:
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


# ------------------------------------------------------------------ mark_applied
def test_mark_applied_clears_the_last_record_only():
    r = Planted(history_size=4)
    r.step(grad=INF)
    r.step(grad=INF)
    r.s.mark_applied()
    assert [skipped for _, _, skipped in r.s.history()] == [True, False]
    assert r.s.skipped_steps == 1 and r.s.consecutive_overflows == 0
    assert not r.s.last_step_skipped


def test_mark_applied_on_a_wrapped_ring():
    r = Planted(history_size=2)
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
    r = Planted()
    r.s.set_spike_thresholds(loss=5.0)
    r.step(grad=INF, loss=5.0)  # a gradient overflow, its loss at (not above) the threshold
    r.step(loss=2.0)
    total, n = r.s.loss_since(0, without_spikes=True)
    assert (total.item(), n.item()) == (7.0, 2.0)


def test_loss_since_keeps_a_vetoed_loss_once_the_step_was_applied():
    r = Planted()
    r.s.set_spike_thresholds(loss=5.0)
    r.step(loss=2.0)
    r.step(loss=9.0)  # vetoed
    assert r.s.loss_since(0, without_spikes=True)[0].item() == 2.0
    r.s.mark_applied()  # rerun clean and applied: a step of the run's course after all
    total, n = r.s.loss_since(0, without_spikes=True)
    assert (total.item(), n.item()) == (11.0, 2.0)


# ------------------------------------------------------------------ first_loss after a load
def test_the_first_loss_is_none_when_the_loaded_records_start_after_update_one():
    src = Planted(history_size=2)
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
    src = Planted(history_size=4)
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
