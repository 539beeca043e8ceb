"""A run folder is data, round 3, for ``ampctl plot`` (issue 37): a scaler history claiming 10^12
updates, an events.jsonl of empty objects, a sweep naming a trial outside itself, values that
are not numbers, and a 3 GB sweep results.json. Each case runs through the CLI in-process (exit
code, no traceback, one line where refused) with its memory bound asserted (tracemalloc peak)."""

from __future__ import annotations

import json
import math
import tracemalloc

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.commands.plot import build_sweep_figure, decimate, load_run_data
from ampctl.commands.plot import sweep_figure as sweep_mod

pytest.importorskip("matplotlib")
runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def row(step, loss=3.0, **kw):
    r = dict(step=step, loss=loss, scale=1024.0, skipped=0, overflow_rate=0.0, grad_norm=1.0)
    r.update(kw)
    return r


def write_run(path, rows, events=()):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def peak_of(fn):
    """(result, peak bytes allocated by Python while ``fn`` ran)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def plot_ok(d, tmp_path):
    out = tmp_path / f"{d.name}.png"
    res = runner.invoke(app, ["plot", str(d), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output and res.exception is None
    assert out.read_bytes()[:8] == PNG
    return res


def test_a_scaler_history_claiming_1e12_updates_is_not_walked(tmp_path):
    """The update -> step map is built from the restores alone: the claimed count is checked
    against the checkpoint's step without a loop over it (it was a 3.4 GB loop)."""
    d = write_run(tmp_path / "r", [row(4), row(8, skipped=1), row(12, skipped=1)])
    (d / "checkpoints").mkdir()
    hist = torch.tensor([[1.0, 1024.0, 0.0], [1e12, 512.0, 1.0]], dtype=torch.float64)
    state = {
        "step": 12,
        "scaler": {"history": hist, "skipped_total": 1},
        "trainer": {"wall_s": 9.0},
    }
    torch.save(state, d / "checkpoints" / "step_00000012.pt")
    data, peak = peak_of(lambda: load_run_data(d))
    assert peak < 8 << 20, peak
    assert data.skip_source == "metrics"  # the history does not add up: the metrics' counter
    assert [(m.step, m.count) for m in data.skips] == [(8, 1)]
    plot_ok(d, tmp_path)


def test_a_history_of_non_numbers_or_out_of_order_records_is_ignored(tmp_path):
    """Each history below adds up to the checkpoint's step but one record is not a number, out
    of order or not a whole update: the exact skips are not taken from it."""
    for name, (hist, step) in {
        "inf": ([[1.0, 1024.0, 0.0], [2.0, math.inf, 1.0]], 2),
        "nan": ([[1.0, 1024.0, 0.0], [2.0, 512.0, math.nan]], 2),
        "backwards": ([[1.0, 1024.0, 0.0], [3.0, 512.0, 1.0], [2.0, 512.0, 0.0]], 2),
        "fraction": ([[1.5, 1024.0, 1.0]], 1),
    }.items():
        d = write_run(tmp_path / name, [row(1), row(2, skipped=1)])
        (d / "checkpoints").mkdir()
        state = {"step": step, "scaler": {"history": torch.tensor(hist, dtype=torch.float64)}}
        torch.save(state, d / "checkpoints" / f"step_{step:08d}.pt")
        assert load_run_data(d).skip_source == "metrics", name
    plot_ok(d, tmp_path)


def test_an_events_file_of_empty_objects_is_streamed_not_kept(tmp_path):
    """events.jsonl of `{}` lines (64 MiB of them took plot to 3.2 GB): each is read and
    dropped, so four times the lines cost no more memory (kept, 15,000 more would be ~1 MB)."""
    peaks = []
    for n in (5_000, 20_000):
        d = write_run(tmp_path / f"r{n}", [row(4), row(8)])
        (d / "events.jsonl").write_bytes(b"{}\n" * n)
        data, peak = peak_of(lambda d=d: load_run_data(d))
        assert data.events == [] and not data.overflow_marks and not data.event_marks
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 256 << 10, peaks
    plot_ok(d, tmp_path)


def test_many_overflow_events_are_kept_per_pixel_column(tmp_path, monkeypatch):
    """Every overflow is an event: past the cap they cost the marks a figure can show (here a
    cap of 50 and 40 columns, so a few thousand events show it)."""
    monkeypatch.setattr(decimate, "MARK_CAP", 50)
    monkeypatch.setattr(decimate, "BUCKETS", 40)
    d = write_run(tmp_path / "r", [row(4), row(40_000)])
    line = '{"step": %d, "kind": "overflow", "overflow": "gradient"}\n'
    (d / "events.jsonl").write_text("".join(line % (4 * i) for i in range(10_000)))
    ticks = load_run_data(d).overflow_marks["gradient"]
    assert ticks.is_grouped and len(ticks) <= 40 and ticks.total == 10_000
    assert sum(n for _x, _y, n in ticks.marks()) == 10_000


def sweep_row(trial, init, status="ok", loss=1.0):
    return dict(trial=trial, init_scale=init, growth_interval=2, status=status, final_loss=loss)


def test_a_sweep_trial_named_outside_the_sweep_is_not_opened(tmp_path, monkeypatch):
    """results.json naming ``../../outside/run``, an absolute path or a link out of the sweep:
    none is opened (the outside run's files are never read); the figure says so."""
    outside = write_run(tmp_path / "outside" / "run", [row(4, 9.0), row(8, 9.5)])
    sweep = tmp_path / "a" / "b" / "sweep"
    write_run(sweep / "t1", [row(4, 2.0), row(8, 1.5)])
    (sweep / "t3").symlink_to(outside, target_is_directory=True)
    rows = [
        sweep_row("t1", 1024.0),
        sweep_row("../../../outside/run", 2048.0),
        sweep_row(str(outside), 4096.0),
        sweep_row("t3", 8192.0),
    ]
    (sweep / "results.json").write_text(json.dumps({"trials": rows}))
    opened = []
    real = sweep_mod.load_run_data
    monkeypatch.setattr(sweep_mod, "load_run_data", lambda p: opened.append(p) or real(p))
    fig = build_sweep_figure(sweep)
    assert opened == [sweep / "t1"]
    ax_sc = fig.axes[1]
    assert "3 trial name(s) outside the sweep folder not opened" in ax_sc.get_title()
    assert [ln.get_gid() for ln in ax_sc.lines if ln.get_gid()] == ["trial:t1"]
    before = sorted(p.name for p in outside.iterdir())
    plot_ok(sweep, tmp_path)
    assert sorted(p.name for p in outside.iterdir()) == before  # nothing written there


@pytest.mark.parametrize(
    "rows,events",
    [
        ([row(4), row(8)], [{"step": 6, "kind": "rollback", "to_step": "x", "from_step": 8}]),
        ([row(4), row(8, skipped="inf"), row(12, skipped=2)], []),
        ([row(4), row(8, skipped=1e308), row(12, skipped=-1e308)], []),
        ([row(4, scale="x"), row("x")], [{"step": "inf", "kind": "fallback"}]),
        ([row(4)], [{"step": 4, "kind": "rollback", "from_step": [1], "discarded_steps": "x"}]),
        ([row(4)], [{"step": 4, "kind": 7}, {"step": 4, "kind": "overflow", "overflow": []}]),
        ([row(4), row(10**400, loss=10**400)], []),  # JSON ints past float's range
        (
            [
                row(4),
                row(
                    8,
                    loss=1e308,
                    overflow_rate=1e308,
                    grad_norm=1e308,
                    scale=1e308,
                    grad_underflow_frac=1.7e308,  # x 1.25 is inf
                    act_grad_underflow_frac=-1e308,
                ),
            ],
            [{"step": 1e308, "kind": "rollback", "to_step": 1e308, "from_step": -1e308}],
        ),  # fmt: skip
    ],
    ids=[
        "to_step-x",
        "skipped-inf",
        "skipped-huge",
        "step-x",
        "from_step-list",
        "kind-int",
        "int-10e400",
        "all-1e308",
    ],
)
def test_values_that_are_not_numbers_are_missing_not_a_traceback(tmp_path, rows, events):
    """What a quick fuzz of every row, event and summary field with "x", "inf", "nan", null,
    true, [], {}, +-1e308, 1.7e308 and 10**400 found crashing (each case once a traceback)."""
    d = write_run(tmp_path / "r", rows, events)
    plot_ok(d, tmp_path)


def test_a_non_number_in_a_summary_is_drawn_as_text(tmp_path):
    d = write_run(tmp_path / "r", [row(4), row(8)])
    summary = {"promoted_modules": [1, None], "final_scale": "x", "steps": [], "status": {}}
    (d / "summary.json").write_text(json.dumps(summary))
    plot_ok(d, tmp_path)


def test_a_3gb_sweep_results_json_is_streamed_not_refused_for_its_size(tmp_path):
    """results.json is streamed a trial at a time (no whole-file cap): a 3 GB one (sparse here:
    a valid start, then zeros) is read up to where it stops being JSON (the first zero byte: no
    value starts so, and nothing after it is read), and that is the one line (exit 2), with
    memory of a chunk, not the file (it was a MemoryError, then a refusal for its size, then a
    read of all 3 GB as one long scalar)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    path = sweep / "results.json"
    trial = json.dumps(sweep_row("t0", 1024.0))
    with open(path, "wb") as f:
        f.write(b'{"trials": [' + trial.encode() + b", ")
        f.write(b" " * (1 << 17))  # past the first chunk: the text is JSON so far
        f.truncate(3 << 30)
    runner.invoke(app, ["plot", str(sweep)])  # the modules plot imports, before the count
    res, peak = peak_of(lambda: runner.invoke(app, ["plot", str(sweep)]))
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "limit" not in res.output
    assert "a value expected at character 131" in res.output, res.output
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"ampctl: error: {str(path)!r}: is not valid JSON (")
    assert peak < 8 << 20, peak
    assert not (sweep / "plot.png").exists()


def test_results_json_as_a_plain_list_of_trials_is_read_too(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rows = [sweep_row(f"t{i}", float(2 ** (10 + i))) for i in range(3)]
    (sweep / "results.json").write_text(json.dumps(rows))
    res = runner.invoke(app, ["plot", str(sweep), "--out", str(tmp_path / "s.png")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s.png").stat().st_size > 0


def test_a_sweep_grid_too_large_to_draw_is_one_line(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rows = [sweep_row(f"t{i}", float(i + 1)) for i in range(2000)]
    for i, r in enumerate(rows):
        r["growth_interval"] = i + 1
    (sweep / "results.json").write_text(json.dumps(rows))
    res = runner.invoke(app, ["plot", str(sweep)])
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [
        "ampctl: error: results.json: 2000 init_scale x 2000 growth_interval values make "
        "4000000 cells; a sweep figure draws at most 1024"
    ]
