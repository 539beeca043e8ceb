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
  (ampctl configs behind the trust rule; Hugging Face models from ``config.json``), and
  :mod:`.findings` -- what the replay found, as problems;
* :mod:`.fp8` -- 3. for fp8 runs, each fp8 layer's cast headroom in e4m3/e5m2 terms;
* :mod:`.course` and :mod:`.verdict` -- 4. the verdict on the whole run (its history, the other
  checkpoints, the scaler's record, the guard's events): healthy, recovered or broken, the
  cause, and the checkpoint to resume from (written before the first sign of trouble);
* :mod:`.recommend` -- 5. the fix, in ampctl's and the user's own terms;
* :mod:`.report` -- the report (its JSON schema is documented there);
* :mod:`.render` -- rich output; :mod:`.pipeline` -- one diagnosis start to end.

The stages pass typed records (:mod:`.stages`), written to JSON by one function.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .common import EXPLOSION_FACTOR, SCHEMA, UNDERFLOW_LIMIT
from .health import name_optimizer_state, state_health
from .history import grad_norm_trend, overflow_bursts
from .pipeline import diagnose, diagnose_report
from .readers import FORMATS
from .render import render
from .report import report_json

__all__ = [
    "SCHEMA",
    "FORMATS",
    "diagnose",
    "diagnose_report",
    "run_diagnose",
    "json_error",
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
    probe: bool = True,
    rebuild: str | None = None,
) -> int:
    """What ``ampctl diagnose`` does: diagnose, print (rich tables, or only JSON on stdout),
    return 0 when healthy or recovered and 1 when problems were found. Bad input raises (the
    caller prints it; with ``as_json`` the JSON document is :func:`json_error`'s)."""
    from rich.console import Console

    from ampctl.ui.progress import ByteProgress

    from .health import read_progress

    # a read longer than a couple of seconds shows its progress on stderr (a bar on a
    # terminal, a line now and then otherwise; never on stdout)
    with read_progress(ByteProgress("reading checkpoint", live=None if not as_json else False)):
        report = diagnose_report(
            path, batches=batches, precision=precision, device=device, fmt=fmt,
            trust_code=trust_code, data=data, max_memory=max_memory, probe=probe,
            rebuild=rebuild,
        )  # fmt: skip
    if as_json:
        _print_json(report_json(report))
    else:
        render(report, Console())
    return report.exit_code


def json_error(message: str) -> None:
    """The ``--json`` document of a diagnosis that could not be made (exit code 2)."""
    _print_json({"error": message})


def _print_json(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()
