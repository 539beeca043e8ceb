"""The spike rule (ampctl.amp.spike) on planted records: the window it reads, the thresholds it
hands the scaler, the z-scores of an event and its saved state -- exactly, in milliseconds."""

from __future__ import annotations

import math

import pytest
import torch

from ampctl.amp import records as rec
from ampctl.amp.spike import SpikeRule, WindowStats, _stats
from ampctl.protect.figures import DeviceFigures
from tests.protect.recorded import row, scaler_with

INF, NAN = math.inf, math.nan


def _read(rule: SpikeRule, scaler) -> dict:
    fig = DeviceFigures(torch.device("cpu"))
    rule.figures(fig, scaler)
    return fig.read()


def test_window_stats_threshold_and_z():
    w = WindowStats(2.0, 0.5, 9)
    assert w.threshold(6.0) == 5.0 and w.threshold(0.0) == 2.0
    assert w.z(3.0) == 2.0 and w.z(1.5) == -1.0
    assert math.isnan(w.z(INF)) and math.isnan(w.z(NAN)) and math.isnan(w.z(-INF))
    flat = WindowStats(2.0, 0.0, 3)  # no spread: anything above the mean is infinitely far
    assert flat.z(2.5) == INF and flat.z(2.0) == INF and flat.threshold(6.0) == 2.0


def test_stats_need_two_values_and_are_the_population_figures():
    assert _stats([]) is None and _stats([4.0]) is None
    assert _stats([1.0, 3.0]) == WindowStats(2.0, 1.0, 2)
    s = _stats([1.0, 2.0, 3.0, 6.0])
    assert (s.mean, s.n) == (3.0, 4) and s.std == pytest.approx(math.sqrt(3.5), rel=1e-12)


def test_the_rule_defaults_and_its_arguments():
    r = SpikeRule()
    assert (r.z, r.window, r.min_steps, r.grad_norm, r.enabled) == (6.0, 128, 128, True, True)
    assert r.loss is None and r.norm is None
    r = SpikeRule(z=3, window=16, min_steps=4, grad_norm=0, enabled=1)
    assert (r.z, r.window, r.min_steps, r.grad_norm, r.enabled) == (3.0, 16, 4, False, True)
    assert type(r.z) is float and type(r.grad_norm) is bool and type(r.enabled) is bool
    assert SpikeRule(window=5).min_steps == 5 and SpikeRule(window=5, min_steps=2).min_steps == 2


def test_figures_add_the_windows_skip_flag_loss_and_grad_norm_columns():
    rows = [row(loss=float(i), gnorm=10.0 + i, skipped=i == 2) for i in range(1, 5)]
    scaler = scaler_with(rows)
    got = _read(SpikeRule(window=3), scaler)
    assert got == {"spike_window": [1.0, 2.0, 12.0, 0.0, 3.0, 13.0, 0.0, 4.0, 14.0]}
    # the whole record when the window is longer than it
    assert _read(SpikeRule(window=10), scaler)["spike_window"][:3] == [0.0, 1.0, 11.0]


def test_figures_add_nothing_when_disabled_or_before_the_first_update():
    scaler = scaler_with([row(), row()])
    assert _read(SpikeRule(enabled=False), scaler) == {}
    empty = scaler_with([])
    assert empty.num_updates == 0
    assert _read(SpikeRule(), empty) == {}


def _window(rows: list[list[float]]) -> dict:
    """The values of a log read whose spike window holds ``rows`` (skipped, loss, gnorm)."""
    return {"spike_window": [x for r in rows for x in r]}


def test_on_read_sets_thresholds_from_the_clean_finite_steps_only():
    scaler = scaler_with([row()])
    rule = SpikeRule(z=2.0, window=8, min_steps=3)
    rule.on_read(
        _window(
            [
                [0.0, 1.0, 10.0],
                [1.0, 1000.0, 9000.0],  # a skipped step: left out
                [0.0, 3.0, 30.0],
                [0.0, NAN, INF],  # not finite: left out of both
                [0.0, 2.0, 20.0],
            ]
        ),
        scaler,
    )
    sd = math.sqrt(2.0 / 3.0)
    assert (rule.loss.mean, rule.loss.n) == (2.0, 3)
    assert rule.loss.std == pytest.approx(sd, rel=1e-12)
    assert (rule.norm.mean, rule.norm.n) == (20.0, 3)
    assert rule.norm.std == pytest.approx(10 * sd, rel=1e-12)
    lt, gt = scaler.spike_thresholds
    assert lt == pytest.approx(2.0 + 2.0 * sd, rel=1e-12)
    assert gt == pytest.approx(20.0 + 20.0 * sd, rel=1e-12)
    # the thresholds are on the device too, in the packed vector the next step compares with
    assert scaler._t["vec"][2].item() == pytest.approx(lt, rel=1e-6)
    assert scaler._t["vec"][3].item() == pytest.approx(gt, rel=1e-6)


def test_on_read_waits_for_min_steps_clean_values():
    scaler = scaler_with([row()])
    rule = SpikeRule(window=8, min_steps=3)
    rule.on_read(_window([[0.0, 1.0, 5.0], [0.0, 2.0, NAN], [0.0, 3.0, 7.0]]), scaler)
    assert rule.loss is not None and rule.loss.n == 3  # exactly min_steps: acts
    assert rule.norm is None  # two finite norms only
    assert scaler.spike_thresholds[1] == INF and scaler.spike_thresholds[0] < INF
    rule.on_read(_window([[0.0, 1.0, 5.0], [0.0, 2.0, 6.0]]), scaler)
    assert rule.loss is None and rule.norm is None
    assert scaler.spike_thresholds == (INF, INF)  # back off: too few steps to judge


def test_on_read_reads_the_window_three_values_a_step():
    scaler = scaler_with([row()])
    rule = SpikeRule(window=4, min_steps=2)
    # zero losses and norms: a window read at any other stride would take them for clean flags
    rule.on_read(_window([[0.0, 0.0, 4.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), scaler)
    assert rule.loss == WindowStats(1.0, 1.0, 2) and rule.norm == WindowStats(2.0, 2.0, 2)


def test_on_read_without_the_grad_norm_rule_keeps_its_threshold_off():
    scaler = scaler_with([row()])
    rule = SpikeRule(window=4, min_steps=2, grad_norm=False)
    rule.on_read(_window([[0.0, 1.0, 5.0], [0.0, 3.0, 7.0]]), scaler)
    assert rule.loss == WindowStats(2.0, 1.0, 2) and rule.norm is None
    assert scaler.spike_thresholds == (8.0, INF)


def test_on_read_does_nothing_without_its_window_or_when_disabled():
    scaler = scaler_with([row()])
    scaler.set_spike_thresholds(loss=5.0, grad_norm=7.0)
    rule = SpikeRule(window=4, min_steps=2)
    rule.loss = WindowStats(1.0, 1.0, 2)
    rule.on_read({"loss_sum": 3.0}, scaler)
    assert scaler.spike_thresholds == (5.0, 7.0) and rule.loss == WindowStats(1.0, 1.0, 2)
    off = SpikeRule(window=4, min_steps=2, enabled=False)
    off.on_read(_window([[0.0, 1.0, 5.0], [0.0, 3.0, 7.0]]), scaler)
    assert scaler.spike_thresholds == (5.0, 7.0) and off.loss is None and off.norm is None


def test_z_scores_against_the_window_in_force():
    rule = SpikeRule()
    assert rule.z_scores(5.0, 5.0) == {}
    rule.loss = WindowStats(2.0, 0.5, 9)
    assert rule.z_scores(5.0, 7.0) == {"loss_z": 6.0}
    rule.norm = WindowStats(1.0, 2.0, 9)
    assert rule.z_scores(5.0, 7.0) == {"loss_z": 6.0, "grad_norm_z": 3.0}
    z = rule.z_scores(NAN, NAN)  # a non-finite loss still has its (NaN) z; a NaN norm none
    assert list(z) == ["loss_z"] and math.isnan(z["loss_z"])
    rule.loss = None
    assert rule.z_scores(5.0, 3.0) == {"grad_norm_z": 1.0}


def test_state_dict_round_trip_puts_the_thresholds_back_on_the_scaler():
    rule = SpikeRule(z=4.0)
    assert rule.state_dict() == {"loss": None, "norm": None}
    rule.loss = WindowStats(2.0, 0.5, 9)
    rule.norm = WindowStats(1.0, 0.25, 7)
    sd = rule.state_dict()
    assert sd == {"loss": [2.0, 0.5, 9], "norm": [1.0, 0.25, 7]}
    scaler = scaler_with([row()])
    back = SpikeRule(z=4.0)
    back.load_state_dict({"loss": [2, 0.5, 9.0], "norm": [1, 0.25, 7.0]}, scaler)
    assert back.loss == WindowStats(2.0, 0.5, 9) and back.norm == WindowStats(1.0, 0.25, 7)
    assert type(back.loss.mean) is float and type(back.loss.std) is float
    assert type(back.norm.n) is int
    assert scaler.spike_thresholds == (4.0, 2.0)
    back.load_state_dict({"loss": [3.0, 1.0, 4]}, scaler)  # no norm saved
    assert back.norm is None and scaler.spike_thresholds == (7.0, INF)
    back.load_state_dict(None, scaler)
    assert back.loss is None and back.norm is None and scaler.spike_thresholds == (INF, INF)


def test_a_disabled_rule_loads_its_state_but_sets_no_threshold():
    scaler = scaler_with([row()])
    scaler.set_spike_thresholds(loss=5.0, grad_norm=7.0)
    off = SpikeRule(enabled=False)
    off.load_state_dict({"loss": [2.0, 0.5, 9], "norm": None}, scaler)
    assert off.loss == WindowStats(2.0, 0.5, 9)
    assert scaler.spike_thresholds == (5.0, 7.0)


def test_the_window_comes_from_the_records_the_scaler_kept():
    rows = [row(loss=1.0 + 0.1 * i, skipped=False) for i in range(6)]
    rows.append(row(loss=500.0, skipped=True, loss_thr=2.0))
    scaler = scaler_with(rows)
    assert rec.kind(rows[-1]) == rec.SPIKE
    rule = SpikeRule(z=6.0, window=8, min_steps=4)
    rule.on_read(_read(rule, scaler), scaler)
    assert rule.loss.n == 6 and rule.loss.mean == pytest.approx(1.25, rel=1e-6)
    assert rule.norm is None  # no grad norm was reported
    assert scaler.spike_thresholds[0] == pytest.approx(rule.loss.threshold(6.0), rel=1e-12)
