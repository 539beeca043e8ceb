"""The fused non-finite check and attribution (``ampctl.amp.overflow``) on planted values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampctl.amp.overflow import (
    check_and_unscale_,
    group_by_device_and_dtype,
    local_tensor,
    naive_overflow_check,
    names_flagged,
    nonfinite_flags,
    nonfinite_grad_names,
    nonfinite_tensor_names,
)

INF, NAN = float("inf"), float("nan")
CPU = torch.device("cpu")


class _Sharded:
    """Stands in for a DTensor: ``to_local()`` gives the rank's shard."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def to_local(self) -> torch.Tensor:
        return self.local

    def numel(self) -> int:
        return self.local.numel()


def test_local_tensor_takes_the_shard_and_leaves_tensors_alone():
    t = torch.ones(2)
    assert local_tensor(t) is t
    assert local_tensor(_Sharded(t)) is t


def test_groups_by_device_and_dtype_in_order_with_shards():
    a, b, c = torch.zeros(1), torch.zeros(2, dtype=torch.float16), torch.zeros(3)
    groups = group_by_device_and_dtype([a, _Sharded(b), c])
    assert list(groups) == [CPU]
    assert list(groups[CPU]) == [torch.float32, torch.float16]
    assert groups[CPU][torch.float32][0] is a and groups[CPU][torch.float32][1] is c
    assert groups[CPU][torch.float16][0] is b


def test_check_and_unscale_multiplies_in_place_and_flags_into_the_given_tensor():
    a = torch.tensor([2.0, 4.0])
    b = torch.tensor([8.0], dtype=torch.float16)
    found = torch.zeros(())
    inv = torch.tensor(0.25)
    out = check_and_unscale_([a, b], inv, found)
    assert list(out) == [CPU] and out[CPU] is found
    assert found.item() == 0.0
    assert a.tolist() == [0.5, 1.0] and b.tolist() == [2.0] and b.dtype == torch.float16
    c = torch.tensor([1.0, INF], dtype=torch.float16)
    out = check_and_unscale_([a, _Sharded(c)], inv, found)
    assert out[CPU] is found and found.item() == 1.0
    assert a.tolist() == [0.125, 0.25]


def test_check_and_unscale_gives_each_device_its_own_flag():
    """A second device (``meta`` here: CPU-only tests) gets a copy of the flag on that device."""
    a, m = torch.tensor([INF]), torch.ones(2, device="meta")
    found = torch.zeros(())
    out = check_and_unscale_([m, a], torch.ones(()), found)
    assert list(out) == [torch.device("meta"), CPU]
    assert out[CPU] is found and found.item() == 1.0
    assert out[torch.device("meta")].device.type == "meta"


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_check_and_unscale_flags_every_kind_of_non_finite(bad):
    found = torch.zeros(())
    check_and_unscale_([torch.ones(3), torch.tensor([1.0, bad])], torch.ones(()), found)
    assert found.item() == 1.0


def test_check_and_unscale_of_nothing_flags_nothing():
    found = torch.zeros(())
    assert check_and_unscale_([], torch.ones(()), found) == {}
    assert found.item() == 0.0


def test_nonfinite_flags_keep_the_given_order_across_dtype_groups():
    named = [
        ("none", None),
        ("a16", torch.tensor([1.0, INF], dtype=torch.float16)),
        ("b32", torch.tensor([1.0, 2.0])),
        ("empty", torch.zeros(0)),
        ("ints", torch.tensor([1, 2])),
        ("c16", torch.tensor([3.0], dtype=torch.float16)),
        ("d32", torch.tensor([NAN])),
        ("big", torch.tensor([3e38, 3e38])),  # finite: its 2-norm would overflow, not its max
        ("shard", _Sharded(torch.tensor([-INF]))),
    ]
    names, flags = nonfinite_flags(named)
    assert names == ["a16", "b32", "c16", "d32", "big", "shard"]
    assert flags.dtype == torch.float32
    assert flags.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_nonfinite_flags_live_on_the_first_tensors_device():
    named = [("m", torch.ones(2, device="meta")), ("c", torch.tensor([INF])), ("d", torch.ones(1))]
    names, flags = nonfinite_flags(named)
    assert names == ["m", "c", "d"]
    assert flags.device.type == "meta" and flags.shape == (3,)


def test_nonfinite_flags_reads_the_values_of_sparse_tensors():
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, INF]), (4,), check_invariants=True
    )
    clean = torch.sparse_coo_tensor(
        torch.tensor([[1]]), torch.tensor([5.0]), (4,), check_invariants=True
    )
    names, flags = nonfinite_flags([("s", sparse), ("c", clean)])
    assert names == ["s", "c"] and flags.tolist() == [1.0, 0.0]


def test_nonfinite_flags_of_no_floating_tensor_is_none():
    assert nonfinite_flags([("a", None), ("b", torch.tensor([1])), ("c", torch.zeros(0))]) == (
        [],
        None,
    )


def test_names_flagged_with_and_without_a_limit():
    names = ["a", "b", "c", "d"]
    flags = [1.0, 0.0, 1.0, 1.0]
    assert names_flagged(names, flags) == ["a", "c", "d"]
    assert names_flagged(names, flags, None) == ["a", "c", "d"]
    assert names_flagged(names, flags, 2) == ["a", "c"]
    assert names_flagged(names, flags, 0) == []
    with pytest.raises(ValueError):
        names_flagged(names, flags[:3])


def test_nonfinite_tensor_names_reads_and_limits():
    named = [("x", torch.tensor([INF])), ("y", torch.tensor([0.0])), ("z", torch.tensor([NAN]))]
    assert nonfinite_tensor_names(named) == ["x", "z"]
    assert nonfinite_tensor_names(named, limit=1) == ["x"]
    assert nonfinite_tensor_names([("n", None)]) == []


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    net(torch.ones(1, 3)).sum().backward()
    return net


def test_nonfinite_grad_names_from_a_module_or_named_parameters():
    net = _net()
    assert nonfinite_grad_names(net) == []
    net[1].weight.grad[0, 0] = NAN
    net[0].bias.grad[1] = INF
    assert nonfinite_grad_names(net) == ["0.bias", "1.weight"]
    assert nonfinite_grad_names(net, limit=1) == ["0.bias"]
    assert nonfinite_grad_names(list(net.named_parameters())[2:]) == ["1.weight"]
    net[1].weight.grad = None
    assert nonfinite_grad_names(net) == ["0.bias"]


def test_naive_overflow_check_finds_nan_and_inf_and_skips_missing_grads():
    net = _net()
    assert naive_overflow_check(net.parameters()) is False
    net[0].weight.grad = None
    net[1].bias.grad[0] = NAN
    assert naive_overflow_check(net.parameters()) is True
    net[1].bias.grad[0] = -INF
    assert naive_overflow_check(net.parameters()) is True
    net[1].bias.grad[0] = 0.0
    assert naive_overflow_check(net.parameters()) is False
