"""Tests for ampctl.ui.display (no torch, no GPU, all in-memory consoles), and the display's fp8
figures: plain-line keys and live cells, only for an fp8 run's rows.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ampctl.ui.display import (
    Display,
    fmt_duration,
    fmt_float,
    fmt_loss,
    fmt_lr,
    fmt_pct,
    fmt_rate,
    fmt_scale,
)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _not_dumb_term(monkeypatch):
    # rich treats TERM=dumb/unknown as a dumb terminal; CI often sets that.
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)  # the colour tests need colour


def make_console(terminal: bool, width: int = 120) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=width), buf


def metrics(step: int = 40, **over) -> dict:
    m = dict(
        step=step,
        max_steps=200,
        loss=4.1234,
        scale=1024.0,
        skipped=2,
        spikes=1,
        overflow_rate=0.05,
        grad_norm=1.234,
        grad_amax=0.045,
        grad_underflow_frac=0.001,
        act_grad_underflow_frac=0.023,
        nonfinite_grads=0,
        lr=1e-4,
        precision="fp16",
        tokens_per_s=12500.0,
        elapsed_s=13.0,
    )
    m.update(over)
    return m


def plain(s: str) -> str:
    return ANSI.sub("", s)


# ----------------------------------------------------------------------------- formatting


def test_scale_shows_power_of_two():
    assert fmt_scale(1024.0) == "1024 (2^10)"
    assert fmt_scale(65536) == "65536 (2^16)"
    assert fmt_scale(1.0) == "1 (2^0)"
    assert fmt_scale(0.5) == "0.5 (2^-1)"
    assert fmt_scale(1000.0) == "1000"  # not a power of two: no exponent
    assert fmt_scale(1024.0, pow2=False) == "1024"
    assert fmt_scale(float("inf")) == "inf"
    assert fmt_scale(float("nan")) == "nan"
    assert fmt_scale(0.0) == "0"
    assert fmt_scale(None) == "-"


def test_compact_number_formats():
    assert fmt_lr(3.2e-5) == "3.2e-05"
    assert fmt_lr(1e-4) == "1.0e-04"
    assert fmt_float(1.2344) == "1.234"
    assert fmt_float(0.045) == "0.045"
    assert fmt_float(3.2e-5) == "3.2e-05"
    assert fmt_float(0) == "0"
    assert fmt_loss(4.12344) == "4.1234"
    assert fmt_loss(float("nan")) == "nan"
    assert fmt_loss(float("-inf")) == "-inf"
    assert fmt_rate(12500) == "12.5k"
    assert fmt_rate(1.25e6) == "1.2M"
    assert fmt_rate(950) == "950"
    assert fmt_pct(0.05) == "5.0%"
    assert fmt_pct(0.001) == "0.1%"
    assert fmt_pct(1e-5) == "0.001%"  # tiny but non-zero underflow is not shown as 0.0%
    assert fmt_pct(0) == "0.0%"
    assert fmt_duration(13) == "00:13"
    assert fmt_duration(3723.4) == "1:02:03"


ODD_VALUES = [None, "abc", float("nan"), float("inf"), -1e300, 10**400, True, []]
EXPECTED = {  # None -> "-", text as itself, non-finite as such, huge values stay short
    fmt_scale: ["-", "abc", "nan", "inf", "-1.0e+300", "inf", "True", "[]"],
    fmt_float: ["-", "abc", "nan", "inf", "-1.0e+300", "inf", "True", "[]"],
    fmt_loss: ["-", "abc", "nan", "inf", "-1.000e+300", "inf", "True", "[]"],
    fmt_lr: ["-", "abc", "nan", "inf", "-1.0e+300", "inf", "True", "[]"],
    fmt_pct: ["-", "abc", "nan", "inf", "-1.0e+302%", "inf", "True", "[]"],
    fmt_rate: ["-", "abc", "nan", "inf", "-1.0e+300", "inf", "True", "[]"],
    fmt_duration: ["-", "abc", "nan", "inf", "-1.0e+300s", "inf", "True", "[]"],
}


@pytest.mark.parametrize("fn", list(EXPECTED), ids=lambda f: f.__name__)
def test_formatters_are_total_and_short(fn):
    assert [fn(v) for v in ODD_VALUES] == EXPECTED[fn]


# ----------------------------------------------------------------------------- plain mode


def test_plain_one_line_per_update():
    con, buf = make_console(terminal=False)
    with Display(200, mode="plain", console=con) as d:
        d.update(metrics(40))
        d.update(metrics(50, loss=3.5, scale=2048.0))
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    assert "\x1b" not in buf.getvalue()
    assert "step=40/200" in lines[0] and "loss=4.1234" in lines[0] and "scale=1024" in lines[0]
    assert "step=50/200" in lines[1] and "loss=3.5000" in lines[1] and "scale=2048" in lines[1]
    # all the other figures are there too, in the stable key=value form
    for part in (
        "skipped=2",
        "spikes=1",
        "overflow=5.0%",
        "gnorm=1.23",
        "amax=0.045",
        "underflow=0.1%",
        "act_underflow=2.3%",
        "nonfinite=0",
        "lr=1.0e-04",
        "prec=fp16",
        "tok/s=12.5k",
        "elapsed=00:13",
    ):
        assert part in lines[0], part


def test_plain_line_is_not_wrapped_on_narrow_console():
    con, buf = make_console(terminal=False, width=40)
    d = Display(200, mode="plain", console=con)
    d.update(metrics(40))
    assert len(buf.getvalue().splitlines()) == 1


def test_plain_every_key_present_even_when_missing():
    con, buf = make_console(terminal=False)
    d = Display(200, mode="plain", console=con)
    d.update({"step": 3})
    line = buf.getvalue().strip()
    keys = [tok.split("=")[0] for tok in line.split()]
    assert keys == [
        "step",
        "loss",
        "scale",
        "skipped",
        "spikes",
        "overflow",
        "gnorm",
        "amax",
        "underflow",
        "act_underflow",
        "nonfinite",
        "lr",
        "prec",
        "tok/s",
        "elapsed",
        "eta",
    ]
    assert "loss=-" in line and "step=3/200" in line


def test_plain_event_one_line_with_kind():
    con, buf = make_console(terminal=False)
    d = Display(200, mode="plain", console=con)
    d.event({"step": 41, "kind": "rollback", "message": "restored step 40\nafter 3 overflows"})
    lines = buf.getvalue().splitlines()
    assert lines == ["[event] step=41 rollback: restored step 40 after 3 overflows"]


def test_plain_eta_from_step_rate():
    con, buf = make_console(terminal=False)
    d = Display(200, mode="plain", console=con)
    now = [100.0]
    d._clock = lambda: now[0]
    d.update(metrics(10))
    now[0] += 10.0
    d.update(metrics(20))  # 1 step/s, 180 steps left
    assert d.eta_s() == pytest.approx(180.0)
    assert buf.getvalue().splitlines()[-1].endswith("eta=03:00")
    now[0] += 1.0
    d.update(metrics(5))  # rolled back: rate window restarts, ETA unknown again
    assert d.eta_s() is None


# ----------------------------------------------------------------------------- mode selection


def test_auto_mode_plain_for_non_terminal_live_for_terminal():
    con, _ = make_console(terminal=False)
    assert Display(10, console=con).mode == "plain"
    con, _ = make_console(terminal=True)
    assert Display(10, console=con).mode == "live"


def test_auto_mode_plain_for_dumb_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "dumb")
    con, _ = make_console(terminal=True)
    assert Display(10, console=con).mode == "plain"


def test_bad_mode_rejected():
    with pytest.raises(ValueError):
        Display(10, mode="fancy")


# ----------------------------------------------------------------------------- quiet / summary

SUMMARY = dict(
    final_loss=2.3456,
    steps=200,
    skipped=3,
    overflow_rate=0.015,
    final_scale=32768.0,
    wall_time_s=75.0,
    tokens_per_s=12500.0,
    precision="bf16",
    promoted_modules=["encoder.layers.0.norm", "lm_head"],
    events={"overflow": 3, "promotion": 1},
    run_dir="runs/2024-05-01_12-00-00_a_rather_long_directory_name_that_must_not_be_wrapped_anywhere",
    resume_hint="ampctl train --resume runs/2024-05-01_12-00-00/checkpoints/last.pt",
    some_new_key=(1, 2),
)


def test_quiet_prints_nothing_until_summary():
    con, buf = make_console(terminal=True)
    with Display(200, mode="quiet", console=con) as d:
        d.update(metrics(10))
        d.event({"step": 11, "kind": "abort", "message": "boom"})
        assert buf.getvalue() == ""
        d.summary(SUMMARY)
    out = plain(buf.getvalue())
    assert "2.3456" in out


@pytest.mark.parametrize("mode,terminal", [("plain", False), ("quiet", False), ("live", True)])
def test_summary_shows_final_loss_and_run_dir(mode, terminal):
    con, buf = make_console(terminal=terminal, width=80)
    with Display(200, mode=mode, console=con) as d:
        d.update(metrics(200))
        d.summary(SUMMARY)
    out = plain(buf.getvalue())
    tail = out[out.index("summary") :]
    assert "final_loss" in tail and "2.3456" in tail
    assert SUMMARY["run_dir"] in tail  # on one line even though wider than the console
    assert SUMMARY["resume_hint"] in tail
    assert "32768 (2^15)" in tail
    assert "1.5%" in tail and "12.5k tok/s" in tail and "01:15" in tail
    assert "lm_head" in tail and "overflow=3" in tail and "promotion=1" in tail
    assert "some_new_key" in tail


def test_summary_handles_odd_values():
    con, buf = make_console(terminal=False)
    d = Display(10, mode="quiet", console=con)
    d.summary({"final_loss": float("nan"), "x": None, "y": {}, "z": [], 3: object()})
    d.summary({})
    d.summary(None)
    assert "nan" in buf.getvalue()


# ----------------------------------------------------------------------------- robustness

ODD_METRICS = [
    {},
    None,
    {"step": None, "loss": None, "scale": None},
    metrics(
        5,
        loss=float("nan"),
        scale=float("inf"),
        grad_norm=float("nan"),
        grad_amax=float("inf"),
        overflow_rate=float("nan"),
        lr=None,
        tokens_per_s=float("inf"),
        elapsed_s=float("nan"),
    ),
    {
        **metrics(5),
        "loss": "oops",
        "scale": -3,
        "skipped": "?",
        "max_steps": None,
        "precision": None,
        "step": float("inf"),
    },
    metrics(5, max_steps=0, elapsed_s=-5.0, nonfinite_grads=10**400),
]


@pytest.mark.parametrize(
    "mode,terminal", [("plain", False), ("live", True), ("live", False), ("quiet", False)]
)
def test_odd_metrics_never_crash(mode, terminal):
    con, buf = make_console(terminal=terminal)
    with Display(200, mode=mode, console=con) as d:
        for m in ODD_METRICS:
            d.update(m)
        d.event({})
        d.event(None)
        d.event({"kind": None, "message": None, "step": "x"})
        d.summary({})
    assert d.render_errors == 0
    con2, _ = make_console(terminal=True)
    con2.print(d.render())  # the live frame renders for the odd state too


def test_nan_loss_shows_nan():
    con, buf = make_console(terminal=False)
    d = Display(200, mode="plain", console=con)
    d.update(metrics(7, loss=float("nan")))
    d.update({"step": 8, "loss": float("inf")})
    lines = buf.getvalue().splitlines()
    assert "loss=nan" in lines[0] and "loss=inf" in lines[1]


def test_nan_loss_is_red_in_live_mode():
    con, buf = make_console(terminal=True)
    with Display(200, mode="live", console=con) as d:
        d.update(metrics(7, loss=float("nan")))
    con2 = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=120)
    with con2.capture() as cap:
        con2.print(d.render())
    # "nan" preceded by the red SGR code (31) with no reset in between
    assert re.search(r"\x1b\[[0-9;]*31[0-9;]*mnan", cap.get())


# ----------------------------------------------------------------------------- live mode


def test_live_renders_table_history_and_events():
    con, buf = make_console(terminal=True)
    with Display(200, mode="live", console=con, title="unit run") as d:
        for s in range(10, 110, 10):
            d.update(metrics(s, loss=4.0 - s / 1000, scale=2.0 ** (16 - s // 40)))
        d.event({"step": 41, "kind": "overflow", "message": "scale halved to 32768"})
        d.event({"step": 61, "kind": "rollback", "message": "restored checkpoint step 60"})
        d.event({"step": 99, "kind": "abort", "message": "loss diverged"})
    out = plain(buf.getvalue())
    final = out[out.rfind("unit run") :]  # last frame (transient=False keeps it)
    assert "3.9000" in final  # latest loss (step 100)
    assert "100/200" in final
    assert "16384 (2^14)" in final
    assert "restored checkpoint step 60" in final and "rollback" in final
    assert "loss diverged" in final
    # both underflow figures, each under its own name
    assert re.search(r"param underflow\s+0\.1%", final), final
    assert re.search(r"act underflow\s+2\.3%", final), final
    assert re.search(r"spikes\s+1", final), final  # steps the spike rule skipped
    # history keeps the last 8 logged rows: steps 30..100 (losses 3.97..3.90), not 10/20
    assert [row[0] for row in d.history] == list(range(30, 110, 10))
    assert "3.9700" in final and "3.9800" not in final and "3.9900" not in final
    assert "overflow 1" in final and "rollback 1" in final  # event counts


def test_live_event_styles():
    con, buf = make_console(terminal=True)
    d = Display(200, mode="live", console=con)
    d.event({"step": 1, "kind": "overflow", "message": "o"})
    d.event({"step": 2, "kind": "promotion", "message": "p"})
    d.event({"step": 3, "kind": "abort", "message": "a"})
    d.event({"step": 4, "kind": "spike", "message": "s"})
    d.event({"step": 5, "kind": "divergence", "message": "d"})
    con2 = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=120)
    with con2.capture() as cap:
        con2.print(d.render())
    text = cap.get()
    assert re.search(r"\x1b\[[0-9;]*33[0-9;]*moverflow", text)  # yellow
    assert re.search(r"\x1b\[[0-9;]*35[0-9;]*mpromotion", text)  # magenta
    assert re.search(r"\x1b\[[0-9;]*31[0-9;]*mabort", text)  # red
    assert re.search(r"\x1b\[[0-9;]*33[0-9;]*mspike", text)  # yellow
    assert re.search(r"\x1b\[[0-9;]*31[0-9;]*mdivergence", text)  # red
    d.__exit__(None, None, None)


def test_live_keeps_only_last_events():
    con, buf = make_console(terminal=True)
    with Display(200, mode="live", console=con) as d:
        for i in range(12):
            d.event({"step": i, "kind": "overflow", "message": f"msg-{i:02d}"})
    final = plain(buf.getvalue())
    final = final[final.rfind("ampctl train") :]
    assert "msg-11" in final and "msg-07" in final and "msg-06" not in final
    assert "overflow 12" in final


def test_live_narrow_console_stacks_tables():
    con, buf = make_console(terminal=True, width=60)
    with Display(200, mode="live", console=con) as d:
        d.update(metrics(40))
    final = plain(buf.getvalue())
    final = final[final.rfind("ampctl train") :]
    assert "4.1234" in final and "1024 (2^10)" in final
    assert all(len(line) <= 60 for line in final.splitlines())


def test_live_forced_on_non_terminal_prints_final_frame_without_ansi():
    con, buf = make_console(terminal=False)
    with Display(200, mode="live", console=con) as d:
        d.update(metrics(40))
        d.event({"step": 41, "kind": "fallback", "message": "fp16 -> bf16"})
    out = buf.getvalue()
    assert "\x1b" not in out
    assert out.count("ampctl train") == 1
    d.summary({"final_loss": 1.0})
    assert "\nampctl train - summary" in buf.getvalue()  # the frame's last line is terminated
    assert "4.1234" in out and "fp16 -> bf16" in out


def test_live_stops_cleanly_on_exception():
    con, buf = make_console(terminal=True)
    stdout = sys.stdout
    with pytest.raises(RuntimeError, match="kaboom"):
        with Display(200, mode="live", console=con) as d:
            d.update(metrics(40))
            raise RuntimeError("kaboom")
    assert sys.stdout is stdout  # Live's stdout redirection was undone
    assert d._live is None
    assert "4.1234" in plain(buf.getvalue())
    # the console is usable for a new Live afterwards
    with Display(200, mode="live", console=con) as d2:
        d2.update(metrics(41))


def test_update_without_context_manager_and_summary_stops_live():
    con, buf = make_console(terminal=True)
    d = Display(200, mode="live", console=con)
    d.update(metrics(40))
    assert d._live is not None
    d.summary({"final_loss": 1.5, "run_dir": "runs/x"})
    assert d._live is None
    out = plain(buf.getvalue())
    assert out.rfind("summary") > out.rfind("ampctl train ")  # summary printed after the last frame


# ----------------------------------------------------------------------------- deps


def test_display_does_not_import_torch():
    code = "import sys, ampctl.ui.display; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env)
    assert r.returncode == 0


def test_markup_like_strings_are_shown_verbatim():
    con, buf = make_console(terminal=False)
    d = Display(10, mode="live", console=con, title="run [bold]x[/bold]")
    with d:
        d.update({"step": 1, "precision": "[red]fp16"})
        d.event({"step": 1, "kind": "fallback", "message": "[/] weird [b]"})
    d.summary({"[k]": "[v]", "run_dir": "runs/[x]"})
    out = buf.getvalue()
    for s in ("run [bold]x[/bold]", "[red]fp16", "[/] weird [b]", "[k]", "[v]", "runs/[x]"):
        assert s in out, s


# ====================================================================================== fp8 figures
ROW = {
    "step": 40,
    "loss": 4.1,
    "precision": "fp8",
    "fp8_layers": 13,
    "fp8_sat": 0.0068,
    "fp8_sat_layer": "bert.encoder.layer.1.attention.output.dense",
    "fp8_under": 3.05e-05,
    "fp8_under_layer": "bert.encoder.layer.0.intermediate.dense",
    "fp8_nonfinite_layers": 2,
}


def _console(width: int = 200, terminal: bool = False) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=terminal, color_system=None), buf


def test_plain_line_ends_with_the_worst_fp8_layer_figures():
    con, buf = _console()
    d = Display(200, mode="plain", console=con)
    d.update(ROW)
    d.update({**ROW, "fp8_sat": None, "fp8_sat_layer": None})  # no figure: "-"
    d.update({"step": 50, "precision": "bf16"})  # after a fallback: no fp8 keys
    first, second, third = buf.getvalue().splitlines()
    assert first.endswith(
        " eta=- fp8_sat=0.7%@bert.encoder.layer.1.attention.output.dense"
        " fp8_under=0.003%@bert.encoder.layer.0.intermediate.dense fp8_nonfinite=2"
    )
    assert " fp8_sat=- fp8_under=0.003%@" in second
    assert "fp8" not in third.replace("prec=bf16", "")


def test_live_table_shows_fp8_cells_and_a_demotion_event():
    d = Display(200, mode="quiet", console=_console()[0])  # render() is the live frame
    d.update(ROW)
    d.event({"step": 40, "kind": "demotion", "message": "x: fp8 -> bf16 (non-finite)"})
    con, buf = _console(width=160)
    con.print(d.render())
    text = buf.getvalue()
    for part in ("fp8 layers", "13", "fp8 nonfinite", "fp8 sat", "0.7%", "fp8 under", "demotion"):
        assert part in text, part
    assert "0.7% ...layer.1.attention.output.dense" in text  # long names keep their tail


def test_summary_counts_the_fp8_layers():
    con, buf = _console()
    Display(10, mode="quiet", console=con).summary(
        {"fp8_layers": [f"l{i}" for i in range(13)], "fp8_demoted": {"l3": "why"}}
    )
    text = buf.getvalue()
    assert "13 layers: l0 ... l12" in text and "l3=why" in text
