"""The protection's wiring and state (ampctl.protect.protection): the rules it builds from its
config, the Rewind a rollback or fallback hands the loop, the fallback a loop cannot make, the
saved state, and a scaler that does not check the loss -- exact, on the tiny planted loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.fp8 import Fp8Health
from ampctl.amp.precision import make_precision
from ampctl.protect.protection import Protection, Rewind, TrainAborted
from ampctl.protect.settings import GuardConfig
from tests.protect.recorded import row
from tests.protect.test_protection_unit import Loop


def _capture(loop: Loop) -> list:
    """The Rewinds the loop gets back from the protection."""
    got: list = []
    apply = loop.apply

    def keep(rewind):
        got.append(rewind)
        apply(rewind)

    loop.apply = keep
    return got


# ------------------------------------------------------------------ wiring
def test_the_protection_builds_its_rules_from_its_config():
    model = nn.Linear(2, 1)
    cfg = GuardConfig(spike_z=3.0, spike_window=16, spike_min_steps=4, spike_grad_norm=False,
                      divergence_factor=9.0, divergence_patience=2, fp8_patience=5)  # fmt: skip
    prot = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), make_precision("fp16"),
                      config=cfg)  # fmt: skip
    s = prot.spike
    assert (s.z, s.window, s.min_steps, s.grad_norm, s.enabled) == (3.0, 16, 4, False, True)
    assert prot.divergence.rules == cfg.divergence_rules
    assert prot.fp8_health.rules == cfg.fp8_rules and prot.fp8_health.history == {}
    assert prot.retried is False and prot._rng_at_step is None and prot.rerun_clip is None
    assert prot.promoted_at == {} and prot.not_the_cause == set() and prot.snapshot is None
    for off in (GuardConfig(spike=False), GuardConfig(enabled=False)):
        p = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), make_precision("fp16"),
                       config=off)  # fmt: skip
        assert p.spike.enabled is False
    assert GuardConfig(spike_min_steps=None).spike_min_steps is None
    p = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), make_precision("fp16"),
                   config=GuardConfig(spike_min_steps=None, spike_window=8))  # fmt: skip
    assert p.spike.min_steps == 8


def test_a_loop_that_cannot_switch_precision_aborts_a_fallback_with_its_reason():
    loop = Loop(rollback_after=1, max_rollbacks=0,
                protection={"fallback_unavailable": "the framework owns autocast"})  # fmt: skip
    with pytest.raises(TrainAborted) as e:
        loop.step(plant=("head.weight",))
    reason = (
        "1 consecutive overflows, after 0 rollbacks at fp16: falling back fp16 -> bf16, but the "
        "framework owns autocast"
    )
    assert str(e.value) == reason and loop.prot.events[-1]["message"] == reason
    assert loop.prot.precision.name == "fp16" and not loop.prot._can_switch()


def test_a_rollback_hands_back_its_steps_progress_and_the_batches_to_skip():
    loop = Loop(snapshot_every=1, rollback_after=2, skip_batches=3)
    got = _capture(loop)
    loop.step()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    assert got[-1] == Rewind("rollback", 3, 1, {"step": 1, "seen": 8}, 0, skip_batches=3)
    assert got[:2] == [None, None]


def test_a_fallback_hands_back_its_steps_and_progress_and_keeps_it_in_the_new_snapshot():
    loop = Loop(snapshot_every=1, rollback_after=1, max_rollbacks=0)
    got = _capture(loop)
    loop.step()
    loop.step(plant=("head.weight",))
    assert got[-1] == Rewind("fallback", 2, 1, {"step": 1, "seen": 8}, 0)
    snap = loop.prot.snapshot
    assert snap.step == 1 and snap.progress == {"step": 1, "seen": 8}
    assert loop.prot.fp8_health is not None and isinstance(loop.prot.fp8_health, Fp8Health)
    assert loop.prot.fp8_health.rules == loop.prot.config.fp8_rules


def test_a_fused_fallback_hands_back_the_steps_it_discarded():
    loop = Loop(fused=True, snapshot_every=1, rollback_after=1, max_rollbacks=0)
    loop.step(plant=("head.weight",))
    loop.step()
    rewind = loop.prot.sync()
    assert rewind == Rewind("fallback", 1, 0, {"step": 0, "seen": 0}, 1)


# ------------------------------------------------------------------ state
def test_the_saved_state_comes_back_with_its_types():
    loop = Loop()
    loop.prot.load_state_dict(
        {
            "window": [1],
            "consecutive": 1,
            "rollbacks": 0,
            "divergence": {"losses": [2.0, 3.0], "steps": [4, 8], "good_step": 4, "start": 9.0},
            "promoted_at": {"amp": "12"},
            "not_the_cause": ["head", "amp.lin"],
        }
    )
    d = loop.prot.divergence
    assert (d.losses, d.steps, d.good_step, d.start) == ([2.0, 3.0], [4, 8], 4, 9.0)
    assert loop.prot.promoted_at == {"amp": 12} and type(loop.prot.promoted_at["amp"]) is int
    assert loop.prot.not_the_cause == {"head", "amp.lin"}
    assert loop.prot.state_dict()["not_the_cause"] == ["amp.lin", "head"]
    loop.prot.load_state_dict({"promoted_at": None, "not_the_cause": None, "divergence": None})
    assert loop.prot.promoted_at == {} and loop.prot.not_the_cause == set()
    assert loop.prot.divergence.losses == [] and loop.prot.divergence.start is None


def test_the_divergence_watch_state_round_trip_and_defaults():
    loop = Loop()
    w = loop.prot.divergence
    w.load_state_dict({"losses": ["1.5"], "steps": ["3"], "good_step": "2", "start": "0.5"})
    assert (w.losses, w.steps, w.good_step, w.start) == ([1.5], [3], 2, 0.5)
    assert type(w.steps[0]) is int and type(w.start) is float
    w.load_state_dict({})
    assert (w.losses, w.steps, w.good_step, w.start) == ([], [], 0, None)
    assert w.rules is loop.prot.divergence.rules and w.rules.patience == 3


# ------------------------------------------------------------------ a scaler that does not check the loss
def test_without_checking_the_loss_a_non_finite_loss_is_a_gradient_overflow():
    loop = Loop(scaler={"check_loss": False}, rollback_after=0)
    loop.model.gain = float("inf")  # the loss itself overflows
    loop.step()
    assert loop.prot.events[0]["overflow"] == "gradient"
    assert loop.prot.scaler.get_scale() == 512.0  # backed off, as GradScaler would


def test_the_fused_path_without_checking_the_loss_too():
    loop = Loop(fused=True, scaler={"check_loss": False}, rollback_after=0)
    loop.model.gain = float("inf")
    loop.step()
    loop.sync()
    assert [e["overflow"] for e in loop.prot.events] == ["gradient"]


def test_the_discarded_skips_carry_the_scale_read_with_them():
    loop = Loop(fused=True, rollback_after=1, snapshot_every=1)
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    reads = loop.prot.pending_reads().tolist()
    loop.apply(loop.prot.on_read(reads))
    assert loop.prot.events[-1]["discarded"] is True
    assert loop.prot.events[-1]["scale"] == reads[0] == 256.0


# ------------------------------------------------------------------ fp8 replays from _observe
def test_an_fp8_gradient_overflow_decided_late_is_replayed_on_the_later_weights():
    pytest.importorskip("torchao.float8")
    from tests.protect.test_fp8_guard_unit import X, _fp8

    prot = _fp8(rollback_after=0)
    prot.model.storm = True
    prot._observe(3, kind=rec.GRADIENT, record=row(skipped=True), scale_after=1.0,
                  batches=[X], late_by=2)  # fmt: skip
    ev = prot.events[-1]
    assert ev["kind"] == "demotion" and ev["step"] == 3 and ev["module"] == "a.1"
    assert ev["reason"].endswith("(replayed on the weights of step 5)")


def test_an_fp8_forward_overflow_or_a_step_without_batches_is_not_cast_replayed():
    pytest.importorskip("torchao.float8")
    from tests.protect.test_fp8_guard_unit import X, _fp8

    prot = _fp8(rollback_after=0, locate_forward=False)
    prot.model.storm = True
    prot._observe(3, kind=rec.FORWARD, record=row(skipped=True, loss=float("nan")),
                  scale_after=1.0, batches=[X])  # fmt: skip
    prot._observe(4, kind=rec.GRADIENT, record=row(skipped=True), scale_after=1.0, batches=None)
    assert [e["kind"] for e in prot.events] == ["overflow", "overflow"]
