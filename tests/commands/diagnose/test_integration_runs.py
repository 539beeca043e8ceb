"""ampctl diagnose on run folders that ampctl.integrations.ProtectedRun writes around a loop of
its own (metrics.jsonl, events.jsonl, summary.json, and checkpoints only when the loop saves
some): the history with the planted overflows, the replay skipped with the reason, exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampctl.amp import LossScaler
from ampctl.cli import app
from ampctl.integrations import LoopInfo, ProtectedRun
from ampctl.protect.protection import TrainAborted
from ampctl.runlog import RunLayout
from ampctl.train.checkpoint import save_checkpoint
from ampctl.train.data import SyntheticSource
from ampctl.train.models import BertForMaskedLM

from .conftest import diagnose_cli, kinds, problem

PLANTED = (5, 6)  # steps whose gradients are made infinite
STEPS = 10


def _loop(run_dir: Path, *, guard=None, config=None, save_at: int | None = None) -> Path:
    """A plain fp16 loop under ProtectedRun (the README's own-loop pattern), tiny."""
    torch.manual_seed(0)
    data = SyntheticSource(vocab_size=64, seq_len=16, batch_size=4)
    model = BertForMaskedLM(
        vocab_size=64, max_position=16, hidden_size=32, num_layers=1, num_heads=2, ffn_size=64,
        dropout=0.0, attn_impl="eager",
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=1024.0)
    planted = model.bert.encoder.layer[0].output.dense.weight
    with ProtectedRun(
        model, opt, scaler, run_dir=run_dir, max_steps=STEPS, log_every=2, display=None,
        guard=guard, loop=LoopInfo(config=config or {}),
    ) as run:  # fmt: skip
        for step in range(1, STEPS + 1):
            batch = data.next_batch()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            if step in PLANTED:
                planted.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            run.after_step(loss, batch)
            if step == save_at:  # the loop saves its own checkpoint in ampctl's format
                save_checkpoint(
                    RunLayout(run_dir),
                    step,
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(),
                        "ampctl": run.state_dict(),
                        "precision": run.state_dict()["precision"],
                    },
                )
    return run_dir


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory) -> Path:
    return _loop(tmp_path_factory.mktemp("loop") / "run")


def test_a_protected_run_without_checkpoints_reports_its_history(loop_run):
    code, rep, err = diagnose_cli(loop_run)
    assert code == 0 and err == "" and rep["healthy"]
    h = rep["history"]
    assert h["source"] == "run folder" and h["first_overflow_step"] == PLANTED[0]
    assert h["first_overflow_source"] == "events"
    assert [(b["start"], b["end"], b["length"]) for b in h["bursts"]] == [(5, 6, 2)]
    assert h["events"]["overflow"] == 2
    scales = [s for _, s in h["scale_trajectory"]]
    assert scales[0] == 1024 and scales[-1] == 256  # halved at each planted overflow
    assert rep["checkpoint"]["precision"] == "fp16" and rep["checkpoint"]["step"] is None
    assert rep["checkpoints"] == [] and rep["state"]["weights"]["tensors"] == 0
    r = rep["replay"]
    assert not r["ran"]
    assert r["reason"] == (
        "a run written by ampctl's 'loop' integration and no checkpoint in this run folder: the "
        "model is your code and the run does not record it (no model._target_), so ampctl "
        "cannot rebuild it"
    )
    assert "--trust-code" not in r["reason"]


def test_the_rendered_history_names_the_overflow_step(loop_run):
    res = CliRunner().invoke(
        app, ["diagnose", str(loop_run), "--device", "cpu"], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    out = " ".join(res.stdout.replace("│", " ").split())
    assert "first overflow step 5 (from events)" in out
    assert "overflow bursts 1: 5-6 (2)" in out
    assert "1. State health: no checkpoint read" in out
    assert "3. Replay skipped: a run written by ampctl's 'loop' integration" in out


def test_a_recorded_model_target_points_to_trust_code(tmp_path):
    run = _loop(tmp_path / "run", config={"model": {"_target_": "mypkg.models.Net"}})
    code, rep, _ = diagnose_cli(run)
    assert code == 0
    reason = rep["replay"]["reason"]
    assert "model._target_='mypkg.models.Net' in config.yaml" in reason
    assert "--trust-code" in reason
    assert "mypkg" not in __import__("sys").modules  # named, never imported


def test_a_loop_checkpoint_without_config_gets_state_health(tmp_path):
    run = _loop(tmp_path / "run", save_at=8)
    ckpt = RunLayout(run).checkpoint(8)
    code, rep, _ = diagnose_cli(run)
    assert code == 0 and rep["checkpoint"]["step"] == 8 and rep["checkpoint"]["path"] == str(ckpt)
    assert rep["state"]["weights"]["tensors"] > 0 and rep["history"]["first_overflow_step"] == 5
    assert "its checkpoint holds no config" in rep["replay"]["reason"]
    # a NaN planted in a weight of that checkpoint: exit 1, named, the history still there
    ck = torch.load(ckpt, weights_only=True)
    ck["model"]["bert.encoder.layer.0.output.dense.weight"][1, 2] = float("nan")
    torch.save(ck, ckpt)
    code, rep, _ = diagnose_cli(run)
    assert code == 1 and kinds(rep) == ["nonfinite_weights"]
    assert rep["history"]["first_overflow_step"] == 5
    assert rep["resume"]["command"].startswith("no healthy checkpoint")


def test_a_run_the_guard_aborted_exits_1(tmp_path):
    with pytest.raises(TrainAborted):
        _loop(tmp_path / "run", guard={"rollback_after": 2, "max_rollbacks": 0})
    code, rep, _ = diagnose_cli(tmp_path / "run")
    assert code == 1 and kinds(rep) == ["run_aborted"]
    assert problem(rep, "run_aborted")["step"] == PLANTED[1]
    assert rep["history"]["first_overflow_step"] == PLANTED[0]
