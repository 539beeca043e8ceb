"""The log step's figures (ampctl.protect.figures): the interval's loss on the device, every value
read in one transfer, the SUM and MAX reductions across ranks applied to exactly the values that
need them, and the names the metrics row reads -- on planted records and hand-made tensors; and
the log window's course loss at its boundary: a window that began at the scaler's last update has
no step of its own yet, so it has no course (mutation survivors of issue #31).
"""

from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
from torch import nn

from ampctl.hostreads import count_host_reads
from ampctl.protect.figures import DeviceFigures, LogWindow, gather_log_figures, sampling
from tests.protect.recorded import row, scaler_with

CPU = torch.device("cpu")
NAN = math.nan


class _TwoRanks:
    """A process group of two ranks whose other rank holds ``other`` in every value."""

    enabled = True

    def __init__(self, other: float) -> None:
        self.other = other
        self.calls: list[tuple[str, list[float]]] = []

    def reduce_sum(self, t):
        self.calls.append(("sum", t.tolist()))
        return t + self.other

    def reduce_max(self, t):
        self.calls.append(("max", t.tolist()))
        return torch.maximum(t, torch.full_like(t, self.other))


# ------------------------------------------------------------------ LogWindow
def test_a_log_window_starts_empty_at_update_zero():
    before = time.perf_counter()
    w = LogWindow()
    assert (w.first_update, w.loss_sum, w.loss_n, w.tokens) == (0, None, None, 0)
    assert before <= w.t0 <= time.perf_counter()


def test_handed_over_losses_sum_the_finite_ones_and_count_the_tokens():
    w = LogWindow(first_update=3)
    w.add(torch.tensor(2.0), tokens=5)
    assert w.loss_sum.item() == 2.0 and w.loss_n.item() == 1.0 and w.tokens == 5
    w.add(torch.tensor(float("inf")), tokens=7)
    w.add(torch.tensor(NAN))
    w.add(torch.tensor(0.5, dtype=torch.float64), tokens=1)
    assert w.loss_sum.item() == 2.5 and w.loss_n.item() == 2.0 and w.tokens == 13
    assert w.loss_n.dtype == torch.float64
    scaler = scaler_with([row(loss=9.0)] * 5)
    s, n = w.loss(scaler)  # what was handed over wins over the scaler's records
    assert (s.item(), n.item()) == (2.5, 2.0)


def test_without_handed_over_losses_the_window_reads_the_scalers_records():
    scaler = scaler_with([row(loss=1.0), row(loss=2.0), row(loss=NAN, skipped=True), row(loss=4.0)])
    s, n = LogWindow(first_update=1).loss(scaler)
    assert (s.item(), n.item()) == (6.0, 2.0)
    s, n = LogWindow(first_update=0).loss(scaler)
    assert (s.item(), n.item()) == (7.0, 3.0)
    s, n = LogWindow(first_update=3).loss(scaler)
    assert (s.item(), n.item()) == (4.0, 1.0)
    assert LogWindow(first_update=4).loss(scaler) == (0.0, 0.0)  # nothing since
    assert LogWindow(first_update=6).loss(scaler) == (0.0, 0.0)
    got = LogWindow(first_update=4).loss(scaler)
    assert all(type(x) is float for x in got)


def test_the_rows_loss_is_over_the_applied_steps_the_skipped_ones_counted_apart():
    """The issue's row: a spike the rule skipped (2948) among steps of ~2.6 is not averaged into
    the row's loss, nor is an overflow's loss; the skip counters count them. An interval whose
    every step was skipped keeps their finite losses (a row of skips is not a NaN loss)."""
    rows = [
        row(loss=2.6, loss_thr=10.0),
        row(loss=2948.0, skipped=True, loss_thr=10.0),  # a spike, vetoed
        row(loss=2.5, skipped=True, loss_thr=10.0),  # a gradient overflow: finite loss, skipped
        row(loss=2.7, loss_thr=10.0),
    ]
    s, n = LogWindow(first_update=0).loss(scaler_with(rows))
    assert n.item() == 2.0 and s.item() / n.item() == pytest.approx(2.65)
    skips = [row(loss=2.5, skipped=True), row(loss=NAN, skipped=True), row(loss=3.5, skipped=True)]
    s, n = LogWindow(first_update=0).loss(scaler_with(skips))
    assert (s.item(), n.item()) == (6.0, 2.0)
    # a step the guard reran clean (mark_applied) counts as applied again
    rerun = scaler_with([row(loss=2.0), row(loss=4.0, skipped=True)])
    rerun.mark_applied()
    s, n = LogWindow(first_update=0).loss(rerun)
    assert (s.item(), n.item()) == (6.0, 2.0)
    scaler = scaler_with(rows)
    scaler.recent_records(1)  # the device state exists
    with count_host_reads() as reads:
        LogWindow(first_update=0).loss(scaler)
    assert reads.total == 0


def test_log_window_state_round_trip():
    w = LogWindow(first_update=7, tokens=11)
    assert w.state_dict() == {"first_update": 7, "loss_sum": None, "loss_n": None, "tokens": 11}
    w.add(torch.tensor(3.0), tokens=4)
    sd = w.state_dict()
    assert sd["first_update"] == 7 and sd["tokens"] == 15
    assert sd["loss_sum"].item() == 3.0 and sd["loss_n"].item() == 1.0
    assert sd["loss_sum"].device == CPU and not sd["loss_sum"].requires_grad
    back = LogWindow.from_state(sd, CPU)
    assert (back.first_update, back.tokens) == (7, 15)
    assert back.loss_sum.item() == 3.0 and back.loss_n.item() == 1.0
    meta = LogWindow.from_state(sd, torch.device("meta"))
    assert meta.loss_sum.device.type == "meta" and meta.loss_n.device.type == "meta"
    fresh = LogWindow.from_state(None, CPU)
    assert (fresh.first_update, fresh.tokens, fresh.loss_sum, fresh.loss_n) == (0, 0, None, None)
    part = LogWindow.from_state({"first_update": "2", "tokens": 3.0, "loss_sum": None}, CPU)
    assert (part.first_update, part.tokens, part.loss_sum) == (2, 3, None)
    assert type(part.first_update) is int and type(part.tokens) is int


# ------------------------------------------------------------------ DeviceFigures
def test_figures_come_back_as_numbers_or_lists_in_one_read():
    fig = DeviceFigures(CPU)
    assert fig.device == CPU and fig.read() == {}
    fig.add("a", 1.5)
    fig.add("none", None)
    fig.add("t", torch.tensor(2))
    fig.add("vec1", torch.tensor([3.0]), vector=True)
    fig.add("grid", torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    fig.add("s", torch.tensor(5.0, requires_grad=True), "sum")
    fig.add("m", torch.tensor([6.0, 7.0]), "max")
    with count_host_reads() as reads:
        got = fig.read()
    assert reads.total == 1
    assert list(got) == ["s", "m", "a", "none", "t", "vec1", "grid"]  # sum, max, then the rest
    assert got["a"] == 1.5 and got["t"] == 2.0 and got["s"] == 5.0
    assert math.isnan(got["none"])
    assert got["vec1"] == [3.0] and got["grid"] == [1.0, 2.0, 3.0, 4.0] and got["m"] == [6.0, 7.0]
    assert all(t.dtype == torch.float64 and t.dim() == 1 for _, t, _ in fig._items)


def test_figures_are_moved_to_the_figures_device():
    fig = DeviceFigures(torch.device("meta"))
    fig.add("x", torch.tensor(1.0))
    fig.add("y", 2.0, "max")
    assert [(n, t.device.type, r) for n, t, r in fig._items] == [
        ("x", "meta", None),
        ("y", "meta", "max"),
    ]


def test_ranks_sum_and_max_exactly_the_values_that_ask_for_it():
    fig = DeviceFigures(CPU)
    fig.add("keep", 1.0)
    fig.add("s1", 2.0, "sum")
    fig.add("m", torch.tensor([3.0, 20.0]), "max")
    fig.add("s2", torch.tensor([4.0, 5.0]), "sum")
    ctx = _TwoRanks(10.0)
    got = fig.read(ctx)
    assert ctx.calls == [("sum", [2.0, 4.0, 5.0]), ("max", [3.0, 20.0])]  # one each
    assert got == {"s1": 12.0, "s2": [14.0, 15.0], "m": [10.0, 20.0], "keep": 1.0}
    off = _TwoRanks(10.0)
    off.enabled = False
    assert fig.read(off) == {"s1": 2.0, "s2": [4.0, 5.0], "m": [3.0, 20.0], "keep": 1.0}
    assert off.calls == []
    assert fig.read(object()) == fig.read(None)  # a context without `enabled`: one process


def test_a_max_only_read_reduces_once():
    fig = DeviceFigures(CPU)
    fig.add("m", 3.0, "max")
    ctx = _TwoRanks(-1.0)
    assert fig.read(ctx) == {"m": 3.0} and ctx.calls == [("max", [3.0])]


# ------------------------------------------------------------------ probes
class _Probe:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    @contextlib.contextmanager
    def sampling(self, model, enabled):
        self.log.append((self.name, "in", enabled, model))
        yield
        self.log.append((self.name, "out"))

    def figures(self, fig):
        fig.add(f"{self.name}_fig", 1.0, "max")

    def row(self, values):
        return {}


def test_sampling_opens_every_probe_on_a_log_step_only():
    log: list = []
    model = nn.Linear(1, 1)
    probes = [_Probe(log, "a"), _Probe(log, "b")]
    with sampling(probes, model, False):
        log.append("body")
    assert log == ["body"]
    with sampling([], model, True):
        log.append("body")
    assert log == ["body", "body"]
    log.clear()
    with sampling(probes, model, True):
        log.append("body")
    assert log == [("a", "in", True, model), ("b", "in", True, model), "body", ("b", "out"),
                   ("a", "out")]  # fmt: skip


# ------------------------------------------------------------------ gather_log_figures
class _Protection:
    def log_figures(self, fig):
        fig.add("from_protection", 9.0)


def _stats():
    return {
        "grad_norm": torch.tensor(3.0),
        "grad_underflow": torch.tensor(4.0),
        "grad_elems": torch.tensor(10.0),
        "nonfinite_grads": torch.tensor(1.0),
        "grad_amax": torch.tensor(2.5),
    }


def test_gather_names_every_figure_the_row_reads_and_how_ranks_combine_it():
    rows = [row(loss=1.0, skipped=True), row(loss=3.0, scale=512.0), row(loss=5.0)]
    scaler = scaler_with(rows)
    fig = DeviceFigures(CPU)
    gather_log_figures(
        fig,
        window=LogWindow(first_update=1),
        stats=_stats(),
        scaler=scaler,
        overflow_window=2,
        lr=torch.tensor(0.01),
        probes=[_Probe([], "p")],
        protection=_Protection(),
    )
    kinds = {n: r for n, _, r in fig._items}
    assert kinds == {
        "loss_sum": "sum",
        "loss_n": "sum",
        "course_loss_sum": "sum",
        "course_loss_n": "sum",
        "grad_norm_sq": None,
        "grad_underflow": None,
        "grad_elems": None,
        "nonfinite_grads": None,
        "grad_amax": None,
        "scale": None,
        "skipped_total": None,
        "forward_overflows": None,
        "spikes": None,
        "consecutive_overflows": None,
        "last_skipped": None,
        "recent_skips": None,
        "lr": None,
        "p_fig": "max",
        "from_protection": None,
    }
    got = fig.read()
    assert (got["loss_sum"], got["loss_n"]) == (8.0, 2.0)
    assert (got["course_loss_sum"], got["course_loss_n"]) == (8.0, 2.0)  # no spike among them
    assert got["grad_norm_sq"] == 9.0 and got["grad_amax"] == 2.5 and got["grad_elems"] == 10.0
    assert (got["grad_underflow"], got["nonfinite_grads"]) == (4.0, 1.0)
    assert got["skipped_total"] == 1.0 and got["recent_skips"] == 0.0  # the last 2: clean
    assert got["lr"] == pytest.approx(0.01) and got["from_protection"] == 9.0


def test_gather_sharded_gradients_are_summed_and_their_max_taken_across_ranks():
    scaler = scaler_with([row(loss=1.0)])
    fig = DeviceFigures(CPU)
    gather_log_figures(
        fig, window=LogWindow(), stats=_stats(), scaler=scaler, overflow_window=4, lr=0.1,
        sharded=True,
    )  # fmt: skip
    kinds = {n: r for n, _, r in fig._items}
    assert [kinds[k] for k in ("grad_norm_sq", "grad_underflow", "grad_elems")] == ["sum"] * 3
    assert kinds["nonfinite_grads"] == "sum" and kinds["grad_amax"] == "max"
    got = fig.read(_TwoRanks(1.0))
    assert got["grad_norm_sq"] == 10.0 and got["grad_amax"] == 2.5 and got["loss_n"] == 2.0


def test_gather_without_gradient_statistics_probes_or_protection():
    scaler = scaler_with([row(loss=2.0)])
    fig = DeviceFigures(CPU)
    gather_log_figures(
        fig, window=LogWindow(), stats=None, scaler=scaler, overflow_window=4, lr=None
    )
    got = fig.read()
    assert "grad_norm_sq" not in got and "grad_amax" not in got
    assert got["loss_sum"] == 2.0 and math.isnan(got["lr"])
    assert got["scale"] == 1024.0 and got["recent_skips"] == 0.0


def test_the_course_loss_leaves_out_the_spikes_the_rule_skipped():
    """The divergence rule's course: a skipped step whose loss was above the spike threshold is
    left out; an overflow (skipped, loss under the threshold) and clean steps stay in."""
    rows = [
        row(loss=2.0, loss_thr=10.0),
        row(loss=500.0, skipped=True, loss_thr=10.0),  # the spike rule's veto
        row(loss=3.0, skipped=True, loss_thr=10.0),  # a gradient overflow
        row(loss=4.0, loss_thr=10.0),
    ]
    window = LogWindow(first_update=0)
    total = window.loss(scaler_with(rows))
    course = window.course_loss(scaler_with(rows))
    assert (total[0].item(), total[1].item()) == (6.0, 2.0)  # the row's: applied steps only
    assert (course[0].item(), course[1].item()) == (9.0, 3.0)
    window.add(torch.tensor(1.0))  # losses handed over: no record of which step was a spike
    assert window.course_loss(scaler_with(rows)) is None


# ====================================================== the course loss at its boundary (issue #31)
def test_a_window_that_began_at_the_last_update_has_no_course_loss_yet():
    scaler = scaler_with([row(loss=2.0), row(loss=3.0)])
    assert scaler.num_updates == 2
    assert LogWindow(first_update=2).course_loss(scaler) is None
    assert LogWindow(first_update=2).loss(scaler) == (0.0, 0.0)
    course = LogWindow(first_update=1).course_loss(scaler)  # one step since: update 2
    assert (course[0].item(), course[1].item()) == (3.0, 1.0)
