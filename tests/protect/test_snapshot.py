"""The rollback snapshot (ampctl.protect.snapshot) on its own: what it keeps, in buffers allocated
once, and what restoring puts back -- weights, buffers, fp32 masters, optimizer state and its host
values -- in place, by name when a module was swapped, whole when the optimizer state appeared."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ampctl.protect.snapshot import (
    Snapshot,
    _copy_groups,
    _layout,
    _restore_host,
    _tensors,
    _with_tensors,
    _without_tensors,
    clone_state,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)
        self.norm = nn.BatchNorm1d(2)  # a buffer (running stats) and an int64 counter

    def forward(self, x):
        return self.norm(self.lin(x)).pow(2).mean()


X = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


def _train(model, opt, n=1):
    for _ in range(n):
        opt.zero_grad()
        model(X).backward()
        opt.step()


def _state(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


# ------------------------------------------------------------------ helpers
def test_tensors_of_a_nested_state_with_their_paths_in_order():
    t1, t2, t3 = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    got = _tensors({"a": t1, "b": [t2, (t3, 5)], "c": "x", "d": None})
    assert [(p, t is want) for (p, t), want in zip(got, (t1, t2, t3), strict=True)] == [
        (("a",), True),
        (("b", 0), True),
        (("b", 1, 0), True),
    ]
    assert _tensors(t1) == [((), t1)] and _tensors(3.0) == [] and _tensors({}) == []
    assert _tensors(t1, ("root",)) == [(("root",), t1)]


def test_layout_is_path_shape_dtype_device():
    t = torch.zeros(2, 3, dtype=torch.float16)
    assert _layout([(("w",), t)]) == ((("w",), torch.Size([2, 3]), torch.float16, t.device),)


def test_copy_groups_copies_every_pair_across_dtypes():
    dst = [torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(3)]
    src = [torch.ones(2), torch.full((1,), 2.0, dtype=torch.float64), torch.arange(3.0)]
    _copy_groups(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    with pytest.raises(ValueError):
        _copy_groups(dst, src[:2])


class Local(torch.Tensor):
    """A tensor that says it is a DTensor shard (``to_local``), as FSDP2's are."""

    copies = 0

    def to_local(self):
        return self

    def copy_(self, other):
        Local.copies += 1
        return super().copy_(other)


def test_copy_groups_copies_sharded_tensors_one_by_one():
    Local.copies = 0
    dst = [torch.zeros(2).as_subclass(Local), torch.zeros(2)]
    _copy_groups(dst, [torch.ones(2), torch.full((2,), 3.0)])
    assert Local.copies == 1 and dst[0].tolist() == [1.0, 1.0] and dst[1].tolist() == [3.0, 3.0]


def test_clone_state_copies_tensors_on_their_device_and_keeps_the_shape_of_the_state():
    t = torch.ones(2, requires_grad=True)
    inner = {"k": [1, 2]}
    state = {"t": t, "l": [t, 3], "tup": (t, "s"), "obj": inner}
    out = clone_state(state)
    assert _equal(out, state) and type(out["tup"]) is tuple and type(out["l"]) is list
    assert out["t"] is not t and not out["t"].requires_grad
    assert out["t"].data_ptr() != t.data_ptr()
    assert out["obj"] == inner and out["obj"] is not inner and out["obj"]["k"] is not inner["k"]
    assert clone_state(5) == 5
    other = SimpleNamespace(items=[1, 2])  # anything else: a deep copy
    got = clone_state({"o": other})["o"]
    assert got.items == [1, 2] and got is not other and got.items is not other.items


def test_without_and_with_tensors_split_and_rebuild_a_state():
    t = torch.arange(3.0)
    state = {"state": {0: {"m": t, "step": 3}}, "groups": [{"lr": 0.1, "params": [0]}], "x": (1,)}
    host = _without_tensors(state)
    assert host == {"state": {0: {"m": None, "step": 3}}, "groups": [{"lr": 0.1, "params": [0]}],
                    "x": (1,)}  # fmt: skip
    assert type(host["x"]) is tuple and host["groups"][0] is not state["groups"][0]
    back = _with_tensors(host, [("state", 0, "m")], [t])
    assert _equal(back, state) and back["state"][0]["m"] is not t
    assert host["state"][0]["m"] is None  # the host part itself is not filled in
    with pytest.raises(TypeError) as e:
        _with_tensors({"a": (None,)}, [("a", 0)], [t])
    assert str(e.value) == "a tensor inside a tuple of an optimizer state cannot be restored"


def test_restore_host_puts_back_the_param_group_values_but_not_params_nones_or_tensors():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    host = _without_tensors(opt.state_dict())
    opt.param_groups[0]["lr"] = 0.01
    opt.param_groups[0]["momentum"] = 0.1
    opt.param_groups[0]["extra"] = "mine"
    opt.param_groups[0]["tensor_lr"] = torch.tensor(1.0)
    host["param_groups"][0]["tensor_lr"] = 2.0
    host["param_groups"][0]["gone"] = None
    _restore_host(opt, host)
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["extra"]) == (0.5, 0.9, "mine")
    assert g["params"] == [p] and "gone" not in g
    assert g["tensor_lr"].item() == 1.0  # a tensor value is restored with the tensors
    host["param_groups"][0]["betas"] = [0.9]
    _restore_host(opt, host)
    assert g["betas"] == [0.9] and g["betas"] is not host["param_groups"][0]["betas"]


# ------------------------------------------------------------------ Snapshot
def test_an_empty_snapshot_holds_nothing():
    s = Snapshot()
    assert (s.step, s.progress) == (-1, None)
    assert s.model_state() == {} and s.optimizer_state() is None
    assert s.masters() is None and s.scale is None


def test_take_keeps_copies_of_weights_buffers_optimizer_state_masters_and_scale():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    masters = [torch.full((2,), 7.0), torch.full((1,), 8.0)]
    s = Snapshot()
    s.take(3, model, opt, masters=masters, scale=torch.tensor(256.0), progress={"p": 1})
    want_model, want_opt = _state(model, opt)
    assert (s.step, s.progress) == (3, {"p": 1})
    assert _equal(s.model_state(), want_model)
    assert _equal(s.optimizer_state(), want_opt)
    assert [m.tolist() for m in s.masters()] == [[7.0, 7.0], [8.0]]
    assert s.scale.item() == 256.0
    _train(model, opt)  # copies: training on changes nothing kept
    masters[0].fill_(0.0)
    assert _equal(s.model_state(), want_model) and _equal(s.optimizer_state(), want_opt)
    assert s.masters()[0].tolist() == [7.0, 7.0]
    got = s.optimizer_state()
    got["state"][0]["exp_avg"].fill_(9.0)
    assert _equal(s.optimizer_state(), want_opt)  # handed out as clones


def test_a_snapshot_without_masters_or_scale():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Snapshot()
    s.take(0, model, opt)
    assert s.masters() is None and s.scale is None and s.progress is None
    assert list(s.model_state()) == list(model.state_dict())


def test_take_refreshes_the_same_buffers_until_the_layout_changes():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = Snapshot()
    s.take(0, model, opt, scale=torch.tensor(1.0))
    first = list(s._buffers)
    s.take(1, model, opt, scale=torch.tensor(2.0))
    assert all(a is b for a, b in zip(s._buffers, first, strict=True))  # refreshed in place
    assert s.scale.item() == 2.0 and s.step == 1
    _train(model, opt)  # the optimizer created its state: a new layout
    s.take(2, model, opt, scale=torch.tensor(4.0))
    assert len(s._buffers) > len(first) and s.scale.item() == 4.0
    assert _equal(s.optimizer_state(), _state(model, opt)[1])
    again = list(s._buffers)
    _train(model, opt)
    s.take(3, model, opt, scale=torch.tensor(8.0))
    assert all(a is b for a, b in zip(s._buffers, again, strict=True))
    assert _equal(s.model_state(), _state(model, opt)[0])


def test_restore_puts_everything_back_in_place():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    masters = [torch.full((2,), 7.0)]
    s = Snapshot()
    s.take(1, model, opt, masters=masters, scale=torch.tensor(64.0))
    want_model, want_opt = _state(model, opt)
    live = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    _train(model, opt, 2)
    opt.param_groups[0]["lr"] = 0.5
    masters[0].fill_(-1.0)
    s.restore(model, opt, masters)
    assert _equal(model.state_dict(), want_model) and _equal(opt.state_dict(), want_opt)
    assert all(v is live[k] for k, v in model.state_dict(keep_vars=True).items())  # in place
    assert opt.param_groups[0]["lr"] == 1e-2 and masters[0].tolist() == [7.0, 7.0]
    _train(model, opt)
    s.restore(model, opt, masters)  # again, from the same snapshot
    assert _equal(model.state_dict(), want_model) and _equal(opt.state_dict(), want_opt)


def test_restore_loads_the_optimizer_state_whole_when_it_appeared_since():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = Snapshot()
    s.take(0, model, opt)
    want_model, want_opt = _state(model, opt)
    _train(model, opt, 2)
    assert opt.state_dict()["state"]
    s.restore(model, opt)
    assert _equal(model.state_dict(), want_model)
    assert opt.state_dict()["state"] == {} and _equal(opt.state_dict(), want_opt)


def test_restore_by_name_when_a_module_was_swapped():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Snapshot()
    s.take(0, model, opt)
    want = _state(model, opt)[0]
    swapped = nn.Linear(3, 2, dtype=torch.float64)  # e.g. a layer cast to another dtype
    model.lin = swapped
    s.restore(model, opt)
    assert model.lin is swapped and model.lin.weight.dtype == torch.float64
    assert torch.equal(model.lin.weight.float(), want["lin.weight"])
    assert torch.equal(model.norm.running_mean, want["norm.running_mean"])


def test_restore_without_masters_leaves_other_tensors_alone():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Snapshot()
    s.take(0, model, opt, scale=torch.tensor(8.0))
    other = torch.full((1,), 5.0)
    s.restore(model, opt, [])
    assert other.item() == 5.0 and s.scale.item() == 8.0


def test_restore_by_name_when_the_modules_were_reordered():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Snapshot()
    s.take(0, model, opt)
    want = _state(model, opt)[0]
    lin = model.lin
    del model.lin
    model.lin = lin  # registered again: now after `norm` in the state dict
    assert list(model.state_dict())[0] == "norm.weight"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    s.restore(model, opt)
    assert _equal(dict(model.state_dict()), dict(want))


def test_optimizer_state_of_the_same_layout_is_restored_into_the_same_tensors():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)
    s = Snapshot()
    s.take(1, model, opt)
    want = _state(model, opt)[1]
    live = [id(t) for st in opt.state.values() for t in st.values()]
    _train(model, opt)
    s.restore(model, opt)
    assert [id(t) for st in opt.state.values() for t in st.values()] == live
    assert _equal(opt.state_dict(), want)


def test_optimizer_state_whose_dtype_changed_is_loaded_whole():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt)
    s = Snapshot()
    s.take(1, model, opt)
    want = _state(model, opt)[1]
    p = model.lin.weight
    opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].double() * 3
    s.restore(model, opt)
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32  # as the optimizer loads it
    assert _equal(opt.state_dict(), want)


def test_host_values_are_deep_copies_both_ways():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    opt.param_groups[0]["tags"] = SimpleNamespace(names=["a"])
    model = nn.Module()
    model.p = p
    s = Snapshot()
    s.take(0, model, opt)
    opt.param_groups[0]["tags"].names.append("b")  # changed after the snapshot
    s.restore(model, opt)
    assert opt.param_groups[0]["tags"].names == ["a"]
    opt.param_groups[0]["tags"].names.append("c")  # the restored value is the caller's own
    s.restore(model, opt)
    assert opt.param_groups[0]["tags"].names == ["a"]


def test_restoring_onto_an_optimizer_with_other_param_groups_is_refused():
    model = Net()
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    s = Snapshot()
    s.take(0, model, opt)
    opt.add_param_group({"params": list(model.norm.parameters()), "lr": 0.2})
    with pytest.raises(ValueError):
        s.restore(model, opt)
