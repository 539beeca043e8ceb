"""The protection's replays, driven by hand (ampctl.protect.replays): the rerun of a skipped step
(transient or reproducible, retried with the rerun's gradients, RNG kept); the fp8 cast replay of
a gradient overflow, the fp8 demotion rules at the log read fed with a recorded cast history
(``after_log``) and ``demote_layer``, on tiny fp8 ``nn.Linear`` stacks with real torchao on the
CPU (those tests skip without torchao); and the pieces the mutation run found open (issue #31):
the cast replay through a stand-in plugin (no torchao needed) -- unused parameters, no figures, a
short table, ranks -- a dist context without ``enabled``, and the rerun's message when no
grad-norm threshold was in force. Exact events, weights, gradients and RNG state.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampctl.amp import fp8
from ampctl.amp import records as rec
from ampctl.amp.precision import make_precision
from ampctl.protect.figures import DeviceFigures
from ampctl.protect.protection import Protection
from ampctl.protect.settings import GuardConfig
from tests.protect.loop import BATCH, Loop
from tests.protect.recorded import Ranks, row, strip_time

# ====================================================================== the rerun of a skipped step
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


# ================================================= fp8: the cast replay and demotion (real torchao)
# ------------------------------------------------------------------ fp8: demotion at the log read
class InfGrad(torch.autograd.Function):
    """Identity forward; an inf gradient backward (a planted gradient storm)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, INF)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.ab = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
        self.storm = False

    def forward(self, x):
        h = self.a(x)
        if self.storm:
            h = InfGrad.apply(h)
        return self.ab(h).float().pow(2).mean()


X = {"x": torch.randn(4, 16, generator=torch.Generator().manual_seed(3))}


def _fp8(**guard) -> Protection:
    """A protection over the fp8 ``Stack``; the test skips where torchao is not installed."""
    pytest.importorskip("torchao.float8")
    model = Stack()
    prec = make_precision("fp8", options={"exclude": []})
    prec.prepare(model)
    opt = torch.optim.AdamW(prec.optimizer_params(model), lr=1e-3)
    return Protection(model, opt, prec, config=GuardConfig(**guard))


def _log(prot: Protection, rows: dict[str, list[float]]) -> None:
    """One log step whose cast figures read ``rows`` (layer -> figures), then ``after_log``."""
    probe = prot.precision.probe
    with probe.sampling(prot.model, True), prot.precision.autocast():
        prot.forward(prot.model, X).backward()
    fig = DeviceFigures(torch.device("cpu"))
    probe.figures(fig)
    values = fig.read()
    names = list(probe._open.names)
    values["fp8_rows"] = [x for n in names for x in rows.get(n, [1.0] + [0.0] * 8)]
    probe.row(values)


SAT = [1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # input saturation 50%
UNDER = [1.0, 0.0, 0.0, 1.0, 0.0, 0.2, 1.0, 0.0, 0.0]  # weight underflow 20%


def test_persistent_saturation_at_the_log_reads_demotes_the_layer():
    prot = _fp8(fp8_patience=2)
    _log(prot, {"a.1": SAT, "ab.0": UNDER})
    prot.after_log(10)
    assert prot.events == [] and set(prot.fp8_health.history) == {"a.0", "a.1", "ab.0", "ab.1"}
    _log(prot, {"a.1": SAT, "ab.0": UNDER})
    prot.after_log(20)
    assert [strip_time(e) for e in prot.events] == [
        {
            "step": 20,
            "kind": "demotion",
            "message": "a.1: fp8 -> bf16 (saturation above 10.0% in 2 samples in a row (last "
            "50.0%))",
            "module": "a.1",
            "reason": "saturation above 10.0% in 2 samples in a row (last 50.0%)",
            "to_precision": "bf16",
        },
        {
            "step": 20,
            "kind": "demotion",
            "message": "ab.0: fp8 -> bf16 (underflow above 1.0% in 2 samples in a row (last "
            "20.0%))",
            "module": "ab.0",
            "reason": "underflow above 1.0% in 2 samples in a row (last 20.0%)",
            "to_precision": "bf16",
        },
    ]
    assert fp8.converted_layers(prot.model) == ["a.0", "ab.1"]
    assert set(prot.fp8_health.history) == {"a.0", "ab.1"}  # the demoted are forgotten
    assert prot.precision.demoted == {
        "a.1": "saturation above 10.0% in 2 samples in a row (last 50.0%)",
        "ab.0": "underflow above 1.0% in 2 samples in a row (last 20.0%)",
    }
    prot.after_log(30)  # no new sample: nothing to judge
    assert len(prot.events) == 2


@pytest.mark.parametrize("guard", [{"fp8_demote": False}, {"enabled": False}])
def test_the_sample_is_taken_but_nothing_demoted_when_demotion_is_off(guard):
    prot = _fp8(fp8_patience=1, **guard)
    _log(prot, {"a.1": SAT})
    prot.after_log(10)
    assert prot.events == [] and prot.precision.probe.take_sample() is None
    assert fp8.converted_layers(prot.model) == ["a.0", "a.1", "ab.0", "ab.1"]


def test_a_probe_without_samples_is_passed_over():
    prot = _fp8(fp8_patience=1)
    _log(prot, {"ab.1": SAT})
    probe = prot.precision.probe
    prot.precision.probes = lambda: [object(), probe]  # e.g. a probe that keeps no sample
    prot.after_log(5)
    assert [e["module"] for e in prot.events] == ["ab.1"]


def test_demote_layer_records_only_a_real_demotion():
    prot = _fp8()
    prot.fp8_health.observe(["a.0"], [[1.0] + [0.0] * 8])
    assert prot.demote_layer(7, "a.0", "why") is True
    assert "a.0" not in prot.fp8_health.history
    assert prot.demote_layer(8, "a.0", "again") is False
    assert prot.demote_layer(8, "nothing", "x") is False
    assert [(e["step"], e["message"]) for e in prot.events] == [(7, "a.0: fp8 -> bf16 (why)")]


# ------------------------------------------------------------------ fp8: the cast replay
def test_a_gradient_storm_is_replayed_and_the_first_layer_it_reached_demoted():
    prot = _fp8()
    prot.model.storm = True
    grads = [p.grad for p in prot.model.parameters()]
    rng = torch.get_rng_state()
    prot._replay_casts(4, [X], None)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [p.grad for p in prot.model.parameters()] == grads  # the replay's are discarded
    assert [strip_time(e) for e in prot.events] == [
        {
            "step": 4,
            "kind": "demotion",
            "message": "a.1: fp8 -> bf16 (non-finite output gradient (amax inf) on the replay of "
            "the skipped step)",
            "module": "a.1",
            "reason": "non-finite output gradient (amax inf) on the replay of the skipped step",
            "to_precision": "bf16",
        }
    ]
    prot._replay_casts(6, [X, X], 3)  # decided late: replayed on the later weights
    assert prot.events[-1]["reason"] == (  # through a.1, now bf16, the storm is NaN
        "non-finite output gradient (amax nan) on the replay of the skipped step (replayed on the "
        "weights of step 9)"
    )
    assert prot.events[-1]["module"] == "a.0"


def test_a_non_finite_weight_is_replayed_and_its_layer_demoted():
    prot = _fp8()
    with torch.no_grad():
        prot.model.ab[0].weight[0, 0] = INF
    prot._replay_casts(2, [X], None)
    assert [e["module"] for e in prot.events] == ["ab.0"]
    assert prot.events[0]["reason"] == (
        "non-finite weight (amax inf) on the replay of the skipped step"
    )


def test_a_clean_replay_demotes_nothing():
    prot = _fp8()
    prot._replay_casts(2, [X], None)
    assert prot.events == [] and fp8.converted_layers(prot.model) == ["a.0", "a.1", "ab.0", "ab.1"]


@pytest.mark.parametrize("guard", [{"fp8_demote": False}, {"enabled": False}])
def test_no_replay_when_demotion_is_off(guard):
    prot = _fp8(**guard)
    prot.model.storm = True
    calls = []
    prot.forward = lambda m, b: calls.append(1) or m(**b)
    prot._replay_casts(2, [X], None)
    assert prot.events == [] and calls == []


def test_ranks_demote_the_union_of_what_each_found_first_rank_first():
    prot = _fp8()
    prot.model.storm = True
    prot.dist = Ranks([{"ab.0": "theirs", "a.1": "their reason"}, None])
    prot._replay_casts(3, [X], None)
    assert [(e["module"], e["reason"]) for e in prot.events] == [
        ("ab.0", "theirs on the replay of the skipped step"),
        ("a.1", "their reason on the replay of the skipped step"),
    ]
    off = _fp8()
    off.dist = Ranks([{"ab.0": "theirs"}])
    off.dist.enabled = False
    off._replay_casts(3, [X], None)
    assert off.events == []


def test_a_gradient_overflow_of_an_fp8_run_is_replayed_at_its_step():
    prot = _fp8()
    prot.start()
    prot.model.storm = True
    with prot.precision.autocast():
        loss = prot.forward(prot.model, X)
    prot.precision.backward(loss)
    prot.precision.unscale_(prot.optimizer)
    assert prot.precision.optimizer_step(prot.optimizer) is True
    prot.after_step(1, skipped=True, batches=[X])
    assert [e["kind"] for e in prot.events] == ["overflow", "demotion"]
    assert prot.events[1]["module"] == "a.1"


def test_a_forward_overflow_in_an_fp8_layer_demotes_it_before_promoting_it():
    prot = _fp8()
    with torch.no_grad():
        prot.model.ab[0].weight[0, 0] = INF
    prot._locate_and_promote(2, [X], None)
    assert [(e["kind"], e["step"], e["module"]) for e in prot.events] == [
        ("demotion", 2, "ab.0"),
        ("promotion", 2, "ab.0"),
    ]
    assert prot.events[0]["reason"] == "inside 'ab.0', promoted to fp32"
    assert prot.events[1]["message"] == (
        "forward overflow first appears in ab.0 (non-finite, bfloat16): now runs in fp32"
    )
    assert prot.precision.in_fp32 == ["ab.0"] and prot.promoted_at == {"ab.0": 2}
    assert fp8.converted_layers(prot.model) == ["a.0", "a.1", "ab.1"]


# =============================================== the pieces the mutation run found open (issue #31)
OK = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # one layer's cast figures, all finite
BAD_INPUT = [INF, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0]  # its input cast went non-finite


class NoFlag:
    """A dist context of an older shape: no ``enabled``, nothing to gather with."""


def _planted(rows: list[list[float]] | None, names=("amp.lin", "head"), **protection):
    """A bf16 loop whose plugin claims fp8 layers ``names``; its cast replay runs the step and
    returns ``rows`` (None: no figures). Returns the loop and the list of demotions made."""
    loop = Loop("bf16", protection=protection or None)
    prec = loop.prot.precision
    demoted: list[tuple[str, str]] = []
    ran: list[int] = []

    def replay_casts(model, run):
        run()
        ran.append(1)
        return None if rows is None else (list(names), torch.tensor(rows, dtype=torch.float64))

    prec.demotable = lambda model, under="": list(names)
    prec.replay_casts = replay_casts
    prec.demote = lambda model, name, reason: demoted.append((name, reason)) or True
    return loop, demoted, ran


def test_the_cast_replay_runs_over_a_model_with_an_unused_parameter():
    loop, demoted, ran = _planted([BAD_INPUT, OK])
    loop.model.spare = nn.Parameter(torch.ones(1))  # never used by the forward
    loop.prot._replay_casts(3, [BATCH], None)
    assert ran == [1]
    assert demoted == [("amp.lin", "non-finite input (amax inf) on the replay of the skipped step")]
    assert [(e["kind"], e["module"]) for e in loop.prot.events] == [("demotion", "amp.lin")]
    assert loop.model.spare.grad is None  # the replay's gradients are discarded


def test_a_cast_replay_without_figures_demotes_nothing():
    loop, demoted, ran = _planted(None)
    loop.prot._replay_casts(3, [BATCH], 2)
    assert ran == [1] and demoted == [] and loop.prot.events == []


def test_a_cast_table_shorter_than_its_names_is_refused():
    loop, demoted, _ = _planted([BAD_INPUT], names=("amp.lin", "head"))
    with pytest.raises(ValueError):
        loop.prot._replay_casts(3, [BATCH], None)
    assert demoted == []


def test_a_dist_context_without_enabled_is_a_single_process_for_the_cast_replay():
    loop, demoted, _ = _planted([OK, BAD_INPUT], dist=NoFlag())
    loop.prot._replay_casts(3, [BATCH], 1)
    assert demoted == [
        ("head", "non-finite input (amax inf) on the replay of the skipped step (replayed on "
         "the weights of step 4)")
    ]  # fmt: skip


def test_ranks_demote_what_this_rank_found_too():
    loop, demoted, _ = _planted([BAD_INPUT, OK], dist=Ranks([None, {"head": "theirs"}]))
    loop.prot._replay_casts(3, [BATCH], None)
    assert demoted == [
        ("head", "theirs on the replay of the skipped step"),
        ("amp.lin", "non-finite input (amax inf) on the replay of the skipped step"),
    ]


# ------------------------------------------------------------------ rerun
def test_a_dist_context_without_enabled_is_a_single_process_for_the_rerun():
    loop = Loop(rerun=True, protection={"dist": NoFlag()})
    loop.step(plant=("head.weight",))
    ev = loop.prot.events[0]
    assert ev["kind"] == "rerun" and ev["verdict"] == "transient" and ev["rank"] is None
    assert ev["message"].startswith("rerun of step 1 (overflow): clean (loss ")


def test_the_rerun_says_nothing_of_the_grad_norm_without_a_threshold():
    loop = Loop(rerun=True)
    loop.step()
    record = row(skipped=True, loss=5.0, loss_thr=1e6, gnorm=3.0, gnorm_thr=INF)
    assert loop.prot._rerun(2, [BATCH], record, rec.SPIKE) == "transient"
    msg = loop.prot.events[-1]["message"]
    assert msg.endswith("a transient fault, the step was retried") and "grad norm" not in msg
