"""The probe of a run ampctl did not train (#36): its model rebuilt without running its code, its
change trained for a few patiences in a plain loop of ampctl's precision plugin (autocast, the
``LossScaler`` that skips a non-finite step as ``torch.amp.GradScaler`` does, the fp32 modules),
AdamW as the HF Trainer builds it, on synthetic token batches of its shape (the run's data is
named in no file diagnose may open).

* a Hugging Face folder with ``config.json``: the model class of a known ``model_type`` from
  transformers' Auto classes (``trust_remote_code=False``, local files only, as the replay
  builds it), the checkpoint's weights, optimizer (the Trainer's two groups: weight decay, then
  none) and ``scaler.pt``; from a fresh start, the same class initialised with seed 0;
* any run, with ``--rebuild MODULE:FUNCTION``: the user's own factory, imported because the user
  named it on the command line (as ``--trust-code``; a run folder's own saved names are never
  imported), MODULE found from the working directory too. ``FUNCTION(config)`` gets the run's saved config (a dict, or None) and returns a
  dict: ``model`` (an ``nn.Module`` whose forward takes a batch's keys and returns a loss or an
  object or dict with ``loss``), ``batch`` (a function of the batch index: a dict of tensors,
  the run's own data) and optionally ``optimizer`` (a function of the parameters and the lr;
  default ``torch.optim.AdamW``). The checkpoint's weights are loaded into the model when it
  has them.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampctl.errors import UsageError

__all__ = ["Loop", "hf_loop", "rebuild_loop", "loop_trial"]

#: Synthetic batches of a Hugging Face model: sequences of this many tokens, this many a batch.
SEQ, BATCH = 32, 4


@dataclass
class Loop:
    """What a probe needs of a run it did not train."""

    model: nn.Module  # the model to start from (copied for each trial)
    batch: Callable[[int], dict[str, Any]]
    precision: str  # the run's (fp16, bf16, fp32 ...)
    data: str  # the batches, in words
    optimizer: Callable[[nn.Module, float], torch.optim.Optimizer] | None = None
    opt_state: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None
    lr: float | None = None  # the run's lr (from its history), when no optimizer state gives it


def _adamw_groups(model: nn.Module) -> Callable[[nn.Module, float], torch.optim.Optimizer]:
    """AdamW over the HF Trainer's two groups (weight decay, then none), so its saved state
    loads; the hyperparameters come with that state (``load_state_dict``)."""
    from .readers.hf import _decay_names

    decay = set(_decay_names(model))

    def make(copy_: nn.Module, lr: float) -> torch.optim.Optimizer:
        named = [(n, p) for n, p in copy_.named_parameters() if p.requires_grad]
        groups = [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
        return torch.optim.AdamW([{"params": g} for g in groups if g], lr=lr, weight_decay=0.0)

    return make


def hf_loop(found: Any, resume: Any | None, device: torch.device) -> Loop:
    """The loop of a Hugging Face checkpoint (``found``: the diagnosed one; ``resume``: the one
    to start from, read, or None for a fresh start). Raises :class:`UsageError` with the reason
    when the model cannot be rebuilt."""
    from ampctl.train.data import SyntheticSource

    from .replay import ReplaySkipped, hf_input

    start = resume if resume is not None else found
    try:  # the replay's rebuild: size checks, config.json under the cap, the weights fit
        model = hf_input(
            start, precision="fp32", device=device, batches=1, data_file=None, scaler=None
        ).model
    except ReplaySkipped as e:
        raise UsageError(str(e)) from None
    if resume is None:  # a fresh start: the same class, initialised as from_config does
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = type(model)(model.config).to(device)
    cfg = model.config
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    seq = min(SEQ, int(getattr(cfg, "max_position_embeddings", SEQ) or SEQ))
    src = SyntheticSource(
        vocab_size=int(cfg.vocab_size),
        seq_len=seq,
        batch_size=BATCH,
        objective="mlm" if arch.endswith("ForMaskedLM") else "causal",
    )

    def batch(i: int) -> dict[str, Any]:
        b = src.batch_at(i)
        return {
            k: v.long().to(device) if k == "attention_mask" else v.to(device) for k, v in b.items()
        }

    return Loop(
        model=model,
        batch=batch,
        precision=found.precision or "fp32",
        data=f"synthetic token batches of the model's shape ({BATCH} x {seq}, ids below "
        f"{cfg.vocab_size}): the run's data is named in no file diagnose opens",
        optimizer=_adamw_groups(model),
        opt_state=resume.optimizer if resume is not None else None,
        scaler_state=resume.scaler if resume is not None else None,
    )


def rebuild_loop(target: str, found: Any, resume: Any | None, device: torch.device) -> Loop:
    """The loop the user's factory ``MODULE:FUNCTION`` builds (see the module docstring), with
    the weights of ``resume`` (read) loaded when it has them. **Runs the user's code**: only
    because the user named it on the command line."""
    mod_name, _, fn_name = target.partition(":")
    sys.path.insert(0, os.getcwd())  # the user's module, from where they run (as uvicorn does)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise UsageError(f"--rebuild {target}: cannot import it ({e})") from None
    finally:
        sys.path.remove(os.getcwd())
    config = found.config if isinstance(found.config, dict) else None
    got = fn(config)
    if not isinstance(got, dict) or not isinstance(got.get("model"), nn.Module):
        raise UsageError(f"--rebuild {target}: must return a dict with 'model' and 'batch'")
    if not callable(got.get("batch")):
        raise UsageError(f"--rebuild {target}: 'batch' must be a function of the batch index")
    model = got["model"].to(device)
    if resume is not None and resume.weights:
        missing, _ = model.load_state_dict(dict(resume.weights), strict=False)
        if missing:
            raise UsageError(
                f"--rebuild {target}: the checkpoint's weights do not fit its model "
                f"({len(missing)} missing, first {missing[0]})"
            )
    prec = (found.config or {}).get("precision") if isinstance(found.config, dict) else None
    name = prec.get("name") if isinstance(prec, dict) else found.precision
    return Loop(
        model=model,
        batch=lambda i: {k: v.to(device) for k, v in got["batch"](i).items()},
        precision=name or "fp32",
        data=f"the batches of {target}",
        optimizer=(lambda m, lr: got["optimizer"](m.parameters(), lr))
        if callable(got.get("optimizer"))
        else None,
        opt_state=resume.optimizer if resume is not None else None,
        scaler_state=resume.scaler if resume is not None else None,
    )


def _changes(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The ampctl overrides as the loop's settings; the keys it cannot apply (the guard's: the
    plain loop has none), listed."""
    out: dict[str, Any] = {"scaler": {}}
    ignored = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "optim.lr":
            out["lr"] = float(value)
        elif key == "optim.warmup_steps":
            out["warmup"] = int(value)
        elif key == "optim.clip_grad_norm":
            out["clip"] = float(value)
        elif key == "precision":
            out["precision"] = value
        elif key == "precision.fp32_modules":
            out["fp32"] = [m for m in value.strip("[]").split(",") if m]
        elif key.startswith("scaler."):
            out["scaler"][key.split(".", 1)[1]] = float(value)
        else:
            ignored.append(key)
    return out, ignored


def loop_trial(
    loop: Loop, lr: float | None, overrides: list[str], steps: int, every: int, device: torch.device
) -> tuple[str, list[float], int]:
    """Train a copy of the loop's model ``steps`` steps with the changes: (status, the mean
    loss of every ``every`` steps, the steps it skipped). Status ``ok``, ``skipped`` (more than
    half the steps skipped) or ``failed: ...``. **Syncs** (it trains)."""
    from ampctl.amp import make_precision

    ch, _ignored = _changes(overrides)
    lr = lr if lr is not None else ch.get("lr")
    model = copy.deepcopy(loop.model).train()
    prec = make_precision(
        ch.get("precision", loop.precision),
        fp32_modules=ch.get("fp32", []),
        device_type=device.type,
        scaler_args=ch["scaler"] or None,
    )
    model = prec.prepare(model)
    params = prec.optimizer_params(model)
    make = loop.optimizer or (lambda m, x: torch.optim.AdamW(m.parameters(), lr=x))
    opt = make(model, lr if lr is not None else loop.lr or 1e-3)
    if loop.opt_state is not None:
        try:
            opt.load_state_dict(copy.deepcopy(loop.opt_state))
        except (ValueError, KeyError, RuntimeError):
            pass  # another grouping: a fresh optimizer state
    lr = lr if lr is not None else opt.param_groups[0]["lr"]
    if loop.scaler_state and not ch["scaler"] and prec.scaler.is_enabled():
        try:
            prec.scaler.load_state_dict(dict(loop.scaler_state))
        except (KeyError, RuntimeError, ValueError):
            pass
    warmup, clip = ch.get("warmup", 0), ch.get("clip")
    losses, rows, skipped = [], [], 0
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for i in range(steps):
                for g in opt.param_groups:
                    g["lr"] = lr * min(1.0, (i + 1) / warmup) if warmup else lr
                opt.zero_grad(set_to_none=True)
                with prec.autocast():
                    out = model(**loop.batch(i))
                loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", out)
                prec.backward(loss)
                prec.unscale_(opt)
                if clip:
                    torch.nn.utils.clip_grad_norm_(params, clip)
                skipped += bool(prec.optimizer_step(opt))
                losses.append(float(loss.detach()))
                if len(losses) == every:
                    bad = [x for x in losses if not math.isfinite(x)]
                    rows.append(bad[0] if bad else sum(losses) / every)
                    losses = []
    except RuntimeError as e:
        return f"failed: {str(e).splitlines()[0][:200]}", rows, skipped
    return ("skipped" if 2 * skipped > steps else "ok"), rows, skipped
