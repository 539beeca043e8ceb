"""Part 1 of a diagnosis: the health of the state a checkpoint holds.

Weights, fp32 master weights and optimizer state (Adam's moments) are checked for NaN/inf and
for values out of the run's range, named by parameter; the loss scaler's state is read whatever
wrote it (ampctl's ``LossScaler``, ``torch.amp.GradScaler``, DeepSpeed's loss scaler). What a
format does not record is ``None`` ("unknown"), never 0.

Thresholds:

* a weight or master weight above ``FP16_MAX`` (65504) in an fp16 run is a fault: it becomes
  ``inf`` when cast to fp16 (for bf16/fp32 runs the limit is the compute dtype's max);
* a first moment (``exp_avg``) above 65504 or a second moment (``exp_avg_sq``) above 65504**2 is
  a fault in any precision: it stands for a gradient that fp16 cannot hold even at scale 1;
* a ``GradScaler`` scale below 1 has collapsed (it halved on every step: the gradients are
  non-finite at any scale).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ampctl.amp.formats import FP16_MAX, dtype_max

from .common import RECENT_WINDOW, finite, problem
from .readers.base import Found

__all__ = ["state_health", "name_optimizer_state", "scaler_state", "COMPUTE_DTYPES"]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SQUARED_KEYS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


# ---------------------------------------------------------------------------- tensor figures
def _tensor_figures(tensors: list[torch.Tensor], limits: list[float]) -> list[list[float]]:
    """Per tensor [nan count, +inf count, -inf count, count above limit, max finite |x|, numel].

    Computed on the tensors' device; **one host read** for the whole list."""
    if not tensors:
        return []
    rows = []
    dev = tensors[0].device
    for t, limit in zip(tensors, limits, strict=True):
        t = t.detach()
        if t.numel() == 0:
            rows.append(torch.zeros(6, dtype=torch.float64, device=dev))
            continue
        fin = torch.isfinite(t)
        mag = torch.where(fin, t, torch.zeros((), dtype=t.dtype, device=t.device)).abs().float()
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
    entries: list[tuple[str, torch.Tensor, str | None, str | None, float]],
) -> dict[str, Any]:
    """Health of ``(name, tensor, param, key, limit)`` entries. **Syncs once.**"""
    figs = _tensor_figures([t for _, t, *_ in entries], [lim for *_, lim in entries])
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


def _dedup(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Floating tensors, tied ones once (under the first name)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = []
    for k, v in named:
        if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out.append((k, v))
    return out


# ---------------------------------------------------------------------------- names
def _state_shape(st: Any) -> tuple[int, ...] | None:
    if not isinstance(st, dict):
        return None
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg", "sum"):
        t = st.get(key)
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return tuple(t.shape)
    return None


def _same_shape(state: tuple[int, ...] | None, param: tuple[int, ...]) -> bool:
    """Whether an optimizer entry's shape fits a parameter's, index by index. A 2-D weight may be
    saved transposed (GPT-2's Conv1D layout in its state dict, nn.Linear in memory)."""
    return state is None or state == param or (len(param) == 2 and state == param[::-1])


def name_optimizer_state(
    opt_sd: dict[str, Any],
    orders: list[tuple[str, list[tuple[str, tuple[int, ...]]]]],
    unordered: list[tuple[str, tuple[int, ...]]] | None = None,
) -> tuple[dict[Any, str], str, str | None]:
    """Map optimizer-state keys to parameter names: ``(names, method, note)``.

    Keys that are names already (DCP, DeepSpeed) are kept. Otherwise the optimizer's index order
    (``param_groups`` flattened) is matched against each candidate order in ``orders``: the first
    whose shapes agree index by index names every entry (method = that order's label). Failing
    that, entries whose shape belongs to exactly one parameter are named by shape; the others
    keep ``param[i]`` and the note says why. ``unordered``: parameters whose order is not known
    (a safetensors file): used for names by shape only. Pure function."""
    state = opt_sd.get("state") or {}
    ids = [pid for g in opt_sd.get("param_groups") or [] for pid in g.get("params", [])]
    ids += [pid for pid in state if pid not in ids]
    if ids and all(isinstance(pid, str) for pid in ids):
        return {pid: pid for pid in ids}, "names in the checkpoint", None
    shapes = [_state_shape(state.get(pid)) for pid in ids]
    for label, order in orders:
        if len(order) != len(ids):
            continue
        if all(_same_shape(s, tuple(o[1])) for s, o in zip(shapes, order, strict=True)):
            return {pid: order[i][0] for i, pid in enumerate(ids)}, f"by {label}", None
    candidates = max(orders, key=lambda o: len(o[1]))[1] if orders else list(unordered or [])
    if not candidates:
        return (
            {pid: f"param[{pid}]" for pid in ids},
            "indices",
            "optimizer state is indexed by position and no parameter list was found: "
            "entries are named param[i]",
        )
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, shape in candidates:
        by_shape.setdefault(tuple(shape), []).append(name)
    out: dict[Any, str] = {}
    unnamed = 0
    for pid, shape in zip(ids, shapes, strict=True):
        names = by_shape.get(shape or (), [])
        if len(names) == 1:
            out[pid] = names[0]
        else:
            unnamed += 1
            out[pid] = f"param[{pid}]" + (f" (shape {list(shape)})" if shape else "")
    note = None
    if unnamed:
        note = (
            f"{unnamed} of {len(ids)} optimizer entries cannot be named: the format keeps no "
            "parameter order and their shapes are shared"
        )
    return out, "by shape", note


# ---------------------------------------------------------------------------- scaler
def _history_rows(sc: dict[str, Any]) -> list[tuple[int, float, bool]]:
    hist = sc.get("history")
    if not isinstance(hist, torch.Tensor) or hist.numel() == 0:
        return []
    return [(int(s), float(v), bool(k)) for s, v, k in hist.double().reshape(-1, 3).tolist()]


def _num(x: Any, default: Any = None) -> Any:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    return x if isinstance(x, int | float) and not isinstance(x, bool) else default


def scaler_state(sc: Any, kind: str | None) -> dict[str, Any] | None:
    """The loss scaler's state in one shape for every format (None: not recorded). ampctl's
    ``LossScaler`` state is GradScaler's keys plus its own counters and history; a state with
    GradScaler's keys only is read as a GradScaler (skips unknown)."""
    if not isinstance(sc, dict):
        return None
    if kind == "deepspeed":
        return _deepspeed_scaler(sc)
    if "scale" not in sc:
        return None
    if not any(k in sc for k in ("skipped_total", "history", "min_scale")):  # a GradScaler
        scale = float(_num(sc.get("scale"), math.nan))
        return {
            "kind": "GradScaler",
            "enabled": True,
            "scale": scale,
            "min_scale": None,
            "max_scale": None,
            "at_floor": None,
            "growth_interval": _num(sc.get("growth_interval")),
            "growth_factor": _num(sc.get("growth_factor")),
            "backoff_factor": _num(sc.get("backoff_factor")),
            "growth_tracker": _num(sc.get("_growth_tracker")),
            "hysteresis": None,
            "skipped_total": None,
            "forward_overflows": None,
            "consecutive_overflows": None,
            "updates": None,
            "recent_window": None,
            "recent_skips": None,
        }
    rows = _history_rows(sc)
    recent = rows[-RECENT_WINDOW:]
    enabled = bool(sc.get("enabled", True))
    scale = float(_num(sc.get("scale"), math.nan))
    min_scale = float(sc.get("min_scale", 1.0))
    return {
        "kind": "ampctl",
        "enabled": enabled,
        "scale": scale,
        "min_scale": min_scale,
        "max_scale": float(sc.get("max_scale", 2.0**24)),
        "at_floor": enabled and scale <= min_scale,
        "growth_interval": int(sc.get("growth_interval", 2000)),
        "growth_factor": _num(sc.get("growth_factor")),
        "backoff_factor": _num(sc.get("backoff_factor")),
        "growth_tracker": _num(sc.get("_growth_tracker")),
        "hysteresis": int(sc.get("hysteresis", 1)),
        "skipped_total": int(sc.get("skipped_total", 0)),
        "forward_overflows": int(sc.get("forward_overflows", 0)),
        "consecutive_overflows": int(sc.get("consecutive_overflows", 0)),
        "updates": int(sc.get("num_updates", len(rows))),
        "recent_window": len(recent),
        "recent_skips": sum(1 for r in recent if r[2]),
    }


def _deepspeed_scaler(sc: dict[str, Any]) -> dict[str, Any]:
    scale = _num(sc.get("cur_scale"))
    dynamic = bool(sc.get("dynamic", False))
    min_scale = _num(sc.get("min_scale"))
    return {
        "kind": "deepspeed",
        "enabled": scale is not None,
        "scale": float(scale) if scale is not None else None,
        "min_scale": min_scale,
        "max_scale": None,
        "at_floor": (scale <= min_scale) if dynamic and scale is not None and min_scale else None,
        "growth_interval": _num(sc.get("scale_window")) if dynamic else None,
        "growth_factor": _num(sc.get("scale_factor")) if dynamic else None,
        "backoff_factor": None,
        "growth_tracker": None,
        "hysteresis": _num(sc.get("delayed_shift")),
        "skipped_total": _num(sc.get("skipped_steps")),
        "forward_overflows": None,
        "consecutive_overflows": None,
        "updates": _num(sc.get("cur_iter")),
        "recent_window": None,
        "recent_skips": None,
    }


def scaler_history_rows(found: Found) -> list[tuple[int, float, bool]]:
    """ampctl's per-update scaler record ``(step, scale used, skipped)``; empty elsewhere."""
    if found.scaler_kind == "ampctl" and isinstance(found.scaler, dict):
        return _history_rows(found.scaler)
    return []


# ---------------------------------------------------------------------------- state health
def _weight_limit(precision: str | None) -> float:
    compute = COMPUTE_DTYPES.get(precision or "fp32", torch.float16)
    return FP16_MAX if compute == torch.float16 else dtype_max(compute)


def state_health(found: Found) -> dict[str, Any]:
    """Part 1 of the report for what a reader found.

    Returns ``{"weights", "master", "optimizer", "scaler", "names", "problems"}``. **Syncs**
    (one host read per section)."""
    precision = found.precision
    wlimit = _weight_limit(precision)
    weights = _section([(n, t, n, None, wlimit) for n, t in _dedup(found.weights.items())])
    weights["limit"] = wlimit

    pname: dict[Any, str] = {}
    names_info: dict[str, Any] = {"method": None, "note": found.optimizer_note}
    optimizer = None
    opt_sd = found.optimizer
    if isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict):
        pname, method, note = name_optimizer_state(
            opt_sd, found.param_orders, found.unordered_params
        )
        names_info = {"method": method, "note": note or found.optimizer_note}
        entries = []
        for pid, st in opt_sd["state"].items():
            if not isinstance(st, dict):
                continue
            for key, t in st.items():
                if key == "step" or not isinstance(t, torch.Tensor):
                    continue
                if not t.is_floating_point() or t.dim() == 0:
                    continue
                limit = FP16_MAX**2 if key in _SQUARED_KEYS else FP16_MAX
                p = pname.get(pid, f"param[{pid}]")
                entries.append((f"{p}.{key}", t, p, key, limit))
        optimizer = _section(entries)
        optimizer.pop("amax")

    master = None
    if found.masters:
        mnames = found.master_names
        if mnames is None:
            ordered = [
                pname[pid]
                for g in (opt_sd or {}).get("param_groups", [])
                for pid in g.get("params", [])
                if pid in pname
            ]
            mnames = ordered if len(ordered) == len(found.masters) else None
        entries = [
            (
                mnames[i] if mnames else f"master[{i}]",
                t,
                mnames[i] if mnames else None,
                None,
                wlimit,
            )
            for i, t in enumerate(found.masters)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        master = _section(entries)
        master["limit"] = wlimit

    scaler = scaler_state(found.scaler, found.scaler_kind)
    problems = _tensor_problems(weights, master, optimizer, wlimit, precision)
    problems += _scaler_problems(scaler)
    return {
        "weights": weights,
        "master": master,
        "optimizer": optimizer,
        "scaler": scaler,
        "names": names_info,
        "problems": problems,
    }


def _listed(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


def _tensor_problems(
    weights: dict[str, Any],
    master: dict[str, Any] | None,
    optimizer: dict[str, Any] | None,
    wlimit: float,
    precision: str | None,
) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    for label, sec, kind in (("weight", weights, "weights"), ("master weight", master, "master")):
        if sec is None:
            continue
        nonfinite = [b for b in sec["bad"] if b["nan"] or b["posinf"] or b["neginf"]]
        extreme = [b for b in sec["bad"] if b not in nonfinite]
        if nonfinite:
            names = [b["name"] for b in nonfinite]
            problems.append(
                problem(
                    f"nonfinite_{kind}",
                    f"{len(nonfinite)} {label} tensor(s) hold inf/NaN, first {_listed(names)}",
                    tensors=names,
                )
            )
        if extreme:
            names = [b["name"] for b in extreme]
            problems.append(
                problem(
                    f"extreme_{kind}",
                    f"{len(extreme)} {label} tensor(s) exceed {wlimit:g} ({precision}: they "
                    f"overflow when cast), first {_listed(names)}",
                    tensors=names,
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
                params = list(dict.fromkeys(b["param"] for b in group))
                problems.append(
                    problem(
                        kind,
                        f"optimizer state {what}: "
                        + _listed([f"{b['key']} of {b['param']}" for b in group]),
                        tensors=[b["name"] for b in group],
                        params=params,
                    )
                )
    return problems


def _scaler_problems(scaler: dict[str, Any] | None) -> list[dict[str, Any]]:
    problems: list[dict[str, Any]] = []
    if scaler is None or not scaler["enabled"]:
        return problems
    scale = scaler["scale"]
    if not (finite(scale) and scale > 0):
        problems.append(
            problem("bad_scale", f"the loss scale is {scale}: a resumed run would scale by it")
        )
    elif scaler["kind"] == "GradScaler" and scale < 1.0:
        problems.append(
            problem(
                "scale_collapsed",
                f"the GradScaler scale fell to {scale:.3g} (below 1): it halved on step after "
                "step, so the gradients were non-finite at every scale it tried",
            )
        )
    if scaler["at_floor"] and (
        (scaler["consecutive_overflows"] or 0) > 0 or (scaler["recent_skips"] or 0) > 0
    ):
        problems.append(
            problem(
                "scale_at_floor",
                f"loss scale at its floor ({scaler['min_scale']:g}) and still overflowing: "
                f"{scaler['recent_skips']} of the last {scaler['recent_window']} steps skipped",
            )
        )
    return problems
