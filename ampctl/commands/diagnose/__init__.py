"""``ampctl diagnose``: explain why a run went NaN and what to change, for any PyTorch training
checkpoint (ampctl, HF Trainer, Accelerate, Lightning, DCP, DeepSpeed, safetensors, state dicts).

The parts, one file each:

* :mod:`.readers` -- one reader per format, chosen by what is on disk; files are data
  (``weights_only=True``, safetensors, an allow-list unpickler), never code, read under the
  resource rules of :mod:`ampctl.trust` (size caps, memory estimated before allocating);
* :mod:`.health` -- 1. state health: NaN/inf and out-of-range weights, masters and optimizer
  moments named by parameter; the loss scaler's state;
* :mod:`.history` -- 2. what the run logged: first overflow, first NaN loss, grad-norm trend,
  which branch of an ampctl run folder was read;
* :mod:`.replay` -- 3. a few batches replayed in fp32 and the run's precision with hooks
  (ampctl configs behind the trust rule; Hugging Face models from ``config.json``);
* :mod:`.fp8` -- 3. for fp8 runs, each fp8 layer's cast headroom in e4m3/e5m2 terms;
* :mod:`.recommend` -- 4. overrides in ampctl's and the user's own terms, and where to resume;
* :mod:`.report` -- the report dict (its JSON schema is documented there);
* :mod:`.render` -- rich output; :mod:`.pipeline` -- one diagnosis start to end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .common import EXPLOSION_FACTOR, SCHEMA, UNDERFLOW_LIMIT
from .health import name_optimizer_state, state_health
from .history import grad_norm_trend, overflow_bursts
from .pipeline import diagnose
from .readers import FORMATS
from .render import render

__all__ = [
    "SCHEMA",
    "FORMATS",
    "diagnose",
    "run_diagnose",
    "render",
    "state_health",
    "name_optimizer_state",
    "overflow_bursts",
    "grad_norm_trend",
    "UNDERFLOW_LIMIT",
    "EXPLOSION_FACTOR",
]


def run_diagnose(
    path: Path,
    batches: int = 2,
    precision: str | None = None,
    device: str = "auto",
    as_json: bool = False,
    *,
    fmt: str | None = None,
    trust_code: bool = False,
    data: Path | None = None,
    max_memory: int | None = None,
) -> int:
    """What ``ampctl diagnose`` does: diagnose, print (rich tables, or only JSON on stdout),
    return 0 when healthy and 1 when problems were found."""
    from rich.console import Console

    report: dict[str, Any] = diagnose(
        path,
        batches=batches,
        precision=precision,
        device=device,
        fmt=fmt,
        trust_code=trust_code,
        data=data,
        max_memory=max_memory,
    )
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:
        render(report, Console())
    return 0 if report["healthy"] else 1
