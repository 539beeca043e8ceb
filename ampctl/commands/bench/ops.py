"""Section 5: device ops per step -- what protection launches beside a bare GradScaler loop.

Counted, not timed: :func:`ampctl.opcount.count_ops` counts every aten op outside the model's
forward and backward, gradient clipping, the optimizer's own math and data loading (on a GPU each
is a kernel launch). The same counts on any device, so the figures here are the ones the GPU
would launch, measured on whatever machine runs the bench.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ampctl.config import RunConfig, with_changes

from .common import BenchError, Progress, _free
from .overhead import _BareLoop


def _mean(xs: list[int]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _part_means(counts: list[dict[str, int]]) -> dict[str, float]:
    """Each part's mean ops over ``counts`` (one ``OpCount.by_part`` per step), largest first."""
    names = {k for c in counts for k in c}
    means = {k: sum(c.get(k, 0) for c in counts) / len(counts) for k in names} if counts else {}
    return dict(sorted(means.items(), key=lambda kv: (-kv[1], kv[0])))


def protection_parts() -> dict[str, tuple[tuple[Any, str], ...]]:
    """The protection's parts, each the methods whose ops it is charged with (the innermost
    part running wins; what runs outside all of them is ``other``)."""
    from ampctl.amp import LossScaler
    from ampctl.amp.actgrad import ActGradCounter
    from ampctl.amp.fp8 import CastRecord
    from ampctl.protect import shell
    from ampctl.protect.figures import DeviceFigures, LogWindow
    from ampctl.protect.protection import Protection
    from ampctl.protect.snapshot import Snapshot
    from ampctl.train import trainer as trainer_module

    scaler = ("scale", "unscale_", "report_grad_norm", "step", "update")
    return {
        "loss scaler": tuple((LossScaler, m) for m in scaler),
        "log window": ((LogWindow, "add"),),
        "gradient stats": ((trainer_module, "grad_stats"),),
        "log-step figures": (
            (shell, "gather_log_figures"),
            (DeviceFigures, "add"),
            (DeviceFigures, "read"),
            (Protection, "log_figures"),
        ),
        "probes": ((ActGradCounter, "_add"), (CastRecord, "_stats"), (CastRecord, "_add")),
        "snapshot": ((Snapshot, "take"),),
        "guard": tuple(
            (Protection, m) for m in ("after_step", "on_read", "sync", "on_log_read", "after_log")
        ),
    }


def measure_device_ops(
    cfg: RunConfig, steps: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Ops per optimizer step of the bare GradScaler loop and of :meth:`Trainer.step_once`
    (the step, the guard's bookkeeping, the log step when due), on ``cfg``'s model.

    The first ``log_every + 1`` steps of each run uncounted (optimizer state and snapshot buffers
    exist by then), then ``steps`` are counted. Returns the bare loop's ops per step, the
    protected loop's on a clean step without a log, on a log step, and its mean over all counted
    steps (log and snapshot steps included), each beside the bare figure as ``extra``; and
    ``parts``: the protected step's mean ops on clean and on log steps by part
    (:func:`protection_parts`)."""
    from ampctl.amp.actgrad import ActGradCounter
    from ampctl.amp.fp8 import CastRecord
    from ampctl.opcount import count_ops
    from ampctl.train.trainer import Trainer

    warm = cfg.trainer.log_every + 1
    total = warm + steps + 1
    cfg = with_changes(cfg, trainer={"max_steps": total, "ckpt_every": total})
    bare_counts: list[int] = []
    clean: list[int] = []
    logged: list[int] = []
    parts: dict[bool, list[dict[str, int]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="ampctl-bench-ops-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        bare = _BareLoop(cfg, trainer)
        real_once = trainer.step_once
        excluded = dict(
            models=(trainer.fwd_model, bare.model),
            optimizers=(trainer.optimizer, bare.optimizer),
            exclude=((trainer.data, "next_batch"), (bare.data, "next_batch")),
            # the log step's probes run inside the forward and backward: counted all the same
            include=((ActGradCounter, "_add"), (CastRecord, "_stats"), (CastRecord, "_add")),
        )
        if trainer.compiled is not None:
            raise BenchError(
                "bench: the device_ops section counts eager steps; run it with trainer.compile=false"
            )

        def counted() -> dict[str, Any] | None:
            n = trainer.step + 1  # the step about to run
            log = trainer._is_due(cfg.trainer.log_every)
            if n <= warm or n >= total:
                bare.step()
                return real_once()
            with count_ops(**excluded) as c:
                bare.step()
            bare_counts.append(c.total)
            with count_ops(**excluded, parts=protection_parts()) as c:
                row = real_once()
            (logged if log else clean).append(c.total)
            parts[log].append(dict(c.by_part))
            done = n - warm
            if progress is not None and done % 10 == 0:
                progress(f"device ops: {done}/{steps} steps")
            return row

        trainer.step_once = counted  # type: ignore[method-assign]
        trainer.save = lambda: Path(d)  # type: ignore[method-assign]
        result = trainer.run()
        device = trainer.device
        trainer = bare = real_once = None
    _free(device)
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if not bare_counts:
        raise BenchError(
            f"bench: the protected loop stopped before the counted steps (status {result.status})"
        )
    base = _mean(bare_counts)
    every = clean + logged
    figures = {"clean": _mean(clean), "log": _mean(logged), "mean": _mean(every)}
    return {
        "bare": base,
        **figures,
        "extra": {k: (None if v is None else v - base) for k, v in figures.items()},
        "parts": {"clean": _part_means(parts[False]), "log": _part_means(parts[True])},
        "steps": len(every),
        "log_steps": len(logged),
        "log_every": cfg.trainer.log_every,
        "counted": "aten ops outside forward, backward, clip_grad_norm_, optimizer.step and data loading",
    }
