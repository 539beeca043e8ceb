"""ActGradCounter / ActGradProbe: what counts as an underflowed fp16 activation gradient."""

from __future__ import annotations

import torch
from torch import nn

from ampctl.amp.actgrad import ActGradCounter, ActGradProbe
from ampctl.protect.figures import DeviceFigures


class ToHalf(nn.Module):
    def forward(self, x):
        return x.half()


class Net(nn.Module):
    """x -> fp16 (leaf: counted) -> fp32 (leaf: not counted)."""

    def __init__(self):
        super().__init__()
        self.to_half = ToHalf()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.to_half(x).float())


def _backward_with(model, grad):
    x = torch.ones(1, 4, requires_grad=True)
    y = model.to_half(x)  # only the fp16 leaf output matters here
    y.backward(grad.half())


def test_counts_zero_subnormal_and_normal_elements_exactly():
    model = Net()
    c = ActGradCounter()
    with c.hooks(model):
        # 0 stays 0; 1e-9 flushes to 0 in fp16; 1e-6 is a subnormal; 1e-3 is normal
        _backward_with(model, torch.tensor([[0.0, 1e-9, 1e-6, 1e-3]]))
    assert c.counts.tolist() == [2, 3, 4]
    assert c.fractions(c.counts.tolist()) == {
        "act_grad_underflow_frac": 0.75,
        "act_grad_zero_frac": 0.5,
    }


def test_counts_add_up_over_backward_passes_and_only_fp16_tensors_count():
    model = Net()
    c = ActGradCounter()
    with c.hooks(model):
        for _ in range(3):  # gradient accumulation: three backward passes
            model(torch.ones(2, 4, requires_grad=True)).sum().backward()
    # the fp16 leaf output (2x4) counted three times; the fp32 Linear output never
    assert c.counts[2].item() == 3 * 8


def test_hooks_are_removed_and_nothing_is_counted_after_the_context():
    model = Net()
    c = ActGradCounter()
    with c.hooks(model):
        pass
    assert all(not m._forward_hooks for m in model.modules())
    model(torch.ones(1, 4, requires_grad=True)).sum().backward()
    assert c.counts is None


def test_a_run_without_fp16_activations_reports_none():
    c = ActGradCounter()
    lin = nn.Linear(4, 4)
    with c.hooks(lin):
        lin(torch.ones(1, 4)).sum().backward()
    assert c.counts is None
    assert c.fractions(None) == {"act_grad_underflow_frac": None, "act_grad_zero_frac": None}


def test_loss_scaling_is_what_lifts_gradients_out_of_the_subnormal_range():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)

    def frac(scale):
        c = ActGradCounter()
        with c.hooks(mlp):
            with torch.autocast("cpu", dtype=torch.float16):
                y = mlp(x)
            (y.float().mean() * 1e-4 * scale).backward()
        mlp.zero_grad()
        return c.fractions(c.counts.tolist())["act_grad_underflow_frac"]

    assert frac(1.0) > 0.9  # a mean over many elements times a small loss: subnormal
    assert frac(2.0**16) < 0.05  # the loss scale brings it back into fp16's normal range


def test_probe_installs_nothing_when_not_sampling_and_rides_on_the_log_read():
    model = Net()
    probe = ActGradProbe()
    with probe.sampling(model, False):
        assert all(not m._forward_hooks for m in model.modules())
    fig = DeviceFigures(torch.device("cpu"))
    probe.figures(fig)
    assert fig.read(None) == {}
    assert probe.row({}) == {}

    with probe.sampling(model, True):
        _backward_with(model, torch.tensor([[0.0, 1e-9, 1e-6, 1e-3]]))
    fig = DeviceFigures(torch.device("cpu"))
    probe.figures(fig)
    values = fig.read(None)
    assert values == {"act_grad_counts": [2.0, 3.0, 4.0]}
    assert probe.row(values) == {"act_grad_underflow_frac": 0.75, "act_grad_zero_frac": 0.5}
    assert probe.row(values) == {}  # one row per sample
