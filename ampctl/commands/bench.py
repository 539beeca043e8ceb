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

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampctl.amp.precision import PRECISIONS
from ampctl.config import RunConfig, load_config, split_overrides, with_changes
from ampctl.errors import UsageError, first_line

__all__ = ["SECTIONS", "BenchError", "bench", "plan", "run_bench", "print_report"]

SECTIONS = ("overhead", "overflow_check", "host_reads", "precision")
OVERHEAD_GOAL = 1.02
_MEMORY_STEPS = 2

Progress = Callable[[str], None]


class BenchError(UsageError):
    """The bench could not measure what it was asked to (bad steps, a loop that stopped)."""


# ---------------------------------------------------------------------------- helpers
def plan(steps: int) -> dict[str, int]:
    """Step counts of every section for ``--steps``: the default 20 gives 40 timed overhead
    pairs after 4 warm-up steps, 10 timed steps per precision, 2 counted steps per host-read
    path and 20 overflow-check repeats."""
    return {
        "overhead_pairs": max(2, 2 * steps),
        "overhead_warmup": max(2, steps // 5),
        "precision_steps": max(2, steps // 2),
        "host_read_steps": max(2, steps // 10),
        "overflow_repeats": max(5, steps),
    }


def _clock(device: torch.device) -> float:
    """``perf_counter`` after waiting for the device (**syncs** on CUDA, by design: timing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- 1. overhead
class _BareLoop:
    """The reference: a plain ``torch.amp.GradScaler`` loop over the same model architecture,
    initial weights and batches as a :class:`Trainer` (built before its first step)."""

    def __init__(self, cfg: RunConfig, trainer: Any) -> None:
        from ampctl.amp import PrecisionPolicy
        from ampctl.train.builders import build_data_source, build_model, build_optimizer

        self.device = trainer.device
        self.accum = cfg.trainer.grad_accum_steps
        self.clip = cfg.optim.clip_grad_norm
        self.model = build_model(cfg.model).to(self.device)
        self.model.load_state_dict(trainer.model.state_dict())  # casts fp16-pure weights up
        if trainer.precision.master is not None:  # fp16-pure: the exact fp32 values are the masters
            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, master in trainer.precision.named_optimizer_params(trainer.model):
                    own[name].copy_(master)
        # fp16-pure has no GradScaler equivalent: the bare loop runs fp16 autocast instead
        name = "fp16" if cfg.precision.name == "fp16-pure" else cfg.precision.name
        self.policy = PrecisionPolicy(
            name=name,
            fp32_modules=list(cfg.precision.fp32_modules),
            device_type=self.device.type,
            options=cfg.precision.options(),
        )
        # the same fp32 module exemptions (fp8: and torchao's convert_to_float8_training of the
        # same layers, bf16 autocast, no scaling): the same architecture
        self.policy.prepare(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.params, self.device)
        s = cfg.scaler
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=s.init_scale,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
            enabled=self.policy.needs_scaler,
        )
        self.data = build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)

    def step(self) -> float:
        """One optimizer step; returns its wall time. GradScaler.step reads its found-inf flag
        on the host (one sync), as the protected loop does."""
        from ampctl.protect.loss import extract_loss

        t0 = _clock(self.device)
        for _ in range(self.accum):
            batch = {
                k: v.to(self.device, non_blocking=True) for k, v in self.data.next_batch().items()
            }
            with self.policy.autocast():
                loss = extract_loss(self.model(**batch)).float() / self.accum
            self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return _clock(self.device) - t0


def measure_overhead(
    cfg: RunConfig, pairs: int, warmup: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Protected loop vs bare GradScaler loop, interleaved step by step.

    The protected side is :meth:`Trainer.run` itself (display off, guard as configured, a log
    step every ``trainer.log_every`` steps, metrics written to a temporary run folder); only
    checkpoint writes are left out (the bare loop writes none). Each protected iteration -- the
    step, the guard's bookkeeping, the log read -- is timed from one ``train_step`` call to the
    next, and one bare step runs between two protected iterations: A, B, A, B ...
    """
    from ampctl.train.trainer import Trainer

    total = warmup + pairs + 1  # the last iteration has no end mark: not timed
    cfg = with_changes(cfg, trainer={"max_steps": total, "ckpt_every": total})
    prot: list[float] = []
    bare_t: list[float] = []
    logs: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        bare = _BareLoop(cfg, trainer)
        device = trainer.device
        real_step = trainer.train_step
        mark: dict[str, Any] = {"t": None, "log": False}

        def interleaved(log: bool) -> dict[str, Any]:
            now = _clock(device)
            if mark["t"] is not None:
                prot.append(now - mark["t"])
                logs.append(mark["log"])
                n = len(prot)
                if progress is not None and n > warmup and (n - warmup) % 10 == 0:
                    progress(f"overhead: {n - warmup}/{pairs} pairs")
            if trainer.step + 1 < total:
                bare_t.append(bare.step())
            mark["log"] = log
            mark["t"] = _clock(device)
            return real_step(log)

        trainer.train_step = interleaved  # type: ignore[method-assign]
        trainer.save = lambda: Path(d)  # type: ignore[method-assign]
        result = trainer.run()
        params = sum(p.numel() for p in trainer.model.parameters())
        trainer = bare = real_step = None  # free both models before the next section
    _free(device)
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if len(prot) < warmup + 1:
        raise BenchError(
            f"bench: the protected loop stopped after {len(prot)} steps (status {result.status}); "
            "fix the config (see `ampctl train` with the same overrides) and run again"
        )
    a, b, lg = prot[warmup:], bare_t[warmup : len(prot)], logs[warmup:]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    base = "torch.amp.GradScaler loop: autocast, scale(loss).backward(), unscale_, clip_grad_norm_, step, update, zero_grad"
    if cfg.precision.name == "fp16-pure":
        base += " (fp16 autocast with fp32 weights: GradScaler has no pure-fp16 mode)"
    elif cfg.precision.name == "fp8":
        base = (
            "torchao float8 loop: convert_to_float8_training (the same layers), bf16 autocast, "
            "backward, clip_grad_norm_, step, zero_grad (GradScaler disabled: no scaling)"
        )
    return {
        "ratio": _median(ratios),
        "total_ratio": sum(a) / sum(b),
        "protected_median_s": _median(a),
        "bare_median_s": _median(b),
        "pairs": len(a),
        "warmup": warmup,
        "log_every": cfg.trainer.log_every,
        "log_steps": sum(lg),
        "goal": OVERHEAD_GOAL,
        "protected": f"Trainer.run ({cfg.precision.name}, guard {'on' if cfg.guard.enabled else 'off'}, display off, "
        "metrics written, checkpoints left out)",
        "baseline": base,
        "params": params,
    }


# ---------------------------------------------------------------------------- 2. overflow check
def measure_overflow_check(
    device: torch.device, repeats: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Fused non-finite check vs the per-parameter checker on a 24-layer BERT's gradients.

    BERT-Large's shape on CUDA; on CPU a 24-layer BERT of hidden size 64 (same tensor count,
    small tensors, so it runs in seconds). The gradients come from one real backward pass and
    are finite. The fused side is timed to completion (a sync on CUDA); the naive side reads the
    device on the host up to twice per parameter by construction.
    """
    from ampctl.amp.overflow import check_and_unscale_, naive_overflow_check
    from ampctl.train.models import BertForMaskedLM

    if device.type == "cuda":
        shape = dict(vocab_size=30522, hidden_size=1024, num_heads=16, ffn_size=4096)
        batch, seq = 4, 128
    else:
        shape = dict(vocab_size=1024, hidden_size=64, num_heads=4, ffn_size=256)
        batch, seq = 2, 32
    layers = 24
    gen = torch.Generator().manual_seed(0)
    rng_devices = []
    if device.type == "cuda":
        rng_devices = [torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=rng_devices), torch.device(device):
        torch.manual_seed(0)  # built on the device: BERT-Large initialises in a blink there
        model = BertForMaskedLM(
            num_layers=layers, max_position=seq, dropout=0.0, attn_impl="sdpa", **shape
        )
    ids = torch.randint(4, shape["vocab_size"], (batch, seq), generator=gen).to(device)
    model(
        input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), labels=ids
    ).loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    one = torch.ones((), dtype=torch.float32, device=device)
    found = torch.zeros((), dtype=torch.float32, device=device)

    def naive() -> float:
        t0 = _clock(device)
        naive_overflow_check(params)
        return _clock(device) - t0

    def fused() -> float:
        t0 = _clock(device)
        check_and_unscale_(grads, one, found)  # x1.0: the gradients are unchanged
        return _clock(device) - t0

    for _ in range(3):  # warm-up
        naive(), fused()
    tn: list[float] = []
    tf: list[float] = []
    for r in range(repeats):
        if r % 2 == 0:
            tn.append(naive())
            tf.append(fused())
        else:
            tf.append(fused())
            tn.append(naive())
    if progress is not None:
        progress(f"overflow check: {repeats} repeats on {len(grads)} gradient tensors")
    clean = not naive_overflow_check(params) and float(found.item()) == 0.0  # outside the timing
    out = {
        "ratio": _median([n / f for n, f in zip(tn, tf, strict=True)]),
        "naive_median_s": _median(tn),
        "fused_median_s": _median(tf),
        "repeats": repeats,
        "layers": layers,
        "hidden_size": shape["hidden_size"],
        "tensors": len(grads),
        "elements": sum(g.numel() for g in grads),
        "device": str(device),
        "finite": clean,
    }
    del model
    params.clear()
    grads.clear()
    _free(device)
    return out


# ---------------------------------------------------------------------------- 3. host reads
def count_step_reads(cfg: RunConfig, steps: int) -> tuple[int, dict[str, int]]:
    """Host reads over ``steps`` clean ``train_step(log=False)`` calls (after one warm-up step):
    ``(total, by method)``."""
    from ampctl.hostreads import count_host_reads
    from ampctl.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        trainer.train_step(log=False)  # lazy state (optimizer moments, scaler) is created here
        with count_host_reads() as reads:
            for _ in range(steps):
                trainer.train_step(log=False)
        device = trainer.device
        del trainer
    _free(device)
    return reads.total, {k: v for k, v in reads.by_method.items() if v}


def measure_host_reads(
    cfg: RunConfig, steps: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Host reads per step on the standard path (optim.fused=false) and the fused-optimizer
    path (optim.fused=true, clipping as configured)."""
    out: dict[str, Any] = {"steps": steps}
    for label, fused in (("standard", False), ("fused", True)):
        try:
            total, by = count_step_reads(with_changes(cfg, optim={"fused": fused}), steps)
        except UsageError as e:
            if not fused:
                raise
            out.update(fused=None, fused_total=None, fused_by_method={}, fused_error=first_line(e))
            continue
        out[label] = total / steps
        out[f"{label}_total"] = total
        out[f"{label}_by_method"] = by
        if progress is not None:
            progress(f"host reads: {label} path {total} in {steps} steps")
    out.setdefault("fused_error", None)
    out["goal"] = {"standard": 1, "fused": 0}
    return out


# ---------------------------------------------------------------------------- 4. precision table
def _rss_now() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _warm_imports() -> None:
    """Load what torch imports lazily on a first optimizer step and a first autocast pass (torch
    imports its compiler stack, ~80 MB of modules, when the first optimizer is built), and on a
    first torchao float8 step, so that the memory measured afterwards is the run's own."""
    import ampctl.train.models  # noqa: F401  (the packaged model, imported by _target_)

    w = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([w], lr=1e-3)
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cpu", dtype=dtype):
            loss = (torch.ones(1, 2) @ w).float().sum()
        loss.backward()
    opt.step()
    del w, opt, loss
    try:  # torchao (fp8), when installed: its first float8 step imports ~440 more modules
        from ampctl.amp import fp8  # (~26 MB, measured), which are not the fp8 row's memory

        tiny = torch.nn.Sequential(torch.nn.Linear(16, 16))
        fp8.convert(tiny, exclude=[])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tiny(torch.ones(2, 16)).float().sum().backward()
        del tiny
    except UsageError:
        pass
    gc.collect()


def _measure_rss(cfg: RunConfig, precision: str, steps: int) -> dict[str, Any]:
    """Peak memory growth of building a trainer and running ``steps`` steps, in this process.

    Linux: ``VmHWM`` (peak RSS, reset through ``/proc/self/clear_refs`` first) minus the
    file-backed RSS at the end (library code paged in by the first kernels is not training
    memory) minus the anonymous RSS at the start. Elsewhere: ``ru_maxrss`` minus the RSS at
    the start.
    """
    from ampctl.train.trainer import Trainer

    cfg = with_changes(cfg, precision={"name": precision})
    gc.collect()
    method = "ru_maxrss"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        if _status_kib("VmHWM") is not None and _status_kib("RssAnon") is not None:
            method = "VmHWM"
    except OSError:
        pass
    base = _rss_now() if method == "ru_maxrss" else (_status_kib("RssAnon") or 0) * 1024
    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as d:
        trainer = Trainer(cfg, Path(d), display=None)
        for _ in range(steps):
            trainer.train_step(log=False)
    if method == "VmHWM":
        kib = [_status_kib(k) or 0 for k in ("VmHWM", "RssFile", "RssShmem")]
        peak = (kib[0] - kib[1] - kib[2]) * 1024
    else:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = ru if sys.platform == "darwin" else ru * 1024
    return {"precision": precision, "peak_growth_bytes": max(peak - base, 0), "method": method}


def _memory_worker() -> int:
    """Subprocess entry (1 thread): reads ``{"config", "precisions", "steps"}`` as JSON on stdin
    and prints one JSON line per precision. Each precision is measured in its own process,
    forked from this one after the imports, so neither the imports nor another precision's
    memory is counted; without ``os.fork`` it measures its single precision in-process."""
    torch.set_num_threads(1)
    from ampctl.config import config_from_dict

    req = json.loads(sys.stdin.read())
    cfg = config_from_dict(req["config"])
    steps = int(req["steps"])
    _warm_imports()
    if not hasattr(os, "fork"):
        for p in req["precisions"]:
            print(json.dumps(_measure_rss(cfg, p, steps)), flush=True)
        return 0
    for p in req["precisions"]:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: measure, report, exit without running any parent cleanup
            code = 0
            try:
                line = json.dumps(_measure_rss(cfg, p, steps))
            except BaseException as e:  # noqa: BLE001  (reported to the parent as a row error)
                line, code = json.dumps({"precision": p, "error": first_line(e)}), 1
            os.write(1, (line + "\n").encode())
            os._exit(code)
        os.waitpid(pid, 0)
    return 0


def _run_memory_worker(
    cfg: RunConfig, precisions: Sequence[str], steps: int
) -> dict[str, dict[str, Any]]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the user's model imports too
    code = (
        "import sys; from ampctl.commands.bench import _memory_worker; sys.exit(_memory_worker())"
    )
    req = json.dumps({"config": cfg.to_dict(), "precisions": list(precisions), "steps": steps})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            input=req,
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        return {p: {"error": "memory subprocess timed out"} for p in precisions}
    out: dict[str, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row.pop("precision")] = row
    tail = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    for p in precisions:
        out.setdefault(p, {"error": f"memory subprocess failed: {tail}"})
    return out


def measure_cpu_memory(
    cfg: RunConfig, precisions: Sequence[str], steps: int
) -> dict[str, tuple[float | None, str, str | None]]:
    """Peak RSS growth (MiB) of ``steps`` training steps per precision, each in a fresh 1-thread
    process: ``{precision: (MiB or None, method, error or None)}``."""
    if hasattr(os, "fork"):
        rows = _run_memory_worker(cfg, precisions, steps)
    else:
        rows = {}
        for p in precisions:
            rows.update(_run_memory_worker(cfg, [p], steps))
    out: dict[str, tuple[float | None, str, str | None]] = {}
    for p in precisions:
        r = rows[p]
        if r.get("error"):
            out[p] = (None, "", r["error"])
        else:
            out[p] = (r["peak_growth_bytes"] / 2**20, r["method"], None)
    return out


def _precision_cfgs(
    cfg: RunConfig, device: torch.device, precisions: Sequence[str] = PRECISIONS
) -> tuple[dict[str, RunConfig], dict[str, str]]:
    from ampctl.amp import bf16_supported

    cfgs: dict[str, RunConfig] = {}
    errors: dict[str, str] = {}
    for p in precisions:
        if p == "bf16" and not bf16_supported(device):
            errors[p] = f"bf16 is not supported on {device}"
            continue
        cfgs[p] = with_changes(cfg, precision={"name": p})
    return cfgs, errors


def _rows(
    times: dict[str, list[float]],
    tokens: int,
    errors: dict[str, str],
    mem: dict[str, float | None],
    precisions: Sequence[str] = PRECISIONS,
) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    ref = _median(times["fp32"]) if times.get("fp32") else None
    ref16 = _median(times["bf16"]) if times.get("bf16") else None
    for p in precisions:
        if p in times and times[p]:
            t = _median(times[p])
            rows[p] = {
                "step_s": t,
                "tokens_per_s": tokens / t,
                "speed_vs_fp32": (ref / t) if ref else None,
                "speed_vs_bf16": (ref16 / t) if ref16 else None,
                "peak_mem_mib": mem.get(p),
                "error": errors.get(p),
            }
        else:
            rows[p] = {
                "step_s": None,
                "tokens_per_s": None,
                "speed_vs_fp32": None,
                "speed_vs_bf16": None,
                "peak_mem_mib": mem.get(p),
                "error": errors.get(p, "not measured"),
            }
    return rows


def measure_precisions(
    cfg: RunConfig,
    steps: int,
    progress: Progress | None = None,
    precisions: Sequence[str] = PRECISIONS,
) -> dict[str, Any]:
    """Step time, tokens/s and peak memory of fp32 / bf16 / fp16 / fp16-pure / fp8 (or the
    given ``precisions``) on the configured model (``train_step(log=False)``, one warm-up step
    each, two with ``trainer.compile=true``).

    CPU: the four trainers live side by side and are stepped round robin (the starting precision
    rotates every round), so drift hits all of them; memory comes from fresh processes
    (:func:`measure_cpu_memory`).
    CUDA: one precision at a time (so that its peak memory is its own), timed with a sync
    around each step.
    """
    from ampctl.train.builders import resolve_device
    from ampctl.train.trainer import Trainer

    device = resolve_device(cfg.trainer.device)
    cfgs, errors = _precision_cfgs(cfg, device, precisions)
    warmup = 2 if cfg.trainer.compile else 1
    d = cfg.data
    tokens = d.batch_size * d.seq_len * cfg.trainer.grad_accum_steps
    times: dict[str, list[float]] = {p: [] for p in cfgs}
    mem: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="ampctl-bench-") as tmp:
        if device.type == "cuda":
            timing = "one precision at a time, synchronised around each step"
            method = "torch.cuda.max_memory_allocated minus memory allocated before the trainer was built"
            for p, c in cfgs.items():
                _free(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                trainer = None
                try:
                    trainer = Trainer(c, Path(tmp), display=None)
                    for _ in range(warmup):
                        trainer.train_step(log=False)
                    for _ in range(steps):
                        t0 = _clock(device)
                        trainer.train_step(log=False)
                        times[p].append(_clock(device) - t0)
                    mem[p] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                except torch.cuda.OutOfMemoryError:
                    times[p] = []
                    errors[p] = f"out of memory (batch {d.batch_size} x seq {d.seq_len})"
                except UsageError as e:
                    times[p] = []
                    errors[p] = first_line(e)
                finally:
                    del trainer
                    _free(device)
                if progress is not None:
                    progress(
                        f"precision: {p} "
                        + (errors[p] if p in errors else f"{_median(times[p]):.3f} s/step")
                    )
        else:
            timing = "interleaved: one step of each precision per round"
            trainers: dict[str, Any] = {}
            for p, c in cfgs.items():
                try:
                    trainers[p] = Trainer(c, Path(tmp), display=None)
                except UsageError as e:
                    errors[p] = first_line(e)
            order = list(trainers)
            for r in range(steps + warmup):  # the first rounds are the warm-up
                k = r % max(len(order), 1)
                for p in order[k:] + order[:k]:
                    t0 = time.perf_counter()
                    trainers[p].train_step(log=False)
                    if r >= warmup:
                        times[p].append(time.perf_counter() - t0)
                if progress is not None and r >= warmup:
                    progress(f"precision: round {r - warmup + 1}/{steps}")
            del trainers
            _free(device)
            methods = set()
            if progress is not None:
                progress(f"precision: peak memory, {len(order)} fresh processes")
            measured = measure_cpu_memory(cfg, order, _MEMORY_STEPS) if order else {}
            for p, (mib, how, err) in measured.items():
                mem[p] = mib
                if err is not None:
                    errors[p] = err
                else:
                    methods.add(how)
                if progress is not None:
                    progress(f"precision: {p} peak memory " + (err or f"{mib:.1f} MiB"))
            how = (
                "VmHWM minus file-backed RSS"
                if methods == {"VmHWM"}
                else "ru_maxrss minus RSS at the start"
            )
            method = (
                f"peak resident memory growth ({how}) from just before the trainer is built to the end of "
                f"{_MEMORY_STEPS} training steps, in a fresh 1-thread process per precision "
                "(forked after the imports)"
            )
    return {
        "timing": timing,
        "memory_method": method,
        "steps": steps,
        "rows": _rows(times, tokens, errors, mem, precisions),
    }


# ---------------------------------------------------------------------------- the bench
def bench(
    cfg: RunConfig,
    steps: int = 20,
    *,
    sections: Sequence[str] = SECTIONS,
    progress: Progress | None = None,
    preset: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark sections on ``cfg`` and return the figures (schema in the module
    docstring). ``steps`` scales every section (:func:`plan`); ``progress`` gets one-line
    messages while measuring. Timing **syncs** the device around each timed step."""
    from ampctl.train.builders import resolve_device

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise BenchError(f"--steps {steps!r}: must be an integer >= 2")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise BenchError(f"bench sections {unknown}: allowed sections are {', '.join(SECTIONS)}")
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
            "model": m["_target_"].rsplit(".", 1)[-1]
            + (
                f" {m['num_layers']}x{m['hidden_size']}"
                if "num_layers" in m and "hidden_size" in m
                else ""
            ),
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
    if "overflow_check" in sections:
        say("overflow check: fused vs per-parameter on a 24-layer BERT's gradients")
        out["overflow_check"] = measure_overflow_check(device, n["overflow_repeats"], say)
    if "host_reads" in sections:
        say("host reads: counting reads per train_step")
        out["host_reads"] = measure_host_reads(cfg, n["host_read_steps"], say)
    if "precision" in sections:
        say(f"precision: {' / '.join(PRECISIONS)}, {n['precision_steps']} timed steps each")
        out["precision"] = measure_precisions(cfg, n["precision_steps"], say)
    out["meta"]["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------- output
def _fmt_s(x: float | None) -> str:
    return "-" if x is None else (f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s")


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def print_report(res: dict[str, Any], console: Any = None) -> None:
    """Print the figures as rich tables (what ``ampctl bench`` shows without ``--json``)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    meta = res["meta"]
    params = f", {meta['params'] / 1e6:.2f}M params" if meta.get("params") else ""
    console.print(
        f"[bold]ampctl bench[/bold]: {meta['model']}{params}, {meta['precision']}, batch "
        f"{meta['batch_size']} x seq {meta['seq_len']}, {meta['device']}, torch {meta['torch']}, "
        f"{meta['threads']} thread(s); measured in {meta['wall_s']:.0f} s",
        highlight=False,
    )
    t = Table(title="What protection costs (ratios measured side by side)", title_justify="left")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("goal")
    t.add_column("detail")
    ov = res.get("overhead")
    if ov is not None:
        ok = "[green]ok[/green]" if ov["ratio"] <= ov["goal"] else "[red]over[/red]"
        t.add_row(
            "overhead: protected / bare step",
            f"{ov['ratio']:.3f}",
            f"<= {ov['goal']} {ok}",
            f"median of {ov['pairs']} pairs: {_fmt_s(ov['protected_median_s'])} vs "
            f"{_fmt_s(ov['bare_median_s'])}",
        )
        t.add_row(
            "overhead: total, with log steps",
            f"{ov['total_ratio']:.3f}",
            "",
            f"{ov['log_steps']} log step(s) in {ov['pairs']} (log every {ov['log_every']})",
        )
    oc = res.get("overflow_check")
    if oc is not None:
        t.add_row(
            "overflow check: naive / fused",
            f"{oc['ratio']:.1f}x",
            "",
            f"{oc['layers']} layers, {oc['tensors']} grads: {_fmt_s(oc['naive_median_s'])} vs "
            f"{_fmt_s(oc['fused_median_s'])}",
        )
    hr = res.get("host_reads")
    if hr is not None:
        for label, goal in (("standard", 1), ("fused", 0)):
            v = hr[label]
            mark = "" if v is None else (" [green]ok[/green]" if v == goal else " [red]off[/red]")
            detail = (
                f"{hr[label + '_total']} in {hr['steps']} steps"
                if v is not None
                else hr.get("fused_error") or "-"
            )
            name = "host reads / step" + (", fused AdamW" if label == "fused" else "")
            t.add_row(name, _fmt(v, "g"), f"{goal}{mark}", Text(detail))  # errors as written
    if t.row_count:
        console.print(t)
    pr = res.get("precision")
    if pr is not None:
        p = Table(
            title=f"Precision: median of {pr['steps']} steps each ({pr['timing']})",
            title_justify="left",
        )
        p.add_column("precision")
        for col in ("step", "tokens/s", "vs fp32", "vs bf16", "peak memory"):
            p.add_column(col, justify="right")
        p.add_column("note")
        for name, row in pr["rows"].items():
            p.add_row(
                name,
                _fmt_s(row["step_s"]),
                _fmt(row["tokens_per_s"], ",.0f"),
                "-" if row["speed_vs_fp32"] is None else f"{row['speed_vs_fp32']:.2f}x",
                "-" if row.get("speed_vs_bf16") is None else f"{row['speed_vs_bf16']:.2f}x",
                "-" if row["peak_mem_mib"] is None else f"{row['peak_mem_mib']:,.1f} MiB",
                Text(row["error"] or ""),  # as written: install hints hold "[fp8]"
            )
        console.print(p)
        console.print(f"peak memory: {pr['memory_method']}", highlight=False, style="dim")


def run_bench(overrides: list[str], steps: int, as_json: bool, config_dir: Path | None) -> int:
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

    res = bench(cfg, steps, progress=progress, preset=preset)
    if as_json:
        sys.stdout.write(json.dumps(res, indent=2) + "\n")
        sys.stdout.flush()
    else:
        print_report(res)
    return 0
