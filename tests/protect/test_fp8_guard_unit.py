"""The guard's fp8 layer demotion, driven by hand (ampctl.protect.replays): the rules at the log
read fed with a recorded cast history (``after_log``), the cast replay of a gradient overflow and
``demote_layer`` -- tiny fp8 ``nn.Linear`` stacks, real torchao on the CPU, exact events."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from ampctl.amp import fp8  # noqa: E402
from ampctl.amp.precision import make_precision  # noqa: E402
from ampctl.protect.figures import DeviceFigures  # noqa: E402
from ampctl.protect.protection import Protection  # noqa: E402
from ampctl.protect.settings import GuardConfig  # noqa: E402
from tests.protect.recorded import Ranks, strip_time  # noqa: E402

INF = math.inf


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
