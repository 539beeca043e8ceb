"""Hugging Face Trainer checkpoints: a ``checkpoint-N/`` folder (``model.safetensors`` or
``pytorch_model.bin``, ``optimizer.pt``, ``scaler.pt``, ``trainer_state.json``, ``config.json``)
or the ``output_dir`` holding them (the newest ``checkpoint-N`` is diagnosed, all are listed).

``trainer_state.json``'s ``log_history`` is the history (loss, grad_norm, learning_rate). The
Trainer logs a step whose loss was NaN/inf as the mean of the interval's finite losses, and as
``0.0`` when none was finite (``logging_nan_inf_filter``): a logged loss of exactly 0.0 next to a
non-finite grad norm is read as a NaN loss. ``training_args.bin`` and ``rng_state*.pth`` hold
pickled objects and are never opened; without them the run's precision is inferred (a
``scaler.pt`` means fp16) or unknown.

Optimizer state is named through the model rebuilt from ``config.json`` on the meta device
(transformers' Auto classes, ``trust_remote_code=False``, nothing downloaded) and the Trainer's
own grouping (weight-decay parameters first, then the rest); without transformers, by shape.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError
from ampctl.runlog.readers import JsonArrayStream, as_number
from ampctl.trust import read_bounded

from ..rows import RowKeeper
from ..stages import Row
from .base import FileNote, ForeignHistory, Found, NotACheckpoint
from .lazy import lazy_from, shapes_of
from .weights import read_state_files, read_weight_files, weight_files

__all__ = ["FORMAT_NAME", "claims", "read", "checkpoints_of", "build_meta_model", "nan_filtered"]

FORMAT_NAME = "hf-trainer"
TRAINER_STATE = "trainer_state.json"
_CKPT = re.compile(r"^checkpoint-(\d+)\Z")


def checkpoints_of(folder: Path) -> list[Path]:
    """``checkpoint-N`` folders of an output_dir, newest first."""
    found = [
        (int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CKPT.match(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True)]


def claims(path: Path) -> bool:
    if path.is_file():
        return path.name == TRAINER_STATE
    return (path / TRAINER_STATE).is_file() or bool(
        path.is_dir() and any((c / TRAINER_STATE).is_file() for c in checkpoints_of(path))
    )


def read(path: Path) -> Found:
    if path.is_file():
        path = path.parent
    siblings: list[Path] = []
    if not (path / TRAINER_STATE).is_file():
        ckpts = [c for c in checkpoints_of(path) if (c / TRAINER_STATE).is_file()]
        if not ckpts:
            raise NotACheckpoint(f"{str(path)!r} holds no checkpoint-N folder with {TRAINER_STATE}")
        path, siblings = ckpts[0], ckpts[1:]
    elif _CKPT.match(path.name):
        siblings = [c for c in checkpoints_of(path.parent) if c != path][::1]
        siblings = [c for c in siblings if _step_of(c) < _step_of(path)]
    found = Found(format=FORMAT_NAME, path=path, siblings=siblings)
    _read_files(found, path)
    return found


def _step_of(p: Path) -> int:
    m = _CKPT.match(p.name)
    return int(m.group(1)) if m else -1


def _trainer_state(found: Found, path: Path) -> tuple[dict[str, Any], ForeignHistory | None]:
    """``trainer_state.json`` in one pass (:class:`~ampctl.runlog.readers.JsonArrayStream`):
    its top-level keys, and its ``log_history`` entries one at a time into a bounded
    :class:`~..rows.RowKeeper` (an entry over the per-entry cap is skipped and counted; the file
    is never refused for its size). What cannot be read is kept in ``found.history_errors``."""
    source = path / TRAINER_STATE
    stream = JsonArrayStream(source, "log_history")
    keeper = RowKeeper(by_step=False)
    for r in stream:
        row = _log_row(r)
        if row is not None:
            keeper.add(row)
    rows = keeper.rows()
    if stream.error is not None:
        read = f"; the {stream.entries} log_history entries before it were read" if rows else ""
        found.history_errors.append((TRAINER_STATE, stream.error + read))
    elif stream.bad_count and not rows:
        n = stream.bad_count
        found.history_errors.append(
            (
                TRAINER_STATE,
                f"{stream.bad_why}: {n} log_history entr{'y' if n == 1 else 'ies'} skipped",
            )
        )
    if not rows:
        return stream.top, None
    notes = [n for n in (stream.note(), keeper.note(str(source))) if n]
    return stream.top, ForeignHistory(
        source=str(source),
        rows=[
            {
                "step": r.step,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "learning_rate": r.learning_rate,
            }
            for r in rows
        ],
        columns={"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate"},
        notes=notes,
        nan_filter=True,
        logged=keeper.seen,
    )


def _log_row(r: Any) -> Row | None:
    """A training row of ``log_history`` (eval rows and the final train summary are not)."""
    if not isinstance(r, dict) or "loss" not in r and "grad_norm" not in r:
        return None
    step = r.get("step")
    if not isinstance(step, int):
        return None
    return Row(
        step=step,
        loss=as_number(r.get("loss")),
        grad_norm=as_number(r.get("grad_norm")),
        learning_rate=as_number(r.get("learning_rate")),
    )


def _read_files(found: Found, path: Path) -> None:
    state, history = _trainer_state(found, path)
    step = state.get("global_step")
    found.step = (
        step if isinstance(step, int) else (_step_of(path) if _step_of(path) >= 0 else None)
    )
    found.weights = read_weight_files(path, found.files, found.problems)

    def other(f: Path) -> None:
        if f.name == TRAINER_STATE:
            read = not found.history_errors
            found.files.append(FileNote(f.name, read, "log_history" if read else "unreadable"))
        elif f.name == "config.json":
            found.model_dir = path
            found.files.append(FileNote(f.name, True, "model config (replay, names)"))
        elif f.name not in weight_files(path):
            found.files.append(FileNote(f.name, False, "not needed"))

    read_state_files(found, path, lambda name: name in ("optimizer.pt", "optimizer.bin"), other)
    if found.scaler is None:
        found.notes.append(
            "precision unknown: training_args.bin (pickled) is not read and there is no "
            "scaler.pt (fp32 or bf16); pass --precision to replay in the run's precision"
        )
    found.history = history
    if found.model_dir is not None:
        try:
            found.param_orders = hf_param_orders(found.model_dir, len(found.weights))
            why = None
        except UsageError as e:  # config.json over the cap, or more layers than tensors
            found.param_orders, why = [], str(e)
        if why is not None:
            found.notes.append(
                f"the model is not rebuilt from config.json ({why}): optimizer state is named "
                "by shape"
            )
        elif not found.param_orders:
            found.notes.append(
                "the model could not be rebuilt from config.json (is transformers installed? "
                "pip install transformers): optimizer state is named by shape"
            )
        else:  # report weights in the model's order (safetensors keeps names sorted)
            rank = {n: i for i, (n, _) in enumerate(found.param_orders[-1][1])}
            found.weights = lazy_from(found.weights).reordered(lambda k: rank.get(k, len(rank)))
    found.unordered_params = shapes_of(found.weights)


def nan_filtered(row: dict[str, Any], previous_loss: float | None) -> bool:
    """Whether a logged loss of 0.0 stands for NaN losses (HF's ``logging_nan_inf_filter``)."""
    import math

    loss, gn = row.get("loss"), row.get("grad_norm")
    if loss != 0.0:
        return False
    if isinstance(gn, int | float) and not math.isfinite(gn):
        return True
    return previous_loss is not None and previous_loss > 0


# ---------------------------------------------------------------------------- names
def build_meta_model(model_dir: Path, tensors: int | None = None) -> Any:
    """The model of a Hugging Face folder, built on the meta device from ``config.json``
    through transformers' Auto classes (``trust_remote_code=False``, local files only), after
    ``config.json`` is read under the whole-file cap and its layer counts are checked against
    ``tensors`` (the checkpoint's; :func:`ampctl.trust_counts.check_counts`). Raises
    :class:`~ampctl.errors.UsageError` for those refusals, ImportError / ValueError / OSError
    when it cannot be built without foreign code."""
    import json

    import torch
    from transformers import AutoConfig

    from ampctl.trust_counts import check_counts

    raw = read_bounded(model_dir / "config.json")  # FileRefused over the cap: never read whole
    if tensors is not None:
        check_counts(json.loads(raw), tensors, source=f"{model_dir / 'config.json'}")

    config = AutoConfig.from_pretrained(
        str(model_dir), trust_remote_code=False, local_files_only=True
    )
    cls = auto_class_for(config)
    with torch.device("meta"):
        return cls.from_config(config, trust_remote_code=False)


def auto_class_for(config: Any) -> Any:
    """The Auto class whose mapping holds the config's architecture (``BertForMaskedLM`` ->
    ``AutoModelForMaskedLM``), or ``AutoModel``."""
    import transformers

    arch = (getattr(config, "architectures", None) or [""])[0]
    for name in (
        "AutoModelForCausalLM",
        "AutoModelForMaskedLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
        "AutoModelForSeq2SeqLM",
        "AutoModelForQuestionAnswering",
    ):
        auto = getattr(transformers, name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None:
            continue
        try:
            names = {getattr(c, "__name__", "") for c in _mapping_values(mapping, config)}
        except Exception:  # noqa: BLE001 - an Auto class without this model type
            continue
        if arch in names:
            return auto
    return transformers.AutoModel


def _mapping_values(mapping: Any, config: Any) -> list[Any]:
    v = mapping[type(config)]
    return list(v) if isinstance(v, list | tuple) else [v]


def hf_param_orders(
    model_dir: Path, tensors: int | None = None
) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """Candidate optimizer orders: the Trainer's two groups (weight decay, then none), and the
    plain model order. Empty when the model cannot be built (names then come from shapes);
    :class:`~ampctl.errors.UsageError` when ``config.json`` is refused (the size cap, more
    layers than ``tensors``)."""
    try:
        model = build_meta_model(model_dir, tensors)
    except UsageError:
        raise
    except Exception:  # noqa: BLE001 - names are a nicety: fall back to shapes
        return []
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    decay = set(_decay_names(model))
    grouped = [x for x in named if x[0] in decay] + [x for x in named if x[0] not in decay]
    return [("Trainer groups (decay, no decay)", grouped), ("model order", named)]


def _decay_names(model: Any) -> list[str]:
    from torch import nn

    try:
        from transformers.trainer_pt_utils import get_parameter_names
    except ImportError:
        return []
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    return get_parameter_names(model, [nn.LayerNorm], patterns)
