"""The protection's replays, driven by hand (ampctl.protect.replays): the rerun of a skipped step
(transient or reproducible, retried with the rerun's gradients, RNG kept), the fp8 cast replay of
a gradient overflow, and the fp8 demotion rules at the log read fed with a recorded cast history
-- exact events, weights, gradients and RNG state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.precision import make_precision
from ampctl.protect.protection import Protection
from ampctl.protect.settings import GuardConfig
from tests.protect.recorded import Ranks, row, strip_time
from tests.protect.test_protection_unit import BATCH, Loop

INF, NAN = math.inf, math.nan


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ rerun
def test_a_fault_that_does_not_replay_is_transient_and_its_step_is_retried():
    loop, twin = Loop(rerun=True), Loop()
    loop.model.amp.flaky = 1  # the first pass overflows, the rerun does not
    assert loop.step() is True and twin.step() is False
    assert loop.prot.retried is True
    ev = strip_time(loop.prot.events[0])
    assert [e["kind"] for e in loop.prot.events] == ["rerun"]
    loss = ev["rerun_loss"]
    assert ev == {
        "step": 1,
        "kind": "rerun",
        "message": f"rerun of step 1 (overflow): clean (loss {loss:.4g}): a transient fault, the "
        "step was retried",
        "verdict": "transient",
        "cause": "overflow",
        "rank": None,
        "rerun_loss": loss,
    }
    assert math.isfinite(loss) and loss > 0
    # the retried step is the clean step: same weights, same optimizer state, same scale
    assert _same(_weights(loop.model), _weights(twin.model))
    a, b = loop.prot.optimizer.state_dict()["state"], twin.prot.optimizer.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]) for k in b)
    assert loop.prot.scaler.get_scale() == 1024.0 == twin.prot.scaler.get_scale()
    assert loop.prot.guard.consecutive == 0  # observed as a clean step
    loop.step()
    assert loop.prot.retried is False  # only the step it was retried at


def test_planted_non_finite_gradients_are_a_transient_fault_too():
    loop, twin = Loop(rerun=True), Loop()
    loop.step(plant=("head.weight",))
    twin.step()
    assert [e["verdict"] for e in loop.prot.events] == ["transient"]
    assert _same(_weights(loop.model), _weights(twin.model))


def test_a_fault_that_replays_is_reproducible_and_the_step_stays_skipped():
    loop = Loop(rerun=True)
    before = _weights(loop.model)
    loop.model.amp.boost = 1e20  # overflows in fp32 too: every time
    assert loop.step() is True
    assert loop.prot.retried is False
    kinds = [e["kind"] for e in loop.prot.events]
    assert kinds[:2] == ["rerun", "overflow"]
    ev = strip_time(loop.prot.events[0])
    assert ev["verdict"] == "reproducible" and ev["cause"] == "overflow" and ev["rank"] is None
    assert not math.isfinite(ev["rerun_loss"])
    assert ev["message"] == (
        f"rerun of step 1 (overflow): fails again (loss {ev['rerun_loss']:.4g}): the data or the "
        "numerics"
    )
    assert _same(_weights(loop.model), before)
    assert loop.prot.scaler.get_scale() == 1024.0  # a forward overflow keeps its scale


def test_a_step_without_its_batches_is_not_rerun():
    loop = Loop(rerun=True)
    loop.step(plant=("head.weight",), batches=[])
    assert [e["kind"] for e in loop.prot.events] == ["overflow"] and not loop.prot.retried


def test_a_spike_that_replays_is_reproducible_and_the_spike_recorded():
    loop = Loop(rerun=True)
    loop.step()
    loop.prot.scaler.set_spike_thresholds(loss=1e-6)  # every loss is a spike now
    assert loop.step() is True
    assert [e["kind"] for e in loop.prot.events] == ["rerun", "spike"]
    ev = loop.prot.events[0]
    assert ev["cause"] == "spike" and ev["verdict"] == "reproducible"
    assert ev["message"].startswith("rerun of step 2 (spike): fails again (loss ")


def _direct(loop: Loop, record: list[float], kind: int, **kw) -> str:
    loop.step()
    return loop.prot._rerun(2, [BATCH], record, kind, **kw)


def test_the_rerun_compares_its_loss_with_the_threshold_of_the_step():
    loop = Loop(rerun=True)
    assert _direct(loop, row(skipped=True, loss=5.0, loss_thr=1e-6), rec.SPIKE) == "reproducible"
    loop = Loop(rerun=True)
    got = _direct(loop, row(skipped=True, loss=5.0, loss_thr=1e6, gnorm=3.0, gnorm_thr=2.0), 3)
    assert got == "transient"
    ev = loop.prot.events[-1]
    assert ev["message"].endswith(
        "a transient fault, the step was retried; its grad norm was 3 against 2"
    )
    assert ev["cause"] == "spike"
    loop = Loop(rerun=True)  # a grad-norm threshold, but no norm reported: nothing said of it
    _direct(loop, row(skipped=True, loss=5.0, gnorm=NAN, gnorm_thr=2.0), rec.SPIKE)
    assert "grad norm" not in loop.prot.events[-1]["message"]


def test_the_rerun_unscales_with_the_scale_the_step_used():
    loop, twin = Loop(rerun=True), Loop()
    loop.step()
    twin.step()
    twin.step()
    loop.prot._rerun(2, [BATCH], row(scale=1024.0, skipped=True), rec.GRADIENT)
    assert _same(_weights(loop.model), _weights(twin.model))
    off = Loop("bf16", rerun=True)  # no loss scaling: the record's scale is not used
    off_twin = Loop("bf16")
    off.step()
    off_twin.step()
    off_twin.step()
    off.prot._rerun(2, [BATCH], row(scale=8.0, skipped=True), rec.GRADIENT)
    assert _same(_weights(off.model), _weights(off_twin.model))


def test_the_retried_step_is_clipped_to_the_loops_clip():
    loop = Loop(rerun=True, protection={"rerun_clip": 1e-3})
    loop.step(plant=("head.weight",))
    grads = [p.grad for p in loop.model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)


def test_ranks_rerun_together_and_a_fault_that_replays_on_one_rank_is_reproducible():
    loop = Loop(rerun=True, protection={"dist": Ranks([(True, True)])})
    loop.step(plant=("head.weight",))  # clean here, fails again on rank 0
    ev = loop.prot.events[0]
    assert ev["verdict"] == "reproducible" and ev["rank"] is None
    assert "(rank" not in ev["message"]
    loop = Loop(rerun=True, protection={"dist": Ranks([(True, False), (True, True)])})
    loop.step(plant=("head.weight",))
    assert loop.prot.events[0]["verdict"] == "reproducible"
    loop = Loop(rerun=True, protection={"dist": Ranks([(True, False)])})
    loop.step(plant=("head.weight",))
    ev = loop.prot.events[0]
    assert ev["verdict"] == "transient" and ev["rank"] == 0
    assert ev["message"].startswith("rerun of step 1 (overflow) (rank 0, 1): clean (loss ")
    off = Ranks([(True, True)])
    off.enabled = False  # a single process: the others are not asked
    loop = Loop(rerun=True, protection={"dist": off})
    loop.step(plant=("head.weight",))
    assert loop.prot.events[0]["verdict"] == "transient" and loop.prot.events[0]["rank"] is None


class Noisy(nn.Module):
    """A loss with noise from the global RNG; ``flaky`` calls return inf."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.flaky = 0

    def forward(self, x, y):
        loss = ((self.lin(x) - y) ** 2).mean() + torch.rand(())
        if self.flaky > 0:
            self.flaky -= 1
            return loss * INF
        return loss


def test_the_rerun_starts_from_the_rng_of_the_step_and_leaves_the_rng_as_the_step_did():
    model = Noisy()
    prec = make_precision("fp32")
    prot = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec,
                      config=GuardConfig(rerun=True))  # fmt: skip
    torch.manual_seed(5)
    prot.mark_step_start()
    at_start = torch.get_rng_state()
    assert torch.equal(prot._rng_at_step[0], at_start) and prot._rng_at_step[1] is None
    model.flaky = 1
    loss = prec.scaler.scale(model(**BATCH))
    loss.backward()
    prec.unscale_(prot.optimizer)
    assert prec.optimizer_step(prot.optimizer) is True
    after = torch.get_rng_state()
    prot.after_step(1, skipped=True, batches=[BATCH])
    assert torch.equal(torch.get_rng_state(), after)  # the rerun forked the RNG
    twin = Noisy()
    torch.set_rng_state(at_start)
    want = twin(**BATCH).item()
    assert prot.events[0]["rerun_loss"] == pytest.approx(want, rel=1e-6)
    assert prot.events[0]["verdict"] == "transient"


def test_the_rng_is_kept_only_when_reruns_are_on():
    for guard in ({"rerun": False}, {"rerun": True, "enabled": False}):
        loop = Loop(**guard)
        loop.prot.mark_step_start()
        assert loop.prot._rng_at_step is None


def test_the_rerun_backs_off_nothing_it_uses_the_steps_own_scale():
    # 1e6 times the loss overflows fp16 in the backward: the rerun fails as the step did
    loop = Loop(rerun=True)
    loop.step()
    assert loop.prot._rerun(2, [BATCH], row(scale=1e6, skipped=True), rec.GRADIENT) == (
        "reproducible"
    )
    # a precision without loss scaling reruns unscaled, whatever the record says
    off = Loop("bf16", rerun=True)
    off.step()
    assert off.prot._rerun(2, [BATCH], row(scale=1e39, skipped=True), rec.GRADIENT) == ("transient")


def test_the_rerun_of_several_micro_batches_averages_them():
    loop, twin = Loop(rerun=True), Loop()
    half = {k: v[:4] for k, v in BATCH.items()}
    rest = {k: v[4:] for k, v in BATCH.items()}
    loop.step()
    twin.step()
    with torch.no_grad():
        want = (twin.model(**half).item() + twin.model(**rest).item()) / 2
    loop.prot._rerun(2, [half, rest], row(scale=1024.0, skipped=True), rec.GRADIENT)
    assert loop.prot.events[-1]["rerun_loss"] == pytest.approx(want, rel=1e-3)


class Sqrt(nn.Module):
    """``a`` (the first parameter) at 0: its gradient through sqrt is inf, the loss finite."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.ones(1))
        self.unused = nn.Parameter(torch.ones(1))

    def forward(self, x, y):
        return torch.sqrt(self.a).sum() + (self.b * x).mean()


def _sqrt_prot(**kw) -> Protection:
    model = Sqrt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    return Protection(model, opt, make_precision("fp32"), config=GuardConfig(rerun=True, **kw))


def test_a_rerun_whose_first_gradient_is_not_finite_is_reproducible():
    prot = _sqrt_prot()
    assert prot._rerun(1, [BATCH], row(scale=1.0, skipped=True), rec.GRADIENT) == "reproducible"
    assert math.isfinite(prot.events[-1]["rerun_loss"])


def test_a_rerun_at_the_loss_threshold_is_clean_and_unused_parameters_stay_untouched():
    prot = _sqrt_prot()
    with torch.no_grad():
        prot.model.a.fill_(1.0)
        want = prot.model(**BATCH).item()
    before = prot.model.unused.detach().clone()
    prot.model.unused.grad = torch.ones(1)  # stale: from before the skipped step
    record = row(scale=1.0, skipped=True, loss=want, loss_thr=want)
    assert prot._rerun(1, [BATCH], record, rec.SPIKE) == "transient"
    assert prot.model.unused.grad is None  # the stale gradient is dropped, not applied
    assert torch.equal(prot.model.unused, before)
    assert not torch.equal(prot.model.b.detach(), torch.ones(1))  # the retried step moved b


def test_a_loss_made_non_finite_outside_the_model_names_the_model_and_its_dtype():
    loop = Loop()
    loop.prot.forward = lambda m, b: m(**b) * INF  # the loop's own loss function overflows
    loop.prot._locate_and_promote(3, [BATCH], None)
    assert strip_time(loop.prot.events[-1]) == {
        "step": 3,
        "kind": "locate",
        "message": "forward overflow: the loss itself is not finite while every module's "
        "output is (look at the loss function, the labels and the learning rate)",
        "module": "<model>",
        "dtype": "float32",
    }
    loop.prot.forward = lambda m, b: (m(**b) * INF).half()
    loop.prot._locate_and_promote(4, [BATCH, BATCH], 2)
    ev = loop.prot.events[-1]
    assert ev["dtype"] == "float16" and ev["message"].endswith(
        "(replayed on the weights of step 6)"
    )


class HalfOut(nn.Module):
    """A module that computes (and returns) fp16 whatever precision runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 1e3))

    def forward(self, x):
        h = x.half() * self.w.half()
        return h * h


class WithHalf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.half_out = HalfOut()
        self.head = nn.Linear(4, 1)

    def forward(self, x, y):
        return ((self.head(self.half_out(x).float()) - y) ** 2).mean()


def _half_prot(precision: str, **kw) -> Protection:
    model = WithHalf()
    prec = make_precision(precision, **kw)
    prec.prepare(model)
    return Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec)


def test_an_fp32_run_locates_an_fp16_module_but_has_nothing_to_promote_it_to():
    prot = _half_prot("fp32")
    prot._locate_and_promote(5, [BATCH], None)
    assert strip_time(prot.events[-1]) == {
        "step": 5,
        "kind": "locate",
        "message": "forward overflow first appears in half_out (float16)",
        "module": "half_out",
        "dtype": "float16",
    }
    assert prot.precision.in_fp32 == []


def test_a_module_already_in_fp32_that_still_computes_in_fp16_is_named():
    prot = _half_prot("fp16", fp32_modules=["half_out"])
    assert prot.precision.in_fp32 == ["half_out"]
    prot._locate_and_promote(5, [BATCH], 1)
    assert strip_time(prot.events[-1]) == {
        "step": 5,
        "kind": "locate",
        "message": "forward overflow in half_out, already fp32 (replayed on the weights of step 6)",
        "module": "half_out",
    }
