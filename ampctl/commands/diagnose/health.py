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

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ampctl.amp import records as rec
from ampctl.amp.formats import FP16_MAX, dtype_max
from ampctl.trust import context_value

from .common import RECENT_WINDOW, finite
from .readers.base import Found
from .readers.lazy import TensorSource, tensor_sources, view_bytes
from .stages import BadTensor, OptimizerNames, Problem, ScalerState, StateHealth, TensorSection

__all__ = [
    "state_health",
    "name_optimizer_state",
    "scaler_state",
    "applied_updates",
    "is_bare_scaler",
    "COMPUTE_DTYPES",
    "tensor_figures",
    "ReadProgress",
    "read_progress",
]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SQUARED_KEYS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


# ---------------------------------------------------------------------------- tensor figures
#: Elements counted at once where a tensor is not all finite, or exceeds its limit: a chunk
#: of a large tensor (the masks and magnitudes stay a few times this many bytes).
CHUNK = 1 << 22
_NATIVE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _collapsed(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(view, times)``: ``t`` with every dimension of stride 0 (an expanded view: one value
    shown many times) narrowed to one element, and how many times each element is shown. A
    view is never expanded: its figures are the narrowed view's, counts times ``times``."""
    times = 1
    for d in range(t.dim()):
        if t.stride(d) == 0 and t.shape[d] > 1:
            times *= t.shape[d]
            t = t.narrow(d, 0, 1)
    return t, times


def _chunks(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``t`` of at most :data:`CHUNK` elements covering it once (a chunk of a view
    that is not contiguous is copied when flattened: at most a chunk). Reads nothing."""
    stack = [t]
    while stack:
        v = stack.pop()
        n = v.numel()
        if n == 0:
            continue
        if v.is_contiguous() or n <= CHUNK:
            flat = v.reshape(-1)  # a view when contiguous; a copy of at most a chunk otherwise
            for off in range(0, n, CHUNK):
                yield flat[off : off + CHUNK]
            continue
        row = n // v.shape[0]  # not contiguous and larger than a chunk: split its first dim
        step = max(CHUNK // max(row, 1), 1)
        stack.extend(v[i : i + step] for i in reversed(range(0, v.shape[0], step)))


def tensor_figures(t: torch.Tensor, limit: float) -> list[float]:
    """[nan count, +inf count, -inf count, count above limit, max finite |x|, numel] of one
    tensor. One pass of ``aminmax`` over the whole tensor (no temporary; NaN and inf show in
    its min or max) settles a tensor that is all finite, the usual case; any other is taken
    :data:`CHUNK` elements at a time, each chunk settled the same way or, when it holds a
    non-finite value, counted exactly (temporaries bounded by the chunk). A
    stride-0 view is never expanded. **Reads device values on the host** (an offline check)."""
    t = t.detach()
    numel = t.numel()
    if numel == 0:
        return [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    base, times = _collapsed(t)
    if base.dtype in _NATIVE:
        lo, hi = (float(x) for x in torch.aminmax(base))
        if math.isfinite(lo) and math.isfinite(hi):
            top = max(abs(lo), abs(hi))
            above = 0
            if top > limit:
                above = sum(int((c.abs().float() > limit).sum()) for c in _chunks(base))
            return [0.0, 0.0, 0.0, float(above * times), top, float(numel)]
    nan = pos = neg = above = 0
    top = 0.0
    for c in _chunks(base):
        if c.dtype not in _NATIVE:
            c = c.float()  # fp8 and friends: a chunk's upcast is bounded
        lo, hi = (float(x) for x in torch.aminmax(c))
        if math.isfinite(lo) and math.isfinite(hi):  # this chunk is clean: one pass
            mx = max(abs(lo), abs(hi))
            if mx > limit:
                above += int((c.abs().float() > limit).sum())
            top = max(top, mx)
            continue
        fin = torch.isfinite(c)
        nan += int(torch.isnan(c).sum())
        pos += int(torch.isposinf(c).sum())
        neg += int(torch.isneginf(c).sum())
        mag = torch.where(fin, c, torch.zeros((), dtype=c.dtype)).abs().float()
        above += int((mag > limit).sum())
        top = max(top, float(mag.max()))
    return [
        float(nan * times),
        float(pos * times),
        float(neg * times),
        float(above * times),
        top,
        float(numel),
    ]


# ---------------------------------------------------------------------------- progress
class ReadProgress:
    """What the state health reports while it reads (the command layer shows it; nothing is
    displayed here). Every method does nothing by default."""

    def start(self, total_bytes: int, tensors: int) -> None:
        """Before the first tensor: the bytes and tensors to read."""

    def advance(self, name: str, nbytes: int) -> None:
        """After one tensor has been read and checked."""

    def finish(self) -> None:
        """After the last tensor (also when reading failed)."""


_PROGRESS: contextvars.ContextVar[ReadProgress | None] = contextvars.ContextVar(
    "ampctl_read_progress", default=None
)


def read_progress(progress: ReadProgress | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, :func:`state_health` reports its reads to ``progress``."""
    return context_value(_PROGRESS, progress)


#: ``(name, source, param, key, limit)``: one tensor to check, its source read when checked
Entry = tuple[str, TensorSource, str | None, str | None, float]


def _section(
    entries: list[Entry], *, limit: float | None, amax: bool = True, progress: ReadProgress
) -> TensorSection:
    """Health of the entries, read one at a time (each tensor dropped once its figures are
    taken: memory is about the largest one). **Reads device values on the host.**"""
    bad = []
    top = 0.0
    elements = 0
    for name, src, param, key, lim in entries:
        t = src.load()
        nan, pos, neg, above, mx, numel = tensor_figures(t, lim)
        del t
        progress.advance(name, src.nbytes)
        top = max(top, mx)
        elements += int(numel)
        if nan or pos or neg or above:
            bad.append(
                BadTensor(name, param, key, int(nan), int(pos), int(neg), int(above), mx, lim)
            )
    return TensorSection(
        tensors=len(entries), elements=elements, amax=top if amax else None, bad=bad, limit=limit
    )


def _dedup(tensors: Mapping[str, Any]) -> list[TensorSource]:
    """Floating tensors, tied ones once (under the first name); nothing is read."""
    seen: set[Any] = set()
    out = []
    for s in tensor_sources(tensors):
        if s.nbytes and s.identity in seen:
            continue
        seen.add(s.identity)
        out.append(s)
    return out


def _source(name: str, t: torch.Tensor | TensorSource) -> TensorSource:
    """A tensor of the state as a source (one not read yet, e.g. DCP's, as it is)."""
    if isinstance(t, TensorSource):
        return t
    return TensorSource(name, tuple(t.shape), t.dtype, view_bytes(t), id(t), lambda: t)


# ---------------------------------------------------------------------------- names
def _state_shape(st: Any) -> tuple[int, ...] | None:
    if not isinstance(st, dict):
        return None
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "square_avg", "sum"):
        t = st.get(key)
        if isinstance(t, torch.Tensor | TensorSource) and len(t.shape) > 0:
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
def _record_rows(sc: dict[str, Any]) -> list[tuple[int, float, int, float]]:
    """ampctl's per-update record as ``(update, scale used, kind, loss)``: ``history`` rows
    ``(update, scale, kind)`` (kind 0 clean, 1 gradient overflow, 2 forward overflow, 3 spike),
    with each step's loss from ``records`` when the checkpoint has them (NaN otherwise)."""
    hist = sc.get("history")
    if not isinstance(hist, torch.Tensor) or hist.numel() == 0 or hist.shape[-1] != 3:
        return []
    rows = hist.double().reshape(-1, 3).tolist()
    recs = sc.get("records")
    losses = [math.nan] * len(rows)
    if isinstance(recs, torch.Tensor) and recs.dim() == 2 and recs.shape == (len(rows), 6):
        losses = recs[:, rec.LOSS].double().tolist()
    return [
        (int(u), float(v), int(k), float(lo)) for (u, v, k), lo in zip(rows, losses, strict=True)
    ]


def _num(x: Any, default: Any = None) -> Any:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    return x if isinstance(x, int | float) and not isinstance(x, bool) else default


def _int(x: Any) -> int | None:
    v = _num(x)
    return int(v) if v is not None and math.isfinite(v) else None


def is_bare_scaler(sc: Any) -> bool:
    """GradScaler's keys only (a ``torch.amp.GradScaler`` state, or ampctl's read as one)."""
    return not any(k in sc for k in ("skipped_total", "history", "min_scale"))


def scaler_state(sc: Any, kind: str | None) -> ScalerState | None:
    """The loss scaler's state in one shape for every format (None: not recorded). ampctl's
    ``LossScaler`` state is GradScaler's keys plus its own counters and record; a state with
    GradScaler's keys only is read as a GradScaler (skips unknown)."""
    if not isinstance(sc, dict):
        return None
    if kind == "deepspeed":
        return _deepspeed_scaler(sc)
    if "scale" not in sc:
        return None
    scale = float(_num(sc.get("scale"), math.nan))
    common = {
        "growth_factor": _num(sc.get("growth_factor")),
        "backoff_factor": _num(sc.get("backoff_factor")),
        "growth_tracker": _int(sc.get("_growth_tracker")),
    }
    if is_bare_scaler(sc):
        return ScalerState(
            kind="GradScaler",
            enabled=True,
            scale=scale,
            growth_interval=_int(sc.get("growth_interval")),
            **common,
        )
    rows = _record_rows(sc)
    recent = rows[-RECENT_WINDOW:]
    enabled = bool(sc.get("enabled", True))
    min_scale = float(sc.get("min_scale", 1.0))
    return ScalerState(
        kind="ampctl",
        enabled=enabled,
        scale=scale,
        min_scale=min_scale,
        max_scale=float(sc.get("max_scale", 2.0**24)),
        at_floor=enabled and scale <= min_scale,
        growth_interval=int(sc.get("growth_interval", 2000)),
        hysteresis=int(sc.get("hysteresis", 1)),
        skipped_total=int(sc.get("skipped_total", 0)),
        forward_overflows=int(sc.get("forward_overflows", 0)),
        consecutive_overflows=int(sc.get("consecutive_overflows", 0)),
        updates=int(sc.get("num_updates", len(rows))),
        recent_window=len(recent),
        recent_skips=sum(1 for r in recent if r[2] != rec.CLEAN),
        spikes=_int(sc.get("spikes")),
        rows=rows,
        **common,
    )


def _deepspeed_scaler(sc: dict[str, Any]) -> ScalerState:
    scale = _num(sc.get("cur_scale"))
    dynamic = bool(sc.get("dynamic", False))
    min_scale = _num(sc.get("min_scale"))
    return ScalerState(
        kind="deepspeed",
        enabled=scale is not None,
        scale=float(scale) if scale is not None else None,
        min_scale=min_scale,
        at_floor=(scale <= min_scale) if dynamic and scale is not None and min_scale else None,
        growth_interval=_num(sc.get("scale_window")) if dynamic else None,
        growth_factor=_num(sc.get("scale_factor")) if dynamic else None,
        hysteresis=_num(sc.get("delayed_shift")),
        skipped_total=_num(sc.get("skipped_steps")),
        updates=_num(sc.get("cur_iter")),
    )


def applied_updates(opt_sd: Any) -> int | None:
    """The optimizer updates a state dict has applied: the largest per-parameter ``step`` of
    its state (Adam and friends count them; a skipped step does not). None when not kept."""
    state = opt_sd.get("state") if isinstance(opt_sd, dict) else None
    steps = [_num(st.get("step")) for st in (state or {}).values() if isinstance(st, dict)]
    steps = [s for s in steps if s is not None and math.isfinite(s)]
    return int(max(steps)) if steps else None


# ---------------------------------------------------------------------------- state health
def _weight_limit(precision: str | None) -> float:
    compute = COMPUTE_DTYPES.get(precision or "fp32", torch.float16)
    return FP16_MAX if compute == torch.float16 else dtype_max(compute)


def _optimizer_entries(found: Found) -> tuple[list[Entry] | None, dict[Any, str], OptimizerNames]:
    opt_sd = found.optimizer
    names = OptimizerNames(method=None, note=found.optimizer_note)
    if not (isinstance(opt_sd, dict) and isinstance(opt_sd.get("state"), dict)):
        return None, {}, names
    pname, method, note = name_optimizer_state(opt_sd, found.param_orders, found.unordered_params)
    names = OptimizerNames(method=method, note=note or found.optimizer_note)
    entries: list[Entry] = []
    for pid, st in opt_sd["state"].items():
        if not isinstance(st, dict):
            continue
        for key, t in st.items():
            if key == "step" or not isinstance(t, torch.Tensor | TensorSource):
                continue
            if not t.dtype.is_floating_point or len(t.shape) == 0:
                continue
            limit = FP16_MAX**2 if key in _SQUARED_KEYS else FP16_MAX
            p = pname.get(pid, f"param[{pid}]")
            entries.append((f"{p}.{key}", _source(f"{p}.{key}", t), p, key, limit))
    return entries, pname, names


def _master_entries(found: Found, pname: dict[Any, str], wlimit: float) -> list[Entry] | None:
    if not found.masters:
        return None
    mnames = found.master_names
    if mnames is None:
        ordered = [
            pname[pid]
            for g in (found.optimizer or {}).get("param_groups", [])
            for pid in g.get("params", [])
            if pid in pname
        ]
        mnames = ordered if len(ordered) == len(found.masters) else None
    entries: list[Entry] = []
    for i, t in enumerate(found.masters):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            name = mnames[i] if mnames else f"master[{i}]"
            entries.append((name, _source(name, t), mnames[i] if mnames else None, None, wlimit))
    return entries


def state_health(found: Found) -> StateHealth:
    """Part 1 of the report for what a reader found (its problems in ``.problems``). Weights,
    master weights and optimizer state are read one tensor at a time (memory: about the largest
    tensor, whatever the checkpoint's size), reported to the :class:`ReadProgress` of
    :func:`read_progress` when one is set. **Reads device values on the host** (a few per
    tensor: an offline check)."""
    wlimit = _weight_limit(found.precision)
    w_entries: list[Entry] = [(s.name, s, s.name, None, wlimit) for s in _dedup(found.weights)]
    o_entries, pname, names = _optimizer_entries(found)
    m_entries = _master_entries(found, pname, wlimit)
    every = w_entries + (o_entries or []) + (m_entries or [])
    progress = _PROGRESS.get() or ReadProgress()
    progress.start(sum(e[1].nbytes for e in every), len(every))
    try:
        weights = _section(w_entries, limit=wlimit, progress=progress)
        optimizer = (
            None
            if o_entries is None
            else _section(o_entries, limit=None, amax=False, progress=progress)
        )
        master = None if m_entries is None else _section(m_entries, limit=wlimit, progress=progress)
    finally:
        progress.finish()
    scaler = scaler_state(found.scaler, found.scaler_kind)
    problems = _tensor_problems(weights, master, optimizer, wlimit, found.precision)
    problems += _scaler_problems(scaler)
    return StateHealth(
        weights=weights,
        master=master,
        optimizer=optimizer,
        names=names,
        scaler=scaler,
        problems=problems,
    )


def _listed(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


def _tensor_problems(
    weights: TensorSection,
    master: TensorSection | None,
    optimizer: TensorSection | None,
    wlimit: float,
    precision: str | None,
) -> list[Problem]:
    problems: list[Problem] = []
    for label, sec, kind in (("weight", weights, "weights"), ("master weight", master, "master")):
        if sec is None:
            continue
        nonfinite = [b.name for b in sec.bad if b.nonfinite]
        extreme = [b.name for b in sec.bad if not b.nonfinite]
        if nonfinite:
            problems.append(
                Problem(
                    f"nonfinite_{kind}",
                    f"{len(nonfinite)} {label} tensor(s) hold inf/NaN, first {_listed(nonfinite)}",
                    tensors=nonfinite,
                )
            )
        if extreme:
            problems.append(
                Problem(
                    f"extreme_{kind}",
                    f"{len(extreme)} {label} tensor(s) exceed {wlimit:g} ({precision}: they "
                    f"overflow when cast), first {_listed(extreme)}",
                    tensors=extreme,
                )
            )
    if optimizer is not None:
        for group, kind, what in (
            (
                [b for b in optimizer.bad if b.nonfinite],
                "nonfinite_optimizer_state",
                "holds inf/NaN",
            ),
            (
                [b for b in optimizer.bad if not b.nonfinite],
                "extreme_optimizer_state",
                "is out of fp16's gradient range (moment > 65504, second moment > 65504^2)",
            ),
        ):
            if group:
                problems.append(
                    Problem(
                        kind,
                        f"optimizer state {what}: "
                        + _listed([f"{b.key} of {b.param}" for b in group]),
                        tensors=[b.name for b in group],
                        params=list(dict.fromkeys(b.param for b in group if b.param)),
                    )
                )
    return problems


def _scaler_problems(scaler: ScalerState | None) -> list[Problem]:
    """A scale that is not a number (``bad_scale``), a GradScaler scale at 0 or below 1
    (``scale_collapsed``: it halved on step after step), ampctl's at its floor and still
    skipping (``scale_at_floor``). The verdict names their cause from the history."""
    if scaler is None or not scaler.enabled:
        return []
    scale = scaler.scale
    if not (finite(scale) and scale >= 0):
        return [Problem("bad_scale", f"the loss scale is {scale}: a resumed run would scale by it")]
    problems = []
    if scaler.kind != "ampctl" and scale < 1.0:
        problems.append(
            Problem(
                "scale_collapsed",
                f"the {scaler.kind} scale fell to {scale:.3g}"
                + (" (below 1)" if scale > 0 else ""),
            )
        )
    if scaler.at_floor and ((scaler.consecutive_overflows or 0) > 0 or (scaler.recent_skips or 0)):
        problems.append(
            Problem(
                "scale_at_floor",
                f"loss scale at its floor ({scaler.min_scale:g}) and still overflowing: "
                f"{scaler.recent_skips} of the last {scaler.recent_window} steps skipped",
            )
        )
    return problems
