"""``data=hf``: a local dataset through Hugging Face ``datasets``, a local tokenizer, packed
into fixed-length sequences, deterministic, resumable and sharded like the other sources.

Nothing is downloaded: the dataset is read from local storage only and both libraries run
with ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set while ampctl calls them.

* **Dataset** (``data.path``): a ``Dataset.save_to_disk`` folder (split ``data.split`` of a
  ``DatasetDict``), a file, a folder (searched recursively) or a glob of text / json / jsonl
  / parquet files. ``data.format=auto`` decides by what is on disk; ``text``, ``json``,
  ``parquet`` or ``arrow`` (a ``save_to_disk`` folder) force it (e.g. ``.py`` files as text).
  Text files are read one *document per file* (``sample_by="document"``, line breaks kept);
  json/parquet/arrow rows give one document each from the column ``data.text_field``.
* **Tokenizer** (``data.tokenizer``): a ``tokenizer.json`` file, or a folder with one, read
  by the ``tokenizers`` library (with ``tokenizer_config.json`` naming the special tokens, as
  ``ampctl tokenizer train`` writes it); or any folder ``transformers.AutoTokenizer`` loads
  with ``local_files_only=True`` (e.g. ``vocab.txt`` of a BERT). Special tokens are never
  inserted by the tokenizer itself; the packing below places them.
* **Packing**: every document is encoded and followed by a separator: the end-of-text token
  (``eos_token``, else ``<|endoftext|>``, ``</s>``...) for ``objective=causal``, the SEP token
  for ``mlm``. The concatenated stream is cut into windows of ``seq_len`` tokens (causal) or
  ``seq_len - 1`` after a CLS (mlm), as :class:`~ampctl.train.data.PackedSource` describes:
  every window once per epoch, in a seeded order, the batch a pure function of
  ``(seed, global index)``; rank ``r`` of ``W`` takes global batches ``i * W + r``. There is
  no padding: ``attention_mask`` is all True.
* **Cache**: the token stream is written once to ``<cache>/tokenized/<key>/tokens.bin``
  (int32) with a ``meta.json``; ``key`` hashes the dataset files (path, size, mtime), the
  tokenizer files (content), the format, split, text field and separator. Later runs (and
  every rank of a multi-process run: the first takes a file lock, the others wait) map that
  file and start at once; any other ``seq_len`` reuses it too. ``<cache>`` is
  ``data.cache_dir``, else ``$AMPCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ampctl``, else
  ``~/.cache/ampctl``.

Errors are :class:`~ampctl.train.data.DataError` with one line naming the key: a missing
path or tokenizer, no file of a known format, a missing text column, a tokenizer without
the special tokens the objective needs, a tokenizer vocabulary larger than
``data.vocab_size``, a corpus shorter than one sequence, or a missing library (with
``pip install "ampctl[hf]"``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ampctl.errors import require_int
from ampctl.files import open_append, write_file, write_text
from ampctl.train.data import DataError, PackedSource, apply_mlm_masking

__all__ = [
    "FORMATS",
    "INSTALL_HINT",
    "HFSource",
    "TokenizerInfo",
    "load_tokenizer",
    "resolve_dataset",
    "iter_texts",
    "default_cache_dir",
]

INSTALL_HINT = 'pip install "ampctl[hf]"'
#: Allowed values of ``data.format``.
FORMATS: tuple[str, ...] = ("auto", "text", "json", "parquet", "arrow")
_EXTENSIONS: dict[str, tuple[str, ...]] = {
    "text": (".txt", ".text", ".md", ".rst"),
    "json": (".json", ".jsonl"),
    "parquet": (".parquet",),
}
_CACHE_VERSION = 1
_BATCH_DOCS = 256  # documents per tokenizer call

# Special-token names tried when the tokenizer's config does not name the role.
_ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>"),
    "cls": ("[CLS]", "<s>", "<cls>"),
    "sep": ("[SEP]", "</s>", "<sep>"),
    "mask": ("[MASK]", "<mask>"),
    "pad": ("[PAD]", "<pad>", "<|padding|>"),
}


def _require(module: str) -> Any:
    """Import an optional library, or a one-line DataError with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError:
        hint = "pip install transformers" if module == "transformers" else INSTALL_HINT
        raise DataError(f"data=hf needs the {module} package: {hint}") from None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face libraries offline for the duration (env vars and their module flags)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved_env = {n: os.environ.get(n) for n in names}
    for n in names:
        os.environ[n] = "1"
    patched: list[tuple[Any, str, Any]] = []
    for module, attr in (
        ("huggingface_hub.constants", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_HUB_OFFLINE"),
        ("datasets.config", "HF_DATASETS_OFFLINE"),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, attr):
            patched.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, True)
    try:
        yield
    finally:
        for mod, attr, value in patched:
            setattr(mod, attr, value)
        for n, v in saved_env.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def default_cache_dir() -> Path:
    """``$AMPCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/ampctl``, else ``~/.cache/ampctl``."""
    if os.environ.get("AMPCTL_CACHE_DIR"):
        return Path(os.environ["AMPCTL_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ampctl"


# -------------------------------------------------------------------------- tokenizer


@dataclass
class TokenizerInfo:
    """What packing needs of a tokenizer, whichever library loaded it."""

    source: str
    vocab_size: int
    encode_batch: Callable[[list[str]], list[list[int]]]
    roles: dict[str, int | None]  # eos, cls, sep, mask, pad -> id (None: absent)
    special_ids: list[int] = field(default_factory=list)
    fingerprint: str = ""

    def role(self, name: str, objective: str) -> int:
        """The id of special token ``name``; a DataError when the tokenizer has none."""
        token_id = self.roles.get(name)
        if token_id is None:
            tried = ", ".join(_ROLE_NAMES[name])
            raise DataError(
                f"data.tokenizer '{self.source}' has no {name} token, which objective={objective} "
                f"needs (looked for {name}_token in tokenizer_config.json, then {tried}); "
                "train one with `ampctl tokenizer train`"
            )
        return token_id


def _hash_files(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _token_name(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _configured_roles(folder: Path) -> dict[str, str]:
    """Special-token names from ``tokenizer_config.json`` / ``special_tokens_map.json``."""
    names: dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        path = folder / file
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise DataError(f"data.tokenizer: '{path}' is not valid JSON") from None
        for role in _ROLE_NAMES:
            name = _token_name(data.get(f"{role}_token")) if isinstance(data, dict) else None
            if name:
                names[role] = name
    return names


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    """Load a local tokenizer: ``tokenizer.json`` (file or in a folder) via ``tokenizers``,
    else a folder via ``transformers.AutoTokenizer`` (``local_files_only=True``).

    Raises:
        DataError: the path is missing or holds no tokenizer, or a library is missing.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(
            f"data.tokenizer '{path}' does not exist: give a tokenizer.json or a tokenizer "
            "folder (make one with `ampctl tokenizer train CORPUS --out DIR`)"
        )
    file = p if p.is_file() else p / "tokenizer.json"
    if file.is_file():
        return _load_fast(file)
    return _load_auto(p)


def _load_fast(file: Path) -> TokenizerInfo:
    tokenizers = _require("tokenizers")
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # the library raises plain Exceptions for bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"data.tokenizer '{file}' is not a tokenizers tokenizer.json ({first})"
        ) from None
    tok.no_truncation()
    tok.no_padding()
    configured = _configured_roles(file.parent)
    roles: dict[str, int | None] = {}
    for role, names in _ROLE_NAMES.items():
        candidates = [configured[role]] if role in configured else list(names)
        roles[role] = next(
            (tok.token_to_id(n) for n in candidates if tok.token_to_id(n) is not None), None
        )
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    companions = [file] + [
        file.parent / n
        for n in ("tokenizer_config.json", "special_tokens_map.json")
        if (file.parent / n).is_file()
    ]
    return TokenizerInfo(
        source=str(file),
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        encode_batch=lambda texts: [e.ids for e in encode(texts, add_special_tokens=False)],
        roles=roles,
        special_ids=sorted(set(special) | {i for i in roles.values() if i is not None}),
        fingerprint=_hash_files(companions),
    )


def _load_auto(folder: Path) -> TokenizerInfo:
    files = [f for f in folder.iterdir() if f.is_file()] if folder.is_dir() else []
    if not files:
        raise DataError(
            f"data.tokenizer '{folder}' holds no tokenizer files: give a tokenizer.json or a "
            "folder that transformers.AutoTokenizer can load"
        )
    transformers = _require("transformers")
    try:
        with _offline():
            tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"data.tokenizer '{folder}': AutoTokenizer cannot load it ({first})"
        ) from None
    tok.model_max_length = 1 << 62  # documents are long; packing cuts them, not the tokenizer
    roles = {role: getattr(tok, f"{role}_token_id", None) for role in _ROLE_NAMES}
    return TokenizerInfo(
        source=str(folder),
        vocab_size=len(tok),
        encode_batch=lambda texts: tok(texts, add_special_tokens=False)["input_ids"],
        roles=roles,
        special_ids=sorted(set(tok.all_special_ids)),
        fingerprint=_hash_files([f for f in files if f.stat().st_size < (256 << 20)]),
    )


# ---------------------------------------------------------------------------- dataset


def _is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _format_of(file: Path) -> str | None:
    suffix = file.suffix.lower()
    return next((fmt for fmt, exts in _EXTENSIONS.items() if suffix in exts), None)


def resolve_dataset(path: str | Path, fmt: str = "auto") -> tuple[str, list[Path]]:
    """``(format, files)`` of ``data.path``: ``("arrow", [folder])`` for a ``save_to_disk``
    folder, else the text / json / parquet files it names (sorted).

    Raises:
        DataError: nothing there, no file of a known format, or mixed formats under auto.
    """
    if fmt not in FORMATS:
        raise DataError(f"data.format ({fmt!r}) must be one of {', '.join(FORMATS)}")
    raw = str(path)
    p = Path(raw).expanduser()
    if fmt in ("auto", "arrow") and _is_saved_dataset(p):
        return "arrow", [p]
    if fmt == "arrow":
        raise DataError(
            f"data.path '{raw}' is not a save_to_disk folder (no state.json or dataset_dict.json)"
        )
    if p.is_file():
        files = [p]
    elif p.is_dir():
        exts = sum(_EXTENSIONS.values(), ()) if fmt == "auto" else _EXTENSIONS[fmt]
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file()
            and f.suffix.lower() in exts
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        if not files:
            raise DataError(
                f"data.path '{raw}' is a folder with no {'/'.join(exts)} files below it: give "
                "a save_to_disk folder, text/json/parquet files, or a glob with data.format="
            )
    elif any(c in raw for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"data.path '{raw}' matches no files")
    else:
        raise DataError(
            f"data.path '{raw}' does not exist: give a save_to_disk folder, a text/json/parquet "
            "file, a folder or a glob of them"
        )
    if fmt != "auto":
        return fmt, files
    kinds = {_format_of(f) for f in files}
    if None in kinds:
        odd = next(f for f in files if _format_of(f) is None)
        raise DataError(
            f"data.path file '{odd}' has no known extension ({odd.suffix or 'none'}): set "
            "data.format=text, json or parquet"
        )
    if len(kinds) > 1:
        raise DataError(
            f"data.path '{raw}' mixes {', '.join(sorted(k for k in kinds if k))} files: point "
            "it at one format, or set data.format="
        )
    return kinds.pop() or "text", files


def _files_under(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        out.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
    return out


def dataset_fingerprint(fmt: str, files: list[Path]) -> list[tuple[str, int, int]]:
    """(resolved path, size, mtime_ns) of every file the dataset reads."""
    rows = []
    for f in _files_under(files):
        st = f.stat()
        rows.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def iter_texts(
    fmt: str, files: list[Path], text_field: str = "text", split: str = "train"
) -> Iterator[list[str]]:
    """Batches of documents (str) of a resolved dataset, in a fixed order; empty and
    ``None`` documents are skipped. Runs offline.

    Raises:
        DataError: unreadable data, a missing column, a split that is not there, non-text.
    """
    datasets = _require("datasets")
    with _offline():
        try:
            if fmt == "arrow":
                ds = datasets.load_from_disk(str(files[0]))
                if isinstance(ds, datasets.DatasetDict):
                    if split not in ds:
                        raise DataError(
                            f"data.split '{split}' is not in '{files[0]}'; splits: {', '.join(ds)}"
                        )
                    ds = ds[split]
                if text_field not in ds.column_names:
                    raise DataError(
                        f"data.text_field '{text_field}' is not a column of '{files[0]}'; "
                        f"columns: {', '.join(ds.column_names)}"
                    )
                batches = (b[text_field] for b in ds.select_columns([text_field]).iter(_BATCH_DOCS))
            else:
                extra = {"sample_by": "document"} if fmt == "text" else {}
                ds = datasets.load_dataset(
                    fmt,
                    data_files=[str(f) for f in files],
                    split="train",
                    streaming=True,
                    **extra,
                )
                batches = _column(ds.iter(batch_size=_BATCH_DOCS), text_field, files)
            for texts in batches:
                docs = [t for t in texts if t]
                bad = next((t for t in docs if not isinstance(t, str)), None)
                if bad is not None:
                    raise DataError(
                        f"data.text_field '{text_field}' holds {type(bad).__name__} values, "
                        "not text: name a string column"
                    )
                if docs:
                    yield docs
        except DataError:
            raise
        except (UnicodeDecodeError, ValueError, OSError, TypeError, KeyError) as e:
            raise DataError(f"data.path: reading {files[0]} failed: {_first_line(e)}") from None
        except Exception as e:  # datasets/pyarrow raise their own exception types
            if type(e).__module__.split(".")[0] not in ("datasets", "pyarrow", "fsspec"):
                raise
            raise DataError(f"data.path: reading {files[0]} failed: {_first_line(e)}") from None


def _column(batches: Iterator[dict[str, list]], field: str, files: list[Path]) -> Iterator[list]:
    for batch in batches:
        if field not in batch:
            raise DataError(
                f"data.text_field '{field}' is not a field of {files[0]}; fields: "
                f"{', '.join(batch)}"
            )
        yield batch[field]


# ---------------------------------------------------------------------------- caching


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (fcntl; no lock where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open_append(path) as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_meta(folder: Path, key: str) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(meta, dict)
        and meta.get("key") == key
        and isinstance(meta.get("tokens"), int)
        and (folder / "tokens.bin").is_file()
        and (folder / "tokens.bin").stat().st_size == 4 * meta["tokens"]
    )
    return meta if ok else None


def _write_stream(
    out: Path, texts: Iterator[list[str]], tok: TokenizerInfo, separator: int
) -> tuple[int, int]:
    """Encode every document, append the separator, write int32 to ``out`` (atomically, through
    :func:`ampctl.files.write_file`); ``(tokens, documents)``."""
    import array

    n_tokens = n_docs = 0
    with write_file(out) as f:
        for docs in texts:
            buf = array.array("i")
            for ids in tok.encode_batch(docs):
                if ids:
                    buf.extend(ids)
                    buf.append(separator)
                    n_docs += 1
            if buf.itemsize != 4:  # pragma: no cover - C int is 32-bit everywhere torch runs
                raise DataError("this platform's C int is not 32 bits")
            f.write(buf.tobytes())
            n_tokens += len(buf)
    return n_tokens, n_docs


# ----------------------------------------------------------------------------- source


class HFSource(PackedSource):
    """Packed language-model batches from a local dataset and tokenizer (see the module doc).

    Args:
        path: ``data.path``: save_to_disk folder, file, folder or glob.
        tokenizer: ``data.tokenizer``: tokenizer.json or a tokenizer folder.
        seq_len, batch_size, seed, mask_prob, rank, world_size: as for the other sources.
        vocab_size: the model's vocabulary (``data.vocab_size``); the tokenizer's may not be
            larger.
        objective: ``"mlm"`` or ``"causal"``.
        text_field: column holding the text (json/parquet/arrow).
        format: ``auto``, ``text``, ``json``, ``parquet`` or ``arrow``.
        split: split of a saved ``DatasetDict``.
        cache_dir: cache root (None: :func:`default_cache_dir`).

    Attributes:
        cache_path: folder holding ``tokens.bin`` and ``meta.json``.
        cache_hit: whether the stream came from the cache (no tokenization this time).
        num_documents: documents in the stream.
    """

    def __init__(
        self,
        *,
        path: str | Path,
        tokenizer: str | Path,
        seq_len: int,
        batch_size: int,
        vocab_size: int,
        seed: int = 0,
        mask_prob: float = 0.15,
        objective: str = "mlm",
        text_field: str = "text",
        format: str = "auto",
        split: str = "train",
        cache_dir: str | Path | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__(
            vocab_size, seq_len, batch_size, seed, mask_prob, rank, world_size, objective
        )
        require_int("data.vocab_size", vocab_size, 1, DataError)
        for name, value in (("path", path), ("tokenizer", tokenizer)):
            if not isinstance(value, str | Path) or not str(value):
                raise DataError(f"data.{name} must be a path, got {value!r}")
        if not isinstance(text_field, str) or not text_field:
            raise DataError(f"data.text_field must be a column name, got {text_field!r}")
        self.pad_id = -1  # packed: no padding anywhere
        fmt, files = resolve_dataset(path, format)
        tok = load_tokenizer(tokenizer)
        if tok.vocab_size > vocab_size:
            raise DataError(
                f"data.tokenizer '{tokenizer}' has {tok.vocab_size} tokens, more than "
                f"data.vocab_size={vocab_size} (the model's vocabulary): set "
                f"data.vocab_size={tok.vocab_size} or larger"
            )
        self.tokenizer = tok
        if objective == "causal":
            # documents end with end-of-text; a BERT-style tokenizer's SEP serves otherwise
            separator = tok.roles.get("eos")
            if separator is None and tok.roles.get("sep") is not None:
                separator = tok.roles["sep"]
            if separator is None:
                separator = tok.role("eos", objective)  # raises, naming what was looked for
            prefix = None
        else:
            separator = tok.role("sep", objective)
            prefix = tok.role("cls", objective)
            self._mask_id = tok.role("mask", objective)
            self._special = torch.zeros(tok.vocab_size, dtype=torch.bool)
            self._special[torch.tensor(tok.special_ids, dtype=torch.long)] = True
            self._ordinary = (~self._special).nonzero().flatten()
            if self._ordinary.numel() == 0:
                raise DataError(f"data.tokenizer '{tokenizer}' has only special tokens")
        self.separator_id = separator

        key_data = {
            "version": _CACHE_VERSION,
            "format": fmt,
            "files": dataset_fingerprint(fmt, files),
            "split": split if fmt == "arrow" else None,
            "text_field": text_field if fmt != "text" else None,
            "tokenizer": tok.fingerprint,
            "separator": separator,
        }
        key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:24]
        root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.cache_path = root / "tokenized" / key
        texts = functools.partial(iter_texts, fmt, files, text_field, split)
        stream, meta = self._cached_stream(key, key_data, texts, path, text_field)
        self.num_documents = int(meta["documents"])
        self._set_stream(stream, prefix)
        if self.num_windows == 0:
            raise DataError(
                f"data.path '{path}' gives {self.num_tokens} tokens, too few for one sequence of "
                f"seq_len {seq_len}: give more text or a smaller data.seq_len"
            )

    def _cached_stream(
        self,
        key: str,
        key_data: dict[str, Any],
        texts: Callable[[], Iterator[list[str]]],
        path: Any,
        text_field: str,
    ) -> tuple[Tensor, dict[str, Any]]:
        """The token stream of the cache entry ``key``, tokenized from ``texts()`` (batches of
        documents) first when the cache has no such entry."""
        folder = self.cache_path
        meta = _read_meta(folder, key)
        self.cache_hit = meta is not None
        if meta is None:
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise DataError(
                    f"data.cache_dir: cannot create '{folder}' ({e.strerror}): set data.cache_dir="
                ) from None
            with _locked(folder / ".lock"):
                meta = _read_meta(folder, key)  # another rank may have written it meanwhile
                self.cache_hit = meta is not None
                if meta is None:
                    meta = self._tokenize(folder, key, key_data, texts)
        if meta["tokens"] == 0:
            raise DataError(
                f"data.path '{path}' holds no text (field '{text_field}'): nothing to train on"
            )
        stream = torch.from_file(
            str(folder / "tokens.bin"), shared=False, size=meta["tokens"], dtype=torch.int32
        )
        return stream, meta

    def _tokenize(
        self,
        folder: Path,
        key: str,
        key_data: dict[str, Any],
        texts: Callable[[], Iterator[list[str]]],
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        n_tokens, n_docs = _write_stream(
            folder / "tokens.bin", texts(), self.tokenizer, self.separator_id
        )
        meta = {
            "key": key,
            "tokens": n_tokens,
            "documents": n_docs,
            "tokenizer": self.tokenizer.source,
            "tokenizer_vocab_size": self.tokenizer.vocab_size,
            "seconds": round(time.perf_counter() - t0, 3),
            "inputs": key_data,
        }
        write_text(folder / "meta.json", json.dumps(meta, indent=1))
        return meta

    def _mask(self, tokens: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        return apply_mlm_masking(
            tokens,
            self.vocab_size,
            self.mask_prob,
            generator,
            mask_id=self._mask_id,
            special=self._special,
            ordinary_ids=self._ordinary,
        )
