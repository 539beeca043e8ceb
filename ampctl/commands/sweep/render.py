"""Drawing the sweep with rich: the trials table (live while it runs, ranked at the end), one
plain line per finished trial in pipes and logs, and the closing report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ampctl.ui.display import fmt_float, fmt_loss, fmt_pct, fmt_scale

from .plan import SweepPlan, bare
from .rank import fmt_value
from .report import SweepResult, gap_text

__all__ = ["sweep_table", "View", "print_report"]

_STATUS_STYLE = {
    "ok": "green",
    "stopped": "blue",
    "diverged": "bold red",
    "crashed": "bold red",
    "interrupted": "yellow",
    "invalid": "bold red",
    "running": "cyan",
    "pending": "dim",
}


def _num(v: Any, fmt: Callable[[Any], str]) -> str:
    return "-" if v is None else fmt(v)


def sweep_table(
    plan: SweepPlan, rows: list[dict[str, Any]], title: str, ranked: bool = False
) -> Table:
    """A rich table of the trials: one row per trial, identified by its init_scale, growth
    interval and any other swept values; baselines show their precision instead of a scale.
    With ``--halving`` a rung column. ``ranked``: best first, with the rank in the first column."""
    halving = plan.halving is not None
    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    t.add_column("#", justify="right", no_wrap=True)
    t.add_column("init_scale", justify="right", no_wrap=True)
    t.add_column("growth", justify="right", no_wrap=True)
    for k in plan.extra_keys:
        t.add_column(bare(k).split(".")[-1], justify="right", no_wrap=True)
    names = ["rung"] if halving else []
    names += ["steps", "skipped", "overflow", "scale", "1st ovf", "loss", "gap", "steps/s"]
    for name in names:
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    order = list(rows)
    if ranked:
        order.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["kind"] != "baseline"))
    for i, r in enumerate(order, 1):
        base = r["kind"] == "baseline"
        first = "base" if base else (str(r["rank"] or "-") if ranked else str(i))
        cells: list[str | Text] = [
            first,
            (plan.baseline or "-") if base else _num(r["init_scale"], fmt_value),
            _num(r["growth_interval"], fmt_value),
        ]
        # swept values as the user wrote them (a list value's "[...]" is not rich markup)
        cells += [Text(str(r[k])) if r.get(k) is not None else "-" for k in plan.extra_keys]
        if halving:
            cells.append(f"{r.get('rung') or 0}/{plan.top_rung}")
        cells += [
            _num(r.get("steps"), str),
            _num(r["skipped"], str),
            _num(r["overflow_rate"], fmt_pct),
            "-" if base else _num(r["final_scale"], fmt_value),
            _num(r["first_overflow_step"], str),
            _num(r["final_loss"], fmt_loss),
            "-" if base else gap_text(r.get("loss_gap")),
            _num(r["steps_per_s"], lambda v: fmt_float(v, 3)),
        ]
        st = r["status"]
        style = _STATUS_STYLE.get(st)
        cells.append(f"[{style}]{st}[/]" if style else st)
        t.add_row(*cells)
    return t


class View:
    """Live table (terminal) or one plain line per finished trial process."""

    def __init__(self, plan: SweepPlan, console: Console, mode: str) -> None:
        if mode == "auto":
            mode = "live" if console.is_terminal and not console.is_dumb_terminal else "plain"
        self.plan, self.console, self.mode = plan, console, mode
        self.rows: list[dict[str, Any]] = []
        self.done = 0
        self.total = 0
        self._live: Live | None = None

    def start(self, rows: list[dict[str, Any]], total: int) -> None:
        self.rows, self.total = rows, total
        if self.mode == "live":
            self._live = Live(
                self._render(), console=self.console, auto_refresh=False, transient=True
            )
            self._live.start(refresh=True)

    def _render(self) -> Table:
        return sweep_table(
            self.plan,
            self.rows,
            f"ampctl sweep-scale - {self.plan.name}: {self.done}/{self.total} runs done",
        )

    def refresh(self, rows: list[dict[str, Any]] | None = None) -> None:
        if rows is not None:
            self.rows = rows
        if self._live is not None:
            self._live.update(self._render(), refresh=True)

    def say(self, line: str) -> None:
        """A line above the live table (or in the plain stream)."""
        if self.mode != "quiet":
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def finished(self, r: dict[str, Any]) -> None:
        self.done += 1
        if self.mode == "plain":
            gap = "base" if r["kind"] == "baseline" else gap_text(r.get("loss_gap"))
            rung = f" rung={r.get('rung') or 0}" if self.plan.halving is not None else ""
            self.console.out(
                f"[{self.done}/{self.total}] {r['trial']}: {r['status']}{rung} "
                f"steps={_num(r.get('steps'), str)} loss={fmt_loss(r['final_loss'])} gap={gap} "
                f"skipped={_num(r['skipped'], str)} "
                f"overflow={_num(r['overflow_rate'], fmt_pct)} "
                f"scale={_num(r['final_scale'], lambda v: fmt_scale(v, pow2=False))} "
                f"first_overflow={_num(r['first_overflow_step'], str)} "
                f"steps/s={_num(r['steps_per_s'], lambda v: fmt_float(v, 3))} "
                f"time={_num(r['wall_time_s'], lambda v: f'{v:.1f}s')}"
                + (f" ({r['reason']})" if r.get("reason") else ""),
                highlight=False,
            )
        self.refresh()

    def stop(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()


def print_report(console: Console, result: SweepResult, lines: list[str]) -> None:
    plan = result.plan
    console.print(sweep_table(plan, result.rows, f"sweep {plan.name} (ranked)", ranked=True))
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
