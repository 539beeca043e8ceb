"""Deterministic language-model batches: a synthetic Markov-chain source and a text source
(and, in :mod:`ampctl.train.hf_data`, a Hugging Face datasets/tokenizers source).

Every batch is a dict of CPU tensors, for one of two objectives (``objective=``):

``"mlm"`` (masked LM, BERT):

* ``input_ids``: long [B, T]; position 0 is always CLS; some tokens masked.
* ``attention_mask``: bool [B, T]; True for real tokens, False for padding.
* ``labels``: long [B, T]; the original token where a prediction is asked for,
  -100 elsewhere.

``"causal"`` (next-token LM, GPT-2 / Llama):

* ``input_ids``: long [B, T], unmasked (for these two sources position 0 is CLS, which
  serves as the beginning-of-sequence token).
* ``attention_mask``: bool [B, T] as above.
* ``labels``: the input ids themselves (-100 at padding); the model shifts them
  (position t predicts token t + 1), as in Hugging Face.

Special ids are ``PAD=0, CLS=1, SEP=2, MASK=3``; ordinary tokens start at 4.

Determinism: the batch with global index ``g`` is a pure function of
``(seed, g)`` (plus the corpus for :class:`TextSource`). Each batch draws from its
own ``torch.Generator`` seeded from ``(seed, g)``; no global RNG state is read or
written. Rank ``r`` of ``world_size`` ``W`` yields global indices
``r, W + r, 2W + r, ...``, so its local batch ``i`` is global batch ``i * W + r``
and the same global index gives the same batch whatever ``W`` is. A causal batch holds
the same tokens as the masked-LM batch of the same index, unmasked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ampctl.errors import require_int

__all__ = [
    "PAD_ID",
    "CLS_ID",
    "SEP_ID",
    "MASK_ID",
    "FIRST_ORDINARY_ID",
    "MAX_BRANCHING",
    "IGNORE_INDEX",
    "OBJECTIVES",
    "Batch",
    "DataError",
    "TokenSource",
    "SyntheticSource",
    "TextSource",
    "PackedSource",
    "encode",
    "decode",
    "apply_mlm_masking",
]

PAD_ID = 0
CLS_ID = 1
SEP_ID = 2
MASK_ID = 3
#: The first id that is not a special token.
FIRST_ORDINARY_ID = 4
#: Label value for positions that carry no prediction target.
IGNORE_INDEX = -100

#: Allowed values of ``build_data(kind=...)``.
#: Allowed values of a source's ``objective``.
OBJECTIVES: tuple[str, ...] = ("mlm", "causal")

Batch = dict[str, Tensor]

_MASK64 = (1 << 64) - 1
# Domain tags keep the random streams for different purposes independent.
_TAG_CHAIN = 0x43484149  # "CHAI"
_TAG_BATCH = 0x42415443  # "BATC"
_TAG_EPOCH = 0x45504F43  # "EPOC"

# Of the selected positions: 80% become MASK, 10% a random ordinary token, 10% stay.
_MASK_TOKEN_FRACTION = 0.8
_RANDOM_TOKEN_FRACTION = 0.1
# Probability that a synthetic transition ignores the chain and picks uniformly.
_SYNTHETIC_NOISE = 0.005
# Exponent of the Zipf law over topics for a synthetic sequence's first token.
_TOPIC_ZIPF_EXPONENT = 1.5
# Probability resolution of the synthetic chain: each token's successor
# distribution is stored as this many equally likely slots.
_CHAIN_SLOTS = 64
#: Largest ``SyntheticSource(branching=...)``; every successor needs at least one slot.
MAX_BRANCHING = 32


class DataError(ValueError):
    """A data configuration or corpus problem, described in one line."""


# --------------------------------------------------------------------------- seeds


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed; distinct inputs give unrelated seeds."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h >> 1


def _generator(*parts: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_derive_seed(*parts))
    return gen


# ----------------------------------------------------------------------- masking


def apply_mlm_masking(
    tokens: Tensor,
    vocab_size: int,
    mask_prob: float,
    generator: torch.Generator,
    *,
    mask_id: int = MASK_ID,
    special: Tensor | None = None,
    ordinary_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT masking of ``tokens`` (long [B, T]); returns ``(input_ids, labels)``.

    In each row, ``max(1, round(mask_prob * n))`` of the ``n`` ordinary-token
    positions (ids >= 4; never CLS, SEP, PAD or MASK) are selected uniformly at
    random (a row with no ordinary token gets none). Of the selected positions,
    80% are replaced by MASK, 10% by a random ordinary token and 10% are left
    unchanged. ``labels`` holds the original token at the selected positions
    and -100 elsewhere.

    For a tokenizer whose special tokens are not ids 0-3 (:mod:`ampctl.train.hf_data`):
    ``special`` is a bool [vocab_size] table, True for ids never selected; ``ordinary_ids``
    the ids a random replacement is drawn from; ``mask_id`` the mask token.
    """
    batch, seq_len = tokens.shape
    eligible = tokens >= FIRST_ORDINARY_ID if special is None else ~special[tokens]
    n_eligible = eligible.sum(dim=1, keepdim=True)
    n_select = torch.round(n_eligible.double() * mask_prob).long().clamp(min=1)
    n_select = torch.minimum(n_select, n_eligible)

    # Rank eligible positions in a random order; ineligible ones sort last.
    scores = torch.rand(batch, seq_len, generator=generator)
    scores = scores.masked_fill(~eligible, 2.0)
    order = scores.argsort(dim=1)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(seq_len).expand(batch, seq_len))
    selected = rank < n_select

    action = torch.rand(batch, seq_len, generator=generator)
    if ordinary_ids is None:
        random_tokens = torch.randint(
            FIRST_ORDINARY_ID, vocab_size, (batch, seq_len), generator=generator
        )
    else:
        pick = torch.randint(0, ordinary_ids.numel(), (batch, seq_len), generator=generator)
        random_tokens = ordinary_ids[pick]
    to_mask = selected & (action < _MASK_TOKEN_FRACTION)
    to_random = (
        selected
        & (action >= _MASK_TOKEN_FRACTION)
        & (action < _MASK_TOKEN_FRACTION + _RANDOM_TOKEN_FRACTION)
    )
    input_ids = tokens.masked_fill(to_mask, mask_id)
    input_ids = torch.where(to_random, random_tokens, input_ids)
    labels = tokens.masked_fill(~selected, IGNORE_INDEX)
    return input_ids, labels


# ------------------------------------------------------------------------- base


class TokenSource(ABC):
    """Infinite, resumable, rank-sharded stream of language-model batches.

    Subclasses provide :meth:`_tokens`, the unmasked token ids of a global batch;
    this base class checks the arguments every source takes (a :class:`DataError` naming
    the key), applies the objective (masking for ``"mlm"``, none for ``"causal"``) and
    keeps the position.
    """

    vocab_size: int
    #: The keys of every batch: the model is called as ``model(**batch)``.
    batch_keys: tuple[str, ...] = ("input_ids", "attention_mask", "labels")
    #: Padding id: attention_mask is ``tokens != pad_id``; causal labels there are -100.
    pad_id: int = PAD_ID

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        mask_prob: float,
        rank: int,
        world_size: int,
        objective: str = "mlm",
    ) -> None:
        if objective not in OBJECTIVES:
            raise DataError(
                f"data.objective ({objective!r}) must be one of {', '.join(OBJECTIVES)}"
            )
        require_int("data.seq_len", seq_len, 2, DataError)
        require_int("data.batch_size", batch_size, 1, DataError)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise DataError(f"data.seed must be an int, got {seed!r}")
        if isinstance(mask_prob, bool) or not isinstance(mask_prob, int | float):
            raise DataError(f"data.mask_prob must be a float in (0, 1], got {mask_prob!r}")
        if not 0.0 < mask_prob <= 1.0:
            raise DataError(f"data.mask_prob ({mask_prob}) must be in (0, 1]")
        require_int("data.world_size", world_size, 1, DataError)
        require_int("data.rank", rank, 0, DataError)
        if rank >= world_size:
            raise DataError(f"data.rank ({rank}) must be < data.world_size ({world_size})")
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.mask_prob = float(mask_prob)
        self.rank = rank
        self.world_size = world_size
        self.objective = objective
        self._position = 0

    @abstractmethod
    def _tokens(self, global_index: int, generator: torch.Generator) -> Tensor:
        """Unmasked long [batch_size, seq_len] ids of a global batch."""

    def _mask(self, tokens: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Masked-LM ``(input_ids, labels)`` of ``tokens``."""
        return apply_mlm_masking(tokens, self.vocab_size, self.mask_prob, generator)

    @property
    def position(self) -> int:
        """Number of batches this rank has consumed (the next local index)."""
        return self._position

    def global_index(self, index: int) -> int:
        """Global batch index of this rank's local batch ``index``."""
        return index * self.world_size + self.rank

    def batch_at(self, index: int) -> Batch:
        """This rank's local batch ``index``, without changing :attr:`position`."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise DataError(f"batch index must be an int >= 0, got {index!r}")
        global_index = self.global_index(index)
        generator = _generator(self.seed, _TAG_BATCH, global_index)
        tokens = self._tokens(global_index, generator)
        real = tokens != self.pad_id
        if self.objective == "causal":
            return {
                "input_ids": tokens,
                "attention_mask": real,
                "labels": tokens.masked_fill(~real, IGNORE_INDEX),
            }
        input_ids, labels = self._mask(tokens, generator)
        return {"input_ids": input_ids, "attention_mask": real, "labels": labels}

    def next_batch(self) -> Batch:
        """The batch at :attr:`position`; advances the position by one."""
        batch = self.batch_at(self._position)
        self._position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """``{"position": int}``; enough to resume the exact batch sequence."""
        return {"position": self._position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next batch is the one it left off at."""
        position = state.get("position") if isinstance(state, Mapping) else None
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise DataError(
                f"data state must be a mapping with an int 'position' >= 0, got {state!r}"
            )
        self._position = position


# -------------------------------------------------------------------- synthetic


class SyntheticSource(TokenSource):
    """Sequences from a fixed random sparse Markov chain over the ordinary tokens.

    The chain, drawn from ``seed``:

    * The ordinary tokens are shuffled and split into *topics* of ``branching``
      tokens. A token's ``branching`` likely successors are the members of its
      topic (itself included), with skewed probabilities that roughly halve
      from one successor to the next, in a random order per token.
    * With probability 0.005 a transition instead picks a uniformly random
      ordinary token, so every token is reachable (and the topic changes).
    * The first token after CLS is drawn from a Zipf(1.5) law over topics
      (uniform within the topic), so some topics are much more common than
      others, as in natural text.

    A masked token is thus predicted by its neighbours (bigram), by the rest of
    the sequence (topic) and by frequency; the optimal loss is far below
    ``ln(vocab_size)``. The topic structure is what lets a small BERT learn
    within a few hundred steps: a chain whose successors are unrelated to the
    rest of the sequence needs attention to learn relative positions first,
    which at lr 1e-3 takes well over 150 steps.

    Args:
        vocab_size: total ids including the 4 specials; at least 4 + ``branching``.
        seq_len: tokens per sequence, CLS included.
        batch_size: sequences per batch.
        seed: chooses the chain and every batch.
        mask_prob: fraction of positions selected for prediction (``"mlm"``).
        branching: likely successors per token (the topic size), 1 to 32.
        rank, world_size: this process's shard.
        objective: ``"mlm"`` (masked batches) or ``"causal"`` (the same sequences,
            unmasked, labels = input ids).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        mask_prob: float = 0.15,
        branching: int = 4,
        rank: int = 0,
        world_size: int = 1,
        objective: str = "mlm",
    ) -> None:
        super().__init__(
            vocab_size, seq_len, batch_size, seed, mask_prob, rank, world_size, objective
        )
        require_int("data.branching", branching, 1, DataError)
        if branching > MAX_BRANCHING:
            raise DataError(f"data.branching ({branching}) must be <= {MAX_BRANCHING}")
        require_int("data.vocab_size", vocab_size, FIRST_ORDINARY_ID + branching, DataError)
        self.branching = branching
        slot_table, self._start_cdf = self._draw_chain()
        # The slot table followed by the identity, for noise transitions.
        self._lookup = torch.cat([slot_table, torch.arange(vocab_size - FIRST_ORDINARY_ID)])

    def _draw_chain(self) -> tuple[Tensor, Tensor]:
        """The chain as a slot table and the CDF of the first token.

        The slot table is flat, ``n * _CHAIN_SLOTS`` long: row ``c`` (entries
        ``c*S .. c*S + S - 1``, 0-based ordinary ids) lists the successors of
        ``c``, each repeated in proportion to its probability (at least once),
        so a uniform slot gives a successor in one lookup.
        """
        n = self.vocab_size - FIRST_ORDINARY_ID
        b = self.branching
        gen = _generator(self.seed, _TAG_CHAIN)
        order = torch.randperm(n, generator=gen)  # order[p]: token at shuffled position p
        where = torch.empty(n, dtype=torch.long)
        where[order] = torch.arange(n)
        # Topic members of each token; the last, partial topic wraps around.
        topic_start = (where // b) * b
        members = order[(topic_start[:, None] + torch.arange(b)) % n]
        successors = members.gather(1, torch.rand(n, b, generator=gen).argsort(dim=1))

        # Skewed weights ~ 2^-k with jitter, as slot counts: one each, the rest
        # by largest remainder, so every row has exactly S slots.
        jitter = 0.5 + torch.rand(n, b, generator=gen, dtype=torch.float64)
        weights = jitter * torch.pow(0.5, torch.arange(b, dtype=torch.float64))
        raw = weights / weights.sum(dim=1, keepdim=True) * (_CHAIN_SLOTS - b)
        counts = raw.floor().long()
        left_over = (_CHAIN_SLOTS - b) - counts.sum(dim=1, keepdim=True)
        by_remainder = (raw - counts).argsort(dim=1, descending=True).argsort(dim=1)
        counts += 1 + (by_remainder < left_over).long()
        slot_table = torch.repeat_interleave(successors.reshape(-1), counts.reshape(-1))

        # First token: Zipf over topics (by shuffled position), uniform within.
        start = torch.pow((where // b + 1).double(), -_TOPIC_ZIPF_EXPONENT)
        start_cdf = (start / start.sum()).cumsum(dim=0)
        return slot_table, start_cdf

    def _tokens(self, global_index: int, generator: torch.Generator) -> Tensor:
        batch, seq_len = self.batch_size, self.seq_len
        n = self.vocab_size - FIRST_ORDINARY_ID
        steps = seq_len - 1
        # Draw every random number up front, time-major; the loop only indexes.
        first = torch.rand(batch, generator=generator, dtype=torch.float64)
        slots = torch.randint(0, _CHAIN_SLOTS, (steps, batch), generator=generator)
        is_noise = torch.rand(steps, batch, generator=generator) < _SYNTHETIC_NOISE
        uniform = torch.randint(0, n, (steps, batch), generator=generator)

        # Step t reads lookup[chain[t-1] * scale[t] + offset[t]]: a slot of the
        # current token's row, or (noise: scale 0) the identity part of the
        # table. Three in-place ops per step keep a 32 x 128 batch at a few ms.
        scale = (~is_noise).long() * _CHAIN_SLOTS
        offset = torch.where(is_noise, n * _CHAIN_SLOTS + uniform, slots)
        chain = torch.empty(steps, batch, dtype=torch.long)
        chain[0] = torch.searchsorted(self._start_cdf, first).clamp_(max=n - 1)
        index = torch.empty(batch, dtype=torch.long)
        for t in range(1, steps):
            torch.mul(chain[t - 1], scale[t], out=index)
            index += offset[t]
            torch.index_select(self._lookup, 0, index, out=chain[t])

        tokens = torch.empty(batch, seq_len, dtype=torch.long)
        tokens[:, 0] = CLS_ID
        tokens[:, 1:] = chain.t() + FIRST_ORDINARY_ID
        return tokens


# ------------------------------------------------------------------------- text


def encode(text: str) -> list[int]:
    """Byte-level ids of ``text``: each UTF-8 byte ``b`` becomes ``b + 4``."""
    return [b + FIRST_ORDINARY_ID for b in text.encode("utf-8")]


def decode(ids: Sequence[int]) -> str:
    """Inverse of :func:`encode`. Special ids (< 4) are dropped; a byte sequence
    cut inside a multi-byte character decodes to U+FFFD."""
    data = bytearray()
    for i in ids:
        i = int(i)
        if not 0 <= i < TextSource.VOCAB_SIZE:
            raise ValueError(f"token id {i} is outside [0, {TextSource.VOCAB_SIZE})")
        if i >= FIRST_ORDINARY_ID:
            data.append(i - FIRST_ORDINARY_ID)
    return data.decode("utf-8", errors="replace")


def _corpus_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(
            f"data.path '{path}' does not exist: give a UTF-8 .txt file or a directory of .txt files"
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(
                f"data.path '{path}' is a directory with no .txt files below it: "
                "give a UTF-8 .txt file or a directory of .txt files"
            )
        return files
    return [path]


def _read_corpus(path: Path) -> Tensor:
    """Token stream (int16) of the files under ``path``, SEP between non-empty files."""
    pieces: list[Tensor] = []
    for file in _corpus_files(path):
        data = file.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                f"data.path file '{file}' is not valid UTF-8 (byte {err.start}): give UTF-8 text"
            ) from None
        if not data:
            continue
        if pieces:
            pieces.append(torch.tensor([SEP_ID], dtype=torch.int16))
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)
        pieces.append(ids + FIRST_ORDINARY_ID)
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int16)


class PackedSource(TokenSource):
    """Windows of a token stream, each visited once per epoch in a seeded order.

    The stream (a 1-D integer tensor) is cut into consecutive windows of ``width``
    tokens (a trailing partial window is dropped); with a ``prefix_id`` (CLS) that id is
    prepended to each window, so ``width = seq_len - 1``, else ``width = seq_len``. Samples
    are numbered globally (sample ``s`` is row ``s % batch_size`` of global batch
    ``s // batch_size``); epoch ``e`` covers samples ``e*N .. (e+1)*N - 1`` for ``N``
    windows and visits every window once, in an order given by a permutation seeded from
    ``(seed, e)``. Batches continue across epochs forever.

    Subclasses call :meth:`_set_stream` in their constructor.
    """

    _stream: Tensor
    _prefix_id: int | None
    width: int
    num_windows: int

    def _set_stream(self, stream: Tensor, prefix_id: int | None) -> None:
        self._stream = stream
        self._prefix_id = prefix_id
        self.width = self.seq_len - (1 if prefix_id is not None else 0)
        self.num_windows = stream.numel() // self.width
        self._perm_cache: dict[int, Tensor] = {}

    @property
    def num_tokens(self) -> int:
        """Length of the token stream (separators included)."""
        return self._stream.numel()

    def _permutation(self, epoch: int) -> Tensor:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            if len(self._perm_cache) >= 2:
                self._perm_cache.pop(next(iter(self._perm_cache)))
            perm = torch.randperm(
                self.num_windows, generator=_generator(self.seed, _TAG_EPOCH, epoch)
            )
            self._perm_cache[epoch] = perm
        return perm

    def _tokens(self, global_index: int, generator: torch.Generator) -> Tensor:
        first = global_index * self.batch_size
        samples = torch.arange(first, first + self.batch_size)
        epochs, slots = samples // self.num_windows, samples % self.num_windows
        windows = torch.empty(self.batch_size, dtype=torch.long)
        for epoch in epochs.unique().tolist():  # one epoch, or a few for a tiny corpus
            in_epoch = epochs == epoch
            windows[in_epoch] = self._permutation(epoch)[slots[in_epoch]]
        width = self.width
        tokens = torch.empty(self.batch_size, self.seq_len, dtype=torch.long)
        body = tokens if self._prefix_id is None else tokens[:, 1:]
        if self._prefix_id is not None:
            tokens[:, 0] = self._prefix_id
        body.copy_(self._stream[windows[:, None] * width + torch.arange(width)])
        return tokens


class TextSource(PackedSource):
    """Masked-LM or causal-LM batches from UTF-8 text with a byte-level tokenizer.

    ``path`` is a text file, or a directory whose ``*.txt`` files (searched
    recursively, sorted by path) are concatenated with a SEP between files. The
    token stream is cut into consecutive windows of ``seq_len - 1`` tokens
    (a trailing partial window is dropped) and CLS is prepended to each. Samples
    are numbered globally (sample ``s`` is row ``s % batch_size`` of global batch
    ``s // batch_size``); epoch ``e`` covers samples ``e*N .. (e+1)*N - 1`` for
    ``N`` windows and visits every window once, in an order given by a
    permutation seeded from ``(seed, e)``. Batches continue across epochs forever.

    Raises:
        DataError: the path is missing, a directory holds no ``.txt`` file, a
            file is not UTF-8, or the corpus is shorter than one window.
    """

    #: 256 byte values plus the 4 special ids.
    VOCAB_SIZE = 256 + FIRST_ORDINARY_ID

    encode = staticmethod(encode)
    decode = staticmethod(decode)

    def __init__(
        self,
        *,
        path: str | Path,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        mask_prob: float = 0.15,
        rank: int = 0,
        world_size: int = 1,
        objective: str = "mlm",
    ) -> None:
        super().__init__(
            self.VOCAB_SIZE, seq_len, batch_size, seed, mask_prob, rank, world_size, objective
        )
        if not isinstance(path, str | Path):
            raise DataError(f"data.path must be a file or directory path, got {path!r}")
        self.path = Path(path)
        self._set_stream(_read_corpus(self.path), CLS_ID)
        if self.num_windows == 0:
            raise DataError(
                f"data.path '{self.path}' holds {self.num_tokens} tokens, too few for one "
                f"sequence of seq_len {seq_len}: give at least {self.width} bytes of text"
            )
