"""The display's fp8 figures: plain-line keys and live cells, only for an fp8 run's rows."""

from __future__ import annotations

import io

from rich.console import Console

from ampctl.ui.display import Display

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
