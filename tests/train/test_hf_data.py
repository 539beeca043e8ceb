"""data=hf: local datasets + tokenizers, packing, cache, determinism, resume, sharding, errors,
the tokenizer trainer, and one check on real text that ships with Python."""

from __future__ import annotations

import json
import os
import random
import socket
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

from typer.testing import CliRunner  # noqa: E402

from ampctl.cli import app  # noqa: E402
from ampctl.config import load_config  # noqa: E402
from ampctl.errors import UsageError  # noqa: E402
from ampctl.tokenizer import train_tokenizer  # noqa: E402
from ampctl.train import hf_data  # noqa: E402
from ampctl.train.builders import (
    build_data,
    build_data_source,  # noqa: E402
)
from ampctl.train.data import IGNORE_INDEX, DataError  # noqa: E402
from ampctl.train.hf_data import HFSource, load_tokenizer  # noqa: E402

WORDS = (
    "the a loss scale overflow gradient step skip model layer norm weight half float "
    "precision range bits exponent mantissa sum mean token batch train run guard fall back "
    "is was goes grows halves keeps finds stays under over into with from and but"
).split()
VOCAB = 400


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _source(cfg):
    return build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)


def _document(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 6)):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 12))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of .txt documents written by the test (no download)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for i in range(24):
        (root / f"doc{i:02d}.txt").write_text(_document(rng) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tokenizer(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer(corpus, out, vocab_size=VOCAB, min_frequency=1)
    return out


@pytest.fixture
def make(corpus: Path, tokenizer: Path, tmp_path: Path):
    def build(**kw: object) -> HFSource:
        args: dict[str, object] = dict(
            path=str(corpus),
            tokenizer=str(tokenizer),
            seq_len=16,
            batch_size=4,
            vocab_size=VOCAB,
            seed=3,
            objective="causal",
            cache_dir=str(tmp_path / "cache"),
        )
        args.update(kw)
        return build_data("hf", **args)  # type: ignore[return-value]

    return build


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ tokenizer


def test_trained_tokenizer_round_trips_and_names_its_specials(tokenizer: Path) -> None:
    tok = load_tokenizer(tokenizer)
    assert tok.vocab_size == VOCAB
    assert tok.roles == {"eos": 0, "pad": 1, "cls": 2, "sep": 3, "mask": 4}
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    text = "Loss scale halves, naïve café 東京 {x: 1}\n\tend"
    assert raw.decode(raw.encode(text).ids) == text  # byte-level: nothing is unknown


def test_tokenizer_cli_writes_once_and_says_how_to_use_it(corpus: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "tok"
    args = ["tokenizer", "train", str(corpus), "--out", str(out), "--vocab-size", "300"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "300 tokens from 24 documents" in res.output
    assert f"data.tokenizer={out} data.vocab_size=300" in res.output
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == "[MASK]"
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "already holds a tokenizer.json" in again.output
    py = runner.invoke(
        app,
        [
            "tokenizer",
            "train",
            str(corpus / "*.txt"),
            "--out",
            str(tmp_path / "t3"),
            "--format",
            "text",
        ],
    )
    assert py.exit_code == 0 and "data.format=text data.tokenizer=" in py.output
    small = runner.invoke(app, [*args[:4], str(tmp_path / "t2"), "--vocab-size", "100"])
    assert small.exit_code == 2 and "--vocab-size 100" in small.output


def test_auto_tokenizer_folder_works_too(corpus: Path, tmp_path: Path) -> None:
    """A folder without tokenizer.json (a BERT vocab.txt) goes through AutoTokenizer; its
    special tokens sit at the end of the vocabulary, not at ampctl's ids 0-3."""
    pytest.importorskip("transformers")
    folder = tmp_path / "bert"
    folder.mkdir()
    vocab = [".", *sorted(set(WORDS)), "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    )
    src = HFSource(
        path=corpus,
        tokenizer=folder,
        seq_len=32,
        batch_size=4,
        vocab_size=len(vocab),
        objective="mlm",
        cache_dir=tmp_path / "cache",
    )
    cls, sep, mask = (vocab.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
    b = src.next_batch()
    assert (b["input_ids"][:, 0] == cls).all()
    assert (src._stream == sep).sum() == 24
    selected = b["labels"] != IGNORE_INDEX
    assert selected.any() and (b["input_ids"][selected] == mask).any()
    assert (b["labels"][selected] < len(vocab) - 5).all()  # never a special token
    random_ids = b["input_ids"][selected & (b["input_ids"] != b["labels"])]
    assert not torch.isin(
        random_ids, torch.tensor([cls, sep, len(vocab) - 5, len(vocab) - 4])
    ).any()


# -------------------------------------------------------------------- batches


def test_causal_batches_are_consecutive_windows_of_the_stream(make) -> None:
    src = make()
    b = src.batch_at(0)
    assert torch.equal(b["labels"], b["input_ids"]) and b["attention_mask"].all()
    stream = src._stream.long()
    windows = stream[: src.num_windows * 16].view(-1, 16)
    for row in b["input_ids"]:
        assert (windows == row).all(1).any()
    # 24 documents, each closed by <|endoftext|> (id 0)
    assert src.num_documents == 24 and int((stream == 0).sum()) == 24
    assert src.num_windows == src.num_tokens // 16


def test_every_window_once_per_epoch(make) -> None:
    src = make(batch_size=1)
    n = src.num_windows
    windows = src._stream.long()[: n * 16].view(n, 16).tolist()
    rows = [src.batch_at(s)["input_ids"][0].tolist() for s in range(2 * n)]
    assert sorted(rows[:n]) == sorted(windows)
    assert rows[:n] != rows[n:]


def test_mlm_batches_mask_only_ordinary_tokens(make) -> None:
    src = make(objective="mlm")
    b = src.batch_at(1)
    assert (b["input_ids"][:, 0] == 2).all()  # [CLS] prepended
    selected = b["labels"] != IGNORE_INDEX
    assert selected.sum(dim=1).min() >= 1
    assert (b["labels"][selected] >= 5).all()  # specials are 0-4: never asked for
    assert (b["input_ids"][selected] == 4).float().mean() > 0.5  # mostly [MASK]
    assert int((src._stream == 3).sum()) == src.num_documents == 24  # [SEP] closes documents


def test_same_seed_same_batches_other_seed_other(make) -> None:
    a, b, c = make(), make(), make(seed=4)
    for _ in range(3):
        x, y = a.next_batch(), b.next_batch()
        assert same(x, y)
    assert not same(make().batch_at(0), c.batch_at(0))
    m1, m2 = make(objective="mlm"), make(objective="mlm")
    assert same(m1.batch_at(5), m2.batch_at(5))


def test_resume_from_state_dict_continues_exactly(make) -> None:
    src = make(objective="mlm")
    for _ in range(5):
        src.next_batch()
    state = src.state_dict()
    expected = [src.next_batch() for _ in range(3)]
    fresh = make(objective="mlm")
    fresh.load_state_dict(state)
    assert fresh.position == 5
    assert all(same(e, fresh.next_batch()) for e in expected)


def test_ranks_share_the_global_batch_sequence(make) -> None:
    single = make()
    r0, r1 = make(rank=0, world_size=2), make(rank=1, world_size=2)
    for i in range(3):
        assert same(r0.batch_at(i), single.batch_at(2 * i))
        assert same(r1.batch_at(i), single.batch_at(2 * i + 1))


# ---------------------------------------------------------------------- cache


def test_second_run_reads_the_cache_without_tokenizing(make, monkeypatch) -> None:
    first = make()
    assert not first.cache_hit and (first.cache_path / "tokens.bin").is_file()

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(hf_data, "iter_texts", boom)
    t0 = time.perf_counter()
    second = make(seq_len=24, objective="causal")  # another seq_len reuses the stream
    assert second.cache_hit and second.cache_path == first.cache_path
    assert time.perf_counter() - t0 < 5.0
    assert torch.equal(second._stream, first._stream)


def test_cache_is_invalidated_when_a_file_changes(make, corpus: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy)
    a = make(path=str(copy))
    (copy / "doc00.txt").write_text("Entirely new words here, and more of them.\n")
    b = make(path=str(copy))
    assert not b.cache_hit and b.cache_path != a.cache_path and b.num_tokens != a.num_tokens
    assert make(path=str(copy), objective="mlm").cache_path != b.cache_path  # SEP, not EOS


def test_nothing_touches_the_network(make, monkeypatch) -> None:
    import datasets

    def no_network(*a, **k):
        raise AssertionError("network access")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    seen: list[tuple] = []
    load = datasets.load_dataset

    def spy(*a, **k):
        seen.append((os.environ.get("HF_HUB_OFFLINE"), datasets.config.HF_HUB_OFFLINE))
        return load(*a, **k)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    src = make(objective="mlm")
    assert not src.cache_hit and src.num_windows > 0
    assert seen == [("1", True)]  # offline while ampctl calls the library...
    assert "HF_HUB_OFFLINE" not in os.environ  # ...and the user's environment restored
    assert datasets.config.HF_HUB_OFFLINE is False


# -------------------------------------------------------------------- formats


def test_jsonl_parquet_and_save_to_disk(tmp_path: Path, tokenizer: Path) -> None:
    import datasets

    rng = random.Random(1)
    rows = [{"id": i, "body": _document(rng)} for i in range(12)]
    jl = tmp_path / "data.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "data.parquet"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(2))}).save_to_disk(
        str(tmp_path / "saved")
    )
    common = dict(
        tokenizer=tokenizer,
        seq_len=16,
        batch_size=2,
        vocab_size=VOCAB,
        objective="causal",
        text_field="body",
        cache_dir=tmp_path / "cache",
    )
    streams = [
        HFSource(path=tmp_path / name, **common)._stream
        for name in ("data.jsonl", "data.parquet", "saved")
    ]
    assert torch.equal(streams[0], streams[1]) and torch.equal(streams[0], streams[2])
    val = HFSource(path=tmp_path / "saved", split="validation", **common)
    assert val.num_documents == 2
    with pytest.raises(
        DataError, match="data.split 'test' is not in .*; splits: train, validation"
    ):
        HFSource(path=tmp_path / "saved", split="test", **common)
    with pytest.raises(
        DataError, match="data.text_field 'text' is not a field of .*fields: id, body"
    ):
        HFSource(path=jl, **{**common, "text_field": "text"})
    with pytest.raises(DataError, match="'text' is not a column of .*columns: id, body"):
        HFSource(path=tmp_path / "saved", **{**common, "text_field": "text"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"path": "/nonexistent/corpus"}, "data.path '/nonexistent/corpus' does not exist"),
        ({"path": "/nonexistent/*.txt"}, "matches no files"),
        ({"tokenizer": "/nonexistent/tok"}, "data.tokenizer '/nonexistent/tok' does not exist"),
        ({"vocab_size": 300}, "has 400 tokens, more than data.vocab_size=300"),
        ({"seq_len": 100000}, "too few for one sequence of seq_len 100000"),
        ({"format": "arrow"}, "is not a save_to_disk folder"),
        ({"format": "csv"}, "data.format ('csv') must be one of"),
        ({"objective": "span"}, "data.objective ('span') must be one of mlm, causal"),
    ],
)
def test_errors_are_one_clear_line(make, kwargs: dict, message: str) -> None:
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        make(**kwargs)
    assert "\n" not in str(e.value)


def test_unknown_extensions_and_special_less_tokenizers(tmp_path: Path, make) -> None:
    (tmp_path / "a.py").write_text("print('hello world')\n" * 40)
    with pytest.raises(DataError, match=r"no known extension \(\.py\): set data.format=text"):
        make(path=str(tmp_path / "*.py"))
    assert make(path=str(tmp_path / "*.py"), format="text").num_documents == 1
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match="has no eos token, which objective=causal needs"):
        make(tokenizer=str(tmp_path / "bare.json"))
    with pytest.raises(DataError, match="has no sep token, which objective=mlm needs"):
        make(tokenizer=str(tmp_path / "bare.json"), objective="mlm")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(DataError, match="is not a tokenizers tokenizer.json"):
        make(tokenizer=str(tmp_path / "junk.json"))


def test_cli_reports_a_missing_tokenizer_in_one_line(corpus: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        [
            "train",
            "conf=gpt2_tiny",
            "data=hf",
            f"data.path={corpus}",
            f"data.tokenizer={tmp_path / 'none'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ],
    )
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.startswith("ampctl: error:")]
    assert len(lines) == 1 and "data.tokenizer" in lines[0] and "does not exist" in lines[0]
    assert "Traceback" not in res.output


def test_builder_checks_the_model_vocabulary(corpus: Path, tokenizer: Path, tmp_path: Path) -> None:
    base = [
        "conf=gpt2_tiny",
        "data=hf",
        f"data.path={corpus}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path}",
        "data.seq_len=16",
        f"data.vocab_size={VOCAB}",
    ]
    src = _source(load_config(base))
    assert src.objective == "causal" and src.seq_len == 16
    with pytest.raises(
        UsageError, match="more than model.vocab_size=300: set model.vocab_size=400"
    ):
        _source(load_config([*base, "model.vocab_size=300"]))
    with pytest.raises(UsageError, match="more than data.vocab_size=350"):
        _source(load_config([*base[:-1], "data.vocab_size=350"]))


# ------------------------------------------------------------------ real text


def test_real_text_python_stdlib_sources(tmp_path: Path) -> None:
    """Python's own json package sources (they ship with every Python) as a text corpus."""
    pattern = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
    files = sorted(Path(pattern).parent.glob("*.py"))
    assert len(files) >= 4
    tok_dir = tmp_path / "tok"
    trained = train_tokenizer(pattern, tok_dir, vocab_size=1024, format="text")
    assert trained.documents == len(files)
    src = HFSource(
        path=pattern,
        tokenizer=tok_dir,
        format="text",
        seq_len=64,
        batch_size=4,
        vocab_size=1024,
        objective="causal",
        cache_dir=tmp_path / "cache",
    )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    sources = "".join(f.read_text(encoding="utf-8") for f in files)
    # BPE merges many characters per token on code it was trained on
    assert src.num_tokens - src.num_documents < len(sources) / 2.5
    checked = 0
    for row in src.batch_at(0)["input_ids"]:
        segment: list[int] = []
        for t in [*row.tolist(), 0]:  # 0: <|endoftext|>, between files
            if t != 0:
                segment.append(t)
            elif segment:
                assert tok.decode(segment) in sources
                checked += len(segment)
                segment = []
    assert checked >= 4 * 64 - 4
