"""The precision switch (ampctl.protect.switch) on its own: what the new plugin takes over from the
old one, with and without a model, a device or a saved counter state."""

from __future__ import annotations

import torch
from torch import nn

from ampctl.amp.precision import make_precision
from ampctl.amp.scaler import LossScaler
from ampctl.protect.switch import switch_precision


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 1)


def _skipped_once(prec) -> None:
    """One skipped step on the precision's scaler (an inf gradient)."""
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    prec.scaler.scale(p.sum()).backward()
    p.grad.fill_(float("inf"))
    prec.scaler.step(opt)
    prec.scaler.update()


def test_without_a_model_the_fp32_modules_are_carried_over_as_names():
    old = make_precision("fp16", fp32_modules=["b"], options={"recipe": "rowwise"})
    old.prepare(model := Net())
    old.to_fp32(model, "a")
    _skipped_once(old)
    new = switch_precision(old, "bf16", None)
    assert new.name == "bf16" and new.fp32_modules == ["b"] and new.options == {"recipe": "rowwise"}
    assert new.in_fp32 == []  # not attached to a model yet: nothing moved
    assert old.in_fp32 == ["b", "a"]  # and the old plugin still holds the model
    assert new.scaler.device is None  # no device: created at the first scale()
    assert new.scaler.skipped_steps == 1 and not new.scaler.is_enabled()


def test_with_a_model_the_promoted_modules_move_to_fp32_again_and_the_device_is_created():
    old = make_precision("bf16", fp32_modules=["b"])
    old.prepare(model := Net())
    old.to_fp32(model, "a")
    new = switch_precision(old, "fp16", model, device="cpu", scale=32.0)
    assert new.in_fp32 == ["b", "a"] and old.in_fp32 == []
    assert new.scaler.device == torch.device("cpu") and new.scaler.get_scale() == 32.0
    assert new.scaler.is_enabled()


def test_a_pass_through_scaler_hands_over_no_counters():
    old = make_precision("bf16", scaler=LossScaler(enabled=False, check_finite=False))
    assert old.scaler.state_dict() == {}
    new = switch_precision(old, "fp16", None, scale=8.0)
    assert new.scaler.get_scale() == 2.0**16  # the new scaler's own start, not `scale`
    assert new.scaler.history_size == old.scaler.history_size


def test_the_new_scaler_keeps_the_old_history_size_and_starts_at_the_scale_given():
    old = make_precision("fp16", scaler_args={"history_size": 5, "init_scale": 512.0})
    _skipped_once(old)
    new = switch_precision(old, "fp16", None, scale=128.0)
    assert new.scaler.history_size == 5 and new.scaler.get_scale() == 128.0
    assert new.scaler.history() == old.scaler.history()
