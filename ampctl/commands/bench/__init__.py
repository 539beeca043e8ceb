"""``ampctl bench``: what protection costs, measured as ratios in one process run.

Machines are noisy, so every figure that matters is a ratio of two things measured side by side
(interleaved step by step, so that drift hits both), and medians rather than means.

Sections (the keys of the dict :func:`bench` returns and of ``ampctl bench --json``)::

    meta            device, torch, threads, preset, model, params, precision, batch_size, seq_len,
                    tokens_per_step, steps (the --steps value), wall_s (the whole bench)
    overhead        the protected loop vs a bare torch.amp.GradScaler loop (precision=fp8: a bare
                    torchao float8 loop, the same layers converted), same model, same initial
                    weights, same batches, interleaved A, B, A, B ...
      ratio             median over pairs of (protected step time / bare step time); goal <= 1.02
      total_ratio       sum of protected times / sum of bare times (log steps amortised)
      protected_median_s, bare_median_s    median step time of each loop
      pairs, warmup     timed pairs, and untimed warm-up steps before them
      log_every, log_steps   the log interval, and how many timed protected steps were log steps
      goal              1.02
      protected, baseline    what each loop does, in words
    overflow_check  the fused check (check_and_unscale_, what LossScaler.unscale_ runs) vs the
                    seeds' per-parameter checker (naive_overflow_check) on a 24-layer BERT's
                    gradients (one real backward)
      ratio             median over repeats of (naive time / fused time)
      naive_median_s, fused_median_s, repeats, layers, hidden_size, tensors, elements, device
      finite            both checkers found the gradients finite (read after the timing)
    host_reads      host reads (CPU-GPU syncs on CUDA) per clean train_step(log=False), counted
                    with ampctl.hostreads.count_host_reads
      standard          optim.fused=false (goal 1)
      fused             optim.fused=true (goal 0); null when the optimizer has no fused path
      fused_error       why ``fused`` is null (else null)
      steps, standard_total, fused_total, standard_by_method, fused_by_method, goal
    precision       step time, tokens/s and peak memory per precision, for the configured model
      timing            how the steps were timed (interleaved round robin on CPU; one precision
                        at a time on CUDA)
      memory_method     how peak memory was measured (see below)
      steps             timed steps per precision (after one warm-up step)
      rows              {fp32|bf16|fp16|fp16-pure|fp8: {step_s, tokens_per_s, speed_vs_fp32,
                        speed_vs_bf16, peak_mem_mib, error}}; speed_vs_X = X's step time / this
                        step time. The fp8 row needs torchao (the ``fp8`` extra); without it its
                        error says how to install it. With ``trainer.compile=true`` every
                        precision runs compiled (two untimed warm-up steps instead of one)

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` minus what was allocated before the
trainer was built (weights, gradients, optimizer state, activations). On CPU, each precision
trains a few steps in a fresh process (1 thread; forked from a worker that has already imported
torch and warmed its lazy imports, so import memory is not counted), and the figure is the growth
of the peak resident memory from just before the trainer is built to the end (Linux: ``VmHWM``
after a reset through ``/proc/self/clear_refs``, minus the file-backed pages -- library code --
resident at the end, minus the anonymous pages at the start; elsewhere ``ru_maxrss`` minus the
RSS at the start). It includes allocator slack and the data pipeline, so it is an upper bound on
what the training state needs.

Host reads: timing waits for the device around every timed step on CUDA (a sync, on both sides
of each comparison); nothing else here reads device values except the overflow check's one
``found_inf`` read after its timing.

Default step counts (``--steps 20``) keep ``ampctl bench`` with the default config under two
minutes on 2 CPU cores; ``--steps`` scales every section (see :func:`plan`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampctl.amp.precision import PRECISIONS
from ampctl.config import RunConfig, load_config, split_overrides

from .checks import measure_host_reads, measure_overflow_check
from .common import SECTIONS, BenchError, Progress, plan
from .ops import measure_device_ops
from .overhead import measure_overhead
from .precision import measure_precisions
from .report import print_report

__all__ = [
    "SECTIONS",
    "BenchError",
    "bench",
    "plan",
    "run_bench",
    "print_report",
    "measure_overhead",
    "measure_device_ops",
    "SIZES",
    "sized",
    "measure_overflow_check",
    "measure_host_reads",
    "measure_precisions",
]


# ---------------------------------------------------------------------------- the bench
# ``--sizes``: the configured model, then the same architecture at about 10M and 50M parameters
# (4x FFN; the heads keep width 64; a Llama keeps 2 key/value heads)
SIZES: dict[str, dict[str, int]] = {
    "~10M": {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "ffn_size": 1536},
    "~50M": {"hidden_size": 512, "num_layers": 16, "num_heads": 8, "ffn_size": 2048},
}


def sized(cfg: RunConfig, size: str) -> RunConfig:
    """``cfg`` with its model resized to ``size`` (a key of :data:`SIZES`)."""
    import copy
    import dataclasses

    missing = [k for k in SIZES[size] if k not in cfg.model]
    if missing:
        raise BenchError(
            f"--sizes: model {cfg.model.get('_target_')} has no {', '.join(missing)}; "
            "--sizes resizes models with hidden_size, num_layers, num_heads and ffn_size "
            "(ampctl's bert, gpt2 and llama models)"
        )
    model = {**copy.deepcopy(cfg.model), **SIZES[size]}
    if "num_kv_heads" in model:
        model["num_kv_heads"] = 2
    if isinstance(model.get("max_position"), int):
        model["max_position"] = max(model["max_position"], cfg.data.seq_len)
    return dataclasses.replace(cfg, model=model)


def _model_name(m: dict[str, Any]) -> str:
    shape = (
        f" {m['num_layers']}x{m['hidden_size']}" if "num_layers" in m and "hidden_size" in m else ""
    )
    return m["_target_"].rsplit(".", 1)[-1] + shape


def measure_sizes(
    cfg: RunConfig, first: dict[str, Any], n: dict[str, int], say: Progress
) -> list[dict[str, Any]]:
    """The overhead and device-op figures at each size: ``first`` (the configured model's, from
    the main sections) then each of :data:`SIZES`."""
    rows = [{"size": "configured", "model": _model_name(cfg.model), **first}]
    for size in SIZES:
        c = sized(cfg, size)
        say(f"sizes: {size} ({_model_name(c.model)}): overhead, {n['overhead_pairs']} pairs")
        ov = measure_overhead(c, n["overhead_pairs"], n["overhead_warmup"], say)
        say(f"sizes: {size}: device ops, {n['device_op_steps']} steps")
        ops = measure_device_ops(c, n["device_op_steps"], say)
        rows.append(
            {
                "size": size,
                "model": _model_name(c.model),
                "params": ov.pop("params"),
                "overhead": ov,
                "device_ops": ops,
            }
        )
    return rows


def bench(
    cfg: RunConfig,
    steps: int = 20,
    *,
    sections: Sequence[str] = SECTIONS,
    progress: Progress | None = None,
    preset: str | None = None,
    sizes: bool = False,
) -> dict[str, Any]:
    """Run the benchmark sections on ``cfg`` and return the figures (schema in the module
    docstring). ``steps`` scales every section (:func:`plan`); ``progress`` gets one-line
    messages while measuring; ``sizes``: the overhead and device ops again at about 10M and 50M
    parameters (:data:`SIZES`). Timing **syncs** the device around each timed step."""
    from ampctl.train.builders import resolve_device

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise BenchError(f"--steps {steps!r}: must be an integer >= 2")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise BenchError(f"bench sections {unknown}: allowed sections are {', '.join(SECTIONS)}")
    if sizes:
        if "overhead" not in sections or "device_ops" not in sections:
            raise BenchError("--sizes repeats the overhead and device_ops sections: keep both")
        for size in SIZES:
            sized(cfg, size)  # a model that cannot be resized fails before the long part
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    device = resolve_device(cfg.trainer.device)
    n = plan(steps)
    d = cfg.data
    m = cfg.model
    out: dict[str, Any] = {
        "meta": {
            "device": str(device)
            if device.type != "cuda"
            else f"{device} ({torch.cuda.get_device_name(device)})",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "preset": preset,
            "model": _model_name(m),
            "params": None,
            "precision": cfg.precision.name,
            "batch_size": d.batch_size,
            "seq_len": d.seq_len,
            "tokens_per_step": d.batch_size * d.seq_len * cfg.trainer.grad_accum_steps,
            "steps": steps,
            "wall_s": None,
        }
    }
    if "overhead" in sections:
        say(
            f"overhead: protected loop vs bare {'torchao float8' if cfg.precision.name == 'fp8' else 'GradScaler'} loop, {n['overhead_warmup']} warm-up + {n['overhead_pairs']} pairs"
        )
        out["overhead"] = measure_overhead(cfg, n["overhead_pairs"], n["overhead_warmup"], say)
        out["meta"]["params"] = out["overhead"].pop("params")
        say(f"overhead: ratio {out['overhead']['ratio']:.3f}")
    if "device_ops" in sections:
        say(f"device ops: counting ops per step, {n['device_op_steps']} steps")
        out["device_ops"] = measure_device_ops(cfg, n["device_op_steps"], say)
    if "overflow_check" in sections:
        say("overflow check: fused vs per-parameter on a 24-layer BERT's gradients")
        out["overflow_check"] = measure_overflow_check(device, n["overflow_repeats"], say)
    if "host_reads" in sections:
        say("host reads: counting reads per train_step")
        out["host_reads"] = measure_host_reads(cfg, n["host_read_steps"], say)
    if "precision" in sections:
        say(f"precision: {' / '.join(PRECISIONS)}, {n['precision_steps']} timed steps each")
        out["precision"] = measure_precisions(cfg, n["precision_steps"], say)
    if sizes:
        first = {k: out[k] for k in ("overhead", "device_ops")}
        out["sizes"] = measure_sizes(cfg, {"params": out["meta"]["params"], **first}, n, say)
    out["meta"]["wall_s"] = time.perf_counter() - t0
    return out


def run_bench(
    overrides: list[str],
    steps: int,
    as_json: bool,
    config_dir: Path | None,
    sizes: bool = False,
) -> int:
    """``ampctl bench``: load config -> measure -> print (rich tables, or JSON with ``--json``).

    Progress goes to stderr, so ``--json`` output on stdout stays clean.
    """
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False)
    cfg = load_config(overrides, config_dir)
    preset, _ = split_overrides(overrides)

    def progress(msg: str) -> None:
        err.print(f"[dim]bench:[/dim] {escape(msg)}")

    res = bench(cfg, steps, progress=progress, preset=preset, sizes=sizes)
    if as_json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
        sys.stdout.flush()
    else:
        print_report(res)
    return 0
