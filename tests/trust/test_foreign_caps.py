"""A Hugging Face checkpoint folder is data too (issue 37): its ``config.json`` and tokenizer
files are read under the whole-file cap, and a layer count larger than the checkpoint's tensors
is refused before transformers builds the model (the optimizer-naming meta build and the
replay). The attack files are sparse (no disk); the test asserts the refusal and a bounded peak
memory and time."""

from __future__ import annotations

import json
import resource
import shutil
import time

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")  # the Trainer that writes the checkpoint

from tests.commands.diagnose import makers  # noqa: E402
from tests.commands.diagnose.conftest import diagnose_cli  # noqa: E402

BIG = 3 << 30  # a 3 GiB sparse file: over the whole-file cap


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    out = makers.make_hf(tmp_path_factory.mktemp("hfcaps") / "hf")
    return sorted(out.glob("checkpoint-*"))[-1]


@pytest.fixture
def copy(hf_ckpt, tmp_path):
    dest = tmp_path / hf_ckpt.name
    shutil.copytree(hf_ckpt, dest)
    return dest


def _peak_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def test_a_million_layers_in_config_json_are_refused_before_a_build(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["num_hidden_layers"] = 1_000_000
    (copy / "config.json").write_text(json.dumps(cfg))
    t0 = time.perf_counter()
    code, rep, err = diagnose_cli(copy)
    assert code in (0, 1), err
    assert time.perf_counter() - t0 < 60
    want = "asks for num_hidden_layers=1000000 layers but the checkpoint holds"
    assert any(want in n for n in rep["notes"]), rep["notes"]
    assert not rep["replay"]["ran"] and want in rep["replay"]["reason"]


def test_a_3gb_config_json_is_never_read_whole(copy):
    with open(copy / "config.json", "r+b") as f:
        f.truncate(BIG)
    before = _peak_mb()
    code, rep, err = diagnose_cli(copy)
    assert code in (0, 1), err
    assert any(
        "the model is not rebuilt from config.json" in n and "limit" in n for n in rep["notes"]
    )
    assert not rep["replay"]["ran"] and "limit" in rep["replay"]["reason"]
    assert _peak_mb() - before < 500


def test_a_3gb_tokenizer_json_is_not_read_for_data(copy, tmp_path):
    (copy / "tokenizer.json").write_bytes(b"{}")
    with open(copy / "tokenizer.json", "r+b") as f:
        f.truncate(BIG)
    text = tmp_path / "text.txt"
    text.write_text("some words to tokenize\n" * 10)
    before = _peak_mb()
    code, rep, err = diagnose_cli(copy, "--data", str(text))
    assert code in (0, 1), err
    reason = rep["replay"]["reason"]
    assert not rep["replay"]["ran"] and "tokenizer.json" in reason and "limit" in reason, reason
    assert _peak_mb() - before < 500
