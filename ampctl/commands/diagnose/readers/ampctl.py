"""ampctl's own checkpoints: ``runs/<run>/checkpoints/step_XXXXXXXX.pt`` (format
``ampctl-checkpoint/1``), read with ``weights_only=True``. A run folder gives its newest
checkpoint and its history; a checkpoint inside an archived branch
(``branches/NNN-stepS/checkpoints/``) is read with that branch's history.

Run folders written by the integrations (:class:`ampctl.integrations.ProtectedRun`, the
Lightning callback) hold metrics, events and a summary, and checkpoints only when the loop saved
some there: without one the folder is read for its history alone; a ``step_*.pt`` without the
format tag is read as a plain state dict, with the folder's history.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ampctl.amp.precision import saved_in_fp32
from ampctl.runlog import RunLayout, is_run_dir, read_json
from ampctl.runlog.layout import CHECKPOINT_NAME, list_checkpoints
from ampctl.runlog.readers import RunFileError, load_config_text
from ampctl.trust_paths import check_folder_inside

from . import plain
from .base import Found, ReaderError, load_torch

__all__ = ["FORMAT_NAME", "claims", "read", "read_loaded", "resolve"]

FORMAT_NAME = "ampctl"


def claims(path: Path) -> bool:
    """A run folder, its ``checkpoints/`` folder, or a ``step_*.pt`` file."""
    if path.is_dir():
        return is_run_dir(path) or bool(list_checkpoints(path))
    return bool(CHECKPOINT_NAME.match(path.name))


def resolve(path: Path) -> Path:
    """The checkpoint file a path stands for (a run folder: its newest checkpoint)."""
    if path.is_file():
        return path
    check_folder_inside(path / RunLayout.CHECKPOINTS, path, what="the checkpoints folder")
    for d in (path / RunLayout.CHECKPOINTS, path):
        ckpts = list_checkpoints(d)
        if ckpts:
            return ckpts[-1]
    raise ReaderError(f"{str(path)!r} holds no checkpoint (looked for checkpoints/step_*.pt)")


def _run_dir_of(given: Path, ckpt: Path) -> Path | None:
    if given.is_dir():
        return given.parent if given.name == RunLayout.CHECKPOINTS else given
    return ckpt.parent.parent if ckpt.parent.name == RunLayout.CHECKPOINTS else None


def read(path: Path) -> Found:
    from ampctl.train.checkpoint import FORMAT

    if path.is_dir() and is_run_dir(path) and not _has_checkpoint(path):
        return _history_only(path)
    ckpt = resolve(path)
    obj = load_torch(ckpt)
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        obj["path"] = str(ckpt)
        return read_loaded(obj, ckpt, given=path)
    # a step_*.pt that a loop of its own saved (e.g. beside ProtectedRun's records)
    found = plain.from_object(obj, ckpt)
    run_dir = _run_dir_of(path, ckpt)
    found.run_dir = run_dir if run_dir is not None and run_dir.is_dir() else None
    found.run_config = _run_config(found.run_dir)
    found.siblings = [p for p in reversed(list_checkpoints(ckpt.parent)) if p != ckpt]
    return found


def _has_checkpoint(path: Path) -> bool:
    return any(list_checkpoints(d) for d in (path / RunLayout.CHECKPOINTS, path))


def _run_config(run_dir: Path | None) -> dict[str, Any] | None:
    """The run folder's ``config.yaml`` as plain data (never resolved). One that is there but
    unreadable (a YAML tag, not YAML, over the size cap) is bad input: ``RunFileError``."""
    if run_dir is None:
        return None
    path = RunLayout(run_dir).config
    if not path.exists() and not path.is_symlink():
        return None
    return load_config_text(path)


def _note_unread_run_config(found: Found) -> None:
    """Beside the checkpoint's own config the run folder's ``config.yaml`` is not needed; one
    that cannot be read (a Python YAML tag, not YAML ...) is said in a note, not passed over."""
    try:
        _run_config(found.run_dir)
    except RunFileError as e:
        found.notes.append(
            f"the run folder's {RunLayout.CONFIG} is not read ({e.reason}); the checkpoint's own "
            "config is used"
        )


def _history_only(run_dir: Path) -> Found:
    """A run folder without checkpoints (e.g. written by ampctl.integrations.ProtectedRun):
    its records only; the precision from its config.yaml or summary.json."""
    config = _run_config(run_dir)  # (its metrics are the history's: streamed there, not here)
    cfg = config or {}
    prec = cfg.get("precision")
    name = prec.get("name") if isinstance(prec, dict) else None
    if not isinstance(name, str):
        name = (read_json(RunLayout(run_dir).summary) or {}).get("precision")
    who = cfg.get("integration")
    found = Found(
        format=FORMAT_NAME,
        path=run_dir,
        precision=name if isinstance(name, str) else None,
        precision_source=f"{RunLayout.CONFIG}" if isinstance(name, str) else None,
        run_dir=run_dir,
        run_config=config,
    )
    found.notes.append(
        f"no checkpoint in this run folder (looked for {RunLayout.CHECKPOINTS}/step_*.pt): "
        "only what the run logged is diagnosed"
        + (f" (written by ampctl's '{who}' integration)" if isinstance(who, str) else "")
    )
    lit = cfg.get("lightning")
    ckpt_dir = lit.get("checkpoint_dir") if isinstance(lit, dict) else None
    if isinstance(ckpt_dir, str) and ckpt_dir:
        found.notes.append(
            f"the Lightning checkpoints of this run are in {ckpt_dir}: `ampctl diagnose "
            f"{ckpt_dir}` checks their state"
        )
    return found


def read_loaded(ck: dict[str, Any], ckpt: Path, *, given: Path | None = None) -> Found:
    """A loaded ampctl checkpoint dict as a :class:`Found` (``config`` may be missing: a loop
    of its own that saved the format, e.g. with ProtectedRun's state)."""
    if not isinstance(ck.get("model"), dict):
        missing = [k for k in ("model", "config") if k not in ck]
        raise ReaderError(
            f"{str(ckpt)!r} lacks {', '.join(missing) or 'a model state'}: not a complete "
            "ampctl checkpoint"
        )
    prec = ck.get("precision") if isinstance(ck.get("precision"), dict) else {}
    if isinstance(ck.get("precision"), str):  # ProtectedRun.state_dict() keeps the name only
        prec = {"name": ck["precision"]}
    config = ck.get("config") if isinstance(ck.get("config"), dict) else None
    weights = {k: v for k, v in ck["model"].items() if isinstance(v, torch.Tensor)}
    # the optimizer lists the trainable parameters in model order (tied ones once)
    order = _model_order(ck["model"])
    masters = ck.get("master")
    found = Found(
        format=FORMAT_NAME,
        path=ckpt,
        step=int(ck.get("step", 0)),
        weights=weights,
        masters=[t for t in masters if isinstance(t, torch.Tensor)]
        if isinstance(masters, list)
        else None,
        optimizer=ck.get("optimizer") if isinstance(ck.get("optimizer"), dict) else None,
        param_orders=[("model order", order)],
        scaler=ck.get("scaler") if isinstance(ck.get("scaler"), dict) else None,
        scaler_kind="ampctl",
        precision=prec.get("name") or _saved(config, "precision", "name") or "fp32",
        precision_source="checkpoint",
        fp32_modules=saved_in_fp32(prec),
        config=config,
        raw=ck,
    )
    run_dir = _run_dir_of(given or ckpt, ckpt)
    found.run_dir = run_dir if run_dir is not None and run_dir.is_dir() else None
    if config is None:
        found.run_config = _run_config(found.run_dir)
    else:
        _note_unread_run_config(found)
    found.siblings = [p for p in reversed(list_checkpoints(ckpt.parent)) if p != ckpt]
    return found


def _model_order(sd: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    seen: set[tuple[int, int]] = set()
    out = []
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out.append((k, tuple(v.shape)))
    return out


def _saved(config: dict[str, Any] | None, group: str, key: str) -> Any:
    node = (config or {}).get(group)
    if isinstance(node, dict):
        v = node.get(key)
        if isinstance(v, str) and "${" in v:
            return None  # an interpolation is never evaluated
        return v
    return None
