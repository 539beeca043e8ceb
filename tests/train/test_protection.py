"""Protection: the guard's decisions carried out the same way on the standard and the fused path.

The planted gradient overflow of these tests behaves like a real one: it appears only while the
loss scale is at or above a threshold (a gradient spike that fp16 cannot hold at that scale), so a
rollback that lowers the scale cures it, as it would cure the real thing.
"""

from __future__ import annotations

import pytest
import torch

from ampctl.hostreads import count_host_reads
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import Trainer, train
from tests.conftest import read_jsonl


def planted(always: set[int], while_scale_at_least: dict[int, float]):
    """A fault hook: inf in one gradient element at the steps in ``always``, and at the steps of
    ``while_scale_at_least`` only while the scale is >= the given value (decided on the device:
    no host read)."""

    def fault(tr, step, phase):
        g = next(iter(tr.params)).grad
        if step in always:
            g.view(-1)[0] = float("inf")
        elif step in while_scale_at_least:
            scale = tr.scaler.get_scale_tensor()
            hit = scale >= while_scale_at_least[step]
            g.view(-1)[0] = torch.where(hit, torch.tensor(float("inf")), g.view(-1)[0])

    return fault


def reads_per_step(tr: Trainer, steps: int) -> list[int]:
    """Drive the loop by hand, counting the host reads of each step (log steps included)."""
    tr.protection.start(tr.step)
    counts = []
    for _ in range(steps):
        with count_host_reads() as reads:
            tr.step_once()
        counts.append(reads.total)
    return counts


def _events(res):
    return [
        (e["kind"], e["step"], e.get("overflow"), e.get("scale"), e.get("discarded", False))
        for e in read_jsonl(res.run_dir / "events.jsonl")
    ]


def _run(fast_cfg, name, *extra, fault):
    cfg = fast_cfg("trainer.max_steps=40", "trainer.log_every=10", *extra)
    return train(cfg, new_run_dir(cfg.trainer.runs_dir, name), fault=fault)


BURST = {15: 64.0, 16: 64.0, 17: 64.0, 18: 64.0}  # four steps, while the scale is >= 64


def test_fused_path_takes_the_same_decisions_at_the_same_steps(fast_cfg):
    """Isolated overflows at 4 and 28 and a burst of four from step 15 (rollback_after=3):
    the same overflow events at the same steps with the same scales, and the rollback decided at
    the same step, with optim.fused true and false."""
    runs = {
        fused: _run(
            fast_cfg,
            f"f{fused}",
            f"optim.fused={str(fused).lower()}",
            "guard.rollback_after=3",
            fault=planted({4, 28}, BURST),
        )
        for fused in (False, True)
    }
    std, fused = _events(runs[False]), _events(runs[True])
    expected_overflows = [("overflow", s, "gradient") for s in (4, 15, 16, 17, 28)]
    kept = {
        k: [e for e in evs if e[0] == "overflow" and not e[4]]
        for k, evs in (("s", std), ("f", fused))
    }
    for evs in kept.values():
        assert [e[:3] for e in evs] == expected_overflows
    assert kept["s"] == kept["f"]
    # the burst's fourth overflow (18) ran before the fused path's read and was discarded by the
    # rollback: written too, marked discarded (the standard path never ran it as step 18)
    assert [e[:3] for e in fused if e[4]] == [("overflow", 18, "gradient")]
    assert [e for e in std if e[4]] == []
    rb = {
        k: [e for e in read_jsonl(r.run_dir / "events.jsonl") if e["kind"] == "rollback"]
        for k, r in runs.items()
    }
    assert [e["from_step"] for e in rb[False]] == [17] == [e["from_step"] for e in rb[True]]
    # the fused path snapshots at read points (log steps) only: before the burst, at step 10
    assert rb[True][0]["to_step"] == 10 and rb[False][0]["to_step"] <= 14
    assert rb[True][0]["discarded_steps"] == 3  # steps 18-20 ran before the read and are dropped
    # the standard path names the culprit; the fused path says why it cannot
    ev = read_jsonl(runs[True].run_dir / "events.jsonl")
    assert all("unavailable" in e["attribution"] for e in ev if e["kind"] == "overflow")
    ev = read_jsonl(runs[False].run_dir / "events.jsonl")
    assert all(
        e["params"] == ["bert.embeddings.word_embeddings.weight"]
        for e in ev
        if e["kind"] == "overflow"
    )
    for r in runs.values():
        assert r.status == "ok" and r.summary["steps"] == 40


@pytest.mark.parametrize("fused", [False, True])
def test_floor_abort_at_the_same_step_on_both_paths(fast_cfg, fused):
    res = _run(
        fast_cfg,
        f"floor{fused}",
        f"optim.fused={str(fused).lower()}",
        "scaler.init_scale=4",
        "scaler.min_scale=1",
        "guard.floor_policy=abort",
        "guard.rollback_after=0",
        fault=planted(set(range(6, 40)), {}),
    )
    assert res.status == "aborted" and res.exit_code == 1
    abort = [e for e in read_jsonl(res.run_dir / "events.jsonl") if e["kind"] == "abort"]
    # scale 4 -> 2 at step 6, 2 -> 1 at step 7: at the floor with 2 overflows in a row
    assert [e["step"] for e in abort] == [7]
    assert "loss scale at its minimum and still overflowing" in abort[0]["message"]


@pytest.mark.parametrize("fused", [False, True])
def test_skip_budget_fallback_on_both_paths(fast_cfg, fused):
    res = _run(
        fast_cfg,
        f"fb{fused}",
        f"optim.fused={str(fused).lower()}",
        "guard.rollback_after=0",
        "guard.skip_window=10",
        "guard.skip_budget=0.3",
        "guard.skip_action=fallback",
        fault=planted({21, 23, 25, 27}, {}),
    )
    fb = [e for e in read_jsonl(res.run_dir / "events.jsonl") if e["kind"] == "fallback"]
    assert [(e["from_step"], e["from_precision"], e["to_precision"]) for e in fb] == [
        (27, "fp16", "bf16")
    ]
    assert res.summary["precision"] == "bf16" and res.status == "ok"


def test_fused_path_reads_the_host_once_per_log_interval(fast_cfg):
    """No read per step, one per log step, even with overflows in the interval (the guard's
    decisions ride on the log read)."""
    cfg = fast_cfg(
        "optim.fused=true", "trainer.max_steps=20", "trainer.log_every=5", "trainer.ckpt_every=100"
    )
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "reads"), fault=planted({3, 7, 8}, {}))
    assert reads_per_step(tr, 10) == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    kinds = [(e["kind"], e["step"]) for e in read_jsonl(tr.run_dir / "events.jsonl")]
    assert kinds == [("overflow", 3), ("overflow", 7), ("overflow", 8)]


def test_standard_path_reads_once_per_step_plus_log_plus_skipped(fast_cfg):
    cfg = fast_cfg("trainer.max_steps=20", "trainer.log_every=5", "trainer.ckpt_every=100")
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "reads"), fault=planted({3}, {}))
    # the skip flag each step; step 3 adds the attribution read; step 5 the log read
    assert reads_per_step(tr, 5) == [1, 1, 2, 1, 2]
