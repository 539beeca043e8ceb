"""``ampctl bench``'s tables (rendering only: every figure comes from the results)."""

from __future__ import annotations

import math
from typing import Any


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
    ops = res.get("device_ops")
    if ops is not None:
        for key, label in (
            ("clean", "a clean step"),
            ("log", "a log step"),
            ("mean", "the mean step"),
        ):
            if ops[key] is not None:
                t.add_row(
                    f"device ops: {label}",
                    f"{ops[key]:.1f}",
                    "",
                    f"GradScaler loop {ops['bare']:.1f} (+{ops['extra'][key]:.1f})",
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
    if res.get("sizes"):
        _sizes_table(res["sizes"], console)
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


def _sizes_table(rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    t = Table(title="At three model sizes (--sizes)", title_justify="left")
    t.add_column("size")
    t.add_column("model")
    for col in (
        "params",
        "step ratio",
        "total ratio",
        "ops bare",
        "ops clean",
        "ops log",
        "ops mean",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        ov, ops = r["overhead"], r["device_ops"]
        t.add_row(
            r["size"],
            r["model"],
            "-" if not r.get("params") else f"{r['params'] / 1e6:.1f}M",
            f"{ov['ratio']:.3f}",
            f"{ov['total_ratio']:.3f}",
            _fmt(ops["bare"], ".1f"),
            _fmt(ops["clean"], ".1f"),
            _fmt(ops["log"], ".1f"),
            _fmt(ops["mean"], ".1f"),
        )
    console.print(t)
