"""``ampctl tokenizer train``: a byte-level BPE tokenizer trained on the user's own corpus.

Byte-level BPE (GPT-2's, also RoBERTa's) encodes any text without unknown tokens, so one
tokenizer serves both objectives. It reads the corpus exactly as ``data=hf`` does (same
``data.path`` forms: a ``save_to_disk`` folder, text/json/parquet files, a folder, a glob;
same ``format`` and ``text_field``), with the ``tokenizers`` library, offline.

The output folder holds:

* ``tokenizer.json``: the ``tokenizers`` tokenizer (``data.tokenizer=DIR`` reads it);
* ``tokenizer_config.json``: the special tokens by role, and
  ``tokenizer_class: PreTrainedTokenizerFast``, so ``transformers.AutoTokenizer`` loads the
  folder too.

Special tokens, ids 0-4: ``<|endoftext|>`` (end of a document: the causal objective's
separator, also BOS), ``[PAD]``, ``[CLS]``, ``[SEP]``, ``[MASK]`` (the masked-LM objective's).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from ampctl.errors import UsageError
from ampctl.files import WriteRefused, write_new

__all__ = ["SPECIAL_TOKENS", "TokenizerTrainError", "TrainedTokenizer", "train_tokenizer"]

SPECIAL_TOKENS: dict[str, str] = {
    "eos_token": "<|endoftext|>",
    "pad_token": "[PAD]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the specials


class TokenizerTrainError(UsageError):
    """Bad input to ``ampctl tokenizer train``; one line."""


@dataclass
class TrainedTokenizer:
    out: Path
    vocab_size: int
    documents: int
    characters: int
    seconds: float


def train_tokenizer(
    path: str | Path,
    out: str | Path,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    text_field: str = "text",
    format: str = "auto",
    split: str = "train",
) -> TrainedTokenizer:
    """Train a byte-level BPE tokenizer on the corpus at ``path``; write it to ``out``.

    Raises:
        TokenizerTrainError: bad sizes, ``out`` already holds a tokenizer (never
            overwritten), or any corpus problem (missing path, column, library...).
    """
    from ampctl.train.data import DataError
    from ampctl.train.hf_data import INSTALL_HINT, iter_texts, resolve_dataset

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise TokenizerTrainError(
            f"--vocab-size {vocab_size!r}: must be an integer >= {_MIN_VOCAB} "
            "(256 bytes plus the special tokens)"
        )
    if isinstance(min_frequency, bool) or not isinstance(min_frequency, int) or min_frequency < 1:
        raise TokenizerTrainError(f"--min-frequency {min_frequency!r}: must be an integer >= 1")
    out = Path(out).expanduser()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (out / name).exists() or (out / name).is_symlink():
            raise TokenizerTrainError(
                f"--out '{out}' already holds a {name}: choose another folder (nothing is "
                "overwritten)"
            )
    if out.exists() and not out.is_dir():
        raise TokenizerTrainError(f"--out '{out}' is a file: give a folder")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise TokenizerTrainError(
            f"ampctl tokenizer train needs tokenizers: {INSTALL_HINT}"
        ) from None

    t0 = time.perf_counter()
    counts = {"documents": 0, "characters": 0}
    try:
        fmt, files = resolve_dataset(path, format)

        def documents():
            for docs in iter_texts(fmt, files, text_field, split):
                counts["documents"] += len(docs)
                counts["characters"] += sum(len(d) for d in docs)
                yield docs

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS.values()),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(documents(), trainer=trainer)
    except DataError as e:  # worded for data=hf: name this command's options instead
        message = str(e).replace("data.path", "PATH").replace("data.format=", "--format ")
        message = message.replace("data.", "--")
        raise TokenizerTrainError(message.replace("--text_field", "--text-field")) from None
    if counts["documents"] == 0:
        raise TokenizerTrainError(f"'{path}' holds no text to train a tokenizer on")

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS["eos_token"],
        **SPECIAL_TOKENS,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    try:  # new files only, never through a link (ampctl.files.write_new)
        write_new(out / "tokenizer.json", tok.to_str(pretty=True))
        write_new(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    except WriteRefused as e:
        raise TokenizerTrainError(f"--out '{out}': {e}") from None
    return TrainedTokenizer(
        out=out,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        documents=counts["documents"],
        characters=counts["characters"],
        seconds=time.perf_counter() - t0,
    )
