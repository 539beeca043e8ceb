"""Live / plain / quiet display of mixed-precision training health.

The training loop owns a :class:`Display` and feeds it plain Python numbers (never tensors);
this module deliberately does not import torch.

Modes
-----
``live``   a rich ``Live`` panel (refreshed only when ``update``/``event`` is called): progress bar
           with ETA, latest figures, a short history of logged rows and the last few events.
``plain``  one stable ``key=value`` line per update and one ``[event] ...`` line per event, suitable
           for CI, pipes and job logs (no ANSI codes unless the console is a terminal)::

               step=40/200 loss=4.1234 scale=1024 skipped=2 overflow=5.0% gnorm=1.23 amax=0.045 \
underflow=0.1% act_underflow=2.3% nonfinite=0 lr=1.0e-04 prec=fp16 tok/s=12.5k elapsed=00:13 eta=00:52
               [event] step=41 rollback: restored step 40 after 3 overflows

           Every key is always present; a missing or ``None`` value is written as ``-``.
           An fp8 run's rows (they carry ``fp8_layers``) add, at the end of the line, the worst
           fp8 layer's saturation and underflow and the count of non-finite layers::

               ... eta=00:52 fp8_sat=0.68%@bert.encoder.layer.1.attention.output.dense \
fp8_under=0.0031%@bert.encoder.layer.0.intermediate.dense fp8_nonfinite=0
``quiet``  nothing until :meth:`Display.summary`.
``auto``   ``live`` when the console is an (interactive, non-dumb) terminal, else ``plain``.

The display is a side channel: malformed metrics (``None``, missing keys, NaN/inf, strings where
numbers are expected) are rendered as best as possible and never raise into the training loop.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

__all__ = [
    "Display",
    "MODES",
    "fmt_duration",
    "fmt_float",
    "fmt_loss",
    "fmt_lr",
    "fmt_pct",
    "fmt_rate",
    "fmt_scale",
]

MODES = ("auto", "live", "plain", "quiet")

HISTORY_ROWS = 8
EVENT_ROWS = 5
_RATE_WINDOW = 16  # (time, step) samples used for the ETA estimate

EVENT_STYLES: dict[str, str] = {  # every kind the trainer and the protection emit
    "overflow": "yellow",
    "locate": "cyan",
    "promotion": "magenta",
    "demotion": "magenta",
    "rollback": "magenta",
    "fallback": "magenta",
    "abort": "bold red",
    "error": "bold red",
    "warning": "yellow",
    "interrupt": "bold",
    "branch": "blue",
    "spike": "yellow",
    "divergence": "bold red",
    "rerun": "cyan",
    "data_skip": "yellow",
    "promotion_undone": "magenta",
    "resume": "blue",
}

_MISSING = "-"


# --------------------------------------------------------------------------- formatting helpers
# All helpers are total: any input (None, str, NaN, inf, bool, huge ints) gives a string.


def _as_float(x: Any) -> float | None:
    """``float(x)`` or None for None/non-numbers (bools included); huge ints become +-inf."""
    if x is None or isinstance(x, bool):
        return None
    try:
        return float(x)
    except OverflowError:  # int too large for a float
        try:
            return math.inf if x > 0 else -math.inf
        except Exception:
            return None
    except (TypeError, ValueError):
        return None
    except Exception:  # pathological __float__
        return None


def _nonfinite(v: float) -> str | None:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return None


def _fallback(x: Any) -> str:
    """Render something that is not a number (or None) without crashing."""
    if x is None:
        return _MISSING
    try:
        s = str(x)
    except Exception:  # pragma: no cover - pathological __str__
        return "?"
    return s.replace("\n", " ")


def _finite_number(fn):
    """Decorator for formatters: non-numbers render as themselves, NaN/inf as ``nan``/``inf``;
    the wrapped body only ever sees a finite float."""

    @functools.wraps(fn)
    def wrapper(x: Any, *args: Any, **kwargs: Any) -> str:
        v = _as_float(x)
        if v is None:
            return _fallback(x)
        return _nonfinite(v) or fn(v, *args, **kwargs)

    return wrapper


@_finite_number
def fmt_float(v: float, sig: int = 4) -> str:
    """Compact general float: ``1.234``, ``0.045``, ``3.2e-05``, ``1.2e+06``, ``nan``."""
    if v == 0:
        return "0"
    a = abs(v)
    if a < 1e-3 or a >= 1e5:
        return f"{v:.1e}"
    return f"{v:.{sig}g}"


@_finite_number
def fmt_loss(v: float) -> str:
    """Loss with 4 decimals in the usual range (``4.1234``), compact outside it."""
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4f}"
    return f"{v:.3e}"


@_finite_number
def fmt_lr(v: float) -> str:
    """Learning rate, always scientific: ``1.0e-04``."""
    return f"{v:.1e}"


@_finite_number
def fmt_int(v: float) -> str:
    if v == int(v):
        return str(int(v))
    return fmt_float(v)


@_finite_number
def fmt_pct(v: float) -> str:
    """Fraction 0..1 as a percentage; tiny but non-zero fractions are not rounded to 0."""
    p = v * 100.0
    if p != 0 and abs(p) < 0.1:
        return f"{p:.2g}%"
    if abs(p) >= 1e6:
        return f"{p:.1e}%"
    return f"{p:.1f}%"


@_finite_number
def fmt_rate(v: float) -> str:
    """Throughput with an SI suffix: ``950``, ``12.5k``, ``1.2M``."""
    a = abs(v)
    if a >= 1e15:
        return f"{v:.1e}"
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{v / div:.1f}{suffix}"
    return f"{v:.3g}"


@_finite_number
def fmt_duration(v: float) -> str:
    """Seconds as ``MM:SS`` or ``H:MM:SS`` (beyond a year: ``3.2e+08s``)."""
    if abs(v) >= 366 * 86400:
        return f"{v:.1e}s"
    sign = "-" if v < 0 else ""
    s = int(round(abs(v)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{sign}{h}:{m:02d}:{sec:02d}"
    return f"{sign}{m:02d}:{sec:02d}"


def _pow2_exponent(v: float) -> int | None:
    if v <= 0 or not math.isfinite(v):
        return None
    mant, exp = math.frexp(v)
    return exp - 1 if mant == 0.5 else None


@_finite_number
def fmt_scale(v: float, pow2: bool = True) -> str:
    """Loss scale: ``1024 (2^10)``, ``0.5 (2^-1)``, ``1000`` (not a power of two), ``inf``."""
    if v == int(v) and abs(v) < 1e9:
        base = str(int(v))
    else:
        base = fmt_float(v)
    e = _pow2_exponent(v)
    if pow2 and e is not None:
        return f"{base} (2^{e})"
    return base


def _is_bad(x: Any) -> bool:
    v = _as_float(x)
    return v is not None and not math.isfinite(v)


def _positive(x: Any) -> bool:
    v = _as_float(x)
    return v is not None and v > 0


def _one_line(s: Any) -> str:
    return _fallback(s).replace("\r", " ")


# --------------------------------------------------------------------------- summary rendering

_SUMMARY_FORMATTERS: dict[str, Callable[[Any], str]] = {
    "final_loss": fmt_loss,
    "loss": fmt_loss,
    "best_loss": fmt_loss,
    "steps": fmt_int,
    "skipped": fmt_int,
    "spikes": fmt_int,
    "overflow_rate": fmt_pct,
    "grad_underflow_frac": fmt_pct,
    "act_grad_underflow_frac": fmt_pct,
    "final_scale": fmt_scale,
    "scale": fmt_scale,
    "wall_time_s": lambda v: (
        f"{fmt_duration(v)} ({fmt_float(v)} s)" if _as_float(v) is not None else _fallback(v)
    ),
    "elapsed_s": fmt_duration,
    "tokens_per_s": lambda v: f"{fmt_rate(v)} tok/s" if _as_float(v) is not None else _fallback(v),
    "lr": fmt_lr,
    "final_lr": fmt_lr,
}

# Printed below the table, unwrapped, so that paths and commands stay copy-pasteable.
_SUMMARY_TRAILING = ("run_dir", "resume_hint")

_MAX_LIST_ITEMS = 20


def _fmt_generic(v: Any) -> str:
    if v is None:
        return _MISSING
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return fmt_float(v)
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping):
        if not v:
            return "(none)"
        return ", ".join(f"{_fallback(k)}={_fmt_generic(val)}" for k, val in v.items())
    if isinstance(v, (list, tuple, set, frozenset)):
        items = list(v)
        if not items:
            return "(none)"
        shown = [_fmt_generic(i) for i in items[:_MAX_LIST_ITEMS]]
        if len(items) > _MAX_LIST_ITEMS:
            shown.append(f"... (+{len(items) - _MAX_LIST_ITEMS} more)")
        return "\n".join(shown)
    return _fallback(v)


# Long lists shown as a count and their ends (summary.json keeps them whole).
_SUMMARY_COUNTED = {"fp8_layers": "layers"}


def _fmt_summary_value(key: str, v: Any) -> str:
    what = _SUMMARY_COUNTED.get(key)
    if what is not None and isinstance(v, list | tuple) and len(v) > 3:
        return f"{len(v)} {what}: {_fallback(v[0])} ... {_fallback(v[-1])}"
    fn = _SUMMARY_FORMATTERS.get(key)
    if fn is not None and not isinstance(v, (Mapping, list, tuple, set, frozenset)):
        try:
            return fn(v)
        except Exception:
            pass
    return _fmt_generic(v)


# --------------------------------------------------------------------------- the display


class Display:
    """Training display; see the module docstring for the modes.

    Usage::

        with Display(max_steps=cfg.trainer.max_steps) as disp:
            for ...:
                disp.update(metrics)      # once per log interval
                disp.event(ev)            # whenever something happens
            disp.summary(summary)
    """

    def __init__(
        self,
        max_steps: int,
        mode: str = "auto",
        console: Console | None = None,
        title: str = "ampctl train",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.console = console if console is not None else Console()
        if mode == "auto":
            c = self.console
            mode = "live" if c.is_terminal and not c.is_dumb_terminal else "plain"
        self.mode = mode
        self.title = title
        self.max_steps = self._valid_max(max_steps)

        self.metrics: dict[str, Any] = {}
        self.history: deque[tuple[Any, Any, Any, Any]] = deque(maxlen=HISTORY_ROWS)
        self.events: deque[tuple[Any, str, str]] = deque(maxlen=EVENT_ROWS)
        self.event_counts: Counter[str] = Counter()
        self.updates = 0
        self.render_errors = 0

        self._clock: Callable[[], float] = time.monotonic
        self._t0: float | None = None
        self._rate_samples: deque[tuple[float, float]] = deque(maxlen=_RATE_WINDOW)
        self._aborted = False
        self._live: Live | None = None
        # no box-drawing glyphs on e.g. ascii/cp1252 streams
        enc = (getattr(self.console, "encoding", "") or "").lower()
        self._ascii = not enc.startswith("utf")

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Display:
        if self._t0 is None:
            self._t0 = self._clock()
        if self.mode == "live":
            self._start_live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop_live()

    def _start_live(self) -> None:
        if self._live is not None:
            return
        live = Live(
            console=self.console,
            auto_refresh=False,
            transient=False,
            get_renderable=self._render_safe,
        )
        try:
            live.start(refresh=True)
        except Exception as err:  # e.g. another Live on this console in an old rich
            self.mode = "plain"
            self._note_error(err)
            return
        self._live = live

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()  # renders the final frame (transient=False) and restores stdout/stderr
            if not self.console.is_terminal:
                self.console.line()  # rich only ends the last frame's line on terminals

    # ------------------------------------------------------------------ public API
    def update(self, metrics: Mapping[str, Any] | None) -> None:
        """Record one log interval's metrics and refresh the display (no-op output in quiet)."""
        try:
            self._ingest(metrics)
            if self.mode == "plain":
                self.console.out(self._plain_line(), highlight=False)
            elif self.mode == "live":
                self._refresh_live()
        except Exception as err:
            self._note_error(err)

    def event(self, event: Mapping[str, Any] | None) -> None:
        """Record an event (overflow, rollback, promotion, fallback, abort, checkpoint, ...)."""
        try:
            ev = event if isinstance(event, Mapping) else {}
            step = ev.get("step")
            kind = _one_line(ev.get("kind") or "event")
            message = _one_line(ev.get("message") or "").replace("\n", " ")
            self.events.append((step, kind, message))
            self.event_counts[kind] += 1
            if kind == "abort":
                self._aborted = True
            if self.mode == "plain":
                line = f"[event] step={fmt_int(step)} {kind}"
                if message:
                    line += f": {message}"
                self.console.out(line, style=EVENT_STYLES.get(kind), highlight=False)
            elif self.mode == "live":
                self._refresh_live()
        except Exception as err:
            self._note_error(err)

    def summary(self, summary: Mapping[str, Any] | None) -> None:
        """Stop the live display (if any) and print the final table, in every mode."""
        self._stop_live()
        data = summary if isinstance(summary, Mapping) else {}
        try:
            table = Table(box=box.SIMPLE_HEAD, show_edge=False)
            table.add_column("key", style="cyan", no_wrap=True)
            table.add_column("value", overflow="fold")
            trailing: list[tuple[str, str]] = []
            for key, value in data.items():
                k = _fallback(key)
                if k in _SUMMARY_TRAILING and not isinstance(
                    value, (Mapping, list, tuple, set, frozenset)
                ):
                    trailing.append((k, _fallback(value)))
                    continue
                style = "red" if k == "final_loss" and _is_bad(value) else None
                table.add_row(Text(k), Text(_fmt_summary_value(k, value), style=style or ""))
            if not data:
                table.add_row(Text("(empty)"), Text(""))
            self.console.print(Text(f"{self.title} - summary", style="bold"), no_wrap=True)
            self.console.print(table)
            for k, v in trailing:
                # console.out: no wrapping, so long paths/commands stay copy-pasteable
                self.console.out(f"{k}: {v}", highlight=False)
        except Exception as err:  # never lose the summary entirely
            self._note_error(err)
            for key, value in data.items():
                self.console.out(f"{_fallback(key)}: {_fallback(value)}", highlight=False)

    # ------------------------------------------------------------------ state
    @staticmethod
    def _valid_max(x: Any) -> int | None:
        v = _as_float(x)
        if v is None or not math.isfinite(v) or v <= 0:
            return None
        return int(v)

    def _ingest(self, metrics: Mapping[str, Any] | None) -> None:
        m = dict(metrics) if isinstance(metrics, Mapping) else {}
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        self.metrics = m
        self.updates += 1
        mx = self._valid_max(m.get("max_steps"))
        if mx is not None:
            self.max_steps = mx
        step = _as_float(m.get("step"))
        if step is not None and math.isfinite(step):
            if self._rate_samples and step < self._rate_samples[-1][1]:
                self._rate_samples.clear()  # rolled back / restarted: old rate is meaningless
            self._rate_samples.append((now, step))
        self.history.append((m.get("step"), m.get("loss"), m.get("scale"), m.get("skipped")))

    def _elapsed(self) -> float | None:
        e = _as_float(self.metrics.get("elapsed_s"))
        if e is not None and math.isfinite(e):
            return e
        if self._t0 is None:
            return None
        return self._clock() - self._t0

    def eta_s(self) -> float | None:
        """Seconds to ``max_steps`` from the step rate over the last few updates (None if unknown)."""
        if self.max_steps is None or len(self._rate_samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._rate_samples[0], self._rate_samples[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        remaining = self.max_steps - s1
        if remaining <= 0:
            return 0.0
        return remaining * (t1 - t0) / (s1 - s0)

    def _note_error(self, err: BaseException) -> None:
        self.render_errors += 1
        if self.render_errors == 1:  # say it once; the training loop must keep going
            try:
                self.console.out(
                    f"[display] warning: {type(err).__name__}: {err} (display continues)",
                    highlight=False,
                )
            except Exception:
                pass

    # ------------------------------------------------------------------ plain mode
    def _plain_line(self) -> str:
        m = self.metrics
        g = m.get
        mx = self.max_steps if self.max_steps is not None else _MISSING
        eta = self.eta_s()
        return (
            f"step={fmt_int(g('step'))}/{mx}"
            f" loss={fmt_loss(g('loss'))}"
            f" scale={fmt_scale(g('scale'), pow2=False)}"
            f" skipped={fmt_int(g('skipped'))}"
            f" spikes={fmt_int(g('spikes'))}"
            f" overflow={fmt_pct(g('overflow_rate'))}"
            f" gnorm={fmt_float(g('grad_norm'), 3)}"
            f" amax={fmt_float(g('grad_amax'), 3)}"
            f" underflow={fmt_pct(g('grad_underflow_frac'))}"
            f" act_underflow={fmt_pct(g('act_grad_underflow_frac'))}"
            f" nonfinite={fmt_int(g('nonfinite_grads'))}"
            f" lr={fmt_lr(g('lr'))}"
            f" prec={_one_line(g('precision')).replace(' ', '_')}"
            f" tok/s={fmt_rate(g('tokens_per_s'))}"
            f" elapsed={fmt_duration(self._elapsed())}"
            f" eta={fmt_duration(eta) if eta is not None else _MISSING}" + self._plain_fp8()
        )

    def _plain_fp8(self) -> str:
        """The fp8 keys of the plain line ("" unless the row is an fp8 run's)."""
        g = self.metrics.get
        if "fp8_layers" not in self.metrics:
            return ""
        return (
            f" fp8_sat={_pct_at(g('fp8_sat'), g('fp8_sat_layer'))}"
            f" fp8_under={_pct_at(g('fp8_under'), g('fp8_under_layer'))}"
            f" fp8_nonfinite={fmt_int(g('fp8_nonfinite_layers'))}"
        )

    # ------------------------------------------------------------------ live mode
    def _refresh_live(self) -> None:
        if self._live is None:
            self._start_live()  # update() without `with`: start lazily
            if self._live is None:  # could not start -> fell back to plain
                if self.mode == "plain" and self.metrics:
                    self.console.out(self._plain_line(), highlight=False)
                return
        self._live.refresh()

    def _render_safe(self) -> RenderableType:
        try:
            return self.render()
        except Exception as err:  # keep the Live alive with a minimal frame
            self.render_errors += 1
            return Text(f"{self.title}: display error {type(err).__name__}: {err}", style="red")

    def render(self) -> RenderableType:
        """The live panel for the current state (also usable for snapshots/tests).

        The tables are laid out by hand as fixed-width ``Text`` lines: nested rich ``Table``s
        cost ~15 ms per frame (column measurement), this costs ~1-2 ms.
        """
        lines: list[Text] = [self._render_progress()]
        if self.updates:
            lines.append(Text(""))
            latest = self._render_latest()
            history = self._render_history()
            inner_width = self.console.width - 4  # panel border + padding
            lw = max(t.cell_len for t in latest)
            hw = max(t.cell_len for t in history)
            if lw + _GAP + hw <= inner_width:  # side by side
                for i in range(max(len(latest), len(history))):
                    left = latest[i].copy() if i < len(latest) else Text("")
                    left.pad_right(lw - left.cell_len + _GAP)
                    if i < len(history):
                        left.append_text(history[i])
                    lines.append(left)
            else:  # narrow terminal: stack them, with a shorter history to limit the height
                lines.extend(latest)
                lines.append(Text(""))
                lines.extend(history[:2] + history[2:][-_NARROW_HISTORY_ROWS:])
        else:
            lines.append(Text("waiting for the first log interval...", style="dim"))
        if self.events:
            lines.append(Text(""))
            lines.extend(self._render_events())
        for line in lines:
            line.no_wrap = True
            line.overflow = "ellipsis"
        border = "red" if self._aborted else "blue"
        return Panel(Group(*lines), title=Text(self.title), title_align="left", border_style=border)

    def _render_progress(self) -> Text:
        step = _as_float(self.metrics.get("step"))
        done = step if step is not None and math.isfinite(step) else 0.0
        total = self.max_steps
        eta = self.eta_s()
        info = Text.assemble(
            " ",
            (f"{fmt_int(self.metrics.get('step'))}/{total if total else '?'}", "bold"),
            f" {100.0 * done / total:5.1f}%" if total else "",
            "  elapsed ",
            (fmt_duration(self._elapsed()), "cyan"),
            "  ETA ",
            (fmt_duration(eta) if eta is not None else "--:--", "cyan"),
        )
        # the bar gives way to the figures on narrow terminals
        width = max(10, min(_BAR_WIDTH, self.console.width - 4 - info.cell_len))
        full, empty = ("#", "-") if self._ascii else ("━", "━")
        if total:
            frac = max(0.0, min(done / total, 1.0))
            filled = int(frac * width)
            bar_style = "red" if self._aborted else ("green" if frac >= 1.0 else "magenta")
            bar = Text.assemble((full * filled, bar_style), (empty * (width - filled), "grey23"))
        else:
            bar = Text(empty * width, style="grey23")
        return Text.assemble(bar, info)

    def _render_latest(self) -> list[Text]:
        g = self.metrics.get
        loss_style = "bold red" if _is_bad(g("loss")) else "bold"
        under = _as_float(g("grad_underflow_frac"))
        act_under = _as_float(g("act_grad_underflow_frac"))

        def bad(k: str) -> str:
            return "red" if _is_bad(g(k)) else ""

        def warn_pos(k: str, style: str = "yellow") -> str:
            return style if _positive(g(k)) else bad(k)

        cells: list[tuple[str, str, str]] = [
            # left half: progress and loss-scaler health
            ("step", f"{fmt_int(g('step'))}/{self.max_steps or '?'}", ""),
            ("loss", fmt_loss(g("loss")), loss_style),
            ("scale", fmt_scale(g("scale")), bad("scale")),
            ("skipped", fmt_int(g("skipped")), warn_pos("skipped")),
            ("overflow", fmt_pct(g("overflow_rate")), warn_pos("overflow_rate")),
            (
                "act underflow",
                fmt_pct(g("act_grad_underflow_frac")),
                "yellow" if act_under is not None and act_under > 0.01 else "",
            ),
            ("nonfinite", fmt_int(g("nonfinite_grads")), warn_pos("nonfinite_grads", "bold red")),
            ("spikes", fmt_int(g("spikes")), warn_pos("spikes")),
            # right half: gradients and run facts
            ("grad norm", fmt_float(g("grad_norm")), bad("grad_norm")),
            ("max|g|", fmt_float(g("grad_amax")), bad("grad_amax")),
            (
                "param underflow",
                fmt_pct(g("grad_underflow_frac")),
                "yellow" if under is not None and under > 0.01 else bad("grad_underflow_frac"),
            ),
            ("lr", fmt_lr(g("lr")), bad("lr")),
            ("precision", _one_line(g("precision")), ""),
            ("tok/s", fmt_rate(g("tokens_per_s")), ""),
        ]
        if "fp8_layers" in self.metrics:  # an fp8 run: the worst fp8 layer's casts
            sat, under = _as_float(g("fp8_sat")), _as_float(g("fp8_under"))
            cells[8:8] = [
                ("fp8 layers", fmt_int(g("fp8_layers")), ""),
                (
                    "fp8 nonfinite",
                    fmt_int(g("fp8_nonfinite_layers")),
                    warn_pos("fp8_nonfinite_layers", "bold red"),
                ),
            ]
            cells += [
                (
                    "fp8 sat",
                    _pct_at(g("fp8_sat"), g("fp8_sat_layer"), 34, " "),
                    "yellow" if sat is not None and sat > 0.1 else "",
                ),
                (
                    "fp8 under",
                    _pct_at(g("fp8_under"), g("fp8_under_layer"), 34, " "),
                    "yellow" if under is not None and under > 0.01 else "",
                ),
            ]
        half = (len(cells) + 1) // 2
        rows = []
        for i in range(half):
            (k1, v1, s1) = cells[i]
            (k2, v2, s2) = cells[i + half] if i + half < len(cells) else ("", "", "")
            rows.append([(k1, "dim"), (v1, s1), (k2, "dim"), (v2, s2)])
        return _grid(["metric", "value", "metric", "value"], rows, "llll", self._ascii)

    def _render_history(self) -> list[Text]:
        rows = []
        prev_scale: float | None = None
        prev_skipped: float | None = None
        for step, loss, scale, skipped in self.history:
            s, k = _as_float(scale), _as_float(skipped)
            dropped = s is not None and prev_scale is not None and s < prev_scale
            grew = k is not None and prev_skipped is not None and k > prev_skipped
            rows.append(
                [
                    (fmt_int(step), "dim"),
                    (fmt_loss(loss), "red" if _is_bad(loss) else ""),
                    (
                        fmt_scale(scale, pow2=False),
                        "red" if _is_bad(scale) else ("yellow" if dropped else ""),
                    ),
                    (fmt_int(skipped), "yellow" if grew else ""),
                ]
            )
            prev_scale, prev_skipped = s, k
        return _grid(["step", "loss", "scale", "skipped"], rows, "rrrr", self._ascii)

    def _render_events(self) -> list[Text]:
        counts = ", ".join(f"{k} {n}" for k, n in sorted(self.event_counts.items()))
        lines = [Text(f"events ({counts})", style="bold")]
        for step, kind, message in self.events:
            style = EVENT_STYLES.get(kind, "")
            lines.append(
                Text.assemble(
                    (f"  step {fmt_int(step):>7} ", "dim"),
                    (kind, f"bold {style}".strip()),
                    (f": {message}" if message else "", style),
                )
            )
        return lines


def _pct_at(frac: Any, layer: Any, width: int = 0, sep: str = "@") -> str:
    """``0.68%@layer.name`` (the layer's tail only when ``width`` is given); ``-`` without a
    figure."""
    if frac is None:
        return _MISSING
    name = _one_line(layer).replace(" ", "_") if layer is not None else _MISSING
    if width and len(name) > width:  # keep the last dotted components that fit
        parts = name.split(".")
        tail = parts.pop()
        while parts and len(tail) + len(parts[-1]) + 4 <= width:
            tail = f"{parts.pop()}.{tail}"
        name = "..." + tail[-(width - 3) :]
    return f"{fmt_pct(frac)}{sep}{name}"


_GAP = 3
_NARROW_HISTORY_ROWS = 4
_BAR_WIDTH = 40


def _grid(
    headers: list[str], rows: list[list[tuple[str, str]]], justify: str, ascii_only: bool = False
) -> list[Text]:
    """Fixed-width table as Text lines: header, rule, rows. ``justify``: one 'l'/'r' per column."""
    widths = [cell_len(h) for h in headers]
    for row in rows:
        for j, (v, _) in enumerate(row):
            n = cell_len(v)
            if n > widths[j]:
                widths[j] = n

    def cell(v: str, j: int) -> str:
        pad = " " * (widths[j] - cell_len(v))
        return pad + v if justify[j] == "r" else v + pad

    out = [Text("  ".join(cell(h, j) for j, h in enumerate(headers)).rstrip(), style="bold")]
    out.append(
        Text(("-" if ascii_only else "─") * (sum(widths) + 2 * (len(widths) - 1)), style="dim")
    )
    for row in rows:
        line = Text()
        for j, (v, style) in enumerate(row):
            if j:
                line.append("  ")
            line.append(cell(v, j), style=style or None)
        line.rstrip()
        out.append(line)
    return out
