"""State health streams: one tensor at a time, whatever the checkpoint's size (#35).

Small files (a few MB, some sparse) stand for the large ones; the full sizes are in
``scripts/bench_checkpoint_size.py``.
"""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from ampctl.commands.diagnose import health, readers
from ampctl.commands.diagnose.health import state_health, tensor_figures
from ampctl.commands.diagnose.readers import base

from .conftest import diagnose_cli, kinds, problem

NAN_BF16 = b"\xc0\x7f"


def _sparse_safetensors(path: Path, shapes: dict[str, list[int]], dtype: str = "BF16") -> dict:
    """A valid safetensors file of zeros (sparse: a header, then truncate); its header."""
    size = {"BF16": 2, "F32": 4}[dtype]
    header, off = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(header)
    text += " " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text.encode())
        f.truncate(8 + len(text) + off)
    return {"start": 8 + len(text), **header}


def _plant(path: Path, header: dict, name: str, at: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(header["start"] + header[name]["data_offsets"][0] + 2 * at)
        f.write(NAN_BF16)


@pytest.fixture
def live_count(monkeypatch):
    """Counts the safetensors tensors alive at once (loaded and not yet dropped)."""
    pytest.importorskip("safetensors")
    state = {"live": 0, "peak": 0, "loads": 0}
    real = base._safetensors_one

    def counted(path, name):
        t = real(path, name)
        state["loads"] += 1
        state["live"] += 1
        state["peak"] = max(state["peak"], state["live"])
        weakref.finalize(t, lambda: state.__setitem__("live", state["live"] - 1))
        return t

    monkeypatch.setattr(base, "_safetensors_one", counted)
    return state


def test_state_health_holds_one_tensor_at_a_time(tmp_path, live_count):
    p = tmp_path / "many.safetensors"
    shapes = {f"layers.{i}.weight": [256, 256] for i in range(40)}
    hdr = _sparse_safetensors(p, shapes)
    _plant(p, hdr, "layers.33.weight")
    found = readers.read(p)
    assert live_count["loads"] == 0  # reading the file read no tensor
    st = state_health(found)
    assert live_count["loads"] == 40 and live_count["peak"] == 1
    assert [b.name for b in st.weights.bad] == ["layers.33.weight"]
    assert st.weights.tensors == 40 and st.weights.elements == 40 * 256 * 256


def test_a_file_is_not_refused_for_its_size_alone(tmp_path):
    """96 MiB of tensors under --max-memory 100M: each tensor is 32 MiB, read one at a time."""
    pytest.importorskip("safetensors")
    p = tmp_path / "big.safetensors"
    _sparse_safetensors(p, {f"w{i}": [4096, 2048] for i in range(3)}, "F32")
    code, rep, err = diagnose_cli(p, "--max-memory", "100M")
    assert code == 0, err
    assert rep["state"]["weights"]["tensors"] == 3
    code, _, err = diagnose_cli(p, "--max-memory", "64M")  # the largest tensor does not fit
    assert code == 2
    assert "(96.0 MiB of tensors) needs about 96.0 MiB of memory, more than the 64.0 MiB" in err


def _shard_folder(d: Path, *, missing: bool = False, outside: bool = False) -> Path:
    d.mkdir()
    shards = {
        "model-00001-of-00002.safetensors": {"a.weight": [64, 64], "b.weight": [64, 64]},
        "model-00002-of-00002.safetensors": {"c.weight": [64, 64], "d.weight": [64]},
    }
    wmap = {}
    for name, shapes in shards.items():
        hdr = _sparse_safetensors(d / name, shapes)
        if "c.weight" in shapes:
            _plant(d / name, hdr, "c.weight")
        wmap.update(dict.fromkeys(shapes, name))
    if missing:
        wmap["e.weight"] = "model-00003-of-00003.safetensors"
    if outside:
        wmap["f.weight"] = "../elsewhere.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return d


def test_sharded_safetensors_folder_names_the_planted_nan(tmp_path):
    pytest.importorskip("safetensors")
    folder = _shard_folder(tmp_path / "sharded")
    code, rep, err = diagnose_cli(folder)
    assert code == 1, err
    assert rep["format"] == "safetensors"
    assert problem(rep, "nonfinite_weights")["tensors"] == ["c.weight"]
    assert rep["state"]["weights"]["tensors"] == 4
    read = {f["file"]: f["why"] for f in rep["files"] if f["read"]}
    assert read["model.safetensors.index.json"] == "shard index (4 tensors in 2 files)"


def test_a_shard_the_index_names_but_lacks_is_reported(tmp_path):
    pytest.importorskip("safetensors")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"not to be opened")
    folder = _shard_folder(tmp_path / "sharded", missing=True, outside=True)
    code, rep, err = diagnose_cli(folder)
    assert code == 1, err
    assert "nonfinite_weights" in kinds(rep) and "unreadable_file" in kinds(rep)
    assert "model-00003-of-00003.safetensors" in problem(rep, "unreadable_file")["message"]
    notes = {f["file"]: f for f in rep["files"]}
    assert notes["../elsewhere.safetensors"]["read"] is False
    assert "not a shard name: not opened" in notes["../elsewhere.safetensors"]["why"]


def test_a_pt_file_is_memory_mapped_and_its_nan_named(tmp_path, monkeypatch):
    sd = {f"block.{i}.weight": torch.randn(64, 64) for i in range(6)}
    sd["block.4.weight"][3, 3] = float("nan")
    p = tmp_path / "model.pt"
    torch.save(sd, p)
    calls = []
    real = torch.load

    def spy(*a, **kw):
        calls.append(kw.get("mmap"))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "load", spy)
    code, rep, err = diagnose_cli(p)
    assert code == 1, err
    assert calls and all(calls)  # every torch.load of the checkpoint was mmap=True
    assert problem(rep, "nonfinite_weights")["tensors"] == ["block.4.weight"]


def test_a_stride_zero_view_is_never_expanded(tmp_path, monkeypatch):
    """#37: a 1.8 KB .pt holding a 65536x65536 view of one element (16 GiB if expanded)."""
    p = tmp_path / "view.pt"
    torch.save({"w": torch.tensor([float("nan")]).expand(65536, 65536), "b": torch.ones(3)}, p)
    assert p.stat().st_size < 4096
    real = health._chunks

    def bounded(t):
        assert t.numel() <= 1, f"a chunk walk over {t.numel()} elements of a view"
        return real(t)

    monkeypatch.setattr(health, "_chunks", bounded)
    code, rep, err = diagnose_cli(p)
    assert code == 1, err
    bad = problem(rep, "nonfinite_weights")
    assert bad["tensors"] == ["w"]
    assert rep["state"]["weights"]["elements"] == 65536 * 65536 + 3
    # the figures count every element the view shows
    nan, pos, neg, above, top, numel = tensor_figures(
        torch.tensor([7e4]).expand(1 << 16, 3, 1 << 16), 65504
    )
    assert (nan, pos, neg, above, top, numel) == (0, 0, 0, 3 << 32, 7e4, 3 << 32)


def test_figures_are_exact_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(health, "CHUNK", 1000)
    x = torch.zeros(97, 131, dtype=torch.bfloat16)
    x[0, 0], x[3, 4], x[50, 7] = float("nan"), float("nan"), float("inf")
    x[96, 130] = -float("inf")
    x[10, 10], x[90, 1] = 7e4, -8e4
    for t in (x, x.t(), x[::2, 1::3]):
        ref = t.float()
        fin = torch.isfinite(ref)
        mag = torch.where(fin, ref, 0).abs()
        want = [
            float(torch.isnan(ref).sum()),
            float(torch.isposinf(ref).sum()),
            float(torch.isneginf(ref).sum()),
            float((mag > 65504).sum()),
            float(mag.max()),
            float(t.numel()),
        ]
        assert tensor_figures(t, 65504) == want
    assert tensor_figures(torch.full((5000,), 2.0), 1.0)[3] == 5000  # all finite, above limit


def test_replay_that_does_not_fit_is_skipped_with_one_line(tmp_path):
    """A model folder (save_pretrained: weights + config.json) whose rebuild needs more than
    --max-memory: the state health still reports; the replay says why and what would run it."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt2"
    folder.mkdir()
    cfg = transformers.GPT2Config(n_embd=512, n_layer=3, n_head=4, vocab_size=1000, n_positions=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.to_json_file(folder / "config.json")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _sparse_safetensors(folder / "model.safetensors", shapes, "F32")  # ~40 MB, sparse
    code, rep, err = diagnose_cli(folder, "--max-memory", "100M")
    assert code == 0, err
    assert rep["state"]["weights"]["tensors"] == len(shapes)
    reason = rep["replay"]["reason"]
    assert rep["replay"]["ran"] is False and "\n" not in reason
    assert reason.startswith("rebuilding the whole model (in fp32, with gradients and activat")
    assert "more than the 100.0 MiB allowed; the state health and the history do not" in reason
    assert "pass --max-memory SIZE" in reason and "--device cuda" in reason


def test_dcp_items_are_read_one_at_a_time(tmp_path, monkeypatch):
    import warnings

    import torch.distributed.checkpoint as dcp_api

    from ampctl.commands.diagnose.readers import dcp

    model = {f"layer{i}.weight": torch.randn(160, 128) for i in range(6)}
    model["layer4.weight"][7, 7] = float("nan")
    model["layer1.bias"] = torch.zeros(128)  # small: read up front
    optim = {"state": {k: {"exp_avg": torch.zeros_like(v)} for k, v in model.items()}}
    optim["state"]["layer2.weight"]["exp_avg"][0, 0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_api.save({"model": model, "optim": optim}, checkpoint_id=str(tmp_path / "ck"))
    state = {"live": 0, "peak": 0, "loads": 0}
    real = dcp._one_item

    def counted(*a):
        t = real(*a)
        state["loads"] += 1
        state["live"] += 1
        state["peak"] = max(state["peak"], state["live"])
        weakref.finalize(t, lambda: state.__setitem__("live", state["live"] - 1))
        return t

    monkeypatch.setattr(dcp, "_one_item", counted)
    found = readers.read(tmp_path / "ck")
    assert state["loads"] == 0
    st = state_health(found)
    assert state["loads"] == 12 and state["peak"] == 1  # 6 weights, 6 moments, one at a time
    assert [b.name for b in st.weights.bad] == ["layer4.weight"]
    assert [b.param for b in st.optimizer.bad] == ["layer2.weight"]
    assert st.weights.tensors == 7


def test_bin_shards_through_their_index(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    shards = {
        "pytorch_model-00001-of-00002.bin": {"a.weight": torch.randn(32, 32)},
        "pytorch_model-00002-of-00002.bin": {
            "b.weight": torch.randn(32, 32),
            "b.bias": torch.zeros(32),
        },
    }
    shards["pytorch_model-00002-of-00002.bin"]["b.weight"][1, 1] = float("inf")
    wmap = {}
    for name, sd in shards.items():
        torch.save(sd, folder / name)
        wmap.update(dict.fromkeys(sd, name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wmap}))
    code, rep, err = diagnose_cli(folder)
    assert code == 1, err
    assert rep["format"] == "state-dict" and rep["state"]["weights"]["tensors"] == 3
    assert problem(rep, "nonfinite_weights")["tensors"] == ["b.weight"]


def test_tied_tensors_of_a_mapped_file_are_counted_once(tmp_path):
    w = torch.randn(16, 8)
    w[0, 0] = float("nan")
    p = tmp_path / "tied.pt"
    torch.save({"embed.weight": w, "lm_head.weight": w, "norm.weight": torch.ones(8)}, p)
    found = readers.read(p)
    st = state_health(found)
    assert st.weights.tensors == 2 and st.weights.elements == 16 * 8 + 8
    assert [b.name for b in st.weights.bad] == ["embed.weight"]
