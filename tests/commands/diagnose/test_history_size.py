"""Histories of any length: read in one pass (a per-line or per-entry cap, never a whole-file
cap), kept in memory bounded independently of the length (:mod:`ampctl.commands.diagnose.rows`),
judged the same way. Small sizes here (the caps are made small); real sizes in
``scripts/bench_history_size.py``."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from ampctl.commands.diagnose import rows as R
from ampctl.commands.diagnose.history import foreign_history
from ampctl.commands.diagnose.readers import hf, lightning
from ampctl.commands.diagnose.readers.base import Found
from ampctl.commands.diagnose.rows import RowKeeper
from ampctl.commands.diagnose.stages import Row

from .conftest import diagnose_cli, kinds

SMALL = {"ROW_CAP": 400, "HEAD": 50, "TAIL": 100, "MARK_CAP": 40, "MIDDLE_CAP": 100}


@pytest.fixture
def small_caps(monkeypatch):
    """A whole-file cap of 64 KiB and a row cap of 400: a few thousand rows are 'long'."""
    import ampctl.trust as trust

    monkeypatch.setattr(trust, "MAX_WHOLE_FILE", 64 << 10)
    for k, v in SMALL.items():
        monkeypatch.setattr(R, k, v)


def loss_at(i: int, n: int, rng: random.Random) -> float:
    return 0.5 + 2.0 * math.exp(-3 * i / n) + 0.02 * rng.gauss(0, 1)


def metrics_row(step: int, loss: float, skipped: int, scale: float, lr: float) -> dict:
    """A row with the keys ampctl's own writer gives (ampctl.protect.shell.RunShell.row)."""
    return {
        "step": step,
        "loss": loss if math.isfinite(loss) else "nan",
        "scale": scale,
        "skipped": skipped,
        "forward_overflows": 0,
        "spikes": 0,
        "consecutive_overflows": 0,
        "overflow_rate": 0.0,
        "lr": lr,
        "precision": "fp16",
        "tokens_per_s": 1000.0,
        "elapsed_s": step * 0.01,
        "max_steps": None,
        "grad_norm": 1.0 if math.isfinite(loss) else "nan",
        "grad_amax": 0.01,
    }


def write_run(d: Path, n: int, *, nan_from: int | None = None) -> Path:
    """A run folder of ``n`` logged steps (no checkpoint, as ProtectedRun writes one); with
    ``nan_from`` the loss is NaN from that step to the end (every step skipped)."""
    rng = random.Random(0)
    d.mkdir()
    skipped = 0
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(n):
            step = i + 1
            bad = nan_from is not None and step >= nan_from
            skipped += bad
            loss = math.nan if bad else loss_at(i, n, rng)
            scale = 65536.0 * 2 ** (i // 1000) if not bad else 1.0
            f.write(json.dumps(metrics_row(step, loss, skipped, scale, 1e-3)) + "\n")
    (d / "events.jsonl").write_text("")
    status = "ok" if nan_from is None else "aborted"
    (d / "summary.json").write_text(json.dumps({"status": status}))
    return d


# ---------------------------------------------------------------------------- a run folder
def test_a_metrics_file_over_the_whole_file_cap_is_read_and_judged_healthy(small_caps, tmp_path):
    run = write_run(tmp_path / "long", 3000)
    assert (run / "metrics.jsonl").stat().st_size > 64 << 10  # over the (patched) cap
    code, rep, err = diagnose_cli(run)
    assert (code, err) == (0, ""), (code, err, rep and kinds(rep))
    h = rep["history"]
    assert h["metrics_rows"] == 3000 and rep["verdict"]["status"] == "healthy"
    assert not [p for p in rep["problems"] if p["kind"] == "unreadable_history"]
    assert any("3,000 rows read in one pass" in n for n in h["notes"]), h["notes"]


def test_its_broken_twin_with_a_nan_planted_late_is_broken(small_caps, tmp_path):
    run = write_run(tmp_path / "late-nan", 3000, nan_from=2900)
    code, rep, _ = diagnose_cli(run)
    assert code == 1 and "nan_loss" in kinds(rep), kinds(rep)
    h = rep["history"]
    assert h["first_nan_loss_step"] == 2900 and h["break_step"] == 2900
    # the rows right before the break are the logged rows, not merged ones
    assert [r["step"] for r in h["before_break"]] == [2895, 2896, 2897, 2898, 2899]


def test_a_nan_in_the_merged_middle_is_still_the_break(small_caps, tmp_path):
    """A NaN far from both ends (in the part that is merged) is kept exactly, with the rows
    before it: the break and the rows before it are the logged ones."""
    run = write_run(tmp_path / "mid-nan", 3000, nan_from=1500)
    code, rep, _ = diagnose_cli(run)
    assert code == 1 and "nan_loss" in kinds(rep), kinds(rep)
    assert rep["history"]["break_step"] == 1500
    assert [r["step"] for r in rep["history"]["before_break"]] == [1495, 1496, 1497, 1498, 1499]


# ---------------------------------------------------------------------------- the keeper
def old_metrics_rows(rows: list[Row]) -> list[Row]:
    """What history.py kept before it streamed: every row, one per step (the later one)."""
    by_step = {r.step: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def test_below_the_cap_every_row_is_kept_exactly():
    rng = random.Random(1)
    rows = [Row(step=rng.randint(0, 300), loss=rng.random()) for _ in range(1000)]  # re-logged
    k = RowKeeper(cap=len(rows))
    for r in rows:
        k.add(r)
    assert not k.bounded and k.rows() == old_metrics_rows(rows) and k.note("m") is None
    k2 = RowKeeper(cap=len(rows), by_step=False)
    for r in rows:
        k2.add(r)
    assert k2.rows() == rows  # another tool's log: as it came


def _long(n: int, planted: dict[int, float]) -> RowKeeper:
    k = RowKeeper()
    for i in range(n):
        loss = planted.get(i, 2.0 / (1 + i / 1000) + 0.01 * ((i * 7919) % 13))
        k.add(Row(step=i, loss=loss, scale=65536.0, skipped=0, grad_norm=1.0))
    return k


def test_the_kept_rows_do_not_grow_with_the_history(small_caps):
    bound = R.HEAD + R.TAIL + R.MARK_CAP + R.MIDDLE_CAP + R.CONTEXT
    sizes = {}
    for n in (4_000, 16_000):
        k = _long(n, {2_500: math.inf, 2_600: 500.0})
        rows = k.rows()
        sizes[n] = len(rows)
        assert k.bounded and len(rows) <= bound
        assert [r.step for r in rows] == sorted({r.step for r in rows})  # by step, once each
        assert [r.step for r in rows[: R.HEAD]] == list(range(R.HEAD))  # the first rows whole
        assert [r.step for r in rows[-R.TAIL :]] == list(range(n - R.TAIL, n))  # the last too
        kept = {r.step: r.loss for r in rows}
        assert kept[2_500] == math.inf and kept[2_600] == 500.0  # the anomalies exactly
        assert list(range(2_500 - R.CONTEXT, 2_500)) == [
            s for s in range(2_500 - R.CONTEXT, 2_500) if s in kept
        ]  # and the rows before the first non-finite loss
    assert max(sizes.values()) <= bound  # twice the rows, the same bound


def test_the_work_is_linear_in_the_rows(small_caps):
    """Counted, not timed: each row is handled at most twice (once on the way in, once more
    when the cap is first crossed), whatever the length."""
    for n in (2_000, 20_000):
        k = _long(n, {})
        assert k.seen == n and k.visits <= n + R.ROW_CAP + 1


def test_merged_rows_keep_a_non_finite_value_and_the_mean():
    k = RowKeeper(cap=10, head=1, tail=5, mark_cap=0, middle_cap=4, context=5)
    for i in range(60):
        k.add(Row(step=i, loss=math.nan if i in (12, 30) else 1.0, grad_norm=float(i % 2)))
    assert k.marks_over == 1  # the second NaN (the first is the break) past the mark cap ...
    rows = k.rows()
    assert [r.step for r in rows if r.loss is not None and math.isnan(r.loss)] == [12, 30]
    merged = [r for r in rows if r.step not in range(7, 13) and 0 < r.step < 55]
    assert merged and all(r.step == 30 or (r.loss, r.grad_norm) == (1.0, 0.5) for r in merged)
    assert k.width > 1  # ... merged, never averaged away, at its own step


# ---------------------------------------------------------------------------- other tools
def write_trainer_state(path: Path, n: int, *, long_entry: int | None = None, nan_at=None):
    log = []
    rng = random.Random(2)
    for i in range(1, n + 1):
        e = {"epoch": i / n, "grad_norm": 1.0, "learning_rate": 5e-5, "loss": loss_at(i, n, rng)}
        if nan_at is not None and i >= nan_at:
            e.update(loss=0.0, grad_norm=math.nan)  # the Trainer's NaN filter
        e["step"] = i
        if i == long_entry:
            e["pad"] = "x" * 5000
        log.append(e)
    log.append({"step": n, "train_loss": 1.0, "train_runtime": 9.0})
    state = {"epoch": 1.0, "global_step": n, "log_history": log, "max_steps": n}
    path.write_text(json.dumps(state, indent=2, sort_keys=True))


def test_a_trainer_state_with_many_entries_and_one_overlong_is_read(
    small_caps, tmp_path, monkeypatch
):
    import ampctl.runlog.readers as rr

    d = tmp_path / "checkpoint-3000"
    d.mkdir()
    write_trainer_state(d / "trainer_state.json", 3000, long_entry=1234)
    assert (d / "trainer_state.json").stat().st_size > 64 << 10
    found = Found(format="hf-trainer", path=d)
    real = rr.JsonArrayStream.__init__

    def small_entries(self, *a, **kw):  # a per-entry cap of 1000 characters
        real(self, *a, **{**kw, "entry_limit": 1000})

    monkeypatch.setattr(rr.JsonArrayStream, "__init__", small_entries)
    state, fh = hf._trainer_state(found, d)
    assert found.history_errors == [] and state["global_step"] == 3000
    assert any("skipped 1 unreadable log_history entry (1234: longer than" in n for n in fh.notes)
    h = foreign_history(fh, 3000)
    assert h.metrics_rows == 2999 and h.break_step is None  # every entry but the long one
    assert any("2,999 rows read in one pass" in n for n in h.notes), h.notes


def test_a_trainer_state_whose_loss_went_nan_late_breaks_there(small_caps, tmp_path):
    d = tmp_path / "checkpoint-3000"
    d.mkdir()
    write_trainer_state(d / "trainer_state.json", 3000, nan_at=2950)
    found = Found(format="hf-trainer", path=d)
    _state, fh = hf._trainer_state(found, d)
    h = foreign_history(fh, None)
    assert h.first_nan_loss_step == 2950 and h.break_step == 2950
    assert h.nan_filtered_steps[:2] == [2950, 2951]


def test_a_long_metrics_csv_with_an_overlong_line_is_read(small_caps, tmp_path, monkeypatch):
    import ampctl.trust as trust

    monkeypatch.setattr(trust, "MAX_LINE", 2000)
    monkeypatch.setattr(lightning, "iter_lines", lambda p: trust.iter_lines(p, line_limit=2000))
    p = tmp_path / "metrics.csv"
    rng = random.Random(3)
    lines = ["epoch,lr-Adam,step,train_loss_step,val_loss"]
    for i in range(3000):
        lines.append(f"0,0.001,{i},{loss_at(i, 3000, rng)},")
        if i % 500 == 0:
            lines.append(f"0,,{i},,{0.9}")  # a validation row of the same step
    lines.insert(1000, "0,0.001,999999," + "9" * 5000 + ",")  # one line over the cap
    p.write_text("\n".join(lines) + "\n")
    assert p.stat().st_size > 64 << 10
    fh = lightning._csv_history(p)
    assert fh.columns["loss"] == "train_loss_step"
    assert any("skipped 1 line(s) over the per-line cap (1001)" in n for n in fh.notes), fh.notes
    h = foreign_history(fh, None)
    assert h.metrics_rows == 3000 and h.break_step is None
