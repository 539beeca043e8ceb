"""OverflowGuard in ampctl's loop: planted faults through the real loop, and what each decision
did to the run (the pure rules are in tests/amp/test_guard.py, the locator in
tests/amp/test_locate.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

from ampctl.hostreads import count_host_reads
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import Trainer, train
from tests.conftest import read_jsonl


def _load_example():
    """The model of examples/planted_overflow.py (the README walkthrough), so the test and the
    example cannot drift apart."""
    path = Path(__file__).resolve().parents[2] / "examples" / "planted_overflow.py"
    spec = importlib.util.spec_from_file_location("ampctl_example_planted", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a BERT with an Amplifier (fine in fp32, inf in fp16 once its `boost` is raised) between the
# embeddings and the encoder; reachable as model._target_=tests.protect.test_guard_loop.Planted
Planted = _load_example().PlantedBert


def test_forward_overflow_promotes_only_the_culprit(fast_cfg):
    cfg = fast_cfg("model._target_=tests.protect.test_guard_loop.Planted", "trainer.max_steps=16")
    fwd_dtypes = {}

    def fault(tr, step, phase):
        if step == 6:
            tr.model.amp.boost = 1000.0  # from now on the fp16 intermediate overflows

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "p"), fault=fault)
    events = read_jsonl(res.run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["overflow", "promotion"]
    assert events[0]["overflow"] == "forward" and events[1]["module"] == "amp"
    assert res.summary["promoted_modules"] == ["amp"]
    assert math.isfinite(res.summary["final_loss"])
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert rows[-1]["skipped"] == 1 and rows[-1]["forward_overflows"] == 1
    assert rows[-1]["scale"] == 1024.0  # a forward overflow does not back off the scale
    # the rest of the model still runs in fp16
    tr = Trainer(
        cfg,
        new_run_dir(cfg.trainer.runs_dir, "p2"),
        resume=__import__("ampctl.train.checkpoint", fromlist=["x"]).load_checkpoint(res.run_dir),
    )
    assert tr.precision.in_fp32 == ["amp"]
    batch = tr.data.batch_at(0)
    hooks = [
        m.register_forward_hook(lambda mod, i, o, n=n: fwd_dtypes.__setitem__(n, o.dtype))
        for n, m in tr.model.named_modules()
        if n in ("amp", "bert_mlm.bert.encoder.layer.0.intermediate.dense")
    ]
    with tr.precision.autocast():
        tr.model(**batch)
    for h in hooks:
        h.remove()
    assert fwd_dtypes == {
        "amp": torch.float32,
        "bert_mlm.bert.encoder.layer.0.intermediate.dense": torch.float16,
    }


def test_consecutive_gradient_overflows_roll_back_then_fall_back(fast_cfg):
    cfg = fast_cfg(
        "guard.rollback_after=3",
        "guard.max_rollbacks=2",
        "trainer.max_steps=16",
        "guard.snapshot_every=2",
    )
    calls = {"n": 0, "weights_finite": True}

    def fault(tr, step, phase):
        calls["n"] += 1
        calls["weights_finite"] &= all(torch.isfinite(p).all().item() for p in tr.params)
        if 4 <= calls["n"] < 4 + 9:  # 9 poisoned steps in a row: 3 rollbacks' worth
            next(iter(tr.params)).grad.view(-1)[0] = float("inf")

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "rb"), fault=fault)
    kinds = [e["kind"] for e in read_jsonl(res.run_dir / "events.jsonl")]
    assert kinds.count("rollback") == 2 and kinds.count("fallback") == 1
    assert kinds.index("fallback") > max(i for i, k in enumerate(kinds) if k == "rollback")
    assert res.summary["precision"] == "bf16" and res.status == "ok" and res.summary["steps"] == 16
    assert calls["weights_finite"]
    assert all(
        torch.isfinite(p).all()
        for p in Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "chk")).params
    )
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert math.isfinite(rows[-1]["loss"])


def test_abort_policy_exits_with_a_clear_message(fast_cfg):
    cfg = fast_cfg(
        "guard.floor_policy=abort",
        "scaler.init_scale=1",
        "scaler.min_scale=1",
        "guard.rollback_after=0",
    )

    def fault(tr, step, phase):
        if step >= 3:
            next(iter(tr.params)).grad.view(-1)[0] = float("nan")

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "ab"), fault=fault)
    assert res.status == "aborted" and res.exit_code == 1
    last = read_jsonl(res.run_dir / "events.jsonl")[-1]
    assert last["kind"] == "abort"
    assert last["message"] == "loss scale at its minimum and still overflowing (2 in a row)"
    assert (res.run_dir / "checkpoints").is_dir()  # the state was saved for diagnose/resume


def test_clean_run_has_no_events_and_no_extra_host_reads(fast_cfg):
    counts = {}
    for guard in ("default", "off"):
        cfg = fast_cfg(f"guard={guard}")
        with count_host_reads() as reads:
            res = train(cfg, new_run_dir(cfg.trainer.runs_dir, guard))
        counts[guard] = reads.total
        assert (res.run_dir / "events.jsonl").read_text() == ""  # there, and empty
    assert counts["default"] == counts["off"]


def test_snapshot_every_zero_keeps_no_copy_and_still_rolls_back(fast_cfg):
    cfg = fast_cfg("guard.snapshot_every=0", "guard.rollback_after=2")
    calls = {"n": 0}

    def fault(tr, step, phase):
        calls["n"] += 1
        if calls["n"] in (5, 6):
            next(iter(tr.params)).grad.view(-1)[0] = float("inf")
        if calls["n"] == 4:
            assert tr.protection.snapshot is None  # no copy kept while training is clean

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "nosnap"), fault=fault)
    kinds = [e["kind"] for e in read_jsonl(res.run_dir / "events.jsonl")]
    assert kinds == ["overflow", "overflow", "rollback"] and res.status == "ok"
