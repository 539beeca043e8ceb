"""The protected loop end to end: run folder, metrics, checkpoints, resume, precisions."""

from __future__ import annotations

import math

import pytest
import torch

from ampctl.hostreads import count_host_reads
from ampctl.runlog.writers import new_run_dir
from ampctl.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from ampctl.train.trainer import Trainer, train
from tests.conftest import read_jsonl
from tests.train.test_protection import reads_per_step

METRIC_KEYS = {
    "step",
    "loss",
    "scale",
    "skipped",
    "overflow_rate",
    "grad_norm",
    "grad_amax",
    "grad_underflow_frac",
    "nonfinite_grads",
    "lr",
    "precision",
    "tokens_per_s",
    "elapsed_s",
}


def _run(cfg, name="r", **kw):
    run_dir = new_run_dir(cfg.trainer.runs_dir, name)
    return train(cfg, run_dir, **kw)


def test_run_folder_has_everything(fast_cfg):
    cfg = fast_cfg()
    res = _run(cfg)
    d = res.run_dir
    assert res.status == "ok" and res.exit_code == 0
    assert (d / "config.yaml").is_file() and (d / "summary.json").is_file()
    assert (d / "events.jsonl").read_text() == ""  # always there (README), empty: no events
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert METRIC_KEYS <= set(rows[0])
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert [p.name for p in list_checkpoints(d / "checkpoints")] == [
        "step_00000006.pt",
        "step_00000012.pt",
    ]
    ck = load_checkpoint(d)
    assert ck["step"] == 12 and {
        "model",
        "optimizer",
        "scaler",
        "scheduler",
        "rng",
        "data",
        "config",
    } <= set(ck)
    assert ck["data"] == {"position": 12, "world_size": 1}
    s = res.summary
    assert s["steps"] == 12 and s["skipped"] == 0 and s["final_scale"] == 1024.0


def test_existing_run_folder_is_never_overwritten(fast_cfg):
    from ampctl.runlog.writers import RunExistsError

    cfg = fast_cfg()
    d = new_run_dir(cfg.trainer.runs_dir, "same")
    (d / "keep.txt").write_text("precious")
    with pytest.raises(
        RunExistsError, match="exists already: pick another --name, or continue it with --resume"
    ):
        new_run_dir(cfg.trainer.runs_dir, "same")
    assert (d / "keep.txt").read_text() == "precious"
    a, b = new_run_dir(cfg.trainer.runs_dir, None), new_run_dir(cfg.trainer.runs_dir, None)
    assert a != b


def test_resume_gives_identical_losses(fast_cfg):
    full = _run(fast_cfg("trainer.max_steps=12"), "full")
    first = _run(fast_cfg("trainer.max_steps=12"), "part")
    # cut the second run back to its step-6 checkpoint, as if it had died there
    part_dir = first.run_dir
    (part_dir / "checkpoints" / "step_00000012.pt").unlink()
    rows = [r for r in read_jsonl(part_dir / "metrics.jsonl") if r["step"] <= 6]
    (part_dir / "metrics.jsonl").write_text(
        "".join(__import__("json").dumps(r) + "\n" for r in rows)
    )
    ck = load_checkpoint(part_dir)
    assert ck["step"] == 6
    res = train(fast_cfg("trainer.max_steps=12"), part_dir, resume=part_dir)
    a = [r["loss"] for r in read_jsonl(full.run_dir / "metrics.jsonl")]
    b = [r["loss"] for r in read_jsonl(res.run_dir / "metrics.jsonl")]
    assert a == b
    sa, sb = full.summary, res.summary
    assert sa["final_scale"] == sb["final_scale"] and sa["steps"] == sb["steps"] == 12


def test_planted_gradient_overflow_is_skipped_attributed_and_logged(fast_cfg):
    cfg = fast_cfg("guard.rollback_after=0")
    seen = {}

    def fault(tr, step, phase):
        if step == 5:
            seen["before"] = [p.detach().clone() for p in tr.params]
            tr.model.bert.encoder.layer[1].output.dense.weight.grad[0, 0] = float("inf")
        if step == 6:
            seen["after"] = [p.detach().clone() for p in tr.params]

    res = _run(cfg, fault=fault)
    assert all(torch.equal(a, b) for a, b in zip(seen["before"], seen["after"], strict=True))
    events = read_jsonl(res.run_dir / "events.jsonl")
    assert [e["kind"] for e in events] == ["overflow"]
    assert events[0]["step"] == 5 and events[0]["overflow"] == "gradient"
    assert events[0]["params"] == ["bert.encoder.layer.1.output.dense.weight"]
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert rows[-1]["skipped"] == 1 and res.summary["skipped"] == 1
    assert rows[1]["scale"] == 512.0  # halved at step 5


def test_lr_schedule_does_not_advance_on_skipped_steps(fast_cfg):
    def lrs(fault=None, **kw):
        cfg = fast_cfg(
            "guard.rollback_after=0",
            "optim.schedule=linear",
            "trainer.max_steps=8",
            "trainer.log_every=1",
        )
        res = _run(cfg, name=f"lr{id(fault)}", fault=fault)
        return [r["lr"] for r in read_jsonl(res.run_dir / "metrics.jsonl")]

    def plant(tr, step, phase):
        if step == 3:
            next(iter(tr.params)).grad.view(-1)[0] = float("nan")

    clean, skipped = lrs(), lrs(plant)
    # the lr row is what was used for that step: after the skip the schedule lags by one step
    assert skipped[:3] == clean[:3]
    assert skipped[3] == clean[2] and skipped[4:] == clean[3:7]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16-pure"])
def test_other_precisions_train(fast_cfg, precision):
    res = _run(fast_cfg(f"precision={precision}"))
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert rows[-1]["precision"] == precision and math.isfinite(rows[-1]["loss"])
    assert rows[-1]["loss"] < rows[0]["loss"]
    if precision != "fp16-pure":
        assert rows[-1]["scale"] == 1.0


def test_grad_accumulation_and_fused_optimizer(fast_cfg):
    res = _run(fast_cfg("trainer.grad_accum_steps=2", "optim.fused=true"))
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert math.isfinite(rows[-1]["loss"]) and rows[-1]["tokens_per_s"] > 0


def test_host_reads_one_per_step_plus_log(fast_cfg):
    """Clean run: one host read per step plus one per log step, the same with the guard on and
    off (protection costs no read on a clean step)."""
    for guard in ("default", "off"):
        cfg = fast_cfg(
            f"guard={guard}", "trainer.max_steps=8", "trainer.log_every=4", "trainer.ckpt_every=100"
        )
        tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, f"h{guard}"))
        assert sum(reads_per_step(tr, 8)) == 8 + 2, guard


def test_fused_optimizer_makes_no_host_read_per_step(fast_cfg):
    cfg = fast_cfg("optim.fused=true", "optim.clip_grad_norm=null")
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "fz"))
    with count_host_reads() as reads:
        for _ in range(4):
            tr.train_step(log=False)
    assert reads.total == 0


def test_keep_last_checkpoints(fast_cfg):
    res = _run(fast_cfg("trainer.max_steps=12", "trainer.ckpt_every=2", "trainer.keep_last=2"))
    assert [p.name for p in list_checkpoints(res.run_dir / "checkpoints")] == [
        "step_00000010.pt",
        "step_00000012.pt",
    ]
    assert latest_checkpoint(res.run_dir / "checkpoints").name == "step_00000012.pt"


def test_resume_applies_scaler_and_precision_overrides(fast_cfg):
    from ampctl.commands.train import resume_config

    first = _run(fast_cfg("trainer.max_steps=6"), "ov")
    ck = load_checkpoint(first.run_dir)
    cfg = resume_config(
        ck,
        [
            "trainer.max_steps=8",
            "scaler.init_scale=64",
            "scaler.growth_interval=7",
            "precision=bf16",
        ],
    )
    tr = Trainer(cfg, first.run_dir, resume=ck)
    assert tr.precision.name == "bf16"  # asked for on the resume command line
    assert tr.scaler.get_growth_interval() == 7
    plain = Trainer(
        resume_config(ck, ["trainer.max_steps=8", "scaler.init_scale=64"]), first.run_dir, resume=ck
    )
    assert plain.scaler.get_scale() == 64.0 and plain.precision.name == "fp16"
