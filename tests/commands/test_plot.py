"""ampctl plot: run and sweep figures from the folders alone, degrading without matplotlib, and
the TensorBoard sink."""

from __future__ import annotations

import errno
import importlib.util
import json
import math
import shutil
import sys

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.commands.plot import (
    HINT,
    PlotUnavailable,
    build_run_figure,
    build_sweep_figure,
    load_run_data,
    maybe_plot_run,
    plot_run,
    plot_sweep,
    run_plot,
)
from ampctl.config import load_config
from ampctl.errors import UsageError
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import train
from ampctl.ui.tensorboard import TB_HINT, TensorBoardSink, make_tensorboard_sink
from tests.conftest import FAST, read_jsonl

PNG = b"\x89PNG\r\n\x1a\n"
PLANTED = (5, 9, 10)  # 9 and 10 in a row: with rollback_after=2 the guard rolls back at step 10
runner = CliRunner()
needs_mpl = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason='needs matplotlib (pip install "ampctl[plot]")',
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 12-step fp16 run: an isolated gradient overflow at step 5, then two in a row at
    9 and 10 -> rollback to the snapshot of step 7 and replay to 12."""
    torch.set_num_threads(1)
    runs = tmp_path_factory.mktemp("plot") / "runs"
    cfg = load_config(
        [*FAST, f"trainer.runs_dir={runs}", "guard.rollback_after=2", "guard.snapshot_every=2"]
    )
    todo = set(PLANTED)

    def fault(tr, step, phase):
        if step in todo:  # once each: the replayed steps 9 and 10 after the rollback are clean
            todo.discard(step)
            next(iter(tr.params)).grad.view(-1)[0] = float("inf")

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "planted"), fault=fault)
    assert res.status == "ok"
    return res.run_dir


def by_gid(ax, gid):
    return [a for a in ax.lines if a.get_gid() == gid]


def assert_one_line_exit_2(result, text):
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert err.splitlines() == [f"ampctl: error: {text}"]
    assert "Traceback" not in result.output


@needs_mpl
def test_run_figure_panels_skips_and_events(run):
    kinds = [e["kind"] for e in read_jsonl(run / "events.jsonl")]
    assert kinds == ["overflow", "overflow", "overflow", "rollback"]  # the run did what we planted
    fig = build_run_figure(run)
    ax_loss, ax_scale, ax_rate, ax_gn, ax_uf = fig.axes
    assert [a.get_ylabel() for a in fig.axes] == [
        "loss",
        "loss scale (log2)",
        "overflow rate",
        "grad norm",
        "underflow fraction (log)",  # a real fp16 run: ~0.05% of param grads next to ~45% of act
    ]
    assert ax_scale.get_yscale() == "log" and ax_scale.yaxis.get_transform().base == 2
    assert ax_gn.get_xlabel() == "step"
    assert ax_loss.get_shared_x_axes().joined(ax_loss, ax_gn)

    # skipped steps: the exact planted steps (checkpoint scaler history), at the scale each used
    (skips,) = by_gid(ax_scale, "skips")
    assert list(skips.get_xdata()) == list(PLANTED)
    assert list(skips.get_ydata()) == [1024.0, 512.0, 256.0]
    assert load_run_data(run).skip_source == "history"

    # the rollback: decided at step 10, back to step 7, marked on every panel
    for ax in (ax_loss, ax_scale, ax_rate, ax_gn):
        (line,) = by_gid(ax, "event:rollback")
        assert list(line.get_xdata()) == [10, 10]
    (ticks,) = by_gid(ax_rate, "overflow:gradient")
    assert list(ticks.get_xdata()) == list(PLANTED)

    # rows logged before the rollback at step 8 are drawn apart from the replayed row at 8
    loss_line = next(line for line in ax_loss.lines if line.get_label().startswith("loss ("))
    assert list(loss_line.get_xdata()) == [4, 8, 12]
    assert len(by_gid(ax_loss, "abandoned")) == 1
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    for label in (
        "rollback",
        "skipped step",
        "overflow event (gradient)",
        "rolled-back steps (discarded)",
    ):
        assert label in legend
    assert fig.get_suptitle() == "planted | fp16 | ok | step 12/12 | 3 skipped | final scale 2^5"


@needs_mpl
def test_plot_run_writes_png_and_cli(run, tmp_path):
    out = plot_run(run)
    assert out == run / "plot.png"
    data = out.read_bytes()
    assert data[:8] == PNG and len(data) > 1000
    res = runner.invoke(app, ["plot", str(run), "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"wrote {tmp_path / 'x.png'}"
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG
    assert not list(tmp_path.glob(".*.tmp"))


@needs_mpl
def test_copied_run_without_checkpoints_uses_metrics_and_baseline(run, tmp_path):
    copy = tmp_path / "copied"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "plot.png"))
    data = load_run_data(copy)
    assert data.skip_source == "metrics"
    # rows (step, cumulative skipped): (4, 0) (8, 1) (8, 3) (12, 3): skips per log interval
    assert [(m.step, m.count, m.exact) for m in data.skips] == [(8, 1, False), (8, 2, False)]
    fig = build_run_figure(copy, baseline=run)
    ax_loss, ax_scale = fig.axes[:2]
    assert by_gid(ax_scale, "skips") == []
    (approx,) = by_gid(ax_scale, "skips-interval")
    assert list(approx.get_xdata()) == [8, 8]
    (base,) = by_gid(ax_loss, "baseline")
    assert base.get_label() == f"baseline loss ({run.name})"
    rows = read_jsonl(run / "metrics.jsonl")
    assert list(base.get_ydata()) == [rows[0]["loss"], rows[2]["loss"], rows[3]["loss"]]


@needs_mpl
def test_several_baselines_each_drawn_with_its_own_style_and_name(run, tmp_path):
    others = []
    for i in range(3):
        d = tmp_path / f"base{i}"
        write_run(d, [row(4, 5.0 + i), row(8, 4.0 + i)])
        others.append(d)
    fig = build_run_figure(run, baseline=others)
    lines = by_gid(fig.axes[0], "baseline")
    assert [ln.get_label() for ln in lines] == [f"baseline loss (base{i})" for i in range(3)]
    assert [list(ln.get_ydata()) for ln in lines] == [[5.0 + i, 4.0 + i] for i in range(3)]
    assert len({(ln.get_color(), str(ln.get_linestyle())) for ln in lines}) == 3


@needs_mpl
def test_activation_gradient_underflow_is_drawn_next_to_the_parameter_figure(tmp_path):
    d = write_run(
        tmp_path / "r",
        [
            row(4, 5.0, grad_underflow_frac=0.001, act_grad_underflow_frac=0.9),
            row(8, 4.0, grad_underflow_frac=0.002, act_grad_underflow_frac=0.5),
        ],
    )
    ax_uf = build_run_figure(d).axes[-1]
    labels = {ln.get_label(): list(ln.get_ydata()) for ln in ax_uf.lines}
    # the legend says what each fraction counts
    assert labels["param-grad underflow (share of elements 0 or < 2^-24 once scaled)"] == [
        0.001,
        0.002,
    ]
    assert labels["activation-grad underflow (share of fp16 elements 0 or subnormal)"] == [
        0.9,
        0.5,
    ]
    assert ax_uf.get_ylim()[1] >= 0.9  # the axis holds the larger figure

    def height(y):  # where y sits on the axis, 0 (bottom) to 1 (top)
        return ax_uf.transAxes.inverted().transform(ax_uf.transData.transform((0, y)))[1]

    # 0.1% next to 90%: a log axis, so the small figure is readable, not flat on 0%
    assert ax_uf.get_yscale() == "log" and ax_uf.get_ylabel() == "underflow fraction (log)"
    assert height(0.001) > 0.05 and height(0.002) - height(0.001) > 0.05
    # figures of one order: a linear axis from 0, as a fraction reads best
    d2 = write_run(
        tmp_path / "r2",
        [
            row(4, 5.0, grad_underflow_frac=0.3, act_grad_underflow_frac=0.9),
            row(8, 4.0, grad_underflow_frac=0.2, act_grad_underflow_frac=0.5),
        ],
    )
    ax_uf = build_run_figure(d2).axes[-1]
    assert ax_uf.get_yscale() == "linear" and ax_uf.get_ylim()[0] == 0.0


@needs_mpl
def test_the_legend_fits_the_figure_with_long_labels_and_many_baselines(tmp_path):
    """The underflow labels say what they count and baselines carry their run names: the legend
    takes fewer columns rather than run off both sides of the figure (it did at 4 columns)."""
    rows = [row(4, 5.0, act_grad_underflow_frac=0.9), row(8, 4.0, act_grad_underflow_frac=0.5)]
    d = write_run(tmp_path / "fp16-ampctl", rows)
    bases = [write_run(tmp_path / n, rows) for n in ("fp32", "fp16-unscaled", "bf16", "fp16-2e24")]
    for baseline in (bases, bases[:1]):
        fig = build_run_figure(d, baseline=baseline)
        fig.canvas.draw()  # the figure comes on its own Agg canvas
        (legend,) = fig.legends
        box = legend.get_window_extent(fig.canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width, box
        texts = [t.get_text() for t in legend.get_texts()]
        assert "activation-grad underflow (share of fp16 elements 0 or subnormal)" in texts


def write_run(path, rows, events=(), tail=""):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def row(step, loss, scale=1024.0, skipped=0, **kw):
    base = dict(
        step=step,
        loss=loss,
        scale=scale,
        skipped=skipped,
        overflow_rate=0.0,
        grad_norm=1.0,
        grad_underflow_frac=0.01,
    )
    base.update(kw)
    return base


@needs_mpl
def test_nan_loss_null_grads_and_truncated_line_plot_as_gaps(tmp_path):
    rows = [
        row(2, 3.0),
        row(4, float("nan"), 512.0, 1, grad_norm=None, grad_underflow_frac=None),
        row(6, 2.5, 512.0, 1),
    ]
    events = [
        {"step": 3, "kind": "overflow", "message": "forward overflow", "overflow": "forward"},
        {"step": 3, "kind": "promotion", "message": "x now runs in fp32", "module": "x"},
    ]
    d = write_run(tmp_path / "r", rows, events, tail='{"step": 8, "lo')  # killed mid-write
    assert "NaN" in (d / "metrics.jsonl").read_text()
    fig = build_run_figure(d)
    ax_loss, ax_scale, ax_rate, ax_gn, ax_uf = fig.axes
    loss = next(line for line in ax_loss.lines if line.get_label().startswith("loss ("))
    assert list(loss.get_xdata()) == [2, 4, 6]
    assert math.isnan(loss.get_ydata()[1])
    gn = next(line for line in ax_gn.lines if line.get_label() == "grad norm")
    assert math.isnan(gn.get_ydata()[1])
    assert list(by_gid(ax_scale, "skips-interval")[0].get_xdata()) == [4]
    assert list(by_gid(ax_rate, "overflow:forward")[0].get_xdata()) == [3]
    assert list(by_gid(ax_loss, "event:promotion")[0].get_xdata()) == [3, 3]
    assert plot_run(d).read_bytes()[:8] == PNG


def fake_sweep(root, with_gap=True):
    """A sweep folder as ``ampctl sweep-scale`` writes it ({"trials": [...]} with ranks), or, with
    ``with_gap=False``, a bare list of rows without loss_gap or rank (no baseline)."""
    sweep = root / "sweep"
    sweep.mkdir()
    cols = (
        "trial",
        "kind",
        "status",
        "init_scale",
        "growth_interval",
        "final_loss",
        "loss_gap",
        "skipped",
        "rank",
    )
    results = [
        dict(zip(cols, r, strict=True))
        for r in [
            # equal gaps to 0.1%: the sweep ranks the one with fewer skipped steps first
            ("s1024-g100", "trial", "ok", 1024, 100, 3.0006, 0.1002, 0, 1),
            ("s1024-g500", "trial", "ok", 1024, 500, 3.0003, 0.1001, 3, 2),
            ("s65536-g100", "trial", "diverged", 65536, 100, None, None, 40, None),
            ("s65536-g500", "trial", "ok", 65536, 500, 3.4, 0.5, 9, 3),
            ("baseline-fp32", "baseline", "ok", None, None, 2.9, None, 0, None),
        ]
    ]
    doc = {"sweep": "sweep", "trials": results}
    if not with_gap:
        for r in results:
            del r["loss_gap"], r["rank"]
        doc = results
    (sweep / "results.json").write_text(json.dumps(doc))
    write_run(sweep / "s1024-g100", [row(5, 3.5, 1024.0), row(10, 3.1, 512.0, 1)])
    write_run(sweep / "s65536-g100", [row(5, 3.6, 16384.0, 2), row(10, float("nan"), 128.0, 9)])
    write_run(sweep / "baseline-fp32", [row(5, 3.4, 1.0), row(10, 2.9, 1.0)])
    return sweep


@needs_mpl
def test_sweep_heat_map_grid_and_trajectories(tmp_path):
    sweep = fake_sweep(tmp_path)
    fig = build_sweep_figure(sweep)
    ax_hm, ax_sc, ax_ls, cbar = fig.axes
    assert cbar.get_ylabel() == "loss_gap in whole 0.1% steps, below 0 as 0 (lower is better)"
    grid = ax_hm.images[0].get_array()
    assert grid.shape == (2, 2)  # growth_interval {100, 500} x init_scale {2^10, 2^16}
    assert grid.mask.tolist() == [[False, True], [False, False]]  # the diverged cell has no value
    # coloured as the sweep ranks them: +10.02% and +10.01% are one 0.1% step, one colour
    assert grid.data[0, 0] == grid.data[1, 0] == pytest.approx(0.1) and grid.data[1, 1] == 0.5
    assert "all tie" not in ax_hm.get_title()
    assert [t.get_text() for t in ax_hm.get_xticklabels()] == ["2^10", "2^16"]
    assert [t.get_text() for t in ax_hm.get_yticklabels()] == ["100", "500"]
    texts = {t.get_text() for t in ax_hm.texts}
    assert {"diverged", "+10.0%", "+50.0%"} <= texts
    (best,) = [p for p in ax_hm.patches if p.get_gid() == "best"]
    assert best.get_xy() == (-0.5, -0.5)  # the sweep's rank 1: init 2^10, growth 100
    assert (
        ax_hm.get_xlabel() == "scaler.init_scale" and ax_hm.get_ylabel() == "scaler.growth_interval"
    )
    assert sorted(line.get_gid() for line in ax_sc.lines if line.get_gid()) == [
        "trial:s1024-g100",
        "trial:s65536-g100",
    ]
    assert ax_sc.get_yscale() == "log"
    assert "baseline-fp32 (baseline)" in [line.get_label() for line in ax_ls.lines]
    # no loss_gap (no baseline): ranked by final_loss
    (tmp_path / "b").mkdir()
    fig2 = build_sweep_figure(fake_sweep(tmp_path / "b", with_gap=False))
    assert fig2.axes[0].images[0].get_array()[1, 0] == 3.0003
    assert fig2.axes[0].get_title() == "final_loss by init_scale x growth_interval"
    (best,) = [p for p in fig2.axes[0].patches if p.get_gid() == "best"]
    assert best.get_xy() == (-0.5, 0.5)  # no ranks: the lowest final loss, growth 500
    with pytest.raises(
        UsageError,
        match=r"^metric='tokens' is not in results.json; allowed here: loss_gap, final_loss, skipped$",
    ):
        build_sweep_figure(sweep, metric="tokens")
    out = plot_sweep(sweep)
    assert out == sweep / "plot.png" and out.read_bytes()[:8] == PNG


@needs_mpl
def test_a_sweep_where_every_cell_ties_is_one_colour_and_says_so(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    cols = ("trial", "kind", "status", "init_scale", "growth_interval", "loss_gap", "rank")
    trials = [
        dict(zip(cols, r, strict=True))
        for r in [  # the sweep: every gap under one 0.1% step, one cell 1e-5 apart
            ("init_scale=1", "trial", "ok", 1, 100, 5.1e-5, 3),
            ("init_scale=256", "trial", "ok", 256, 100, 0.0, 2),
            ("init_scale=65536", "trial", "ok", 65536, 100, -1e-6, 1),
        ]
    ]
    tie = {"tied": ["init_scale=65536", "init_scale=256"], "rule": "s_star", "target": 65536.0}
    doc = {"trials": trials, "recommendation": {"trial": "init_scale=65536", "tie": tie}}
    (sweep / "results.json").write_text(json.dumps(doc))
    fig = build_sweep_figure(sweep)
    ax_hm = fig.axes[0]
    assert len(fig.axes) == 3  # no colour bar pretending that the cells differ
    img = ax_hm.images[0]
    colours = img.to_rgba(img.get_array())[0]
    assert (colours == colours[0]).all()
    assert ax_hm.get_title() == (
        "loss_gap by init_scale x growth_interval: all tie\n"
        "red box: the recommendation (tie broken by the S* estimate)"
    )
    (best,) = [p for p in ax_hm.patches if p.get_gid() == "best"]
    assert best.get_xy() == (1.5, -0.5)  # rank 1: 2^16
    assert [t.get_text() for t in ax_hm.texts] == ["+0.0%", "+0.0%", "-0.0%"]
    # one whole step apart: two colours and a colour bar again
    trials[0]["loss_gap"] = 0.0011
    (sweep / "results.json").write_text(json.dumps(doc))
    fig = build_sweep_figure(sweep)
    img = fig.axes[0].images[0]
    assert len(fig.axes) == 4 and "all tie" not in fig.axes[0].get_title()
    colours = img.to_rgba(img.get_array())[0]
    assert (colours[0] != colours[1]).any() and (colours[1] == colours[2]).all()
    with pytest.raises(UsageError, match="--baseline applies to a run folder"):
        run_plot(sweep, None, baseline=sweep / "s1024-g100")


def test_without_matplotlib_a_hint_not_a_crash(run, tmp_path, monkeypatch):
    copy = tmp_path / "c"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "plot.png"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert (
        maybe_plot_run(copy)
        == HINT
        == 'plotting needs matplotlib: pip install "ampctl[plot]" (or pip install matplotlib)'
    )
    with pytest.raises(PlotUnavailable):
        run_plot(copy)
    assert_one_line_exit_2(runner.invoke(app, ["plot", str(copy)]), HINT)
    assert not (copy / "plot.png").exists()


@needs_mpl
def test_a_failed_write_is_a_message_not_a_crash(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    d = write_run(tmp_path / "r", [row(1, 2.0), row(2, 1.9)])

    def full(self, fname, **kw):
        fname.write(b"\x89PNG partial")  # savefig writes to the file object of ampctl.files
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    assert maybe_plot_run(d) == f"no plot: writing {d / 'plot.png'} failed: No space left on device"
    assert sorted(p.name for p in d.iterdir()) == ["events.jsonl", "metrics.jsonl"]  # no debris


@needs_mpl
def test_bad_input_one_line(tmp_path):
    missing = tmp_path / "nope"
    assert_one_line_exit_2(
        runner.invoke(app, ["plot", str(missing)]),
        f"{str(missing)!r} does not exist: give a run folder (with metrics.jsonl) or a sweep folder (with results.json)",
    )
    (tmp_path / "bare").mkdir()
    assert_one_line_exit_2(
        runner.invoke(app, ["plot", str(tmp_path / "bare")]),
        f"{str(tmp_path / 'bare')!r} has no metrics.jsonl: give a run folder written by ampctl train, or a sweep folder with results.json",
    )
    empty = write_run(tmp_path / "empty", [])
    msg = f"{str(empty / 'metrics.jsonl')!r} is empty: nothing to plot yet (a row is written every trainer.log_every steps)"
    assert_one_line_exit_2(runner.invoke(app, ["plot", str(empty)]), msg)
    assert maybe_plot_run(empty) == f"no plot: {msg}"
    ok = write_run(tmp_path / "ok", [row(1, 2.0)])
    assert_one_line_exit_2(
        runner.invoke(app, ["plot", str(ok), "--out", str(tmp_path / "x.jpg")]),
        f"--out {str(tmp_path / 'x.jpg')!r}: unknown image type; use a .png, .svg or .pdf name",
    )
    assert_one_line_exit_2(
        runner.invoke(app, ["plot", str(ok), "--baseline", str(tmp_path / "bare")]),
        f"{str(tmp_path / 'bare')!r} has no metrics.jsonl: give a run folder written by ampctl train, or a sweep folder with results.json",
    )
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "results.json").write_text('{"trials": 3}')
    assert_one_line_exit_2(
        runner.invoke(app, ["plot", str(tmp_path / "sw")]),
        f"{str(tmp_path / 'sw' / 'results.json')!r}: expected a list of trial objects (trial, init_scale, growth_interval, status, ...)",
    )


def test_tensorboard_sink_writes_scalars_and_events(run, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert make_tensorboard_sink(tmp_path, enabled=False) is None
    rows = read_jsonl(run / "metrics.jsonl")
    events = read_jsonl(run / "events.jsonl")
    sink = make_tensorboard_sink(tmp_path, enabled=True)
    assert isinstance(sink, TensorBoardSink)
    with sink:
        for r in rows:
            sink.log_metrics(r)
        for e in events:
            sink.log_event(e)
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "ampctl/loss",
        "ampctl/scale",
        "ampctl/skipped",
        "ampctl/grad_norm",
        "ampctl/events/overflow",
        "ampctl/events/rollback",
    } <= tags
    assert "ampctl/precision" not in tags and "ampctl/step" not in tags
    loss = acc.Scalars("ampctl/loss")
    assert [s.step for s in loss] == [r["step"] for r in rows]
    assert loss[0].value == pytest.approx(rows[0]["loss"])
    assert [(s.step, s.value) for s in acc.Scalars("ampctl/events/overflow")] == [
        (5, 1.0),
        (9, 2.0),
        (10, 3.0),
    ]
    assert acc.Tags()["tensors"] == ["events/text_summary"]
    texts = [t.tensor_proto.string_val[0].decode() for t in acc.Tensors("events/text_summary")]
    assert texts[-1].startswith("**rollback** step 7: 2 consecutive overflows: restored step 7")

    # a resumed run: the counts go on from the events already in events.jsonl
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(run / "events.jsonl", resumed / "events.jsonl")
    with TensorBoardSink(resumed) as sink:
        sink.log_event({"step": 11, "kind": "overflow", "message": "gradient overflow"})
    acc = EventAccumulator(str(resumed / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("ampctl/events/overflow")] == [(11, 4.0)]

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert make_tensorboard_sink(tmp_path, enabled=True) == TB_HINT


# --- long runs: one streaming pass, reduced to the figure's resolution (#35) ---


@pytest.fixture
def small_figure(monkeypatch):
    """The reduction's limits made small (rows kept as they are, buckets, marks), so a few
    thousand rows show what 10^6 rows do at the real limits."""
    from ampctl.commands.plot import decimate

    monkeypatch.setattr(decimate, "RAW_LIMIT", 200)
    monkeypatch.setattr(decimate, "BUCKETS", 100)
    monkeypatch.setattr(decimate, "MARK_CAP", 20)
    return decimate


def long_rows(n, spike=1234, dip=2345, gap=777, rollback=(2000, 1900)):
    """``n`` rows at steps 1..n (a rollback at ``rollback[0]`` back to ``rollback[1]``, whose
    rows are logged again), a loss spike, a dip and a NaN; one skipped step every 10 rows."""
    out, i, skipped, back_done = [], 1, 0, False
    while i <= n:
        loss = 3.0 + math.sin(i / 50.0) * 0.1
        loss = 100.0 if i == spike else -50.0 if i == dip else math.nan if i == gap else loss
        skipped += i % 10 == 0
        out.append(row(i, loss, skipped=skipped, grad_norm=1.0 + (i % 7) * 0.01))
        if i == rollback[0] and not back_done:
            back_done, i = True, rollback[1]
        i += 1
    return out


@needs_mpl
def test_a_long_run_is_drawn_per_pixel_column_keeping_every_extreme(tmp_path, small_figure):
    rows = long_rows(3000)
    d = write_run(tmp_path / "long", rows)
    data = load_run_data(d)
    assert data.decimated and data.rows_read == len(rows)
    xs, ys, kept = data.series("loss")
    assert len(xs) <= 5 * 2 * small_figure.BUCKETS < len(rows)
    pairs = {(r["step"], r["loss"]) for r in rows}
    assert all((x, y) in pairs for x, y in zip(xs, ys, strict=True) if y == y)  # real points
    kx = [x for x, k in zip(xs, kept, strict=True) if k]
    assert kx == sorted(set(kx))  # the kept line runs forward
    assert (1234, 100.0) in zip(xs, ys, strict=True)  # the spike and the dip survive
    assert (2345, -50.0) in zip(xs, ys, strict=True)
    assert any(x == 777 and y != y for x, y in zip(xs, ys, strict=True))  # the gap stays
    gone = [x for x, k in zip(xs, kept, strict=True) if not k]
    assert gone and all(1900 <= x <= 2000 for x in gone)  # the rolled-back rows, drawn apart

    fig = build_run_figure(d)
    ax_loss, ax_scale = fig.axes[:2]
    assert ax_loss.get_title(loc="right") == (
        "3,100 rows drawn as first/min/max/last per pixel column"
    )
    assert by_gid(ax_loss, "abandoned")
    # 310 log intervals with a skip: over the cap of 20, one mark per column with its count
    (marks,) = by_gid(ax_scale, "skips-interval")
    assert len(marks.get_xdata()) <= small_figure.BUCKETS
    assert sum(m.count for m in data.skips) == 310 and data.skips_grouped
    assert ax_scale.get_title(loc="right").endswith("grouped per pixel column (counts)")


@needs_mpl
def test_an_ordinary_run_is_drawn_from_every_row(tmp_path):
    rows = long_rows(1500, rollback=(1000, 990))  # under the 2,000 rows kept as they are
    d = write_run(tmp_path / "r", rows)
    data = load_run_data(d)
    assert not data.decimated
    xs, ys, kept = data.series("loss")
    assert xs == [r["step"] for r in rows]
    assert build_run_figure(d).axes[0].get_title(loc="right") == ""


def test_the_reduced_series_is_bounded_whatever_the_length():
    """At the real limits: 20,000 or 200,000 points (with rollbacks) hold the same few
    thousand, and every extreme is among them."""
    from ampctl.ui.plot.decimate import BUCKETS, Decimator

    held = []
    for n in (20_000, 200_000):
        dec = Decimator(("v",))
        for i in range(n):
            v = 10.0 if i == n // 3 else -10.0 if i == 2 * n // 3 else math.sin(i)
            dec.add(float(i - 300 if i % 5000 == 4999 else i), (v,))
        held.append(dec.points())
        xs, ys, _k = dec.series("v")
        assert (n // 3, 10.0) in zip(xs, ys, strict=True)
        assert (2 * n // 3, -10.0) in zip(xs, ys, strict=True)
    assert max(held) <= 5 * 2 * BUCKETS, held


@needs_mpl
def test_guard_decisions_beyond_the_cap_are_grouped_per_column(tmp_path, monkeypatch):
    from ampctl.commands.plot import run_data

    monkeypatch.setattr(run_data, "EVENT_CAP", 5)
    events = [{"step": 2 * i, "kind": "promotion", "module": f"m{i}"} for i in range(1, 101)]
    d = write_run(tmp_path / "r", [row(1, 3.0), row(200, 2.0)], events)
    fig = build_run_figure(d)
    ax_loss = fig.axes[0]
    assert len(by_gid(ax_loss, "event:promotion")) == 5
    grouped = by_gid(ax_loss, "events:promotion")
    assert 0 < len(grouped) <= 95
    assert grouped[0].get_label() == "promotion (95 more, grouped per pixel column)"
    assert "guard decisions beyond 5 grouped per pixel column" in ax_loss.get_title(loc="right")


@needs_mpl
def test_the_cli_prints_what_could_not_be_read_as_notes(tmp_path):
    d = write_run(tmp_path / "r", [row(1, 3.0), row(2, 2.0)], tail="not json\n")
    res = runner.invoke(app, ["plot", str(d), "--out", str(tmp_path / "x.png")])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"wrote {tmp_path / 'x.png'}"
    assert res.stderr.strip() == f"note: {d / 'metrics.jsonl'}: skipped 1 unreadable line(s) (3)"
