"""What the loop promises about state: a rollback restores exactly the snapshot, accumulation is
the large-batch step, fp32 modules really run in fp32, a kill inside a checkpoint write
leaves the previous checkpoint whole."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.runlog import RunLayout
from ampctl.runlog.writers import new_run_dir
from ampctl.train import checkpoint as ck_mod
from ampctl.train.checkpoint import load_checkpoint
from ampctl.train.trainer import Trainer
from tests.conftest import FAST, ampctl_main, forked, read_jsonl
from tests.protect.test_protection import planted


def _state(tr: Trainer) -> dict:
    return {
        "step": tr.step,
        "model": {k: v.detach().clone() for k, v in tr.model.state_dict().items()},
        "optimizer": copy.deepcopy(tr.optimizer.state_dict()),
        "data": tr.data.state_dict(),
        "applied": int(tr.applied),
        "rng": torch.get_rng_state().clone(),
        "skipped": tr.scaler.skipped_steps,
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
def test_rollback_restores_exactly_the_snapshot(fast_cfg, precision):
    """Weights (and fp16-pure masters), optimizer state, data position, RNG, step and the lr
    schedule's count are those of the snapshot, bit for bit; the scale is cut to
    min(scale after the burst, snapshot scale) * rollback_backoff; the skips stay counted."""
    cfg = fast_cfg(
        f"precision={precision}",
        "trainer.max_steps=30",
        "guard.rollback_after=3",
        "guard.snapshot_every=4",
    )
    tr = Trainer(
        cfg,
        new_run_dir(cfg.trainer.runs_dir, "rb"),
        fault=planted({13, 14, 15}, {}),
    )
    tr.protection.start(tr.step)
    seen = {0: _state(tr)}
    masters = {}
    while tr.step < 15:
        out = tr.train_step(False)
        scale_after = tr.scaler.get_scale()
        rewind = tr.protection.after_step(tr.step, skipped=out.skipped, batches=out.batches)
        if rewind is not None:  # rolled back: the loop puts its position back
            tr.apply_rewind(rewind)
            break
        seen[tr.step] = _state(tr)
        if tr.precision.master is not None:
            masters[tr.step] = [m.detach().clone() for m in tr.precision.master.params]
    (rb,) = [e for e in tr.protection.events if e["kind"] == "rollback"]
    to = rb["to_step"]
    assert rb["from_step"] == 15 and to == 12  # the last snapshot: 4 clean steps after 8
    snap_scale = 1024.0  # init_scale; no overflow before the burst
    assert tr.scaler.get_scale() == min(scale_after, snap_scale) * 0.25
    now = _state(tr)
    assert now.pop("skipped") == 3  # the skips happened: the counters keep them
    want = {k: v for k, v in seen[to].items() if k != "skipped"}
    for key in want:
        assert _same(now[key], want[key]), key
    if precision == "fp16-pure":
        assert _same([m.detach() for m in tr.precision.master.params], masters[to])


def test_grad_accumulation_equals_the_large_batch_gradient(fast_cfg):
    """Two micro-batches accumulate to the gradient of their mean loss (fp32, no dropout)."""
    cfg = fast_cfg(
        "precision=fp32",
        "trainer.grad_accum_steps=2",
        "model.dropout=0.0",
        "optim.clip_grad_norm=null",
    )
    grads = {}

    def capture(tr, step, phase):
        grads[step] = [p.grad.detach().clone() for p in tr.params]

    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "acc"), fault=capture)
    ref = copy.deepcopy(tr.model)
    tr.train_step(False)
    losses = [ref(**tr.data.batch_at(i)).loss for i in (0, 1)]
    ((losses[0] + losses[1]) / 2).backward()
    expected = [p.grad for p in ref.parameters() if p.requires_grad]
    assert len(expected) == len(grads[1])
    for got, want in zip(grads[1], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_fp32_modules_run_in_fp32_at_run_time(fast_cfg):
    cfg = fast_cfg("precision.fp32_modules=[*embeddings*]")
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "ex"))
    assert tr.precision.in_fp32 == ["bert.embeddings"]
    seen = {}
    hooks = [
        tr.model.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, o.dtype)
        )
        for name in ("bert.embeddings", "bert.encoder.layer.0.intermediate.dense")
    ]
    tr.train_step(False)
    for h in hooks:
        h.remove()
    assert seen == {
        "bert.embeddings": torch.float32,
        "bert.encoder.layer.0.intermediate.dense": torch.float16,
    }


def _die_in_the_second_checkpoint(cut: int, cwd: str, args: list[str], output: str) -> None:
    """``ampctl train ARGS`` whose second checkpoint write ends the process after ``cut`` bytes
    (-1: half of them), written and synced: ``os._exit``, no cleanup runs (a :func:`forked`
    target)."""
    real_save, calls = torch.save, {"n": 0}

    def save_then_die(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] < 2:
            return real_save(obj, f, *a, **k)
        buf = io.BytesIO()
        real_save(obj, buf, *a, **k)
        data = buf.getvalue()
        f.write(data[: cut if cut >= 0 else len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os._exit(137)  # killed mid-write: no cleanup runs

    ck_mod.torch.save = save_then_die
    os.chdir(cwd)
    ampctl_main("train", *args, output=output)


@pytest.mark.parametrize("cut", [1, -1], ids=["first-byte", "half"])
def test_kill_inside_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, cut):
    """The second checkpoint write dies after ``cut`` bytes (fault injection, no timing luck):
    the previous checkpoint stays the newest complete one, loads, and the run resumes from it."""
    args = [*FAST, "trainer.runs_dir=runs", "trainer.ckpt_every=4", "logging.plot=false", "-q"]
    out = tmp_path / "output.txt"
    proc = forked(
        _die_in_the_second_checkpoint, cut, str(tmp_path), [*args, "--name", "k"], str(out)
    )
    proc.join(timeout=600)
    assert proc.exitcode == 137, out.read_text() if out.exists() else proc.exitcode
    run = RunLayout(tmp_path / "runs" / "k")
    assert [p.name for p in run.checkpoints()] == ["step_00000004.pt"]
    assert load_checkpoint(run.root)["step"] == 4
    r = CliRunner().invoke(app, ["train", "--resume", str(run.root), "-q"])  # in-process
    assert r.exit_code == 0, r.output
    assert load_checkpoint(run.root)["step"] == 12
    assert [row["step"] for row in read_jsonl(run.metrics)] == [4, 8, 12]
