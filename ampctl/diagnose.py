"""``ampctl diagnose``: explain why a run went NaN and what to change.

PATH is a checkpoint file or a run folder (then its latest checkpoint, plus the run's
``metrics.jsonl`` and ``events.jsonl``; a checkpoint inside ``<run>/checkpoints/`` also reads its
run's files, up to the checkpoint's step). Checkpoints are read only through
:func:`ampctl.train.checkpoint.load_checkpoint` (``weights_only=True``): a checkpoint never runs
code. The report has four parts:

1. **State health**: inf/NaN and out-of-range values in the weights, the fp32 master weights
   (fp16-pure) and the optimizer state (Adam's ``exp_avg``/``exp_avg_sq``), named by parameter;
   the loss scaler's state (scale, at its floor?, recent skips).
2. **History** (when the run's files are there): first overflow step, first NaN-loss step, the
   scale trajectory, overflow bursts, and the loss / grad-norm trend before things broke.
3. **Replay**: the model and data are rebuilt from the checkpoint's config and the next
   ``--batches`` batches the run was about to see are replayed forward and backward, once in
   fp32 (the reference) and once in the run's precision with hooks on every module
   (:func:`ampctl.amp.locate.trace_modules`): per-module activation headroom, the first module
   with a non-finite output in forward and in backward, gradient underflow and overflow
   headroom at the current scale. Skipped when the weights are already non-finite.
4. **Recommendations**: override lines ready to paste into ``ampctl train`` and the checkpoint to
   resume from (the newest one whose state is healthy).

Thresholds (all from fp16's range, see :mod:`ampctl.amp.precision`):

* a weight or master weight above ``FP16_MAX`` (65504) in an fp16 run is a fault: it becomes
  ``inf`` when cast to fp16 (for bf16/fp32 runs the limit is the compute dtype's max);
* a first moment (``exp_avg``) above 65504 or a second moment (``exp_avg_sq``) above 65504**2 is
  a fault in any precision: it stands for a gradient that fp16 cannot hold even at scale 1;
* a gradient element underflows when ``|g| * scale < 2**-24`` (fp16's smallest subnormal); the
  scale is too small when more than ``UNDERFLOW_LIMIT`` (1%) of the non-zero gradient elements
  are lost at the current scale and would be kept at the recommended one;
* the ideal scale puts the largest scaled gradient just under fp16's max:
  ``S* = 65504 / max|g|``; the recommended ``init_scale`` is ``S*`` rounded down to a power of
  two, halved as a margin. ``max|g|`` is taken over the parameter gradients and the gradients
  flowing between modules that run in fp16 (fp32 reference replay, unscaled); a scale more than
  2x above ``S*`` is a (warning) problem: up to 2x is the dynamic scaler probing after a growth;
* growth probing (overflow bursts that start right after the scale grew) is a (warning) problem
  when it happened at least twice and cost at least 1% of the scaler's recorded steps;
* the grad norm "explodes" when its peak over the last ``TREND_ROWS`` logged rows before the
  break is ``EXPLOSION_FACTOR`` (10) times the median of the rows before them.

JSON (``ampctl diagnose PATH --json``, and the dict returned by :func:`diagnose`; non-finite
numbers are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``)::

    {
      "schema": "ampctl-diagnose/1",
      "checkpoint": {"path", "step", "precision", "fp32_modules": [module], "run_dir": str|null},
      "healthy": bool,                          # true when "problems" is empty
      "problems": [{"kind", "severity": "error"|"warning", "message", ...details}],
      "state": {
        "weights":   {"tensors", "elements", "amax", "limit", "bad": [BadTensor]},
        "master":    {... same ...} | null,     # fp16-pure only
        "optimizer": {"tensors", "elements", "bad": [BadTensor]} | null,
        "scaler": {"enabled", "scale", "min_scale", "max_scale", "at_floor", "growth_interval",
                   "hysteresis", "skipped_total", "forward_overflows", "consecutive_overflows",
                   "updates", "recent_window", "recent_skips"} | null
      },
      "history": null | {
        "run_dir", "metrics_rows", "events": {kind: count},
        "first_overflow_step": int|null, "first_overflow_source": "events"|"scaler"|"metrics"|null,
        "first_nan_loss_step": int|null, "forward_overflows": int,   # from events
        "scale_trajectory": [[step, scale], ...],       # change points
        "bursts": [{"start", "end", "length", "scale", "after_growth"}],   # scaler history
        "scaler_records": int,                          # (step, scale, skipped) rows kept
        "break_step": int|null,                         # first NaN-loss step
        "before_break": [{"step", "loss", "scale", "skipped", "grad_norm", "grad_amax"}],
        "grad_norm": {"baseline", "peak", "peak_step", "ratio", "exploded"} | null,
        "promotions": [module], "fallbacks": [{"step", "from", "to"}]
      },
      "replay": {                               # only ran/reason/precision/device when skipped
        "ran": bool, "reason": str|null,        # reason: why it was skipped
        "precision", "device", "positions": [int], "scale", "limit",
        "loss": [float], "loss_fp32": [float],
        "modules": [{"name", "dtype", "amax", "headroom_log2", "bad"}],   # forward, in order
        "masked_modules": [module],             # intentional -inf (attention masks): no fault
        "forward_first_bad": {"module", "batch", "position", "nan", "posinf", "neginf",
                              "dtype", "fp32_finite"} | null,
        "backward_first_bad": {... same without fp32_finite ...} | null,
        "gradients": {"scale", "max_abs", "max_abs_param", "max_abs_activation", "max_scaled",
                      "headroom_log2", "underflow_frac", "zero_frac", "zero_frac_replay",
                      "lost_frac", "lost_frac_at_recommended", "ideal_scale",
                      "recommended_init_scale", "max_scaled_replay",
                      "nonfinite_params": [name]} | null,     # null unless fp16 / fp16-pure
        "exempted": [module],                   # modules in fp32 during the replay
        "elapsed_s"
      },
      "recommendations": [{"override": "key=value", "reason"}],
      "checkpoints": [{"path", "step", "healthy", "problems": [kind]}],   # newest first
      "resume": {"checkpoint": str|null, "command": str}
    }

BadTensor: ``{"name", "param", "key", "nan", "posinf", "neginf", "above_limit", "amax",
"limit"}`` (``param``/``key`` name the parameter and the optimizer-state entry, e.g.
``exp_avg_sq``; for weights ``param`` is the tensor name and ``key`` is null).

Problem kinds: ``bad_scale``, ``nonfinite_weights``, ``extreme_weights``, ``nonfinite_master``,
``extreme_master``, ``nonfinite_optimizer_state``, ``extreme_optimizer_state``,
``scale_at_floor``, ``nan_loss``, ``grad_norm_explosion``, ``overflow_after_growth``,
``forward_overflow``, ``forward_nonfinite_fp32``, ``nonfinite_loss``, ``backward_overflow``,
``gradient_underflow``, ``activation_headroom``.

Host reads: this is an offline tool; every section reads device values on the host (each tensor
group once: one stacked read per state section and per replayed batch).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ampctl.amp.locate import ModuleTrace, first_bad, trace_modules
from ampctl.amp.overflow import nonfinite_tensor_names
from ampctl.amp.precision import (
    FP16_MAX,
    FP16_SUBNORMAL,
    PRECISIONS,
    PrecisionPolicy,
    bf16_supported,
    dtype_max,
)
from ampctl.errors import UsageError
from ampctl.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
)

__all__ = [
    "SCHEMA",
    "diagnose",
    "run_diagnose",
    "render",
    "state_health",
    "overflow_bursts",
    "grad_norm_trend",
    "recommended_scale",
    "UNDERFLOW_LIMIT",
    "EXPLOSION_FACTOR",
]

SCHEMA = "ampctl-diagnose/1"
#: Non-zero gradient elements lost to underflow (and recoverable by a larger scale) above which
#: the scale is called too small.
UNDERFLOW_LIMIT = 0.01
#: Peak grad norm / earlier median above which the grad norm is called exploding.
EXPLOSION_FACTOR = 10.0
#: Logged rows shown (and searched for the peak) before the break.
TREND_ROWS = 5
#: Scaler records that count as "recent".
RECENT_WINDOW = 50
#: Bad tensors listed per section.
MAX_LISTED = 10
_SQUARED_KEYS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")
_HIST_OFFSET = 160  # frexp exponents of finite fp32 values lie in [-148, 128]
_HIST_BINS = 300


# ============================================================================ helpers
def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _jsonable(obj: Any) -> Any:
    """Non-finite floats become "inf"/"-inf"/"nan" (strict JSON); tuples become lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    return obj


def _problem(kind: str, message: str, severity: str = "error", **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "message": message, **extra}


def _pow2(x: float) -> str:
    if x > 0 and _finite(x):
        e = math.log2(x)
        if e == int(e):
            return f"{x:g} (2^{int(e)})"
    return f"{x:g}"


def _plain(x: float) -> str:
    """A number as an override value: integers without a decimal point or exponent."""
    return str(int(x)) if _finite(x) and float(x).is_integer() else repr(float(x))


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float | int) and not isinstance(x, bool):
        return format(x, spec) if _finite(x) else str(float(x))
    return str(x)


# ============================================================================ 1. state health
def _tensor_figures(
    named: list[tuple[str, torch.Tensor]], limits: list[float]
) -> list[list[float]]:
    """Per tensor [nan count, +inf count, -inf count, count above limit, max finite |x|, numel].

    Computed on the tensors' device; **one host read** for the whole list."""
    if not named:
        return []
    rows = []
    dev = named[0][1].device
    for (_, t), limit in zip(named, limits, strict=True):
        t = t.detach()
        if t.numel() == 0:
            rows.append(torch.zeros(6, dtype=torch.float64, device=dev))
            continue
        finite = torch.isfinite(t)
        mag = torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=t.device)).abs().float()
        rows.append(
            torch.stack(
                [
                    torch.isnan(t).sum().double(),
                    torch.isposinf(t).sum().double(),
                    torch.isneginf(t).sum().double(),
                    (mag > limit).sum().double(),
                    mag.max().double(),
                    torch.tensor(float(t.numel()), dtype=torch.float64, device=t.device),
                ]
            ).to(dev)
        )
    return torch.stack(rows).tolist()  # the one host read


def _section(
    entries: list[tuple[str, torch.Tensor, str, str | None, float]],
) -> dict[str, Any]:
    """Health of ``(name, tensor, param, key, limit)`` entries. **Syncs once.**"""
    figs = _tensor_figures([(n, t) for n, t, *_ in entries], [lim for *_, lim in entries])
    bad = []
    amax = 0.0
    elements = 0
    for (name, _t, param, key, limit), (nan, pos, neg, above, mx, numel) in zip(
        entries, figs, strict=True
    ):
        amax = max(amax, mx)
        elements += int(numel)
        if nan or pos or neg or above:
            bad.append(
                {
                    "name": name,
                    "param": param,
                    "key": key,
                    "nan": int(nan),
                    "posinf": int(pos),
                    "neginf": int(neg),
                    "above_limit": int(above),
                    "amax": mx,
                    "limit": limit,
                }
            )
    return {"tensors": len(entries), "elements": elements, "amax": amax, "bad": bad}


def _floats(sd: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if v.numel() and key in seen:  # tied weights: check once, under the first name
                continue
            seen.add(key)
            yield k, v


def _optimizer_names(opt_sd: dict[str, Any], names: list[str] | None) -> dict[Any, str]:
    """Optimizer-state index -> parameter name (flattened ``param_groups`` order)."""
    ids = [pid for g in opt_sd.get("param_groups", []) for pid in g.get("params", [])]
    out: dict[Any, str] = {}
    for k, pid in enumerate(ids):
        out[pid] = names[k] if names is not None and k < len(names) else f"param[{pid}]"
    return out


def state_health(ck: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """Section 1 of the report for a loaded checkpoint: weights, masters, optimizer state and
    scaler. ``names``: the optimizer's parameter names in order (``named_optimizer_params``).

    Returns ``{"weights", "master", "optimizer", "scaler", "problems"}``. **Syncs** (one read per
    section)."""
    precision = (ck.get("precision") or {}).get("name", "fp32")
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float16)
    wlimit = FP16_MAX if compute == torch.float16 else dtype_max(compute)
    problems: list[dict[str, Any]] = []

    model_sd = ck.get("model") or {}
    weights = _section([(n, t, n, None, wlimit) for n, t in _floats(model_sd)])
    weights["limit"] = wlimit

    master = None
    if ck.get("master") is not None:
        mnames = names if names is not None and len(names) == len(ck["master"]) else None
        entries = [
            (
                mnames[i] if mnames else f"master[{i}]",
                t,
                mnames[i] if mnames else None,
                None,
                wlimit,
            )
            for i, t in enumerate(ck["master"])
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        master = _section(entries)
        master["limit"] = wlimit

    optimizer = None
    opt_sd = ck.get("optimizer")
    if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict):
        pname = _optimizer_names(opt_sd, names)
        entries = []
        for pid, st in opt_sd["state"].items():
            if not isinstance(st, dict):
                continue
            for key, t in st.items():
                if (
                    key == "step"
                    or not isinstance(t, torch.Tensor)
                    or not t.is_floating_point()
                    or t.dim() == 0
                ):
                    continue
                limit = FP16_MAX**2 if key in _SQUARED_KEYS else FP16_MAX
                p = pname.get(pid, f"param[{pid}]")
                entries.append((f"{p}.{key}", t, p, key, limit))
        optimizer = _section(entries)
        optimizer.pop("amax")

    for label, sec, kind in (("weight", weights, "weights"), ("master weight", master, "master")):
        if sec is None:
            continue
        nonfinite = [b for b in sec["bad"] if b["nan"] or b["posinf"] or b["neginf"]]
        extreme = [b for b in sec["bad"] if b not in nonfinite]
        if nonfinite:
            listed = ", ".join(b["name"] for b in nonfinite[:3]) + (
                " ..." if len(nonfinite) > 3 else ""
            )
            problems.append(
                _problem(
                    f"nonfinite_{kind}",
                    f"{len(nonfinite)} {label} tensor(s) hold inf/NaN, first {listed}",
                    tensors=[b["name"] for b in nonfinite],
                )
            )
        if extreme:
            listed = ", ".join(b["name"] for b in extreme[:3]) + (
                " ..." if len(extreme) > 3 else ""
            )
            problems.append(
                _problem(
                    f"extreme_{kind}",
                    f"{len(extreme)} {label} tensor(s) exceed {wlimit:g} ({precision}: they overflow when cast), "
                    f"first {listed}",
                    tensors=[b["name"] for b in extreme],
                )
            )
    if optimizer is not None:
        nonfinite = [b for b in optimizer["bad"] if b["nan"] or b["posinf"] or b["neginf"]]
        extreme = [b for b in optimizer["bad"] if b not in nonfinite]
        for group, kind, what in (
            (nonfinite, "nonfinite_optimizer_state", "holds inf/NaN"),
            (
                extreme,
                "extreme_optimizer_state",
                "is out of fp16's gradient range (moment > 65504, second moment > 65504^2)",
            ),
        ):
            if group:
                listed = ", ".join(f"{b['key']} of {b['param']}" for b in group[:3]) + (
                    " ..." if len(group) > 3 else ""
                )
                problems.append(
                    _problem(
                        kind,
                        f"optimizer state {what}: {listed}",
                        tensors=[b["name"] for b in group],
                        params=sorted(
                            {b["param"] for b in group}, key=[b["param"] for b in group].index
                        ),
                    )
                )

    scaler = _scaler_state(ck.get("scaler"))
    if (
        scaler is not None
        and scaler["enabled"]
        and not (_finite(scaler["scale"]) and scaler["scale"] > 0)
    ):
        problems.append(
            _problem(
                "bad_scale", f"the loss scale is {scaler['scale']}: a resumed run would scale by it"
            )
        )
    if (
        scaler is not None
        and scaler["at_floor"]
        and (scaler["consecutive_overflows"] > 0 or scaler["recent_skips"] > 0)
    ):
        problems.append(
            _problem(
                "scale_at_floor",
                f"loss scale at its floor ({scaler['min_scale']:g}) and still overflowing: "
                f"{scaler['recent_skips']} of the last {scaler['recent_window']} steps skipped",
            )
        )
    return {
        "weights": weights,
        "master": master,
        "optimizer": optimizer,
        "scaler": scaler,
        "problems": problems,
    }


def _history_rows(sc: dict[str, Any]) -> list[tuple[int, float, bool]]:
    hist = sc.get("history")
    if not isinstance(hist, torch.Tensor) or hist.numel() == 0:
        return []
    return [(int(s), float(v), bool(k)) for s, v, k in hist.double().reshape(-1, 3).tolist()]


def _scaler_state(sc: Any) -> dict[str, Any] | None:
    if not isinstance(sc, dict) or "scale" not in sc:
        return None
    rows = _history_rows(sc)
    recent = rows[-RECENT_WINDOW:]
    enabled = bool(sc.get("enabled", True))
    scale = float(sc["scale"])
    min_scale = float(sc.get("min_scale", 1.0))
    return {
        "enabled": enabled,
        "scale": scale,
        "min_scale": min_scale,
        "max_scale": float(sc.get("max_scale", 2.0**24)),
        "at_floor": enabled and scale <= min_scale,
        "growth_interval": int(sc.get("growth_interval", 2000)),
        "hysteresis": int(sc.get("hysteresis", 1)),
        "skipped_total": int(sc.get("skipped_total", 0)),
        "forward_overflows": int(sc.get("forward_overflows", 0)),
        "consecutive_overflows": int(sc.get("consecutive_overflows", 0)),
        "updates": int(sc.get("num_updates", len(rows))),
        "recent_window": len(recent),
        "recent_skips": sum(1 for r in recent if r[2]),
    }


# ============================================================================ 2. history
def overflow_bursts(rows: Iterable[tuple[int, float, bool]]) -> list[dict[str, Any]]:
    """Runs of consecutive skipped steps in scaler history rows ``(step, scale used, skipped)``.

    ``after_growth``: the burst's first step used a larger scale than the step before it (the
    scaler had just grown). Pure function."""
    rows = list(rows)
    bursts: list[dict[str, Any]] = []
    i = 0
    while i < len(rows):
        if not rows[i][2]:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and rows[j + 1][2]:
            j += 1
        bursts.append(
            {
                "start": rows[i][0],
                "end": rows[j][0],
                "length": j - i + 1,
                "scale": rows[i][1],
                "after_growth": i > 0 and rows[i][1] > rows[i - 1][1],
            }
        )
        i = j + 1
    return bursts


def grad_norm_trend(
    norms: list[tuple[int, float]], window: int = TREND_ROWS, factor: float = EXPLOSION_FACTOR
) -> dict[str, Any] | None:
    """Peak grad norm of the last ``window`` rows against the median of the rows before them
    (the first row when there are not enough). ``exploded`` when peak >= factor * baseline.
    ``norms``: ``(step, grad_norm)`` of logged rows, finite values only. Pure function."""
    norms = [(s, g) for s, g in norms if _finite(g)]
    if len(norms) < 2:
        return None
    if len(norms) > window:
        earlier, recent = norms[:-window], norms[-window:]
    else:
        earlier, recent = norms[:1], norms[1:]
    baseline = statistics.median(g for _, g in earlier)
    peak_step, peak = max(recent, key=lambda r: r[1])
    ratio = peak / baseline if baseline > 0 else math.inf
    return {
        "baseline": baseline,
        "peak": peak,
        "peak_step": peak_step,
        "ratio": ratio,
        "exploded": ratio >= factor,
    }


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    rows, bad = [], 0
    if not path.is_file():
        return rows, bad
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # a line cut by a crash
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return rows, bad


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def _scale_changes(points: Iterable[tuple[int, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for step, scale in points:
        if not out or out[-1][1] != scale:
            out.append([step, scale])
    return out


def history(run_dir: Path, ck: dict[str, Any]) -> dict[str, Any] | None:
    """Section 2: what the run's metrics, events and scaler history say (rows up to the
    checkpoint's step). None when the run folder has neither metrics nor events."""
    mpath, epath = run_dir / "metrics.jsonl", run_dir / "events.jsonl"
    if not mpath.is_file() and not epath.is_file():
        return None
    step_limit = int(ck.get("step", 0))
    metrics, _ = _read_jsonl(mpath)
    events, _ = _read_jsonl(epath)
    metrics = [r for r in metrics if isinstance(r.get("step"), int) and r["step"] <= step_limit]
    events = [e for e in events if isinstance(e.get("step"), int) and e["step"] <= step_limit]
    sc = ck.get("scaler") if isinstance(ck.get("scaler"), dict) else {}
    hrows = _history_rows(sc)

    counts: dict[str, int] = {}
    for e in events:
        counts[str(e.get("kind"))] = counts.get(str(e.get("kind")), 0) + 1
    overflow_events = [e for e in events if e.get("kind") == "overflow"]

    first_overflow, source = None, None
    candidates = []
    if overflow_events:
        candidates.append((min(e["step"] for e in overflow_events), "events"))
    if hrows and hrows[0][0] == 1 and any(k for _, _, k in hrows):  # history covers the start
        candidates.append((next(s for s, _, k in hrows if k), "scaler"))
    if candidates:
        first_overflow, source = min(candidates)
    else:
        skipped_rows = [r["step"] for r in metrics if (_num(r.get("skipped")) or 0) > 0]
        if skipped_rows:
            first_overflow, source = skipped_rows[0], "metrics"

    nan_steps = [
        r["step"]
        for r in metrics
        if (lv := _num(r.get("loss"))) is not None and not math.isfinite(lv)
    ]
    nan_steps += [e["step"] for e in overflow_events if e.get("overflow") == "forward"]
    first_nan = min(nan_steps) if nan_steps else None

    # scale trajectory: logged rows before the scaler history starts, then the exact history
    first_hist = hrows[0][0] if hrows else None
    pts = [(r["step"], _num(r.get("scale"))) for r in metrics if _num(r.get("scale")) is not None]
    pts = [p for p in pts if first_hist is None or p[0] < first_hist] + [
        (s, v) for s, v, _ in hrows
    ]
    if sc.get("scale") is not None and (sc.get("enabled", True)):
        pts.append((step_limit, float(sc["scale"])))
    trajectory = _scale_changes(pts)

    before = [r for r in metrics if first_nan is None or r["step"] < first_nan]
    trend_rows = [
        {k: r.get(k) for k in ("step", "loss", "scale", "skipped", "grad_norm", "grad_amax")}
        for r in before[-TREND_ROWS:]
    ]
    norms = [(r["step"], g) for r in before if (g := _num(r.get("grad_norm"))) is not None]
    return {
        "run_dir": str(run_dir),
        "metrics_rows": len(metrics),
        "events": counts,
        "first_overflow_step": first_overflow,
        "first_overflow_source": source,
        "first_nan_loss_step": first_nan,
        "forward_overflows": sum(1 for e in overflow_events if e.get("overflow") == "forward"),
        "scale_trajectory": trajectory,
        "bursts": overflow_bursts(hrows),
        "scaler_records": len(hrows),
        "break_step": first_nan,
        "before_break": trend_rows,
        "grad_norm": grad_norm_trend(norms),
        "promotions": [
            str(e["module"]) for e in events if e.get("kind") == "promotion" and e.get("module")
        ],
        "fallbacks": [
            {"step": e["step"], "from": e.get("from_precision"), "to": e.get("to_precision")}
            for e in events
            if e.get("kind") == "fallback"
        ],
    }


def _history_problems(h: dict[str, Any], scaler: dict[str, Any] | None) -> list[dict[str, Any]]:
    problems = []
    if h["first_nan_loss_step"] is not None:
        msg = f"the loss became non-finite (forward overflow) at step {h['first_nan_loss_step']}"
        if h["promotions"]:
            msg += f"; the guard moved {', '.join(h['promotions'])} to fp32"
        problems.append(_problem("nan_loss", msg, step=h["first_nan_loss_step"]))
    gn = h["grad_norm"]
    if gn is not None and gn["exploded"]:
        problems.append(
            _problem(
                "grad_norm_explosion",
                f"grad norm rose to {gn['peak']:.4g} at step {gn['peak_step']}, {gn['ratio']:.3g}x its earlier median "
                f"{gn['baseline']:.4g}",
                step=gn["peak_step"],
            )
        )
    # Growth probing skips a step each time the scale grows into overflow (hysteresis steps
    # with hysteresis); a problem when it recurs and wastes >= 1% of the recorded steps.
    after = [b for b in h["bursts"] if b["after_growth"]]
    wasted = sum(b["length"] for b in after) / max(h["scaler_records"], 1)
    if len(after) >= 2 and wasted >= 0.01:
        gi = scaler["growth_interval"] if scaler else None
        steps = ", ".join(str(b["start"]) for b in after[:5])
        problems.append(
            _problem(
                "overflow_after_growth",
                f"{len(after)} overflow burst(s) right after the scale grew (steps {steps}), "
                f"{wasted:.1%} of the recorded steps skipped"
                + (f", growth_interval {gi}" if gi else ""),
                severity="warning",
            )
        )
    return problems


# ============================================================================ 3. replay
@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The same dropout masks for the fp32 and the low-precision replay of a batch; the caller's
    RNG state is left as it was. Also quiets torch's note that hooks on modules returning a
    model-output object see no backward (those modules are covered by their children)."""
    with (
        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        torch.manual_seed(seed)
        yield


def _grad_figures(grads: list[torch.Tensor], scale: float, device: torch.device) -> torch.Tensor:
    """[elements, zeros, nonfinite, max |g|, underflow at ``scale`` (zeros included), exponent
    histogram...] of unscaled gradients, on the device (no host read)."""
    elems = torch.zeros((), dtype=torch.float64, device=device)
    zeros, bad, under = elems.clone(), elems.clone(), elems.clone()
    amax = torch.zeros((), dtype=torch.float32, device=device)
    hist = torch.zeros(_HIST_BINS, dtype=torch.float64, device=device)
    threshold = FP16_SUBNORMAL / scale
    for g in grads:
        g = g.detach().float().reshape(-1).to(device)
        finite = torch.isfinite(g)
        mag = torch.where(finite, g, torch.zeros((), device=device)).abs()
        elems += g.numel()
        zeros += (g == 0).sum()
        bad += (~finite).sum()
        under += ((mag < threshold) & finite).sum()
        amax = torch.maximum(amax, mag.max())
        nz = mag[(mag > 0)]
        if nz.numel():
            _, exp = torch.frexp(nz)
            hist += torch.bincount(
                (exp.long() + _HIST_OFFSET).clamp(0, _HIST_BINS - 1), minlength=_HIST_BINS
            ).double()
    return torch.cat([torch.stack([elems, zeros, bad, amax.double(), under]), hist])


def _lost_at(hist: list[float], nonzero: float, scale: float) -> float:
    """Fraction of non-zero elements with |g| * scale < 2**-24, for a power-of-two scale."""
    if nonzero <= 0:
        return 0.0
    k = -24 - math.log2(scale)  # |g| < 2**k  <=>  frexp exponent <= k (k an integer)
    kk = math.floor(k)
    return sum(hist[: max(0, min(_HIST_BINS, kk + _HIST_OFFSET + 1))]) / nonzero


def recommended_scale(
    max_abs: float, min_scale: float = 1.0, max_scale: float = 2.0**24
) -> tuple[float, float]:
    """``(S*, init_scale)``: S* = 65504 / max|g| (the scale that puts the largest scaled
    gradient exactly at fp16's max); init_scale = S* rounded down to a power of two, halved as
    a margin, within ``[min_scale, max_scale]``. Pure function."""
    if not (_finite(max_abs) and max_abs > 0):
        return math.inf, max_scale
    ideal = FP16_MAX / max_abs
    rec = 2.0 ** math.floor(math.log2(ideal)) / 2
    return ideal, min(max(rec, min_scale), max_scale)


def _trace_bad_backward(t: ModuleTrace) -> bool:
    return t.nan or t.posinf or t.neginf  # no gradient is -inf on purpose


def _where(t: ModuleTrace, batch: int, position: int) -> dict[str, Any]:
    return {
        "module": t.name,
        "batch": batch,
        "position": position,
        "nan": t.nan,
        "posinf": t.posinf,
        "neginf": t.neginf,
        "dtype": t.dtype,
    }


def _load_masters(params: list[torch.nn.Parameter], masters: list[Any]) -> None:
    if len(params) != len(masters):
        raise ValueError(
            f"the checkpoint has {len(masters)} master tensors for {len(params)} parameters"
        )
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)


def replay(
    ck: dict[str, Any], cfg: Any, *, precision: str, device: torch.device, batches: int
) -> dict[str, Any]:
    """Section 3: replay the next ``batches`` batches in fp32 and in ``precision``.

    The batches are ``data.batch_at(position + i)``, the ones the run was about to see, each
    backpropagated as the trainer does (``loss / grad_accum_steps``, times the scale), in train
    mode with the same dropout masks in both passes. The fp32 pass gives the true gradients
    (underflow, ``S*``) and tells whether a non-finite forward is a precision problem at all.
    Raises ``_ReplaySkipped`` when the model or data cannot be rebuilt from the checkpoint.
    **Syncs** once per batch and pass."""
    from ampctl.train.builders import build_data_source, build_model, extract_loss

    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]):  # the init is overwritten: leave the RNG alone
            model = build_model(cfg)
        model.load_state_dict(ck["model"])
    except (UsageError, RuntimeError) as e:
        raise _ReplaySkipped(
            f"the model cannot be rebuilt from the checkpoint: {str(e).splitlines()[0]}"
        ) from None
    reference_params = [p for p in model.parameters() if p.requires_grad]
    if ck.get("master") is not None:
        try:
            _load_masters(reference_params, ck["master"])
        except (ValueError, RuntimeError) as e:
            raise _ReplaySkipped(
                f"master weights do not fit the model: {str(e).splitlines()[0]}"
            ) from None
    model.to(device).train()
    try:
        data = build_data_source(cfg)
    except (UsageError, ValueError) as e:
        raise _ReplaySkipped(f"the data cannot be rebuilt: {str(e).splitlines()[0]}") from None
    start = int((ck.get("data") or {}).get("position", 0))
    positions = [start + i for i in range(batches)]
    seed = int(cfg.trainer.seed)
    batch_list = [{k: v.to(device) for k, v in data.batch_at(p).items()} for p in positions]

    sc = ck.get("scaler") if isinstance(ck.get("scaler"), dict) else {}
    policy_probe = PrecisionPolicy(name=precision)
    if policy_probe.needs_scaler:
        scale = float(sc.get("scale", math.nan)) if sc.get("enabled", False) else math.nan
        if not (_finite(scale) and scale > 0):  # a bf16 checkpoint replayed in fp16, a bad scale
            scale = float(cfg.scaler.init_scale)
    else:
        scale = 1.0
    min_scale = float(sc.get("min_scale", cfg.scaler.min_scale))
    max_scale = float(sc.get("max_scale", cfg.scaler.max_scale))

    accum = int(cfg.trainer.grad_accum_steps)

    def forward_loss(
        b: dict[str, torch.Tensor], autocast: Any, out: list[torch.Tensor]
    ) -> torch.Tensor:
        with autocast():
            o = model(**b)
        loss = extract_loss(o).float()
        out.append(loss.detach())
        return loss / accum  # a micro-batch, as the trainer backpropagates it

    # ---- 1) fp32 reference: true gradients, and whether the forward is finite without fp16
    ref_losses: list[torch.Tensor] = []
    ref_module_bad: list[bool] = []
    ref_bwd: list[list[ModuleTrace]] = []
    ref_figs = []
    for i, b in enumerate(batch_list):
        model.zero_grad(set_to_none=True)
        with _seeded(seed + positions[i], device):
            fwd, bwd = trace_modules(
                model,
                lambda b=b: forward_loss(b, contextlib.nullcontext, ref_losses),
                backward=True,
            )
        ref_module_bad.append(first_bad(fwd) is not None)
        ref_bwd.append(bwd)
        ref_figs.append(
            _grad_figures([p.grad for p in reference_params if p.grad is not None], scale, device)
        )
    model.zero_grad(set_to_none=True)

    # ---- 2) the run's precision, with hooks
    policy = PrecisionPolicy(
        name=precision, fp32_modules=list(cfg.precision.fp32_modules), device_type=device.type
    )
    try:
        for n in (ck.get("precision") or {}).get("exempted", []):
            if n not in policy.exempted:
                policy.exempt(model, n)
        policy.prepare(model)
    except (AttributeError, ValueError) as e:
        raise _ReplaySkipped(
            f"the checkpoint's fp32 modules do not fit the model: {str(e).splitlines()[0]}"
        ) from None
    if policy.master is not None and ck.get("master") is not None:
        _load_masters(policy.master.params, ck["master"])
        policy.master.master_to_model()
    low = str(policy.compute_dtype).replace("torch.", "")
    limit = dtype_max(policy.compute_dtype)
    losses: list[torch.Tensor] = []
    modules: dict[str, dict[str, Any]] = {}
    masked: list[str] = []
    fwd_first: tuple[ModuleTrace, int] | None = None
    bwd_first: dict[str, Any] | None = None
    low_grad_modules: set[str] = set()
    act_scaled_max = 0.0
    replay_figs = []
    nonfinite_params: list[str] = []
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for i, b in enumerate(batch_list):
        model.zero_grad(set_to_none=True)
        with _seeded(seed + positions[i], device):
            fwd, bwd = trace_modules(
                model, lambda b=b: forward_loss(b, policy.autocast, losses) * scale, backward=True
            )
        for t in fwd:
            m = modules.setdefault(
                t.name, {"name": t.name, "dtype": t.dtype, "amax": 0.0, "bad": False}
            )
            m["amax"] = max(m["amax"], t.amax)
            m["bad"] = m["bad"] or t.bad
            if t.neginf and not t.bad and t.name not in masked:
                masked.append(t.name)
        fb = first_bad(fwd)
        if fb is not None and fwd_first is None:
            fwd_first = (fb, i)
        bb = next((t for t in bwd if _trace_bad_backward(t)), None)
        if bb is not None and bwd_first is None:
            bwd_first = _where(bb, i, positions[i])
        for t in bwd:
            if t.dtype == low:
                low_grad_modules.add(t.name)
                if not _trace_bad_backward(t):
                    act_scaled_max = max(act_scaled_max, t.amax)
        grads = [p.grad for _, p in named if p.grad is not None]
        replay_figs.append(_grad_figures([g.float() / scale for g in grads], scale, device))
        for n in nonfinite_tensor_names((n, p.grad) for n, p in named):
            if n not in nonfinite_params:
                nonfinite_params.append(n)
    model.zero_grad(set_to_none=True)

    vals = (
        torch.stack(ref_figs + replay_figs).cpu().tolist()
    )  # the one read of the gradient figures
    ref_vals, low_vals = vals[: len(ref_figs)], vals[len(ref_figs) :]
    loss_ref = torch.stack(ref_losses).double().cpu().tolist()
    loss_low = torch.stack(losses).double().cpu().tolist()
    fwd_first_d = None
    if fwd_first is not None:
        t, i = fwd_first
        fp32_finite = not ref_module_bad[i] and math.isfinite(loss_ref[i])
        fwd_first_d = {**_where(t, i, positions[i]), "fp32_finite": fp32_finite}

    # gradient figures over all replayed batches (fp32 reference: the true, unscaled gradients)
    elems = sum(v[0] for v in ref_vals)
    zeros = sum(v[1] for v in ref_vals)
    bad = sum(v[2] for v in ref_vals)
    max_param = max((v[3] for v in ref_vals), default=0.0)
    under = sum(v[4] for v in ref_vals)
    hist = [sum(v[5 + j] for v in ref_vals) for j in range(_HIST_BINS)]
    nonzero = elems - zeros - bad
    max_act = max(
        (
            t.amax
            for bwd in ref_bwd
            for t in bwd
            if t.name in low_grad_modules and math.isfinite(t.amax)
        ),
        default=0.0,
    )
    max_abs = max(max_param, max_act)
    ideal, rec = recommended_scale(max_abs, min_scale, max_scale)
    max_scaled = max_abs * scale
    gradients = None
    if policy.needs_scaler:
        lost = (under - zeros) / nonzero if nonzero > 0 else 0.0
        gradients = {
            "scale": scale,
            "max_abs": max_abs,
            "max_abs_param": max_param,
            "max_abs_activation": max_act,
            "max_scaled": max_scaled,
            "headroom_log2": math.log2(FP16_MAX / max_scaled) if max_scaled > 0 else math.inf,
            "max_scaled_replay": max(
                max((v[3] for v in low_vals), default=0.0) * scale, act_scaled_max
            ),
            "underflow_frac": under / elems if elems else 0.0,
            "zero_frac": zeros / elems if elems else 0.0,
            "zero_frac_replay": sum(v[1] for v in low_vals) / max(sum(v[0] for v in low_vals), 1),
            "lost_frac": max(lost, 0.0),
            "lost_frac_at_recommended": _lost_at(hist, nonzero, rec),
            "ideal_scale": ideal,
            "recommended_init_scale": rec,
            "nonfinite_params": nonfinite_params,
        }
    mods = []
    for m in modules.values():
        m["headroom_log2"] = math.log2(limit / m["amax"]) if m["amax"] > 0 else math.inf
        mods.append(m)
    return {
        "ran": True,
        "reason": None,
        "precision": precision,
        "device": str(device),
        "positions": positions,
        "scale": scale,
        "limit": limit,
        "loss": loss_low,
        "loss_fp32": loss_ref,
        "modules": mods,
        "masked_modules": masked,
        "forward_first_bad": fwd_first_d,
        "backward_first_bad": bwd_first,
        "gradients": gradients,
        "exempted": list(policy.exempted),
        "elapsed_s": time.perf_counter() - t0,
    }


class _ReplaySkipped(Exception):
    pass


def _replay_problems(r: dict[str, Any], scaler: dict[str, Any] | None) -> list[dict[str, Any]]:
    problems = []
    prec = r["precision"]
    fb = r["forward_first_bad"]
    what = lambda d: "NaN" if d["nan"] else ("+inf" if d["posinf"] else "-inf")  # noqa: E731
    if fb is not None:
        if fb["fp32_finite"]:
            problems.append(
                _problem(
                    "forward_overflow",
                    f"forward overflow in {prec}: {fb['module']} is the first module with a non-finite output "
                    f"({what(fb)}, {fb['dtype']}) on batch {fb['position']}; the same batch is finite in fp32",
                    module=fb["module"],
                )
            )
        else:
            problems.append(
                _problem(
                    "forward_nonfinite_fp32",
                    f"the forward is non-finite in fp32 too (first in {fb['module']}, batch {fb['position']}): "
                    "not a precision problem, the model has diverged",
                    module=fb["module"],
                )
            )
    elif any(not math.isfinite(v) for v in r["loss"]):
        problems.append(
            _problem(
                "nonfinite_loss", f"the {prec} loss is non-finite although no module output is"
            )
        )
    g = r["gradients"]
    if fb is None and g is not None:
        bb = r["backward_first_bad"]
        # A scale up to 2x over S* is the dynamic scaler probing after a growth (one skipped step
        # fixes it); beyond that it was set (or grew) far too high, or the gradients spiked.
        if g["headroom_log2"] < -1:
            halvings = math.ceil(-g["headroom_log2"])
            where = (
                f"; first non-finite gradient flows out of {bb['module']}" if bb is not None else ""
            )
            problems.append(
                _problem(
                    "backward_overflow",
                    f"gradients overflow fp16 at scale {g['scale']:g}: max|g| x scale = {g['max_scaled']:.4g} > 65504"
                    f"{where}; {halvings} skipped steps before the scaler gets back under "
                    f"S* = {g['ideal_scale']:.4g}",
                    severity="warning",
                    module=bb["module"] if bb else None,
                )
            )
        if (
            g["lost_frac"] - g["lost_frac_at_recommended"] > UNDERFLOW_LIMIT
            and g["recommended_init_scale"] > g["scale"]
        ):
            problems.append(
                _problem(
                    "gradient_underflow",
                    f"at scale {g['scale']:g}, {g['lost_frac']:.1%} of the non-zero gradient elements underflow in fp16 "
                    f"(|g| x scale < 2^-24; {g['underflow_frac']:.1%} with zeros); at {g['recommended_init_scale']:g} only "
                    f"{g['lost_frac_at_recommended']:.1%} would",
                )
            )
    if fb is None:
        low_dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(prec, "float16")
        tight = [
            m
            for m in r["modules"]
            if m["dtype"] == low_dtype and m["headroom_log2"] < 1 and not m["bad"]
        ]
        if tight:
            problems.append(
                _problem(
                    "activation_headroom",
                    f"{len(tight)} module output(s) within a factor 2 of {prec}'s max, first {tight[0]['name']} "
                    f"(max|x| {tight[0]['amax']:.4g})",
                    severity="warning",
                    modules=[m["name"] for m in tight],
                )
            )
    return problems


# ============================================================================ 4. recommendations
def _override_list(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _recommend(
    cfg: Any,
    ck: dict[str, Any],
    state: dict[str, Any],
    hist: dict[str, Any] | None,
    rep: dict[str, Any] | None,
    problems: list[dict[str, Any]],
    device: torch.device,
) -> list[dict[str, str]]:
    recs: list[dict[str, str]] = []
    kinds = {p["kind"] for p in problems}
    scaler = state["scaler"]

    def add(override: str, reason: str) -> None:
        key = override.split("=", 1)[0]
        if all(r["override"].split("=", 1)[0] != key for r in recs):
            recs.append({"override": override, "reason": reason})

    # fp32 modules: the replay's first overflowing module, and what the guard promoted
    new_modules: list[str] = []
    exempted = list((ck.get("precision") or {}).get("exempted", []))
    fb = rep["forward_first_bad"] if rep else None
    persistent = False
    if fb is not None and fb["fp32_finite"]:
        if fb["module"] == "<model>" or fb["module"] in exempted:
            persistent = True  # the module cannot be isolated, or is fp32 already
        else:
            new_modules.append(fb["module"])
    if hist is not None:
        new_modules += [m for m in hist["promotions"] if m not in new_modules]
    if new_modules and cfg is not None:
        current = list(cfg.precision.fp32_modules)
        mods = list(dict.fromkeys(current + exempted + new_modules))
        add(
            f"precision.fp32_modules={_override_list(mods)}",
            f"{', '.join(new_modules)} overflow{'s' if len(new_modules) == 1 else ''} in fp16: run "
            f"{'it' if len(new_modules) == 1 else 'them'} in fp32, keep the rest in fp16",
        )
    # bf16: forward overflows that fp32 modules do not cure, or a scale that cannot go lower
    fwd_count = max(
        scaler["forward_overflows"] if scaler else 0, hist["forward_overflows"] if hist else 0
    )
    if fb is not None and fb["fp32_finite"] and fwd_count >= 2:
        persistent = True
    if "nonfinite_loss" in kinds:
        persistent = True
    precision = (ck.get("precision") or {}).get("name", "fp16")
    if (
        (persistent or "scale_at_floor" in kinds)
        and precision in ("fp16", "fp16-pure")
        and bf16_supported(device)
    ):
        add(
            "precision=bf16",
            "forward overflows persist in fp16: bf16 has fp32's range (no loss scaling needed)",
        )
    if hist is not None and hist["fallbacks"]:
        to = hist["fallbacks"][-1]["to"]
        if to:
            add(
                f"precision={to}",
                f"the guard fell back to {to} at step {hist['fallbacks'][-1]['step']}",
            )
    # loss scale
    g = rep["gradients"] if rep else None
    if g is not None and ({"gradient_underflow", "backward_overflow"} & kinds):
        why = (
            "gradients underflow at the current scale"
            if "gradient_underflow" in kinds
            else "gradients overflow at the current scale"
        )
        add(
            f"scaler.init_scale={_plain(g['recommended_init_scale'])}",
            f"{why}: S* = 65504 / max|g| = 65504 / {g['max_abs']:.4g} = {g['ideal_scale']:.4g}, "
            "rounded down to a power of two and halved",
        )
    if "overflow_after_growth" in kinds and scaler is not None:
        add(
            f"scaler.growth_interval={scaler['growth_interval'] * 4}",
            "the scale keeps growing into overflow: grow 4x less often",
        )
    # optimizer: exploding updates
    if (
        kinds
        & {
            "nonfinite_optimizer_state",
            "extreme_optimizer_state",
            "grad_norm_explosion",
            "forward_nonfinite_fp32",
            "scale_at_floor",
        }
        and cfg is not None
    ):
        add(
            f"optim.lr={_plain(cfg.optim.lr / 2)}",
            "updates diverged (optimizer state, grad norm, or overflow at the scale's floor): "
            "halve the learning rate",
        )
        clip = cfg.optim.clip_grad_norm
        if clip is None or clip > 1.0:
            add("optim.clip_grad_norm=1.0", "clip the gradient norm to 1.0 (the BERT-Large recipe)")
    return recs


def _resume_overrides(recs: list[dict[str, str]]) -> list[str]:
    """Overrides that take effect on --resume (precision and scaler state come from the
    checkpoint there)."""
    return [
        r["override"]
        for r in recs
        if r["override"].startswith(("precision.fp32_modules=", "optim."))
    ]


def _state_names(cfg: Any, ck: dict[str, Any]) -> list[str] | None:
    """Parameter names in the optimizer's order (``PrecisionPolicy.named_optimizer_params``),
    from a model built on the meta device (no memory, no init cost). None when it cannot be
    built."""
    from ampctl.train.builders import build_model

    if cfg is None:
        return None
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 - fall back to a real build
        try:
            model = build_model(cfg)
        except Exception:  # noqa: BLE001 - names are a nicety: use indices
            return None
    name = (ck.get("precision") or {}).get("name", cfg.precision.name)
    policy = PrecisionPolicy(
        name=name if name in PRECISIONS else "fp32", fp32_modules=[], device_type="cpu"
    )
    if policy.name == "fp16-pure":
        policy.prepare(model)
    return [n for n, _ in policy.named_optimizer_params(model)]


def _run_dir_of(given: Path, ckpt: Path) -> Path | None:
    if given.is_dir():
        if given.name == "checkpoints":
            return given.parent
        return given
    if ckpt.parent.name == "checkpoints":
        return ckpt.parent.parent
    return None


# ============================================================================ entry points
def diagnose(
    path: str | Path, *, batches: int = 2, precision: str | None = None, device: str = "auto"
) -> dict[str, Any]:
    """Diagnose a checkpoint or run folder; returns the report (the ``--json`` content).

    Raises :class:`UsageError` (or :class:`CheckpointError`) for bad input: a missing path, a
    folder with no checkpoint, a file that is not an ampctl checkpoint, ``batches < 1``, an
    unknown ``precision`` or ``device``. **Syncs** (an offline tool: it reads every tensor)."""
    from ampctl.config import ConfigError, config_from_dict
    from ampctl.train.builders import resolve_device

    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise UsageError(f"--batches {batches!r} is not allowed: give an integer >= 1")
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(
            f"--precision {precision!r} is not allowed: use one of {', '.join(PRECISIONS)}"
        )
    try:
        dev = resolve_device(device)
    except UsageError:
        raise
    except (RuntimeError, ValueError):
        raise UsageError(
            f"--device {device!r} is not allowed: use auto, cpu, cuda or cuda:N"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r} is not allowed: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(
            f"--device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )

    given = Path(path)
    ck = load_checkpoint(given)
    ckpt_path = Path(ck["path"])
    missing = [k for k in ("model", "config") if k not in ck]
    if missing or not isinstance(ck.get("model"), dict):
        raise CheckpointError(
            f"{str(ckpt_path)!r} lacks {', '.join(missing) or 'a model state'}: not a complete ampctl checkpoint"
        )
    try:
        cfg = config_from_dict(ck["config"])
    except ConfigError as e:
        cfg = None
        config_error = str(e).splitlines()[0]
    else:
        config_error = None
    run_precision = (ck.get("precision") or {}).get("name") or (
        cfg.precision.name if cfg else "fp32"
    )
    replay_precision = precision or run_precision
    if replay_precision == "bf16" and not bf16_supported(dev):
        raise UsageError(f"--precision bf16 is not supported on {dev}: use fp16 or fp32")

    names = _state_names(cfg, ck)
    state = state_health(ck, names)
    problems = list(state.pop("problems"))

    run_dir = _run_dir_of(given, ckpt_path)
    hist = history(run_dir, ck) if run_dir is not None else None
    if hist is not None:
        problems += _history_problems(hist, state["scaler"])

    weights_bad = any(p["kind"] in ("nonfinite_weights", "nonfinite_master") for p in problems)
    rep: dict[str, Any]
    skip = None
    if weights_bad:
        skip = "the weights are already non-finite: a replay would only propagate the NaN/inf (meaningless)"
    elif cfg is None:
        skip = f"the checkpoint's config is not valid: {config_error}"
    if skip is None:
        try:
            rep = replay(ck, cfg, precision=replay_precision, device=dev, batches=batches)
        except _ReplaySkipped as e:
            skip = str(e)
    if skip is not None:
        rep = {"ran": False, "reason": skip, "precision": replay_precision, "device": str(dev)}
    else:
        problems += _replay_problems(rep, state["scaler"])

    recs = _recommend(cfg, ck, state, hist, rep if rep["ran"] else None, problems, dev)

    # which checkpoint to resume from: the newest whose state is healthy
    state_kinds = {
        "bad_scale",
        "nonfinite_weights",
        "extreme_weights",
        "nonfinite_master",
        "extreme_master",
        "nonfinite_optimizer_state",
        "extreme_optimizer_state",
    }
    own_bad = sorted({p["kind"] for p in problems if p["kind"] in state_kinds})
    checkpoints = [
        {
            "path": str(ckpt_path),
            "step": int(ck.get("step", 0)),
            "healthy": not own_bad,
            "problems": own_bad,
        }
    ]
    resume_ck = str(ckpt_path) if not own_bad else None
    if own_bad:
        older = [p for p in list_checkpoints(ckpt_path.parent) if p != ckpt_path]
        for p in reversed(older):
            try:
                other = load_checkpoint(p)
            except CheckpointError as e:
                checkpoints.append(
                    {
                        "path": str(p),
                        "step": None,
                        "healthy": False,
                        "problems": [str(e).splitlines()[0]],
                    }
                )
                continue
            if int(other.get("step", 0)) >= int(ck.get("step", 0)):
                continue
            h = state_health(other, names)
            bad = sorted({q["kind"] for q in h["problems"] if q["kind"] in state_kinds})
            checkpoints.append(
                {
                    "path": str(p),
                    "step": int(other.get("step", 0)),
                    "healthy": not bad,
                    "problems": bad,
                }
            )
            if not bad:
                resume_ck = str(p)
                break
    extra = _resume_overrides(recs)
    if resume_ck is not None:
        command = " ".join(["ampctl train --resume", resume_ck, *extra])
    else:
        command = (
            " ".join(["ampctl train", *[r["override"] for r in recs]])
            + "   # no healthy checkpoint: start afresh"
        )
    report = {
        "schema": SCHEMA,
        "checkpoint": {
            "path": str(ckpt_path),
            "step": int(ck.get("step", 0)),
            "precision": run_precision,
            "fp32_modules": list((ck.get("precision") or {}).get("exempted", [])),
            "run_dir": str(run_dir) if hist is not None else None,
        },
        "healthy": not problems,
        "problems": problems,
        "state": state,
        "history": hist,
        "replay": rep,
        "recommendations": recs,
        "checkpoints": checkpoints,
        "resume": {"checkpoint": resume_ck, "command": command},
    }
    return _jsonable(report)


def run_diagnose(
    path: Path, batches: int, precision: str | None, device: str, as_json: bool
) -> int:
    """What ``ampctl diagnose`` does: diagnose, print (rich tables, or only JSON on stdout),
    return 0 when healthy and 1 when problems were found."""
    from rich.console import Console

    report = diagnose(path, batches=batches, precision=precision, device=device)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, allow_nan=False) + "\n")
        sys.stdout.flush()
    else:
        render(report, Console())
    return 0 if report["healthy"] else 1


# ============================================================================ rich output
def _num_or(x: Any) -> float | None:
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    return x if isinstance(x, int | float) and not isinstance(x, bool) else None


def render(report: dict[str, Any], console: Any) -> None:
    """Print the report as rich tables."""
    from rich.table import Table
    from rich.text import Text

    c = report["checkpoint"]
    mods = f", fp32 modules: {', '.join(c['fp32_modules'])}" if c["fp32_modules"] else ""
    console.print(Text(f"ampctl diagnose - {c['path']}", style="bold"))
    console.print(
        f"step {c['step']}, precision {c['precision']}{mods}", highlight=False, markup=False
    )

    # ---- 1. state
    st = report["state"]
    t = Table(title="1. State health", title_justify="left", show_edge=False)
    for col in ("section", "tensors", "max |x|", "limit", "bad tensors"):
        t.add_column(col)
    for label, sec in (
        ("weights", st["weights"]),
        ("master weights", st["master"]),
        ("optimizer state", st["optimizer"]),
    ):
        if sec is None:
            continue
        nbad = len(sec["bad"])
        t.add_row(
            label,
            str(sec["tensors"]),
            _fmt(sec.get("amax")),
            _fmt(sec.get("limit"), ".6g") if "limit" in sec else "65504 / 65504^2",
            Text(str(nbad), style="red bold" if nbad else "green"),
        )
    console.print(t)
    bad = [
        (lbl, b)
        for lbl, sec in (
            ("weight", st["weights"]),
            ("master", st["master"]),
            ("optimizer", st["optimizer"]),
        )
        if sec
        for b in sec["bad"]
    ]
    if bad:
        t = Table(show_edge=False)
        t.add_column("bad tensor", overflow="fold", ratio=1)
        for col in ("NaN", "+inf", "-inf", ">limit", "max|x|"):
            t.add_column(col, justify="right", no_wrap=True)
        for lbl, b in bad[:MAX_LISTED]:
            name = f"{b['key']} of {b['param']}" if b.get("key") else b["name"]
            if lbl == "master":
                name = f"master {name}"
            t.add_row(
                Text(name, style="red"),
                str(b["nan"]),
                str(b["posinf"]),
                str(b["neginf"]),
                str(b["above_limit"]),
                _fmt(b["amax"]),
            )
        if len(bad) > MAX_LISTED:
            t.add_row(f"... {len(bad) - MAX_LISTED} more", "", "", "", "", "")
        console.print(t)
    sc = st["scaler"]
    if sc is not None:
        floor = " (at its floor)" if sc["at_floor"] else ""
        line = (
            f"scaler: scale {_pow2(sc['scale'])}{floor}, min {sc['min_scale']:g}, growth_interval {sc['growth_interval']}, "
            f"skipped {sc['skipped_total']} (forward {sc['forward_overflows']}), consecutive {sc['consecutive_overflows']}, "
            f"recent skips {sc['recent_skips']}/{sc['recent_window']}"
            if sc["enabled"]
            else "scaler: disabled (no loss scaling in this precision)"
        )
        console.print(line, highlight=False, markup=False)

    # ---- 2. history
    h = report["history"]
    if h is not None:
        t = Table(title="2. History", title_justify="left", show_edge=False, show_header=False)
        t.add_column("what")
        t.add_column("value")
        fo = h["first_overflow_step"]
        t.add_row(
            "first overflow",
            "none" if fo is None else f"step {fo} (from {h['first_overflow_source']})",
        )
        t.add_row(
            "first NaN loss",
            "none" if h["first_nan_loss_step"] is None else f"step {h['first_nan_loss_step']}",
        )
        traj = h["scale_trajectory"]
        shown = traj if len(traj) <= 8 else traj[:2] + [None] + traj[-5:]
        t.add_row(
            "scale",
            " -> ".join(
                "..." if p is None else f"{_pow2(_num_or(p[1]) or 0)} @{int(p[0])}" for p in shown
            )
            or "-",
        )
        bursts = h["bursts"]
        if bursts:
            desc = ", ".join(
                f"{b['start']}-{b['end']} ({b['length']}{', after growth' if b['after_growth'] else ''})"
                for b in bursts[-6:]
            )
            t.add_row("overflow bursts", f"{len(bursts)}: {desc}")
        else:
            t.add_row("overflow bursts", "none")
        if h["events"]:
            t.add_row("events", ", ".join(f"{k} {v}" for k, v in sorted(h["events"].items())))
        gn = h["grad_norm"]
        if gn is not None:
            t.add_row(
                "grad norm",
                f"peak {_fmt(gn['peak'])} @{gn['peak_step']} = {_fmt(gn['ratio'], '.3g')}x earlier median {_fmt(gn['baseline'])}",
            )
        console.print(t)
        if h["before_break"]:
            title = (
                f"last rows before step {h['break_step']}"
                if h["break_step"] is not None
                else "last logged rows"
            )
            t = Table(title=title, title_justify="left", show_edge=False)
            for col in ("step", "loss", "scale", "skipped", "grad norm", "max |g|"):
                t.add_column(col, justify="right")
            for r in h["before_break"]:
                t.add_row(
                    *(
                        _fmt(_num_or(r.get(k)) if not isinstance(r.get(k), int) else r.get(k))
                        for k in ("step", "loss", "scale", "skipped", "grad_norm", "grad_amax")
                    )
                )
            console.print(t)

    # ---- 3. replay
    r = report["replay"]
    if not r["ran"]:
        console.print(Text(f"3. Replay skipped: {r['reason']}", style="yellow"))
    else:
        console.print(
            Text(
                f"3. Replay: {len(r['positions'])} batch(es) at positions {', '.join(map(str, r['positions']))}, "
                f"{r['precision']} on {r['device']}, scale {r['scale']:g} ({_fmt(r['elapsed_s'], '.2f')} s)",
                style="bold",
            )
        )
        console.print(
            f"loss {r['precision']}: {', '.join(_fmt(_num_or(v)) for v in r['loss'])}   fp32: {', '.join(_fmt(_num_or(v)) for v in r['loss_fp32'])}",
            highlight=False,
            markup=False,
        )
        limit = r["limit"]
        t = Table(
            title=f"activations vs {r['precision']} max ({limit:.6g}), least headroom first",
            title_justify="left",
            show_edge=False,
        )
        for col in ("module", "dtype", "max |x|", "headroom"):
            t.add_column(col)
        ordered = sorted(r["modules"], key=lambda m: (not m["bad"], _num_or(m["headroom_log2"])))
        for m in ordered[:8]:
            hr = _num_or(m["headroom_log2"])
            head = (
                "non-finite"
                if m["bad"]
                else ("-" if hr is None or math.isinf(hr) else f"2^{hr:.1f}")
            )
            t.add_row(
                Text(m["name"], style="red" if m["bad"] else ""), m["dtype"], _fmt(m["amax"]), head
            )
        console.print(t)
        if r["masked_modules"]:
            console.print(
                f"intentional -inf (masks, not faults): {', '.join(r['masked_modules'])}",
                highlight=False,
                markup=False,
            )
        for label, d in (
            ("forward", r["forward_first_bad"]),
            ("backward", r["backward_first_bad"]),
        ):
            if d is None:
                console.print(f"first non-finite {label}: none", highlight=False, markup=False)
            else:
                kind = "NaN" if d["nan"] else ("+inf" if d["posinf"] else "-inf")
                extra = ""
                if label == "forward":
                    extra = "; finite in fp32" if d["fp32_finite"] else "; non-finite in fp32 too"
                console.print(
                    Text(
                        f"first non-finite {label}: {d['module']} ({kind}, {d['dtype']}, batch {d['position']}){extra}",
                        style="red",
                    )
                )
        g = r["gradients"]
        if g is not None:
            t = Table(
                title=f"gradients at scale {_pow2(g['scale'])}",
                title_justify="left",
                show_edge=False,
                show_header=False,
            )
            t.add_column("what")
            t.add_column("value")
            hr = _num_or(g["headroom_log2"])
            t.add_row(
                "max |g| (unscaled, fp32 replay)",
                f"{_fmt(g['max_abs'])} (params {_fmt(g['max_abs_param'])}, activations {_fmt(g['max_abs_activation'])})",
            )
            t.add_row(
                "largest scaled gradient",
                f"{_fmt(g['max_scaled'])}: headroom {'-' if hr is None or math.isinf(hr) else f'2^{hr:.1f}'} below 65504",
            )
            t.add_row(
                "underflow (|g| x scale < 2^-24)",
                f"{g['underflow_frac']:.2%} of elements incl. zeros ({g['zero_frac']:.2%} are zero in fp32)",
            )
            t.add_row(
                "non-zero elements lost",
                f"{g['lost_frac']:.2%} now, {g['lost_frac_at_recommended']:.2%} at {g['recommended_init_scale']:g}",
            )
            t.add_row(
                "ideal scale S* = 65504 / max|g|",
                f"{_fmt(_num_or(g['ideal_scale']))} -> init_scale {_pow2(g['recommended_init_scale'])}",
            )
            if g["nonfinite_params"]:
                t.add_row("non-finite grads", ", ".join(g["nonfinite_params"][:5]))
            console.print(t)

    # ---- 4. verdict and recommendations
    problems = report["problems"]
    if not problems:
        console.print(Text("Healthy: no problems found.", style="green bold"))
    else:
        console.print(Text(f"Problems ({len(problems)}):", style="red bold"))
        for p in problems:
            style = "red" if p["severity"] == "error" else "yellow"
            console.print(Text(f"  [{p['kind']}] {p['message']}", style=style))
    recs = report["recommendations"]
    if recs:
        console.print(Text("4. Recommendations (paste into ampctl train):", style="bold"))
        for rec in recs:
            console.print(
                Text("  " + rec["override"], style="cyan"),
                Text(f"  # {rec['reason']}", style="dim"),
            )
    res = report["resume"]
    if problems:
        older = [ck for ck in report["checkpoints"][1:]]
        for ck in older:
            state = "healthy" if ck["healthy"] else ", ".join(ck["problems"])
            console.print(f"  checked {ck['path']}: {state}", highlight=False, markup=False)
        console.print(Text.assemble(("Resume: ", "bold"), (res["command"], "cyan")))
        if (
            any(not r["override"].startswith(("precision.fp32_modules=", "optim.")) for r in recs)
            and res["checkpoint"]
        ):
            console.print(
                "  (precision= and scaler.* take effect in a fresh run: --resume restores the checkpoint's precision and scaler state)",
                highlight=False,
                markup=False,
            )
