"""Shared pieces of the plots: matplotlib's import, number reading, drawing kept/discarded
series, saving atomically."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ampctl.errors import UsageError
from ampctl.files import write_file
from ampctl.runlog import as_number

HINT = 'plotting needs matplotlib: pip install "ampctl[plot]" (or pip install matplotlib)'

# guard decisions drawn as vertical lines on every panel: kind -> (colour, line style)
EVENT_STYLE: dict[str, tuple[str, str]] = {
    "rollback": ("tab:orange", "-"),
    "promotion": ("tab:purple", "--"),
    "fallback": ("tab:red", "-."),
    "abort": ("black", "-"),
    "interrupt": ("tab:gray", ":"),
    "branch": ("tab:blue", ":"),
    "divergence": ("tab:red", "-"),
    "spike": ("goldenrod", ":"),
    "rerun": ("tab:cyan", "--"),
    "data_skip": ("tab:brown", ":"),
    "promotion_undone": ("tab:purple", ":"),
}
RESTORING = ("rollback", "fallback")  # events that restore a snapshot (the step goes back)


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


def _num(v: Any) -> float:
    """A value from a run file as a float; missing or not a number -> NaN."""
    if type(v) is float:  # the common case first: this runs for every value of every row
        return v
    try:
        x = as_number(v)
    except OverflowError:  # an int past float's range (JSON allows 10**400)
        return math.nan
    return math.nan if x is None else x


DRAWABLE = 1e300  # past this a finite value breaks matplotlib's ranges (1.7e308 * margins)


def _dnum(v: Any) -> float:
    """A value from a run file as a float to draw: NaN when missing, not a number, infinite or
    beyond +-DRAWABLE (no axis can hold it; it is a gap, as a NaN is)."""
    x = _num(v)
    return x if -DRAWABLE <= x <= DRAWABLE else math.nan


def _kept(steps: list[float]) -> list[bool]:
    """Which points of a step sequence (in file order) survived: a point is abandoned when a
    later point has the same or an earlier step (a rollback or fallback went back over it)."""
    out = [True] * len(steps)
    low = math.inf
    for i in range(len(steps) - 1, -1, -1):
        out[i] = steps[i] < low
        low = min(low, steps[i])
    return out


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
    with write_file(out) as f:  # a fresh temp file, never through a planted link
        fig.savefig(f, format=fmt, dpi=100)
    return out
