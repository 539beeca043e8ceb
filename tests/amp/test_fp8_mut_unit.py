"""ampctl.amp.fp8 at the edges its own tests left (issue #31): which loggers the torchao import
quiets, what counts as an fp8 layer, a model that is a Linear holding Linears, a second
conversion, the CUDA autocast cast of a recorded input and the underflow share of a lone
value. Tiny layers, milliseconds each; the ones that need torchao skip without it."""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
from torch import nn

from ampctl.amp import fp8

ROW = {f: i for i, f in enumerate(fp8.FIELDS)}


def test_require_torchao_quiets_exactly_torchaos_and_pytrees_loggers_then_restores_them(
    monkeypatch,
):
    with contextlib.suppress(fp8.Fp8Unavailable):
        fp8.require_torchao()  # a first import sets the levels of torchao's own loggers
    quiet = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    before = [lg.level for lg in quiet]
    calls: list[tuple[str, int]] = []
    set_level = logging.Logger.setLevel

    def spy(self, level):
        calls.append((self.name, level))
        set_level(self, level)

    monkeypatch.setattr(logging.Logger, "setLevel", spy)
    try:
        fp8.require_torchao()
    except fp8.Fp8Unavailable:
        pass  # without torchao the loggers are quieted and restored all the same
    assert calls == [
        ("torchao", logging.ERROR),
        ("torch.utils._pytree", logging.ERROR),
        ("torchao", before[0]),
        ("torch.utils._pytree", before[1]),
    ]


def test_a_linear_with_an_mm_config_is_not_an_fp8_layer():
    lin = nn.Linear(16, 16)
    lin.linear_mm_config = object()
    assert fp8.is_fp8_layer(lin) is False


class LinearWithParts(nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 16)
        self.inner = nn.Linear(16, 16)


def test_plan_of_a_model_that_is_a_linear_still_takes_the_linears_inside_it():
    p = fp8.plan(LinearWithParts())
    assert p.convert == ["inner"]
    assert p.skip == {"": "the model itself is a Linear: convert a model that contains it"}


def test_a_second_conversion_returns_only_the_layers_it_converted():
    pytest.importorskip("torchao.float8")
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    assert fp8.convert(model, exclude=["1"]) == ["0"]
    assert fp8.convert(model, exclude=[]) == ["1"]
    assert fp8.converted_layers(model) == ["0", "1"]


def test_under_cuda_autocast_the_record_sees_the_input_in_the_autocast_dtype():
    pytest.importorskip("torchao.float8")
    model = nn.Sequential(nn.Linear(16, 16))
    fp8.convert(model)
    rec = fp8.CastRecord(model)
    hook = rec._forward_hook("0")
    x = torch.full((2, 16), 1.005)  # 1.0078125 in bf16
    enabled, dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)  # the flag alone: nothing runs on CUDA here
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        hook(model[0], (x,), torch.zeros(2, 16))
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
    assert rec.names == ["0"]
    row = rec.rows()[0]
    assert row.dtype == torch.float32
    assert row[ROW["in_amax"]].item() == 1.0078125


def test_a_lone_finite_value_flushed_by_an_infinite_amax_is_all_of_the_underflow():
    pytest.importorskip("torchao.float8")
    model = nn.Sequential(nn.Linear(16, 16))
    fp8.convert(model)
    rec = fp8.CastRecord(model)
    layer = model[0]
    x = torch.tensor([[math.inf, 1.0, 0.0, 0.0]])  # the inf makes the scale 0: 1.0 -> 0
    amax, _sat, under = rec._stats(
        x, layer.config.cast_config_input, layer.config, layer, "INPUT", -1
    ).tolist()
    assert amax == math.inf
    assert under == 1.0  # 1 of the 1 finite nonzero value
