"""The run's figure: aligned panels over the step axis."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampctl.errors import UsageError
from ampctl.runlog import RunLayout, describe_lineage

from . import run_data as _run_data
from .common import (
    EVENT_STYLE,
    RESTORING,
    PlotUnavailable,
    _check_out,
    _draw_series,
    _fmt_scale,
    _mpl,
    _num,
    _save,
    _split_kept,
)
from .run_data import RunData, branch_loss, load_run_data

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def _title(data: RunData) -> str:
    s = data.summary or {}
    last = data.last_row
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
        names = promoted if isinstance(promoted, list) else [promoted]
        parts.append("promoted to fp32: " + ", ".join(str(p) for p in names))
    lineage = describe_lineage(RunLayout(data.run_dir))
    return " | ".join(parts) + ("" if lineage == "main line" else f"\n{lineage}")


def _event_lines(axes, data: RunData) -> None:
    """Vertical markers for guard decisions on every panel; the replayed range of each
    rollback/fallback lightly shaded. Beyond EVENT_CAP decisions, one fainter line per pixel
    column and kind (its legend entry says how many it stands for)."""
    restore_iter = iter(data.restores)
    for ev in data.events:
        kind = ev.get("kind")
        if kind not in EVENT_STYLE:
            continue
        color, ls = EVENT_STYLE[kind]
        x = _num(ev.get("step"))
        span = None
        if kind in RESTORING:
            frm, to, _, _ = next(restore_iter, (x, x, kind, 0))
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
    for kind, marks in data.event_marks.items():
        color, ls = EVENT_STYLE[kind]
        label = f"{kind} ({marks.total} more, grouped per pixel column)"
        for i, ax in enumerate(axes):
            for j, (x, _y, _n) in enumerate(marks.marks()):
                ax.axvline(
                    x,
                    color=color,
                    linestyle=ls,
                    linewidth=0.8,
                    alpha=0.5,
                    label=label if i == 0 and j == 0 else None,
                    gid=f"events:{kind}",
                )


# Baseline lines, in --baseline order: the first black as before, then distinct colours.
_BASELINE_STYLES = (
    ("black", "--"),
    ("tab:red", ":"),
    ("tab:green", "-."),
    ("tab:purple", (0, (5, 1, 1, 1))),
    ("tab:gray", (0, (1, 2))),
)


def _loss_panel(ax_loss, data: RunData, bases: list[RunData], branches: bool) -> None:
    """1) loss, with the baselines and the branches a resume set aside overlaid."""
    xs, ys, kept = data.series("loss")
    _draw_series(ax_loss, xs, ys, kept, label=f"loss ({data.name})", color="tab:blue")
    for i, base in enumerate(bases):
        bx, by, bk = base.series("loss")
        bkx, bky, _ = _split_kept(bx, by, bk)
        color, style = _BASELINE_STYLES[i % len(_BASELINE_STYLES)]
        ax_loss.plot(
            bkx,
            bky,
            color=color,
            linestyle=style,
            linewidth=1.2,
            label=f"baseline loss ({base.name})",
            gid="baseline",
        )
    ax_loss.set_ylabel("loss")

    if branches:
        _branch_losses(ax_loss, data)


def _branch_losses(ax_loss, data: RunData) -> None:
    """The loss of each branch a resume set aside (``branches/``), dotted, from its fork."""
    for b in data.branches:
        xs, ys, _ = branch_loss(b).series("loss")
        fork = data.metrics.last_at_or_before("loss", b.forked_at_step)
        if fork is not None:
            xs, ys = [fork[0], *xs], [fork[1], *ys]
        ax_loss.plot(
            xs,
            ys,
            color="tab:gray",
            linestyle=(0, (1, 1.5)),
            linewidth=1.2,
            label=f"set-aside branch {b.name} (resumed from step {b.forked_at_step})",
            gid=f"branch:{b.name}",
        )


def _scale_panel(ax_scale, data: RunData) -> None:
    """2) loss scale (log2) and the skipped steps."""
    sx, sy, sk = data.scale_series()
    _draw_series(
        ax_scale,
        sx,
        sy,
        sk,
        label="loss scale",
        color="tab:green",
        step=True,
        marker="",
    )
    counted = sorted((m for m in data.skips if m.count > 1), key=lambda m: -m.count)
    for exact, label, gid in (
        (True, "skipped step", "skips"),
        (False, "skips in log interval (count)", "skips-interval"),  # hollow, larger
    ):
        marks = [m for m in data.skips if m.exact == exact]
        if marks:
            ax_scale.plot(
                [m.step for m in marks],
                [m.scale for m in marks],
                linestyle="none",
                marker="v",
                markerfacecolor=None if exact else "none",
                color="tab:red",
                markersize=6 if exact else 7,
                label=label,
                gid=gid,
            )
    for m in counted[:_MAX_COUNTS]:  # the largest counts, when there are many
        ax_scale.annotate(
            _fmt_count(m.count),
            (m.step, m.scale),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
            color="tab:red",
        )
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale (log2)")


def _ylim(ax, lo: float, hi: float) -> None:
    """Set y limits a run file's values chose, unless they are not finite (1e308 * 1.25)."""
    if math.isfinite(lo) and math.isfinite(hi) and lo < hi:
        ax.set_ylim(lo, hi)


_MAX_COUNTS = 100  # count labels drawn beside skip marks (the largest first)


def _fmt_count(n: int) -> str:
    return str(n) if n < 1_000_000 else f"{n:.3g}"


def _rate_panel(ax_rate, data: RunData) -> None:
    """3) overflow rate over the window, overflow events as ticks along the bottom."""
    xs, ys, kept = data.series("overflow_rate")
    _draw_series(ax_rate, xs, ys, kept, label="overflow rate (window)", color="tab:red")
    top = max((y for y in ys if math.isfinite(y)), default=0.0)
    ax_rate.set_ylim(-0.02, min(max(0.1, top * 1.15), 1.15))  # a share of steps: at most 100%
    trans = ax_rate.get_xaxis_transform()
    for kind, color in (("gradient", "tab:red"), ("forward", "tab:purple")):
        marks = data.overflow_marks.get(kind)
        steps = [x for x, _y, _n in marks.marks()] if marks is not None else []
        if steps:
            grouped = " per pixel column" if marks.is_grouped else ""
            ax_rate.plot(
                steps,
                [0.0] * len(steps),
                transform=trans,
                linestyle="none",
                marker="|",
                markersize=10,
                color=color,
                label=f"overflow event ({kind}){grouped}",
                gid=f"overflow:{kind}",
                clip_on=False,
            )
    from matplotlib.ticker import PercentFormatter

    ax_rate.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax_rate.set_ylabel("overflow rate")


PARAM_UF_LABEL = "param-grad underflow (share of elements 0 or < 2^-24 once scaled)"
ACT_UF_LABEL = "activation-grad underflow (share of fp16 elements 0 or subnormal)"


def _grad_panel(ax_gn, data: RunData) -> Any:
    """4) gradient norm and underflow fractions (second y-axis); returns the second axis."""
    xs, ys, kept = data.series("grad_norm")
    _draw_series(ax_gn, xs, ys, kept, label="grad norm", color="teal")
    finite = [y for y in ys if math.isfinite(y) and y > 0]
    if finite and max(finite) / min(finite) > 100:
        ax_gn.set_yscale("log")
    ax_gn.set_ylabel("grad norm")
    ax_uf = ax_gn.twinx()
    xs, ys, kept = data.series("grad_underflow_frac")
    _draw_series(ax_uf, xs, ys, kept, label=PARAM_UF_LABEL, color="tab:brown")
    drawn = [y for y in ys if math.isfinite(y)]
    xs, ys, kept = data.series("act_grad_underflow_frac")
    if any(math.isfinite(y) for y in ys):  # fp16 runs: the activation gradients' figure
        _draw_series(ax_uf, xs, ys, kept, label=ACT_UF_LABEL, color="tab:olive")
        drawn += [y for y in ys if math.isfinite(y)]
    _underflow_scale(ax_uf, drawn)
    return ax_uf


def _underflow_scale(ax_uf, values: list[float]) -> None:
    """A fraction axis: linear from 0, or -- when the figures drawn are orders of magnitude
    apart (0.05% of the parameter gradients next to 45% of the activation gradients) -- log,
    so the smaller one is not a flat line on the 0% axis (a 0 sits on the bottom edge)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    pos = [y for y in values if y > 0]
    top = max(values, default=0.0)
    if pos and max(pos) / min(pos) > 10:
        ax_uf.set_yscale("log")
        _ylim(ax_uf, min(pos) / 4, max(pos) * 2)
        ax_uf.yaxis.set_minor_formatter(NullFormatter())
        ax_uf.set_ylabel("underflow fraction (log)")
    else:
        _ylim(ax_uf, 0.0, top * 1.25 if top > 0 else 1e-3)  # a fraction: anchored at 0
        ax_uf.set_ylabel("underflow fraction")
    ax_uf.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y * 100:.3g}%"))


def _fitting_legend(fig: Figure, handles: list, labels: list[str], most: int = 4) -> None:
    """The figure's legend below the panels in the most columns (up to ``most``) whose width
    fits the figure, measured with the figure's renderer: long labels (the underflow figures
    say what they count; many baselines carry their runs' names) would otherwise run off both
    sides of it."""
    width = fig.bbox.width
    renderer = fig.canvas.get_renderer()
    for ncol in range(min(most, max(len(labels), 1)), 0, -1):
        legend = fig.legend(
            handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False
        )
        if ncol == 1 or legend.get_window_extent(renderer).width <= width:
            return
        legend.remove()


def _as_list(baseline: str | Path | Sequence[str | Path] | None) -> list[Path]:
    if baseline is None:
        return []
    if isinstance(baseline, (str, Path)):
        return [Path(baseline)]
    return [Path(b) for b in baseline]


def build_run_figure(
    run_dir: str | Path,
    baseline: str | Path | Sequence[str | Path] | None = None,
    *,
    branches: bool = True,
    foreign: Any = None,
) -> Figure:
    """The run's figure (matplotlib Figure on an Agg canvas). Panels, top to bottom, sharing
    the step axis: loss (the baselines' -- one run or several -- and the discarded branches'
    overlaid), loss scale (log2, skipped steps marked), overflow rate (overflow events as
    ticks), grad norm with the parameter- and activation-gradient underflow fractions on a
    second y-axis. ``foreign``: as :func:`~.run_data.load_run_data`'s. Raises UsageError for
    bad folders and PlotUnavailable without matplotlib. No device reads."""
    Figure, FigureCanvasAgg = _mpl()
    from matplotlib.ticker import MaxNLocator

    data = load_run_data(run_dir, foreign)
    bases = [load_run_data(b, foreign) for b in _as_list(baseline)]
    fig = Figure(figsize=(10, 9.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_scale, ax_rate, ax_gn = fig.subplots(
        4, 1, sharex=True, height_ratios=[3, 3, 2, 2.4]
    )
    _loss_panel(ax_loss, data, bases, branches)
    _scale_panel(ax_scale, data)
    _rate_panel(ax_rate, data)
    ax_uf = _grad_panel(ax_gn, data)
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
    _fitting_legend(fig, handles, labels)
    fig.suptitle(_title(data), fontsize=10)
    fig.ampctl_notes = list(data.notes)  # what could not be read or is drawn grouped
    src = {
        "history": "exact steps (checkpoint scaler history)",
        "metrics": "per log interval (metrics.jsonl)",
    }
    note = "skipped steps: " + src.get(
        data.skip_source, "exact steps, plus per log interval where the history ends"
    )
    if data.skips_grouped:
        note += "; grouped per pixel column (counts)"
    ax_scale.set_title(note, loc="right", fontsize=7, color="gray", pad=2)
    reduced = _reduced_note(data)
    if reduced:
        ax_loss.set_title(reduced, loc="right", fontsize=7, color="gray", pad=2)
    return fig


def _reduced_note(data: RunData) -> str | None:
    """The small line saying the figure shows less than every row, or None when it does not."""
    parts = []
    if data.decimated:
        parts.append(f"{data.rows_read:,} rows drawn as first/min/max/last per pixel column")
    if data.event_marks:
        parts.append(f"guard decisions beyond {_run_data.EVENT_CAP} grouped per pixel column")
    return "; ".join(parts) if parts else None


def plot_run(
    run_dir: str | Path,
    out: str | Path | None = None,
    baseline: str | Path | Sequence[str | Path] | None = None,
    notes: list[str] | None = None,
    foreign: Any = None,
) -> Path:
    """Draw a run folder into ``out`` (default ``<run>/plot.png``); returns the path. Written
    atomically (a temp file renamed over the target). ``notes``, when given, receives one line
    per thing that could not be read or is drawn grouped."""
    run_dir = Path(run_dir)
    if out is not None:
        _check_out(Path(out))  # before any drawing
    fig = build_run_figure(run_dir, baseline=baseline, foreign=foreign)
    if notes is not None:
        notes.extend(fig.ampctl_notes)
    return _save(fig, Path(out) if out is not None else run_dir / "plot.png")


def maybe_plot_run(run_dir: str | Path) -> Path | str:
    """What a run calls at its end (and after Ctrl-C) when ``logging.plot`` is true: writes
    ``<run>/plot.png`` and returns its path, or returns a one-line message instead of raising
    when matplotlib is missing, there is nothing to draw yet (no metrics rows), or the PNG cannot
    be written (OSError: disk full, read-only folder): a finished run never fails because of its
    picture. No device reads."""
    try:
        return plot_run(run_dir)
    except PlotUnavailable as e:
        return str(e)
    except UsageError as e:
        return f"no plot: {e}"
    except OSError as e:
        return f"no plot: writing {Path(run_dir) / 'plot.png'} failed: {e.strerror or e}"
