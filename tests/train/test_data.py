"""Masked-LM data: determinism, resume, sharding, masking statistics, text corpus, errors."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampctl.train.builders import build_data
from ampctl.train.data import (
    CLS_ID,
    FIRST_ORDINARY_ID,
    IGNORE_INDEX,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    DataError,
    SyntheticSource,
    TextSource,
    TokenSource,
    apply_mlm_masking,
    decode,
    encode,
)

Batch = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Small tensors: one intra-op thread is as fast and immune to core contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def same(a: Batch, b: Batch) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def original_tokens(batch: Batch) -> torch.Tensor:
    """The unmasked sequence: labels hold the original token wherever input was changed."""
    return torch.where(batch["labels"] != IGNORE_INDEX, batch["labels"], batch["input_ids"])


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    text = "".join(f"line {i}: naïve café, 東京 — ok\n" for i in range(40))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(params=["synthetic", "text"])
def make_source(request: pytest.FixtureRequest, corpus: Path) -> Callable[..., TokenSource]:
    """A factory for either kind with small shapes; keyword overrides pass through."""

    def make(**kw: object) -> TokenSource:
        base: dict[str, object] = dict(seq_len=24, batch_size=4, seed=3)
        if request.param == "synthetic":
            base["vocab_size"] = 64
        else:
            base["path"] = str(corpus)
        base.update(kw)
        return build_data(request.param, **base)

    return make


# ------------------------------------------------------------------- determinism


def test_same_seed_same_batches_different_seed_different(
    make_source: Callable[..., TokenSource],
) -> None:
    a, b, c = make_source(), make_source(), make_source(seed=4)
    for _ in range(3):
        x, y, z = a.next_batch(), b.next_batch(), c.next_batch()
        assert same(x, y)
        assert not same(x, z)


def test_batches_do_not_touch_the_global_rng(make_source: Callable[..., TokenSource]) -> None:
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    source = make_source()
    first = source.batch_at(0)
    source.next_batch()
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(999)  # the global seed has no effect on the data
    assert same(make_source().batch_at(0), first)


def test_batch_at_matches_iteration_and_keeps_position(
    make_source: Callable[..., TokenSource],
) -> None:
    source = make_source()
    iterated = [batch for _, batch in zip(range(5), source, strict=False)]
    assert source.position == 5
    replay = make_source()
    for i in (3, 0, 4):
        assert same(replay.batch_at(i), iterated[i])
    assert replay.position == 0
    assert same(next(iter(replay)), iterated[0])
    assert replay.position == 1
    with pytest.raises(DataError, match="batch index"):
        replay.batch_at(-1)


def test_resume_from_state_dict_continues_exactly(make_source: Callable[..., TokenSource]) -> None:
    uninterrupted = make_source()
    expected = [uninterrupted.next_batch() for _ in range(8)]

    first = make_source()
    for _ in range(5):
        first.next_batch()
    state = first.state_dict()
    assert state == {"position": 5}

    resumed = make_source()
    resumed.load_state_dict(state)
    assert resumed.position == 5
    assert all(same(resumed.next_batch(), expected[i]) for i in range(5, 8))
    for bad in ({}, {"position": -1}, {"position": "3"}, {"position": True}):
        with pytest.raises(DataError, match="position"):
            resumed.load_state_dict(bad)


def test_ranks_share_the_global_batch_sequence(make_source: Callable[..., TokenSource]) -> None:
    single = make_source()
    global_batches = [single.next_batch() for _ in range(4)]
    rank0 = make_source(rank=0, world_size=2)
    rank1 = make_source(rank=1, world_size=2)
    interleaved = [rank0.next_batch(), rank1.next_batch(), rank0.next_batch(), rank1.next_batch()]
    assert all(same(a, b) for a, b in zip(interleaved, global_batches, strict=True))
    assert rank0.position == rank1.position == 2
    assert [rank1.global_index(i) for i in range(3)] == [1, 3, 5]
    with pytest.raises(DataError, match=r"data.rank \(2\) must be < data.world_size \(2\)"):
        make_source(rank=2, world_size=2)


# ----------------------------------------------------------------------- masking


def test_batch_layout(make_source: Callable[..., TokenSource]) -> None:
    source = make_source()
    batch = source.batch_at(0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape == (4, 24)
    assert ids.dtype == labels.dtype == torch.long and mask.dtype == torch.bool
    assert (ids[:, 0] == CLS_ID).all() and mask[:, 0].all()
    assert ((ids >= 0) & (ids < source.vocab_size)).all()
    assert (labels[:, 0] == IGNORE_INDEX).all()


def test_mask_statistics() -> None:
    source = SyntheticSource(vocab_size=1000, seq_len=128, batch_size=32, seed=0)
    batches = [source.batch_at(i) for i in range(10)]
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    selected = labels != IGNORE_INDEX
    eligible = original_tokens({"input_ids": ids, "labels": labels}) >= FIRST_ORDINARY_ID

    assert not (selected & ~eligible).any()  # never CLS / SEP / PAD
    assert abs(selected.sum().item() / eligible.sum().item() - 0.15) < 0.01
    assert (selected.sum(dim=1) >= 1).all()
    assert not (ids[~selected] == MASK_ID).any()  # untouched positions keep their token

    n = selected.sum().item()
    masked = (ids[selected] == MASK_ID).sum().item() / n
    kept = (ids[selected] == labels[selected]).sum().item() / n
    replaced = 1 - masked - kept
    assert abs(masked - 0.8) < 0.03
    assert abs(kept - 0.1) < 0.03  # (a random replacement equal to the original counts as kept)
    assert abs(replaced - 0.1) < 0.03
    assert (ids[selected & (ids != MASK_ID)] >= FIRST_ORDINARY_ID).all()


def test_short_sequences_still_get_a_prediction() -> None:
    source = SyntheticSource(vocab_size=64, seq_len=3, batch_size=64, seed=0, mask_prob=0.01)
    labels = source.batch_at(0)["labels"]
    assert ((labels != IGNORE_INDEX).sum(dim=1) == 1).all()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.tuples(st.integers(1, 5), st.integers(1, 30)).flatmap(
        lambda shape: st.lists(
            st.lists(st.integers(0, 19), min_size=shape[1], max_size=shape[1]),
            min_size=shape[0],
            max_size=shape[0],
        )
    ),
    mask_prob=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**32),
)
def test_masking_invariants(rows: list[list[int]], mask_prob: float, seed: int) -> None:
    tokens = torch.tensor(rows, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    ids, labels = apply_mlm_masking(tokens, 20, mask_prob, gen)
    selected = labels != IGNORE_INDEX
    eligible = tokens >= FIRST_ORDINARY_ID
    assert not (selected & ~eligible).any()
    assert torch.equal(labels[selected], tokens[selected])
    assert torch.equal(ids[~selected], tokens[~selected])
    n = eligible.sum(dim=1)
    expected = torch.minimum(torch.round(n.double() * mask_prob).long().clamp(min=1), n)
    assert torch.equal(selected.sum(dim=1), expected)
    assert ((ids[selected] == MASK_ID) | (ids[selected] >= FIRST_ORDINARY_ID)).all()


# --------------------------------------------------------------------- synthetic


def test_synthetic_chain_is_sparse_and_learnable() -> None:
    """Transitions concentrate on ``branching`` successors per token."""
    source = SyntheticSource(vocab_size=64, seq_len=64, batch_size=64, seed=1, branching=3)
    seqs = torch.cat([original_tokens(source.batch_at(i))[:, 1:] for i in range(10)])
    assert (seqs >= FIRST_ORDINARY_ID).all() and (seqs < 64).all()
    prev, nxt = seqs[:, :-1].reshape(-1), seqs[:, 1:].reshape(-1)
    counts = torch.zeros(64, 64)
    counts.index_put_((prev, nxt), torch.ones(prev.numel()), accumulate=True)
    top = counts.topk(3, dim=1).values.sum()
    assert top / counts.sum() > 0.97  # only noise leaves the likely successors
    # Conditional entropy of the next token is far below ln(60 ordinary tokens).
    p = counts / counts.sum()
    cond = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    h = -(p[p > 0] * cond[p > 0].log()).sum().item()
    assert h < 0.4 * torch.log(torch.tensor(60.0)).item()


def test_synthetic_generation_is_fast() -> None:
    source = SyntheticSource(vocab_size=30522, seq_len=128, batch_size=32, seed=0)
    source.batch_at(0)
    times = []
    for i in range(5):
        start = time.perf_counter()
        source.batch_at(i)
        times.append(time.perf_counter() - start)
    # About 3-4 ms on one idle core; the bound only catches per-token Python loops.
    assert min(times) < 0.02, times


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(branching=0), r"data.branching \(0\) must be >= 1"),
        (dict(branching=33), r"data.branching \(33\) must be <= 32"),
        (dict(vocab_size=6, branching=4), r"data.vocab_size \(6\) must be >= 8"),
        (dict(seq_len=1), r"data.seq_len \(1\) must be >= 2"),
        (dict(batch_size=0), r"data.batch_size \(0\) must be >= 1"),
        (dict(mask_prob=0.0), r"data.mask_prob \(0.0\) must be in \(0, 1\]"),
        (dict(seed=1.5), r"data.seed must be an int"),
    ],
)
def test_synthetic_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = dict(vocab_size=64, seq_len=16, batch_size=2)
    base.update(kwargs)
    with pytest.raises(DataError, match=message):
        SyntheticSource(**base)  # type: ignore[arg-type]


# -------------------------------------------------------------------------- text


def test_byte_tokenizer_round_trip() -> None:
    text = "héllo wörld — 東京 🙂\n"
    ids = encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(FIRST_ORDINARY_ID <= i < TextSource.VOCAB_SIZE for i in ids)
    assert decode(ids) == text
    assert TextSource.encode(text) == ids and TextSource.decode(ids) == text
    assert TextSource.VOCAB_SIZE == 260
    assert decode([CLS_ID, *ids, SEP_ID, PAD_ID]) == text  # specials are dropped
    assert decode(encode("東")[:2]) == "\ufffd"  # a cut character is replaced, not an error
    with pytest.raises(ValueError, match="260"):
        decode([260])


def test_text_epoch_visits_every_window_once(corpus: Path) -> None:
    seq_len, batch_size = 24, 4
    source = TextSource(path=str(corpus), seq_len=seq_len, batch_size=batch_size, seed=5)
    assert source.vocab_size == 260
    stream = torch.tensor(encode(corpus.read_text(encoding="utf-8")))
    n = stream.numel() // (seq_len - 1)
    assert source.num_windows == n and source.num_tokens == stream.numel()
    windows = stream[: n * (seq_len - 1)].view(n, seq_len - 1)

    batches_per_epoch = -(-2 * n // batch_size)
    rows = torch.cat([original_tokens(source.next_batch()) for _ in range(batches_per_epoch)])
    assert (rows[:, 0] == CLS_ID).all()
    seen = rows[:, 1:]
    for epoch in range(2):
        got = seen[epoch * n : (epoch + 1) * n]
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, windows.tolist()))
    assert not torch.equal(seen[:n], seen[n : 2 * n])  # each epoch has its own order
    assert not torch.equal(seen[:n], windows)  # and it is shuffled


def test_text_directory_joins_sorted_txt_files_with_sep(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("A" * 10, encoding="utf-8")
    (tmp_path / "b" / "c.txt").write_text("C" * 10, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    source = TextSource(path=str(tmp_path), seq_len=22, batch_size=1, seed=0)
    assert source.num_windows == 1 and source.num_tokens == 21
    batch = source.batch_at(0)
    row = original_tokens(batch)[0].tolist()
    assert row == [CLS_ID, *encode("A" * 10), SEP_ID, *encode("C" * 10)]
    assert batch["labels"][0, 11] == IGNORE_INDEX  # SEP is never a prediction target


def test_text_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=r"data.path '.*nope' does not exist: give a UTF-8 .txt"):
        TextSource(path=str(missing), seq_len=16, batch_size=2)

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (empty_dir / "readme.md").write_text("not a .txt file", encoding="utf-8")
    with pytest.raises(DataError, match=r"data.path '.*empty' is a directory with no .txt files"):
        TextSource(path=str(empty_dir), seq_len=16, batch_size=2)

    short = tmp_path / "short.txt"
    short.write_text("tiny", encoding="utf-8")
    with pytest.raises(
        DataError, match=r"data.path '.*short.txt' holds 4 tokens, too few for one sequence"
    ):
        TextSource(path=str(short), seq_len=16, batch_size=2)

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café ".encode("latin-1") * 10)
    with pytest.raises(DataError, match=r"data.path file '.*latin1.txt' is not valid UTF-8"):
        TextSource(path=str(latin1), seq_len=16, batch_size=2)

    assert issubclass(DataError, ValueError)


def test_a_corpus_smaller_than_a_batch_still_cycles(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_text("exactly fifteen", encoding="utf-8")
    source = TextSource(path=str(path), seq_len=16, batch_size=3)
    assert source.num_windows == 1
    rows = original_tokens(source.batch_at(0))
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[1], rows[2])
    assert decode(rows[0].tolist()) == "exactly fifteen"


# ----------------------------------------------------------------------- factory


def test_build_data(corpus: Path) -> None:
    synthetic = build_data("synthetic", vocab_size=64, seq_len=8, batch_size=2)
    assert isinstance(synthetic, SyntheticSource) and synthetic.vocab_size == 64
    text = build_data("text", path=str(corpus), seq_len=8, batch_size=2)
    assert isinstance(text, TextSource) and text.vocab_size == 260
    with pytest.raises(DataError, match=r"data.kind 'wiki' is not one of 'synthetic', 'text'"):
        build_data("wiki", seq_len=8, batch_size=2)
    with pytest.raises(DataError, match=r"data.kind 'text' does not take branching"):
        build_data("text", path=str(corpus), seq_len=8, batch_size=2, branching=4)
    with pytest.raises(DataError, match=r"data.kind 'synthetic' needs vocab_size"):
        build_data("synthetic", seq_len=8, batch_size=2)


# ---------------------------------------------------------------------- causal


def test_causal_batches_are_the_unmasked_sequences(make_source: Callable[..., TokenSource]) -> None:
    mlm, causal = make_source(), make_source(objective="causal")
    for i in range(3):
        m, c = mlm.batch_at(i), causal.batch_at(i)
        assert torch.equal(c["input_ids"], original_tokens(m))  # same tokens, not masked
        assert torch.equal(c["labels"], c["input_ids"])  # the model shifts them
        assert torch.equal(c["attention_mask"], m["attention_mask"])
        assert (c["input_ids"][:, 0] == CLS_ID).all()  # CLS serves as BOS
    state = causal.state_dict()
    causal.next_batch()
    assert causal.state_dict() == {"position": state["position"] + 1}


def test_bad_objective_is_named(make_source: Callable[..., TokenSource]) -> None:
    with pytest.raises(DataError, match=r"data.objective \('span'\) must be one of mlm, causal"):
        make_source(objective="span")


def test_masking_with_a_tokenizer_s_own_special_ids() -> None:
    """data=hf: specials anywhere in the vocabulary, replacements drawn from given ids."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (64, 32), generator=g)
    special = torch.zeros(10, dtype=torch.bool)
    special[[0, 9]] = True
    input_ids, labels = apply_mlm_masking(
        tokens, 10, 0.5, g, mask_id=9, special=special, ordinary_ids=torch.tensor([5])
    )
    selected = labels != IGNORE_INDEX
    assert not torch.isin(labels[selected], torch.tensor([0, 9])).any()
    assert selected.sum() > 500 and (tokens[~selected] == 0).any()
    changed = selected & (input_ids != tokens)
    assert set(input_ids[changed].unique().tolist()) <= {5, 9}
    assert (input_ids[changed] == 5).any() and (input_ids[changed] == 9).float().mean() > 0.8
