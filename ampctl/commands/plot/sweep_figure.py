"""The sweep's figure: a heat map over init_scale x growth_interval and every trial's scale
and loss trajectories."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampctl.errors import UsageError
from ampctl.runlog.readers import JsonArrayStream
from ampctl.ui.plot.common import _check_out, _fmt_scale, _mpl, _save, _split_kept
from ampctl.ui.plot.run_data import load_run_data

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

SWEEP_METRICS = ("loss_gap", "final_loss", "skipped", "overflow_rate", "wall_time_s")
_OK = ("ok",)
MAX_CELLS = 1024  # heat-map cells (init_scale x growth_interval); a sweep grid is ~5 x 4
MAX_TRAJECTORIES = 100  # trial folders drawn in the trajectory panels
MAX_TRIALS = 100_000  # trials kept from results.json (ampctl writes ~0.5 KB each)


def _sweep_rows(sweep_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """results.json's trial rows, and the recommendation's tie record when it has one.

    Streamed (:class:`JsonArrayStream`: one trial at a time, a per-entry cap, never a whole-file
    cap); the trials are kept, since the heat map needs them at once, up to ``MAX_TRIALS``."""
    path = sweep_dir / "results.json"
    stream = JsonArrayStream(path, "trials", or_list=True)
    rows: list[dict[str, Any]] = []
    every_dict = True
    for trial in stream:
        every_dict = every_dict and isinstance(trial, dict)
        if not every_dict:
            break
        if len(rows) == MAX_TRIALS:
            raise UsageError(
                f"{str(path)!r} holds more than {MAX_TRIALS} trials; a sweep figure draws at "
                f"most {MAX_CELLS} cells"
            )
        rows.append(trial)
    if stream.error is not None:
        raise UsageError(f"{str(path)!r}: {stream.error}")
    if not stream.found_array or not every_dict:
        raise UsageError(
            f"{str(path)!r}: expected a list of trial objects (trial, init_scale, growth_interval, status, ...)"
        )
    rec = stream.top.get("recommendation")
    tie = rec.get("tie") if isinstance(rec, dict) and isinstance(rec.get("tie"), dict) else None
    return rows, tie


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


def _gap_tie() -> float:
    from ampctl.commands.sweep.rank import GAP_TIE  # the sweep's own rule (imported when drawn)

    return GAP_TIE


def _colour_value(metric: str, v: float) -> float:
    """The value a cell is coloured by: a loss gap as the sweep ranks it (clipped at 0, in whole
    ``GAP_TIE`` steps, so gaps the ranking ties look alike), any other metric as it is."""
    if metric == "loss_gap":
        tie = _gap_tie()
        return math.floor(max(v, 0.0) / tie + 1e-6) * tie
    return v


def _all_tie(metric: str, values: Any) -> bool:
    """Whether every cell ties: one loss-gap step, final losses within GAP_TIE of each other
    (relative), or the same value of any other metric."""
    if values.size < 2:
        return False
    lo, hi = float(values.min()), float(values.max())
    if metric == "final_loss":
        return hi - lo <= _gap_tie() * max(abs(lo), 1e-12)
    return hi == lo


@dataclass
class _Grid:
    """The heat map's cells: the metric's best value per (growth_interval, init_scale)."""

    metric: str
    inits: list[float]
    grows: list[int]
    z: Any
    status: list[list[str]]
    per_cell: dict[tuple[int, int], int]
    ranked_first: tuple[int, int] | None
    raw: Any  # the metric's own value per cell (the text); ``z`` is what colours it


def _grid(rows: list[dict[str, Any]], grid_rows: list[dict[str, Any]], metric: str | None) -> _Grid:
    import numpy as np

    metric = _pick_metric(rows, metric)
    inits = sorted({float(r["init_scale"]) for r in grid_rows})
    grows = sorted({int(r["growth_interval"]) for r in grid_rows})
    if len(inits) * len(grows) > MAX_CELLS:
        raise UsageError(
            f"results.json: {len(inits)} init_scale x {len(grows)} growth_interval values make "
            f"{len(inits) * len(grows)} cells; a sweep figure draws at most {MAX_CELLS}"
        )
    gi = {g: i for i, g in enumerate(grows)}
    ii = {v: j for j, v in enumerate(inits)}
    z = np.full((len(grows), len(inits)), np.nan)
    raw = np.full_like(z, np.nan)
    status = [["" for _ in inits] for _ in grows]
    per_cell: dict[tuple[int, int], int] = {}
    ranked_first = None
    for r in grid_rows:
        i, j = gi[int(r["growth_interval"])], ii[float(r["init_scale"])]
        per_cell[i, j] = per_cell.get((i, j), 0) + 1
        if r.get("rank") == 1:
            ranked_first = (i, j)
        ok = str(r.get("status", "ok")) in _OK and _is_num(r.get(metric))
        if ok and (math.isnan(raw[i, j]) or r[metric] < raw[i, j]):  # repeated: keep the best
            raw[i, j] = float(r[metric])
            z[i, j] = _colour_value(metric, raw[i, j])
            status[i][j] = "ok"
        elif not ok and status[i][j] != "ok":
            status[i][j] = (
                str(r.get("status", "failed"))
                if str(r.get("status", "ok")) not in _OK
                else "no value"
            )

    return _Grid(metric, inits, grows, z, status, per_cell, ranked_first, raw)


_TIE_RULE = {
    "s_star": "tie broken by the S* estimate",
    "default_init_scale": "tie broken by the default 2^16",
    "default_growth_interval": "tie broken by growth_interval 2000",
    "order": "tie broken by the plan's order",
}


def _heatmap_image(fig, ax_hm, g: _Grid) -> tuple[float, bool]:
    """Draw the cells; returns the value that splits dark from light text and whether every
    cell ties (then they share one colour and no colour bar pretends otherwise)."""
    import numpy as np
    from matplotlib.colors import Normalize

    finite = g.z[np.isfinite(g.z)]
    tie = _all_tie(g.metric, finite)
    label = (
        f"{g.metric} in whole {_gap_tie():.1%} steps, below 0 as 0 (lower is better)"
        if g.metric == "loss_gap"
        else f"{g.metric} (lower is better)"
    )
    # all tie: one colour (the map's middle); else the colours span the values drawn
    norm = Normalize(finite.min() - 1, finite.max() + 1) if tie else None
    img = ax_hm.imshow(
        np.ma.masked_invalid(g.z), cmap="viridis_r", origin="lower", aspect="auto", norm=norm
    )
    img.set_gid("heatmap")
    if not tie:
        fig.colorbar(img, ax=ax_hm, label=label)
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    return mid, tie


def _heatmap_panel(fig, ax_hm, g: _Grid, tie_record: dict[str, Any] | None = None) -> None:
    """The metric over init_scale x growth_interval; failed cells hatched and named, the
    sweep's rank 1 outlined (with the rule that broke its tie, from results.json)."""
    import numpy as np
    from matplotlib.patches import Rectangle

    metric, inits, grows, z, status = g.metric, g.inits, g.grows, g.z, g.status
    per_cell, ranked_first = g.per_cell, g.ranked_first
    mid, all_tie = _heatmap_image(fig, ax_hm, g)
    ax_hm.set_xticks(range(len(inits)), [_fmt_scale(v) for v in inits])
    ax_hm.set_yticks(range(len(grows)), [str(g) for g in grows])
    ax_hm.set_xlabel("scaler.init_scale")
    ax_hm.set_ylabel("scaler.growth_interval")
    finite = z[np.isfinite(z)]
    # the sweep's own rank 1 (merit, then its tie break) when it ranked; else the lowest value
    best = ranked_first or (np.unravel_index(np.nanargmin(z), z.shape) if finite.size else None)
    for i in range(len(grows)):
        for j in range(len(inits)):
            if status[i][j] == "ok":
                v = g.raw[i, j]
                ax_hm.text(
                    j,
                    i,
                    f"{v:+.1%}" if metric == "loss_gap" else f"{v:.4g}",
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
    title = f"{metric} by init_scale x growth_interval{note}"
    if all_tie:
        title += ": all tie"
    rule = _TIE_RULE.get(str((tie_record or {}).get("rule")))
    if best is not None and ranked_first is not None and rule:
        title += f"\nred box: the recommendation ({rule})"
    ax_hm.set_title(title, fontsize=10)


def _trajectory_panels(ax_sc, ax_ls, rows: list[dict[str, Any]], g: _Grid, sweep_dir: Path) -> None:
    """Every trial's scale (log2, skipped steps marked) and loss over steps."""
    inits, grows = g.inits, g.grows
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
    drawn, outside, more = 0, 0, 0
    for r in rows:
        if not r.get("trial"):
            continue
        tdir = _trial_dir(sweep_dir, r["trial"])
        if tdir is None:
            outside += 1  # results.json may only name folders inside the sweep
            continue
        if not (tdir / "metrics.jsonl").is_file():
            continue  # a copied sweep without its trial folders still gets the heat map
        if drawn >= MAX_TRAJECTORIES:
            more += 1
            continue
        try:
            tdata = load_run_data(tdir)  # per-step scale and exact skips when it has a checkpoint
        except UsageError:
            continue  # a trial that crashed before its first log row
        xs, loss, kept = tdata.series("loss")
        kx, ky, _ = _split_kept(xs, loss, kept)
        mk = "o" if len(kx) <= 40 else None
        if r.get("kind", "trial") == "baseline" or not (
            _is_num(r.get("init_scale")) and _is_num(r.get("growth_interval"))
        ):
            ax_ls.plot(
                kx, ky, color="black", linestyle="--", linewidth=1.4, zorder=3,
                label=f"{r['trial']} (baseline)",
            )  # fmt: skip
            continue
        c, ls = colors[float(r["init_scale"])], styles[int(r["growth_interval"])]
        sx, sy, _ = _split_kept(*tdata.scale_series())
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
    if more:
        title += f"; {more} more trials not drawn (at most {MAX_TRAJECTORIES})"
    if outside:
        title += f"\n{outside} trial name(s) outside the sweep folder not opened"
    ax_sc.set_title(title, fontsize=10)
    ax_ls.set_ylabel("loss")
    ax_ls.set_xlabel("step")
    for ax in (ax_sc, ax_ls):
        ax.grid(True, alpha=0.25)
    if ax_ls.get_legend_handles_labels()[0]:
        ax_ls.legend(fontsize=7, ncol=max(1, min(4, len(rows) // 4 + 1)))


def _trial_dir(sweep_dir: Path, trial: Any) -> Path | None:
    """The folder results.json names for a trial, or None when the name is not a plain name
    inside the sweep folder (absolute, ``..``, a link that resolves outside it): results.json is
    data and may not make ampctl open a run elsewhere."""
    name = str(trial)
    if not name or "\0" in name or Path(name).is_absolute():
        return None
    if any(part == ".." for part in Path(name).parts):
        return None
    tdir = sweep_dir / name
    try:
        inside = tdir.resolve().is_relative_to(sweep_dir.resolve())
    except (OSError, RuntimeError, ValueError):
        return None
    return tdir if inside else None


def build_sweep_figure(sweep_dir: str | Path, metric: str | None = None) -> Figure:
    """The sweep's figure: a heat map of ``metric`` (default loss_gap, else final_loss; lower is
    better) over growth_interval (rows) x init_scale (columns), failed trials hatched and named,
    the best cell outlined; then every trial's scale (log2) and loss over steps. Raises
    UsageError for a folder without results.json or without a grid. No device reads."""
    Figure, FigureCanvasAgg = _mpl()

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise UsageError(
            f"{str(sweep_dir)!r} is not a folder: give a sweep folder (runs/<sweep>/ with results.json)"
        )
    if not (sweep_dir / "results.json").is_file():
        raise UsageError(
            f"{str(sweep_dir)!r} has no results.json: give a folder written by ampctl sweep-scale"
        )
    rows, tie_record = _sweep_rows(sweep_dir)
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
    g = _grid(rows, grid_rows, metric)
    fig = Figure(figsize=(11, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1])
    ax_hm = fig.add_subplot(gs[0, 0])
    ax_sc = fig.add_subplot(gs[0, 1])
    ax_ls = fig.add_subplot(gs[1, :])

    _heatmap_panel(fig, ax_hm, g, tie_record)
    _trajectory_panels(ax_sc, ax_ls, rows, g, sweep_dir)
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
