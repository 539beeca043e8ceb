"""Checkpoint readers, one module per format, chosen by what is on disk (``--format`` forces one).

========== ============================================================================
format     what is read
========== ============================================================================
ampctl     ``runs/<run>/`` or ``checkpoints/step_*.pt`` (+ metrics, events, branches)
hf-trainer ``checkpoint-N/`` or the Trainer's ``output_dir`` (newest checkpoint-N)
accelerate ``save_state`` folder (model.safetensors, optimizer.bin, scaler.pt)
lightning  ``*.ckpt`` (+ ``metrics.csv`` / TensorBoard events of its ``version_N``)
dcp        torch.distributed.checkpoint folder (``.metadata`` + ``*.distcp``)
deepspeed  ``save_checkpoint`` folder (``latest``, ``global_stepN/``)
safetensors a ``.safetensors`` file, or a folder of them (shards + ``*.index.json``)
state-dict ``.pt``/``.pth``/``.bin``: a state dict, or a dict of model/optimizer/scaler states
========== ============================================================================

Detection of a file that is not named for one format loads it once (``weights_only=True``)
and looks at its keys (ampctl's format tag, Lightning's version key, DeepSpeed's ``module`` +
``ds_version``).
"""

from __future__ import annotations

from pathlib import Path

from . import accelerate, ampctl, dcp, deepspeed, hf, lightning, model_folder, plain, weights
from .base import Found, NotACheckpoint, ReaderError, load_torch

__all__ = ["FORMATS", "read", "Found", "ReaderError", "NotACheckpoint"]

# Folder readers in the order they are tried: the first that claims a path reads it.
_FOLDERS = (
    (ampctl.FORMAT_NAME, ampctl),
    (hf.FORMAT_NAME, hf),
    (dcp.FORMAT_NAME, dcp),
    (deepspeed.FORMAT_NAME, deepspeed),
    (accelerate.FORMAT_NAME, accelerate),
    (lightning.FORMAT_NAME, lightning),
)
FORMATS = (
    ampctl.FORMAT_NAME,
    hf.FORMAT_NAME,
    accelerate.FORMAT_NAME,
    lightning.FORMAT_NAME,
    dcp.FORMAT_NAME,
    deepspeed.FORMAT_NAME,
    plain.SAFETENSORS,
    plain.STATE_DICT,
)
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl", ".pickle")


def read(path: str | Path, fmt: str | None = None, *, trust_code: bool = False) -> Found:
    """Read a checkpoint file or folder. Raises :class:`ReaderError` (a ``UsageError``) for a
    path that holds nothing diagnose reads, a refused pickle, or an unknown ``fmt``, and the
    resource refusals of :mod:`ampctl.trust`. ``trust_code``: read what is pickled by design
    where a format keeps state that way (DCP's non-tensor values)."""
    p = Path(path)
    if fmt is not None and fmt not in FORMATS:
        raise ReaderError(f"--format {fmt!r} is not allowed: use one of {', '.join(FORMATS)}")
    if not p.exists():
        raise ReaderError(f"{str(p)!r} does not exist: give a checkpoint file or folder")
    if fmt is not None:
        return _forced(p, fmt, trust_code)
    if p.is_dir():
        return _folder(p, trust_code)
    return _file(p)


def _read_with(module, p: Path, trust_code: bool) -> Found:
    return module.read(p, trust_code=trust_code) if module is dcp else module.read(p)


def _forced(p: Path, fmt: str, trust_code: bool) -> Found:
    if fmt in (plain.SAFETENSORS, plain.STATE_DICT) and model_folder.claims_folder(p):
        return _weights_folder(p)
    if fmt == plain.SAFETENSORS:
        return plain.read_safetensors(p)
    if fmt == plain.STATE_DICT:
        return plain.from_object(load_torch(p), p)
    module = dict(_FOLDERS)[fmt]
    return _read_with(module, p, trust_code)


def _folder(p: Path, trust_code: bool) -> Found:
    for _name, module in _FOLDERS:
        if module.claims(p):
            return _read_with(module, p, trust_code)
    if model_folder.claims_folder(p):  # save_pretrained's folder: weights (shards), config.json
        return _weights_folder(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in _FILE_SUFFIXES)
    if len(files) == 1:
        return _file(files[0])
    listed = ", ".join(f.name for f in files[:5]) or "no checkpoint files"
    raise NotACheckpoint(
        f"{str(p)!r} holds no checkpoint diagnose can read ({listed}); it reads ampctl run "
        "folders, HF Trainer checkpoint-N/output_dir, Accelerate save_state, Lightning .ckpt, "
        "DCP and DeepSpeed folders, .safetensors and .pt/.pth/.bin files"
    )


def _weights_folder(p: Path) -> Found:
    safe = any(n.endswith(".safetensors") for n in weights.weight_files(p))
    return model_folder.read_folder(p, plain.SAFETENSORS if safe else plain.STATE_DICT)


def _file(p: Path) -> Found:
    if p.suffix == ".safetensors":
        return plain.read_safetensors(p)
    if hf.claims(p):
        return hf.read(p)
    if deepspeed.claims(p):
        return deepspeed.read(p)
    if ampctl.claims(p):
        return ampctl.read(p)
    obj = load_torch(p)
    if isinstance(obj, dict) and obj.get("format") == _ampctl_format():
        obj["path"] = str(p)
        return ampctl.read_loaded(obj, p)
    if lightning.is_lightning(obj):
        found = lightning.read_loaded(obj, p)
        return found
    if isinstance(obj, dict) and "module" in obj and "ds_version" in obj:
        return deepspeed.read(p)
    return plain.from_object(obj, p)


def _ampctl_format() -> str:
    from ampctl.train.checkpoint import FORMAT

    return FORMAT
