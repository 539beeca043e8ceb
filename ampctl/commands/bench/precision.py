"""Section 4: step time, tokens/s and peak memory per precision."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampctl.amp.precision import PRECISIONS
from ampctl.config import RunConfig, with_changes
from ampctl.errors import UsageError, first_line

from .common import _MEMORY_STEPS, Progress, _clock, _free, _median


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
    code = "import sys; from ampctl.commands.bench.precision import _memory_worker; sys.exit(_memory_worker())"
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
