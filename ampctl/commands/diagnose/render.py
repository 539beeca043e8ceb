"""The report as rich tables and lines (rendering only: every figure comes from the report)."""

from __future__ import annotations

import math
import shlex
from typing import Any

from .common import MAX_LISTED, as_number, fmt, pow2
from .stages import Fp8Section, Gradients, History, Replay, Report, ScalerState, StateHealth

__all__ = ["render"]


def _say(console: Any, text: str, style: str | None = None) -> None:
    from rich.text import Text

    console.print(Text(text, style=style or ""), highlight=False, soft_wrap=True)


def _header(report: Report, console: Any) -> None:
    c = report.checkpoint
    _say(console, f"ampctl diagnose - {c.path} ({report.format})", "bold")
    prec = c.precision or "unknown"
    src = (
        f" (from {c.precision_source})"
        if c.precision_source and c.precision_source != "checkpoint"
        else ""
    )
    mods = f", fp32 modules: {', '.join(c.fp32_modules)}" if c.fp32_modules else ""
    step = c.step if c.step is not None else "unknown"
    if c.step is None and not report.checkpoints:
        step = "- (no checkpoint)"
    _say(console, f"step {step}, precision {prec}{src}{mods}")
    if report.branch:
        _say(console, f"branch: {report.branch.text}")
    skipped = [f for f in report.files if not f["read"] and f["why"] != "not needed"]
    for f in skipped:
        _say(console, f"not read: {f['file']} ({f['why']})", "dim")
    for n in report.notes:
        _say(console, f"note: {n}", "dim")


def _state(st: StateHealth, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    if st.empty:
        _say(console, "1. State health: no checkpoint read (nothing to check)", "dim")
        _scaler(st.scaler, console)
        return
    t = Table(title="1. State health", title_justify="left", show_edge=False)
    for col in ("section", "tensors", "max |x|", "limit", "bad tensors"):
        t.add_column(col)
    for label, sec in (
        ("weights", st.weights),
        ("master weights", st.master),
        ("optimizer state", st.optimizer),
    ):
        if sec is None:
            continue
        nbad = len(sec.bad)
        t.add_row(
            label,
            str(sec.tensors),
            fmt(sec.amax),
            fmt(sec.limit, ".6g") if sec.limit is not None else "65504 / 65504^2",
            Text(str(nbad), style="red bold" if nbad else "green"),
        )
    console.print(t)
    _bad_tensors(st, console)
    if st.names.note:
        _say(console, f"optimizer names: {st.names.note}", "yellow")
    _scaler(st.scaler, console)


def _bad_tensors(st: StateHealth, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    bad = [
        (lbl, b)
        for lbl, sec in (
            ("weight", st.weights),
            ("master", st.master),
            ("optimizer", st.optimizer),
        )
        if sec
        for b in sec.bad
    ]
    if not bad:
        return
    t = Table(show_edge=False)
    t.add_column("bad tensor", overflow="fold", ratio=1)
    for col in ("NaN", "+inf", "-inf", ">limit", "max|x|"):
        t.add_column(col, justify="right", no_wrap=True)
    for lbl, b in bad[:MAX_LISTED]:
        name = f"{b.key} of {b.param}" if b.key else b.name
        if lbl == "master":
            name = f"master {name}"
        t.add_row(
            Text(name, style="red"),
            str(b.nan),
            str(b.posinf),
            str(b.neginf),
            str(b.above_limit),
            fmt(b.amax),
        )
    if len(bad) > MAX_LISTED:
        t.add_row(f"... {len(bad) - MAX_LISTED} more", "", "", "", "", "")
    console.print(t)


def _unknown(x: Any, spec: str = "") -> str:
    if x is None:
        return "unknown"
    return format(x, spec) if spec else str(x)


def _scaler(sc: ScalerState | None, console: Any) -> None:
    if sc is None:
        _say(console, "scaler: none recorded")
        return
    if not sc.enabled:
        _say(console, "scaler: disabled (no loss scaling in this precision)")
        return
    scale = as_number(sc.scale)
    floor = " (at its floor)" if sc.at_floor else ""
    parts = [f"scaler ({sc.kind}): scale {pow2(scale) if scale is not None else sc.scale}{floor}"]
    if sc.kind == "ampctl":
        parts.append(f"min {sc.min_scale:g}")
    parts.append(f"growth_interval {_unknown(sc.growth_interval)}")
    if sc.kind == "GradScaler":
        parts.append(f"growth tracker {_unknown(sc.growth_tracker)}")
    skipped = f"skipped {_unknown(sc.skipped_total)}"
    if sc.kind == "ampctl":
        skipped += (
            f" (forward {sc.forward_overflows}), consecutive {sc.consecutive_overflows}, "
            f"recent skips {sc.recent_skips}/{sc.recent_window}"
        )
    parts.append(skipped)
    _say(console, ", ".join(parts))


def _history(h: History | None, console: Any, unreadable: list[str]) -> None:

    if h is None:
        if unreadable:
            for line in unreadable:
                _say(console, f"2. History: {line.removeprefix('history: ')}", "yellow")
        else:
            _say(console, "2. History: none kept beside this checkpoint", "dim")
        return
    t = _what_value_table(f"2. History ({h.source})")
    fo = h.first_overflow_step
    if h.source == "run folder":
        t.add_row(
            "first overflow",
            "none" if fo is None else f"step {fo} (from {h.first_overflow_source})",
        )
    nan = h.first_nan_loss_step
    filt = (
        f" (logged as 0.0 at {', '.join(map(str, h.nan_filtered_steps[:5]))})"
        if h.nan_filtered_steps
        else ""
    )
    t.add_row("first NaN loss", "none" if nan is None else f"step {nan}{filt}")
    gn_bad = h.first_nonfinite_grad_norm_step
    t.add_row("first non-finite grad norm", "none" if gn_bad is None else f"step {gn_bad}")
    traj = h.scale_trajectory
    if traj:
        shown = traj if len(traj) <= 8 else [*traj[:2], None, *traj[-5:]]
        t.add_row(
            "scale",
            " -> ".join(
                "..." if p is None else f"{pow2(as_number(p[1]) or 0)} @{int(p[0])}" for p in shown
            ),
        )
    if h.source == "run folder":
        bursts = h.bursts
        desc = ", ".join(
            f"{b.start}-{b.end} ({b.length}{', after growth' if b.after_growth else ''})"
            for b in bursts[-6:]
        )
        t.add_row("overflow bursts", f"{len(bursts)}: {desc}" if bursts else "none")
    if h.overflow_params:
        t.add_row("non-finite gradients in", ", ".join(h.overflow_params[:MAX_LISTED]))
    elif h.skipped_steps and h.source != "run folder":
        shown = ", ".join(map(str, h.skipped_steps[:8]))
        more = f" ({len(h.skipped_steps)} in all)" if len(h.skipped_steps) > 8 else ""
        t.add_row("skipped steps (grad norm inf/nan)", shown + more)
    if h.events:
        t.add_row("events", ", ".join(f"{k} {v}" for k, v in sorted(h.events.items())))
    lt = h.loss
    if lt is not None:
        t.add_row(
            "loss",
            f"{fmt(lt.first)} @{lt.first_step} -> min {fmt(lt.min)} @{lt.min_step} "
            f"-> {fmt(lt.last)} @{lt.last_step}",
        )
    gn = h.grad_norm
    if gn is not None:
        t.add_row(
            "grad norm",
            f"peak {fmt(gn.peak)} @{gn.peak_step} = {fmt(gn.ratio, '.3g')}x earlier "
            f"median {fmt(gn.baseline)}",
        )
    console.print(t)
    _rows(h, console)
    for line in unreadable:
        _say(console, line, "yellow")
    for n in h.notes:
        _say(console, f"note: {n}", "dim")


def _rows(h: History, console: Any) -> None:
    from rich.table import Table

    if not h.before_break:
        return
    title = (
        f"last rows before step {h.break_step}" if h.break_step is not None else "last logged rows"
    )
    t = Table(title=title, title_justify="left", show_edge=False)
    keys = [("step", "step"), ("loss", "loss"), ("grad_norm", "grad norm")]
    if h.source == "run folder":
        keys += [("scale", "scale"), ("skipped", "skipped"), ("grad_amax", "max |g|")]
    keys += [("learning_rate", "lr")]
    for _, col in keys:
        t.add_column(col, justify="right")
    for r in h.before_break:
        t.add_row(*(fmt(getattr(r, k)) for k, _ in keys))
    console.print(t)


def _replay(r: Replay, console: Any) -> None:
    if not r.ran:
        _say(console, f"3. Replay skipped: {r.reason}", "yellow")
        return
    _say(
        console,
        f"3. Replay: {len(r.positions)} batch(es) at positions "
        f"{', '.join(map(str, r.positions))}, {r.precision} on {r.device}, scale "
        f"{r.scale:g} ({fmt(r.elapsed_s, '.2f')} s)",
        "bold",
    )
    _say(console, f"data: {r.data}")
    losses = ", ".join(fmt(v) for v in r.loss)
    _say(
        console,
        f"loss {r.precision}: {losses}   fp32: {', '.join(fmt(v) for v in r.loss_fp32)}",
    )
    _modules(r, console)
    if r.masked_modules:
        _say(console, f"intentional -inf (masks, not faults): {', '.join(r.masked_modules)}")
    for label, d in (("forward", r.forward_first_bad), ("backward", r.backward_first_bad)):
        if d is None:
            _say(console, f"first non-finite {label}: none")
            continue
        kind = "NaN" if d.nan else ("+inf" if d.posinf else "-inf")
        extra = ""
        if d.fp32_finite is not None:
            extra = "; finite in fp32" if d.fp32_finite else "; non-finite in fp32 too"
        _say(
            console,
            f"first non-finite {label}: {d.module} ({kind}, {d.dtype}, batch {d.position}){extra}",
            "red",
        )
    _gradients(r.gradients, console)


def _head(x: Any) -> str:
    v = as_number(x)
    if v is None or math.isnan(v):
        return "non-finite"
    return "-" if math.isinf(v) else f"2^{v:.1f}"


def _pct(x: Any) -> str:
    v = as_number(x)
    return f"{v:.2%}" if v is not None and math.isfinite(v) else str(x)


def _fp8(f: Fp8Section | None, console: Any) -> None:
    """Per fp8 layer: amax and headroom of each cast below e4m3's / e5m2's max."""
    from rich.table import Table
    from rich.text import Text

    if f is None:
        return
    if not f.ran:
        _say(console, f"fp8 casts: not replayed ({f.reason})", "yellow")
        return
    t = Table(
        title=f"fp8 casts ({f.recipe}): max |x| (headroom below e4m3 max 448 / e5m2 max "
        "57344), least headroom first",
        title_justify="left",
        show_edge=False,
    )
    t.add_column("fp8 layer", overflow="fold", ratio=1, min_width=16)
    fmts = f.layers[0].formats if f.layers else {}
    for role, label in (("in", "input"), ("w", "weight"), ("go", "grad")):
        t.add_column(f"{label} {fmts.get(role, '')}", justify="right", no_wrap=True)
    t.add_column("sat", justify="right", no_wrap=True)
    t.add_column("grad->0", justify="right", no_wrap=True)
    for m in f.layers[:12]:
        style = "red" if m.nonfinite else ("yellow" if m.findings else "")
        t.add_row(
            Text(m.name, style=style),
            *(
                f"{fmt(m.cast(r, 'amax'), '.3g')} ({_head(m.cast(r, 'headroom_log2'))})"
                for r in ("in", "w", "go")
            ),
            _pct(m.sat),
            _pct(m.go_under),
        )
    if len(f.layers) > 12:
        t.add_row(f"... {len(f.layers) - 12} more", *[""] * 5)
    console.print(t)
    if f.demoted:
        _say(console, f"kept demoted (bf16) as the run had them: {', '.join(f.demoted)}")


def _modules(r: Replay, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(
        title=f"activations vs {r.precision} max ({r.limit:.6g}), least headroom first",
        title_justify="left",
        show_edge=False,
    )
    for col in ("module", "dtype", "max |x|", "headroom"):
        t.add_column(col)
    ordered = sorted(r.modules, key=lambda m: (not m.bad, as_number(m.headroom_log2)))
    for m in ordered[:8]:
        hr = as_number(m.headroom_log2)
        head = "non-finite" if m.bad else ("-" if hr is None or math.isinf(hr) else f"2^{hr:.1f}")
        t.add_row(Text(m.name, style="red" if m.bad else ""), m.dtype, fmt(m.amax), head)
    console.print(t)


def _what_value_table(title: str) -> Any:
    """A two-column (what, value) table without header or edge, titled on the left."""
    from rich.table import Table

    t = Table(title=title, title_justify="left", show_edge=False, show_header=False)
    t.add_column("what")
    t.add_column("value")
    return t


def _gradients(g: Gradients | None, console: Any) -> None:

    if g is None:
        return
    t = _what_value_table(f"gradients at scale {pow2(g.scale)}")
    hr = as_number(g.headroom_log2)
    t.add_row(
        "max |g| (unscaled, fp32 replay)",
        f"{fmt(g.max_abs)} (params {fmt(g.max_abs_param)}, activations {fmt(g.max_abs_activation)})",
    )
    head = "-" if hr is None or math.isinf(hr) else f"2^{hr:.1f}"
    t.add_row("largest scaled gradient", f"{fmt(g.max_scaled)}: headroom {head} below 65504")
    t.add_row(
        "param grads underflow (|g| x scale < 2^-24)",
        f"{g.underflow_frac:.2%} of elements incl. zeros ({g.zero_frac:.2%} are zero in fp32)",
    )
    act = g.act_grad_underflow_frac
    if act is not None:
        t.add_row(
            "fp16 activation gradients",
            f"{act:.2%} below fp16's normal range, {g.act_grad_zero_frac:.2%} flushed to zero",
        )
    t.add_row(
        "non-zero elements lost",
        f"{g.lost_frac:.2%} now, {g.lost_frac_at_recommended:.2%} at {g.recommended_init_scale:g}",
    )
    rec = g.recommended_init_scale
    free = g.recommended_init_scale_unbounded
    bounds = f" (the run's bounds allow {pow2(rec)})" if free != rec else ""
    t.add_row(
        "ideal scale S* = 65504 / max|g|",
        f"{fmt(g.ideal_scale)} -> init_scale {pow2(free)}{bounds}",
    )
    if g.nonfinite_params:
        t.add_row("non-finite grads", ", ".join(g.nonfinite_params[:5]))
    console.print(t)


def _verdict(report: Report, console: Any) -> None:
    problems = [p for p in report.problems if p.severity != "note"]  # notes: in their section
    v = report.verdict
    if not problems:
        style = "green bold" if v.status == "healthy" else "yellow bold"
        head = "Healthy: no problems found." if v.status == "healthy" else "Recovered."
        _say(console, head, style)
        if v.summary not in ("healthy", ""):
            _say(console, f"  {v.summary}", "green" if v.status == "healthy" else "yellow")
    else:
        _say(console, f"Problems ({len(problems)}):", "red bold")
        for p in problems:
            _say(
                console,
                f"  [{p.kind}] {p.message}",
                "red" if p.severity == "error" else "yellow",
            )
        if v.events:
            _say(console, "  the run went through: " + "; ".join(v.events), "dim")
    recs = report.recommendations
    if recs:
        where = (
            "ampctl train" if report.format == "ampctl" else "ampctl train, and in your own setup"
        )
        _say(console, f"4. Recommendations (paste into {where}):", "bold")
        for rec in recs:
            _say(console, f"  {shlex.quote(rec.override)}   # {rec.reason}", "cyan")
            if rec.yours:
                _say(console, f"    yours: {rec.yours}")
    elif problems:
        _say(console, "4. Recommendations: none beyond resuming from a healthy checkpoint", "bold")
    _checkpoints(report, console)


def _checkpoints(report: Report, console: Any) -> None:
    from rich.text import Text

    problems = report.problems
    others = report.checkpoints[1:]
    if problems or report.format != "ampctl":
        for ck in others:
            state = "healthy" if ck.healthy else ", ".join(ck.problems)
            if ck.after_trouble:
                state += ", written after the first sign of trouble"
            _say(console, f"  checked {ck.path}: {state}")
    res = report.resume
    if problems:
        if res.probe:
            _say(console, res.probe)
        console.print(Text.assemble(("Resume: ", "bold"), (res.command, "cyan")), soft_wrap=True)
        if res.why and res.checkpoint is not None:
            _say(console, f"  ({res.why})")
        recs = report.recommendations
        if (
            report.format == "ampctl"
            and res.checkpoint
            and any(
                not r.override.startswith(
                    ("precision.fp32_modules=", "precision.fp8_exclude=", "optim.")
                )
                for r in recs
            )
        ):
            _say(
                console,
                "  (precision= and scaler.* take effect in a fresh run: --resume restores the "
                "checkpoint's precision and scaler state)",
            )


def render(report: Report, console: Any) -> None:
    """Print the report as rich tables."""
    _header(report, console)
    _state(report.state, console)
    unreadable = [p.message for p in report.problems if p.kind == "unreadable_history"]
    _history(report.history, console, unreadable)
    _replay(report.replay, console)
    _fp8(report.fp8, console)
    _verdict(report, console)
