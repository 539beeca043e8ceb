"""Pictures of a run or a sweep: ``ampctl plot RUN_OR_SWEEP``.

A run: one PNG with aligned panels over the step axis -- loss (a baseline run's loss overlaid),
loss scale on a log2 axis with the skipped steps marked, the windowed overflow rate with a tick
per overflow event, gradient norm and underflow fraction (two y-axes) -- and a vertical marker
for every guard decision (rollback, promotion, fallback, abort, interrupt) across all panels.

A sweep (a folder with ``results.json`` from ``ampctl sweep-scale``): a heat map of a ranking
metric over init_scale x growth_interval (failed trials marked), and every trial's scale and loss
trajectory overlaid.

Everything is read from the folder alone (``metrics.jsonl``, ``events.jsonl``, ``summary.json``,
and the latest checkpoint's scaler history when there is one), so plots work on runs copied from
another machine. Skipped steps come from that history (exact steps) when the checkpoint is there
and agrees with the events; otherwise from differences of the cumulative ``skipped`` counter in
the metrics (one marker per log interval that had skips).

Nothing here touches a device: checkpoints are memory-mapped on the CPU. matplotlib is imported
lazily and only its Agg canvas is used (no pyplot, no display); without matplotlib the
functions raise :class:`PlotUnavailable` with an install hint, and :func:`maybe_plot_run` (what
``ampctl train`` calls at the end) returns that hint instead of raising.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampctl.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "HINT",
    "PlotUnavailable",
    "RunData",
    "SkipMark",
    "load_run_data",
    "build_run_figure",
    "build_sweep_figure",
    "plot_run",
    "plot_sweep",
    "maybe_plot_run",
    "run_plot",
    "SWEEP_METRICS",
]

HINT = 'plotting needs matplotlib: pip install "ampctl[plot]" (or pip install matplotlib)'

# guard decisions drawn as vertical lines on every panel: kind -> (colour, line style)
EVENT_STYLE: dict[str, tuple[str, str]] = {
    "rollback": ("tab:orange", "-"),
    "promotion": ("tab:purple", "--"),
    "fallback": ("tab:red", "-."),
    "abort": ("black", "-"),
    "interrupt": ("tab:gray", ":"),
}
RESTORING = ("rollback", "fallback")  # events that restore a snapshot (the step goes back)
SWEEP_METRICS = ("loss_gap", "final_loss", "skipped", "overflow_rate", "wall_time_s")
_OK = ("ok",)


class PlotUnavailable(UsageError):
    """matplotlib is not installed; the message is the one-line install hint."""


def _mpl():
    """Import matplotlib's object-oriented pieces (Figure + Agg canvas), never pyplot."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable(HINT) from None
    return Figure, FigureCanvasAgg


# ---------------------------------------------------------------------------------- reading
def _num(v: Any) -> float:
    """A metrics value as a float; None, strings that are not numbers, bools -> NaN."""
    if v is None or isinstance(v, bool):
        return math.nan
    if isinstance(v, int | float):
        return float(v)
    try:
        return float(v)  # "nan", "inf" written by a custom encoder
    except (TypeError, ValueError):
        return math.nan


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A truncated last line (a run killed mid-write) is dropped; a bad
    line elsewhere is a UsageError naming the file and line."""
    lines = Path(path).read_text().splitlines()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise UsageError(
                f"{path}:{i + 1}: not a JSON object; plot reads the files a run writes"
            ) from None
        if not isinstance(obj, dict):
            raise UsageError(
                f"{path}:{i + 1}: not a JSON object; plot reads the files a run writes"
            )
        rows.append(obj)
    return rows


def _kept(steps: list[float]) -> list[bool]:
    """Which points of a step sequence (in file order) survived: a point is abandoned when a
    later point has the same or an earlier step (a rollback or fallback went back over it)."""
    out = [True] * len(steps)
    low = math.inf
    for i in range(len(steps) - 1, -1, -1):
        out[i] = steps[i] < low
        low = min(low, steps[i])
    return out


@dataclass
class SkipMark:
    """Skipped steps at ``step``: ``count`` of them; ``exact`` when the step is known (scaler
    history), else the logged step that closed an interval with skips (metrics counter)."""

    step: int
    scale: float
    count: int
    exact: bool


@dataclass
class RunData:
    """What a run folder says, ready to draw (no matplotlib needed)."""

    run_dir: Path
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]]
    summary: dict[str, Any] | None
    scale_steps: list[int] = field(default_factory=list)  # per-step scale line (history) ...
    scale_values: list[float] = field(default_factory=list)
    skips: list[SkipMark] = field(default_factory=list)
    skip_source: str = "metrics"  # "history" | "history+metrics" | "metrics"
    restores: list[tuple[int, int, str]] = field(default_factory=list)  # (from step, to step, kind)

    @property
    def name(self) -> str:
        return self.run_dir.name

    def series(self, key: str) -> tuple[list[float], list[float], list[bool]]:
        """(steps, values, kept) of one metrics key, in file order; missing values are NaN."""
        xs = [_num(r.get("step")) for r in self.rows]
        return xs, [_num(r.get(key)) for r in self.rows], _kept(xs)


def _check_run_dir(run_dir: Path, what: str = "run folder") -> Path:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise UsageError(
            f"{str(run_dir)!r} does not exist: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not run_dir.is_dir():
        raise UsageError(
            f"{str(run_dir)!r} is a file: give a {what} (runs/<name>/ with metrics.jsonl)"
        )
    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageError(
            f"{str(run_dir)!r} has no metrics.jsonl: give a {what} written by ampctl train, "
            "or a sweep folder with results.json"
        )
    return run_dir


def _restore_points(events: list[dict[str, Any]]) -> list[tuple[int, int, str]] | None:
    """(from step, to step, kind) of each rollback/fallback, in order. The event's own step is
    the restored one; the step it was decided at is that of the overflow event just before it.
    None when a restore has no overflow event before it (fused optimizer path)."""
    out = []
    last_overflow: int | None = None
    for ev in events:
        kind = ev.get("kind")
        if kind == "overflow":
            last_overflow = int(ev["step"])
        elif kind in RESTORING:
            to = int(ev.get("to_step", ev.get("step", 0)))
            if last_overflow is None or last_overflow <= to:
                return None
            out.append((last_overflow, to, kind))
            last_overflow = None
    return out


def _latest_scaler_state(run_dir: Path) -> dict[str, Any] | None:
    """The scaler state (and step, wall time) of the run's latest checkpoint, or None when the
    folder has none or it cannot be read. The checkpoint is memory-mapped with
    ``weights_only=True``: only the small scaler tensors are actually read."""
    import torch

    from ampctl.train.checkpoint import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return None
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        hist = torch.as_tensor(ck["scaler"]["history"], dtype=torch.float64).reshape(-1, 3).tolist()
        return {
            "step": int(ck["step"]),
            "skipped_total": int(ck["scaler"].get("skipped_total", sum(r[2] for r in hist))),
            "wall_s": float((ck.get("trainer") or {}).get("wall_s", math.inf)),
            "history": hist,
        }
    except Exception:  # noqa: BLE001 - a broken checkpoint only costs the exact skip steps
        return None


def _map_updates(n_updates: int, restores: list[tuple[int, int, str]]) -> list[int]:
    """Trainer step of each scaler update 1..n: one step per update, back to the restored step
    after each rollback/fallback (the scaler keeps counting through them)."""
    steps, t, j = [], 0, 0
    for _ in range(n_updates):
        t += 1
        steps.append(t)
        if j < len(restores) and restores[j][0] == t:
            t = restores[j][1]
            j += 1
    return steps


def _metric_skips(rows: list[dict[str, Any]], below: float, above: float) -> list[SkipMark]:
    """Skip markers from the cumulative counter: for each logged row, the skips since the row
    before that fall at or below ``below`` or beyond ``above`` (counts, not steps)."""
    marks, prev = [], 0.0
    for r in rows:
        s = _num(r.get("skipped"))
        if math.isnan(s):
            continue
        n = max(0.0, min(s, below) - min(prev, below)) + max(0.0, s - max(prev, above))
        if n > 0:
            marks.append(
                SkipMark(
                    step=int(_num(r.get("step"))),
                    scale=_num(r.get("scale")),
                    count=int(n),
                    exact=False,
                )
            )
        prev = max(prev, s)
    return marks


def load_run_data(run_dir: str | Path) -> RunData:
    """Read a run folder: metrics, events, summary, and the exact skipped steps and per-step
    scale from the latest checkpoint's scaler history when it is there and consistent with the
    events; otherwise skips per log interval from the metrics. Raises UsageError for a missing
    folder, no metrics.jsonl, or no rows. Reads the checkpoint on the CPU (no device)."""
    run_dir = _check_run_dir(Path(run_dir))
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if math.isfinite(_num(r.get("step")))]
    if not rows:
        raise UsageError(
            f"{str(run_dir / 'metrics.jsonl')!r} is empty: nothing to plot yet (a row is written every trainer.log_every steps)"
        )
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").is_file() else []
    events = [e for e in events if math.isfinite(_num(e.get("step")))]
    summary = None
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = None
    data = RunData(run_dir=run_dir, rows=rows, events=events, summary=summary)
    restores = _restore_points(events)
    data.restores = restores or []
    if restores is None:  # place restores at their recorded step
        data.restores = [
            (int(e["step"]), int(e.get("to_step", e["step"])), e["kind"])
            for e in events
            if e.get("kind") in RESTORING
        ]

    st = _latest_scaler_state(run_dir)
    hist_ok = False
    if st is not None and st["history"] and restores is not None:
        n = int(st["history"][-1][0])  # update number of the last record (1-based)
        tsteps = _map_updates(n, restores)
        hist_ok = tsteps[-1] == st["step"] and all(int(r[0]) >= 1 for r in st["history"])
    if not hist_ok:
        data.skips = _metric_skips(rows, below=math.inf, above=math.inf)
        xs, ys, _ = data.series("scale")
        data.scale_steps, data.scale_values = xs, ys
        data.skip_source = "metrics"
        return data

    hist = st["history"]
    first_t = tsteps[int(hist[0][0]) - 1]
    covered = sum(1 for r in hist if r[2] > 0)
    before = st["skipped_total"] - covered  # skips older than the history ring buffer
    after = st["skipped_total"]  # skips beyond the checkpoint
    xs, ys = [], []
    for r in rows:  # the part the ring buffer forgot
        if _num(r.get("step")) < first_t and _num(r.get("elapsed_s")) <= st["wall_s"]:
            xs.append(_num(r["step"]))
            ys.append(_num(r.get("scale")))
    for u, scale, sk in hist:
        t = tsteps[int(u) - 1]
        xs.append(t)
        ys.append(scale)
        if sk > 0:
            data.skips.append(SkipMark(step=t, scale=scale, count=1, exact=True))
    for r in rows:  # rows logged after the checkpoint
        if _num(r.get("elapsed_s")) > st["wall_s"]:
            xs.append(_num(r["step"]))
            ys.append(_num(r.get("scale")))
    extra = _metric_skips(rows, below=before, above=after)
    data.skips += extra
    data.scale_steps, data.scale_values = xs, ys
    data.skip_source = "history+metrics" if extra else "history"
    return data


# ---------------------------------------------------------------------------------- drawing
def _split_kept(xs, ys, kept):
    """(kept xs, kept ys) and a list of abandoned segments (each joined to the point before)."""
    kx = [x for x, k in zip(xs, kept, strict=True) if k]
    ky = [y for y, k in zip(ys, kept, strict=True) if k]
    segs, cur = [], None
    for i, k in enumerate(kept):
        if not k:
            if cur is None:
                cur = ([xs[i - 1]], [ys[i - 1]]) if i > 0 else ([], [])
            cur[0].append(xs[i])
            cur[1].append(ys[i])
        elif cur is not None:
            segs.append(cur)
            cur = None
    if cur is not None:
        segs.append(cur)
    return kx, ky, segs


def _draw_series(ax, xs, ys, kept, *, label, color, step=False, marker=None):
    kx, ky, segs = _split_kept(xs, ys, kept)
    ds = "steps-post" if step else "default"
    mk = marker if marker is not None else ("o" if len(kx) <= 40 else None)
    (line,) = ax.plot(
        kx, ky, color=color, label=label, drawstyle=ds, marker=mk, markersize=3, linewidth=1.4
    )
    for sx, sy in segs:
        ax.plot(
            sx,
            sy,
            color=color,
            alpha=0.45,
            linestyle=":",
            drawstyle=ds,
            linewidth=1.2,
            label="rolled-back steps (discarded)",
            gid="abandoned",
        )
    return line


def _fmt_scale(v: float) -> str:
    if v > 0 and math.isfinite(v) and float(v).is_integer() and math.log2(v).is_integer():
        return f"2^{int(math.log2(v))}"
    return f"{v:g}"


def _title(data: RunData) -> str:
    s = data.summary or {}
    last = data.rows[-1]
    steps = s.get("steps", last.get("step"))
    mx = s.get("max_steps", last.get("max_steps"))
    skipped = s.get("skipped", last.get("skipped"))
    prec = s.get("precision", last.get("precision", "?"))
    scale = s.get("final_scale", last.get("scale"))
    parts = [data.name, str(prec)]
    if s.get("status"):
        parts.append(str(s["status"]))
    parts.append(f"step {steps}/{mx}" if mx else f"step {steps}")
    parts.append(f"{skipped} skipped")
    if scale is not None:
        parts.append(f"final scale {_fmt_scale(_num(scale))}")
    promoted = s.get("promoted_modules")
    if promoted:
        parts.append("promoted to fp32: " + ", ".join(promoted))
    return " | ".join(parts)


def _event_lines(axes, data: RunData) -> None:
    """Vertical markers for guard decisions on every panel; the replayed range of each
    rollback/fallback lightly shaded."""
    restore_iter = iter(data.restores)
    for ev in data.events:
        kind = ev.get("kind")
        if kind not in EVENT_STYLE:
            continue
        color, ls = EVENT_STYLE[kind]
        x = _num(ev.get("step"))
        span = None
        if kind in RESTORING:
            frm, to, _ = next(restore_iter, (x, x, kind))
            x, span = frm, (to, frm)
        for i, ax in enumerate(axes):
            ax.axvline(
                x,
                color=color,
                linestyle=ls,
                linewidth=1.1,
                alpha=0.85,
                label=kind if i == 0 else None,
                gid=f"event:{kind}",
            )
            if span is not None and span[0] < span[1]:
                ax.axvspan(span[0], span[1], color=color, alpha=0.07, linewidth=0)


def build_run_figure(run_dir: str | Path, baseline: str | Path | None = None) -> Figure:
    """The run's figure (matplotlib Figure on an Agg canvas). Panels, top to bottom, sharing
    the step axis: loss, loss scale (log2, skipped steps marked), overflow rate (overflow events
    as ticks), grad norm with the underflow fraction on a second y-axis. Raises UsageError for
    bad folders and PlotUnavailable without matplotlib. No device reads."""
    Figure, FigureCanvasAgg = _mpl()
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    data = load_run_data(run_dir)
    base = load_run_data(baseline) if baseline is not None else None

    fig = Figure(figsize=(10, 9.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale, ax_rate, ax_gn = fig.subplots(
        4, 1, sharex=True, height_ratios=[3, 3, 2, 2.4]
    )

    # 1) loss, with the baseline overlaid
    xs, ys, kept = data.series("loss")
    _draw_series(ax_loss, xs, ys, kept, label=f"loss ({data.name})", color="tab:blue")
    if base is not None:
        bx, by, bk = base.series("loss")
        bkx, bky, _ = _split_kept(bx, by, bk)
        ax_loss.plot(
            bkx,
            bky,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"baseline loss ({base.name})",
            gid="baseline",
        )
    ax_loss.set_ylabel("loss")

    # 2) loss scale (log2) and the skipped steps
    _draw_series(
        ax_scale,
        data.scale_steps,
        data.scale_values,
        _kept(data.scale_steps),
        label="loss scale",
        color="tab:green",
        step=True,
        marker="",
    )
    exact = [m for m in data.skips if m.exact]
    approx = [m for m in data.skips if not m.exact]
    if exact:
        ax_scale.plot(
            [m.step for m in exact],
            [m.scale for m in exact],
            linestyle="none",
            marker="v",
            color="tab:red",
            markersize=6,
            label="skipped step",
            gid="skips",
        )
    if approx:
        ax_scale.plot(
            [m.step for m in approx],
            [m.scale for m in approx],
            linestyle="none",
            marker="v",
            markerfacecolor="none",
            color="tab:red",
            markersize=7,
            label="skips in log interval (count)",
            gid="skips-interval",
        )
        for m in approx:
            if m.count > 1:
                ax_scale.annotate(
                    str(m.count),
                    (m.step, m.scale),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color="tab:red",
                )
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (log2)")

    # 3) overflow rate over the window, overflow events as ticks along the bottom
    xs, ys, kept = data.series("overflow_rate")
    _draw_series(ax_rate, xs, ys, kept, label="overflow rate (window)", color="tab:red")
    ax_rate.set_ylim(-0.02, max(0.1, max((y for y in ys if math.isfinite(y)), default=0.0) * 1.15))
    trans = ax_rate.get_xaxis_transform()
    for kind, color in (("gradient", "tab:red"), ("forward", "tab:purple")):
        steps = [
            _num(e.get("step"))
            for e in data.events
            if e.get("kind") == "overflow" and e.get("overflow", "gradient") == kind
        ]
        if steps:
            ax_rate.plot(
                steps,
                [0.0] * len(steps),
                transform=trans,
                linestyle="none",
                marker="|",
                markersize=10,
                color=color,
                label=f"overflow event ({kind})",
                gid=f"overflow:{kind}",
                clip_on=False,
            )
    ax_rate.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax_rate.set_ylabel("overflow rate")

    # 4) gradient norm and underflow fraction (second y-axis)
    xs, ys, kept = data.series("grad_norm")
    _draw_series(ax_gn, xs, ys, kept, label="grad norm", color="teal")
    finite = [y for y in ys if math.isfinite(y) and y > 0]
    if finite and max(finite) / min(finite) > 100:
        ax_gn.set_yscale("log")
    ax_gn.set_ylabel("grad norm")
    ax_uf = ax_gn.twinx()
    xs, ys, kept = data.series("grad_underflow_frac")
    _draw_series(ax_uf, xs, ys, kept, label="grad underflow fraction", color="tab:brown")
    top = max((y for y in ys if math.isfinite(y)), default=0.0)
    ax_uf.set_ylim(0.0, top * 1.25 if top > 0 else 1e-3)  # a fraction: anchored at 0
    ax_uf.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax_uf.set_ylabel("grad underflow fraction")
    ax_gn.set_xlabel("step")
    ax_gn.xaxis.set_major_locator(MaxNLocator(integer=True))

    _event_lines([ax_loss, ax_scale, ax_rate, ax_gn], data)
    for ax in (ax_loss, ax_scale, ax_rate, ax_gn):
        ax.grid(True, alpha=0.25)

    handles, labels = [], []
    for ax in (ax_loss, ax_scale, ax_rate, ax_gn, ax_uf):
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(_title(data), fontsize=10)
    src = {
        "history": "exact steps (checkpoint scaler history)",
        "metrics": "per log interval (metrics.jsonl)",
    }
    note = "skipped steps: " + src.get(
        data.skip_source, "exact steps, plus per log interval where the history ends"
    )
    ax_scale.set_title(note, loc="right", fontsize=7, color="gray", pad=2)
    return fig


def _check_out(out: Path) -> str:
    """The image format of ``out`` (png, svg, pdf); UsageError for a bad name or folder."""
    if not out.parent.is_dir():
        raise UsageError(f"--out {str(out)!r}: folder {str(out.parent)!r} does not exist")
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg", "pdf"):
        raise UsageError(f"--out {str(out)!r}: unknown image type; use a .png, .svg or .pdf name")
    return fmt


def _save(fig, out: Path) -> Path:
    fmt = _check_out(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=100)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def plot_run(
    run_dir: str | Path, out: str | Path | None = None, baseline: str | Path | None = None
) -> Path:
    """Draw a run folder into ``out`` (default ``<run>/plot.png``); returns the path. Written
    atomically (a temp file renamed over the target)."""
    run_dir = Path(run_dir)
    if out is not None:
        _check_out(Path(out))  # before any drawing
    fig = build_run_figure(run_dir, baseline=baseline)
    return _save(fig, Path(out) if out is not None else run_dir / "plot.png")


# ---------------------------------------------------------------------------------- sweep
def _sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    path = sweep_dir / "results.json"
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{str(path)!r} is not valid JSON ({e.msg} at line {e.lineno}); it is written by ampctl sweep-scale"
        ) from None
    if isinstance(obj, dict):
        obj = next(
            (obj[k] for k in ("trials", "results", "rows") if isinstance(obj.get(k), list)), None
        )
    if not isinstance(obj, list) or not all(isinstance(r, dict) for r in obj):
        raise UsageError(
            f"{str(path)!r}: expected a list of trial objects (trial, init_scale, growth_interval, status, ...)"
        )
    return obj


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _pick_metric(rows: list[dict[str, Any]], metric: str | None) -> str:
    present = [m for m in SWEEP_METRICS if any(_is_num(r.get(m)) for r in rows)]
    if metric is None:
        for m in ("loss_gap", "final_loss"):
            if m in present:
                return m
        raise UsageError("results.json: no trial has a loss_gap or final_loss to rank by")
    if metric not in present:
        allowed = ", ".join(present) or "none"
        raise UsageError(f"metric={metric!r} is not in results.json; allowed here: {allowed}")
    return metric


def build_sweep_figure(sweep_dir: str | Path, metric: str | None = None) -> Figure:
    """The sweep's figure: a heat map of ``metric`` (default loss_gap, else final_loss; lower is
    better) over growth_interval (rows) x init_scale (columns), failed trials hatched and named,
    the best cell outlined; then every trial's scale (log2) and loss over steps. Raises
    UsageError for a folder without results.json or without a grid. No device reads."""
    Figure, FigureCanvasAgg = _mpl()
    import numpy as np
    from matplotlib.patches import Rectangle

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UsageError(
            f"{str(sweep_dir)!r} is not a folder: give a sweep folder (runs/<sweep>/ with results.json)"
        )
    if not (sweep_dir / "results.json").is_file():
        raise UsageError(
            f"{str(sweep_dir)!r} has no results.json: give a folder written by ampctl sweep-scale"
        )
    rows = _sweep_rows(sweep_dir)
    grid_rows = [
        r
        for r in rows
        if r.get("kind", "trial") != "baseline"
        and _is_num(r.get("init_scale"))
        and _is_num(r.get("growth_interval"))
    ]
    if not grid_rows:
        raise UsageError(
            f"{str(sweep_dir / 'results.json')!r} has no trials with numeric init_scale and growth_interval"
        )
    metric = _pick_metric(rows, metric)
    inits = sorted({float(r["init_scale"]) for r in grid_rows})
    grows = sorted({int(r["growth_interval"]) for r in grid_rows})
    z = np.full((len(grows), len(inits)), np.nan)
    status = [["" for _ in inits] for _ in grows]
    per_cell: dict[tuple[int, int], int] = {}
    ranked_first = None
    for r in grid_rows:
        i, j = grows.index(int(r["growth_interval"])), inits.index(float(r["init_scale"]))
        per_cell[i, j] = per_cell.get((i, j), 0) + 1
        if r.get("rank") == 1:
            ranked_first = (i, j)
        ok = str(r.get("status", "ok")) in _OK and _is_num(r.get(metric))
        if ok and (math.isnan(z[i, j]) or r[metric] < z[i, j]):  # repeated cells: keep the best
            z[i, j] = float(r[metric])
            status[i][j] = "ok"
        elif not ok and status[i][j] != "ok":
            status[i][j] = (
                str(r.get("status", "failed"))
                if str(r.get("status", "ok")) not in _OK
                else "no value"
            )

    fig = Figure(figsize=(11, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1])
    ax_hm = fig.add_subplot(gs[0, 0])
    ax_sc = fig.add_subplot(gs[0, 1])
    ax_ls = fig.add_subplot(gs[1, :])

    img = ax_hm.imshow(np.ma.masked_invalid(z), cmap="viridis_r", origin="lower", aspect="auto")
    img.set_gid("heatmap")
    fig.colorbar(img, ax=ax_hm, label=f"{metric} (lower is better)")
    ax_hm.set_xticks(range(len(inits)), [_fmt_scale(v) for v in inits])
    ax_hm.set_yticks(range(len(grows)), [str(g) for g in grows])
    ax_hm.set_xlabel("scaler.init_scale")
    ax_hm.set_ylabel("scaler.growth_interval")
    finite = z[np.isfinite(z)]
    # the sweep's own rank 1 (gap, then skips, then speed) when it ranked; else the lowest value
    best = ranked_first or (np.unravel_index(np.nanargmin(z), z.shape) if finite.size else None)
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for i in range(len(grows)):
        for j in range(len(inits)):
            if status[i][j] == "ok":
                ax_hm.text(
                    j,
                    i,
                    f"{z[i, j]:+.1%}" if metric == "loss_gap" else f"{z[i, j]:.4g}",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if z[i, j] > mid else "black",
                )
            elif status[i][j]:
                ax_hm.add_patch(
                    Rectangle(
                        (j - 0.5, i - 0.5),
                        1,
                        1,
                        facecolor="0.85",
                        edgecolor="tab:red",
                        hatch="xx",
                        linewidth=0,
                        gid="failed",
                    )
                )
                ax_hm.text(
                    j,
                    i,
                    status[i][j],
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="tab:red",
                    weight="bold",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.5},
                )
    if best is not None:
        ax_hm.add_patch(
            Rectangle(
                (best[1] - 0.5, best[0] - 0.5),
                1,
                1,
                fill=False,
                edgecolor="red",
                linewidth=2.5,
                gid="best",
            )
        )
    note = ", best of several trials per cell" if any(n > 1 for n in per_cell.values()) else ""
    ax_hm.set_title(f"{metric} by init_scale x growth_interval{note}", fontsize=10)

    colors = {
        v: c
        for v, c in zip(
            inits,
            [
                "tab:blue",
                "tab:orange",
                "tab:green",
                "tab:red",
                "tab:purple",
                "tab:brown",
                "tab:pink",
                "tab:olive",
                "tab:cyan",
                "tab:gray",
            ]
            * 10,
            strict=False,
        )
    }
    styles = {g: s for g, s in zip(grows, ["-", "--", ":", "-."] * 10, strict=False)}
    drawn = 0
    for r in rows:
        tdir = sweep_dir / str(r.get("trial", ""))
        if not r.get("trial") or not (tdir / "metrics.jsonl").is_file():
            continue  # a copied sweep without its trial folders still gets the heat map
        try:
            tdata = load_run_data(tdir)  # per-step scale and exact skips when it has a checkpoint
        except UsageError:
            continue  # a trial that crashed before its first log row
        xs, loss, kept = tdata.series("loss")
        kx, ky, _ = _split_kept(xs, loss, kept)
        mk = "o" if len(kx) <= 40 else None
        if r.get("kind", "trial") == "baseline" or not _is_num(r.get("init_scale")):
            ax_ls.plot(
                kx, ky, color="black", linestyle="--", linewidth=1.4, zorder=3,
                label=f"{r['trial']} (baseline)",
            )  # fmt: skip
            continue
        c, ls = colors[float(r["init_scale"])], styles[int(r["growth_interval"])]
        sx, sy, _ = _split_kept(tdata.scale_steps, tdata.scale_values, _kept(tdata.scale_steps))
        ax_sc.plot(
            sx, sy, color=c, linestyle=ls, drawstyle="steps-post", linewidth=1.3,
            label=str(r["trial"]), gid=f"trial:{r['trial']}",
        )  # fmt: skip
        skips = [m for m in tdata.skips if m.exact]
        if skips:
            ax_sc.plot(
                [m.step for m in skips], [m.scale for m in skips], linestyle="none", marker="v",
                markersize=4, color=c, alpha=0.8,
            )  # fmt: skip
        if str(r.get("status", "ok")) not in _OK and sx:
            ax_sc.plot(
                sx[-1:], sy[-1:], marker="x", color="tab:red", markersize=9, linestyle="none"
            )
        ax_ls.plot(
            kx,
            ky,
            color=c,
            linestyle=ls,
            marker=mk,
            markersize=3,
            linewidth=1.2,
            label=str(r["trial"]),
        )
        drawn += 1
    ax_sc.set_yscale("log", base=2)
    ax_sc.set_ylabel("loss scale (log2)")
    ax_sc.set_xlabel("step")
    title = (
        "scale trajectories (v: skipped steps)"
        if drawn
        else "scale trajectories (no trial folders)"
    )
    ax_sc.set_title(title, fontsize=10)
    ax_ls.set_ylabel("loss")
    ax_ls.set_xlabel("step")
    for ax in (ax_sc, ax_ls):
        ax.grid(True, alpha=0.25)
    if ax_ls.get_legend_handles_labels()[0]:
        ax_ls.legend(fontsize=7, ncol=max(1, min(4, len(rows) // 4 + 1)))
    n_base = sum(1 for r in rows if r.get("kind") == "baseline")
    counts = f"{len(rows) - n_base} trials" + (f" + {n_base} baseline" if n_base else "")
    fig.suptitle(f"sweep {sweep_dir.name}: {counts}", fontsize=11)
    return fig


def plot_sweep(
    sweep_dir: str | Path, out: str | Path | None = None, metric: str | None = None
) -> Path:
    """Draw a sweep folder into ``out`` (default ``<sweep>/plot.png``); returns the path."""
    sweep_dir = Path(sweep_dir)
    if out is not None:
        _check_out(Path(out))
    fig = build_sweep_figure(sweep_dir, metric=metric)
    return _save(fig, Path(out) if out is not None else sweep_dir / "plot.png")


# ---------------------------------------------------------------------------------- entry points
def maybe_plot_run(run_dir: str | Path) -> Path | str:
    """What ``ampctl train`` calls at the end (and after Ctrl-C) when ``logging.plot`` is true:
    writes ``<run>/plot.png`` and returns its path, or returns a one-line message instead of
    raising when matplotlib is missing, there is nothing to draw yet (no metrics rows), or the
    PNG cannot be written (OSError: disk full, read-only folder): a finished run never fails
    because of its picture. No device reads."""
    try:
        return plot_run(run_dir)
    except PlotUnavailable as e:
        return str(e)
    except UsageError as e:
        return f"no plot: {e}"
    except OSError as e:
        return f"no plot: writing {Path(run_dir) / 'plot.png'} failed: {e.strerror or e}"


def run_plot(path: Path, out: Path | None = None, baseline: Path | None = None) -> int:
    """``ampctl plot PATH [--out FILE] [--baseline RUN]``: a sweep folder (has results.json) or
    a run folder. Prints the written path; returns 0. Bad input -> UsageError (exit 2)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(
            f"{str(path)!r} does not exist: give a run folder (with metrics.jsonl) or a sweep folder (with results.json)"
        )
    _mpl()  # the install hint before any reading
    if path.is_dir() and (path / "results.json").is_file():
        if baseline is not None:
            raise UsageError(
                f"--baseline applies to a run folder; {str(path)!r} is a sweep folder (it has results.json)"
            )
        written = plot_sweep(path, out)
    else:
        written = plot_run(path, out, baseline=baseline)
    print(f"wrote {written}")
    return 0
