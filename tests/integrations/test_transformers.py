"""protect_trainer on a real HF Trainer on the CPU (tiny GPT-2 built from a config, nothing
downloaded), with the Trainer's default fused AdamW: fp16 autocast really runs, planted
overflows are skipped (weights unchanged) and recorded from the LossScaler's on-device record,
the lr schedule does not advance on them, and ``resume_from_checkpoint`` loads ``scaler.pt`` into
the LossScaler and continues the guard and the run folder."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch

pytest.importorskip("transformers")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from ampctl.amp import LossScaler  # noqa: E402
from ampctl.integrations.accelerate import AmpctlAcceleratedOptimizer  # noqa: E402
from ampctl.integrations.transformers import SCALER_FILE, protect_trainer  # noqa: E402
from ampctl.ui.display import Display  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402
from tests.integrations.conftest import plant_inf  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Watch(TrainerCallback):
    """The step being run (for the planted overflow) and the weights around each optimizer step."""

    def __init__(self) -> None:
        self.step = 0
        self.weights: dict[int, tuple[dict, dict]] = {}
        self._before: dict | None = None

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.step = state.global_step + 1

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self._before = copy.deepcopy(model.state_dict())

    def on_step_end(self, args, state, control, model=None, **kw):
        self.weights[state.global_step] = (self._before, copy.deepcopy(model.state_dict()))


def _trainer(out, max_steps, plant, protect=True, lr=1e-3, **kw):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    seen: list[torch.dtype] = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    watch = Watch()
    plant_inf(model.lm_head.weight, lambda: watch.step in plant)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=lr,
        lr_scheduler_type="linear",
        logging_steps=2,
        save_steps=4,
        use_cpu=True,
        fp16=True,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[watch])
    cb = protect_trainer(trainer, **kw) if protect else None
    return trainer, cb, watch, seen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run A: 8 steps, overflows planted at 3 and 6, checkpoints at 4 and 8, the plain display.
    Run B: a new Trainer resumes A's checkpoint-4 into the same run folder, overflow at 6."""
    tmp = tmp_path_factory.mktemp("hf")
    buf = io.StringIO()
    display = Display(8, mode="plain", console=Console(file=buf, width=200))
    a, a_cb, a_watch, a_seen = _trainer(
        tmp / "out",
        8,
        {3, 6},
        run_dir=tmp / "run",
        scaler=LossScaler(init_scale=1024.0),
        display=display,
    )
    a.train()
    after_a = {
        "events": read_jsonl(tmp / "run" / "events.jsonl"),
        "rows": read_jsonl(tmp / "run" / "metrics.jsonl"),
        "lr_steps": a.lr_scheduler.last_epoch,
        "scaler": a.accelerator.scaler,
        "display": buf.getvalue(),
    }
    b, b_cb, _, b_seen = _trainer(tmp / "out", 8, {6}, run_dir=tmp / "run")
    b.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-4"))
    return {
        "tmp": tmp,
        "a": a,
        "a_cb": a_cb,
        "a_watch": a_watch,
        "a_seen": a_seen,
        "after_a": after_a,
        "b": b,
        "b_cb": b_cb,
        "b_seen": b_seen,
    }


def test_fp16_on_the_cpu_really_runs_fp16_with_the_trainers_fused_adamw(runs):
    a = runs["a"]
    assert set(runs["a_seen"]) == {torch.float16}
    assert isinstance(a.optimizer, AmpctlAcceleratedOptimizer)
    assert a.optimizer.optimizer.defaults["fused"] is True  # the Trainer's default optimizer
    assert isinstance(a.accelerator.scaler, LossScaler)


def test_planted_overflow_is_skipped_backs_off_and_is_recorded(runs):
    weights = runs["a_watch"].weights
    for step in (3, 6):
        before, after = weights[step]
        assert all(torch.equal(before[k], after[k]) for k in before), step
    before, after = weights[4]
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    a = runs["after_a"]
    # lm_head.weight is tied to the embedding: attribution names the parameter once
    assert [(e["kind"], e["step"], e["scale"], e["params"]) for e in a["events"]] == [
        ("overflow", 3, 512.0, ["transformer.wte.weight"]),
        ("overflow", 6, 256.0, ["transformer.wte.weight"]),
    ]
    assert [(r["step"], r["skipped"], r["scale"]) for r in a["rows"]] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in a["rows"])
    assert a["rows"][1]["overflow_rate"] == pytest.approx(1 / 4)
    # the lr schedule follows the applied updates: 8 steps, 2 skipped
    assert a["lr_steps"] == 6
    assert "step=4/8 loss=" in a["display"] and "[event] step=3 overflow" in a["display"]


def test_resume_from_checkpoint_loads_the_scaler_and_continues_the_run(runs):
    tmp, b, b_cb = runs["tmp"], runs["b"], runs["b_cb"]
    # a plain Trainer on a CPU has no scaler: the state is kept where only ampctl reads it
    assert not (tmp / "out" / "checkpoint-4" / "scaler.pt").exists()
    saved = torch.load(tmp / "out" / "checkpoint-4" / SCALER_FILE, weights_only=True)
    assert saved["scale"] == 512.0 and saved["skipped_total"] == 1
    sc = b.accelerator.scaler
    assert isinstance(sc, LossScaler) and sc.skipped_steps == 2 and sc.get_scale() == 256.0
    assert set(runs["b_seen"]) == {torch.float16}
    assert list(b_cb.run.protection.guard.window)[:4] == [False, False, True, False]
    events = read_jsonl(tmp / "run" / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [
        ("overflow", 3),
        ("resume", 4),
        ("overflow", 6),
    ]
    rows = read_jsonl(tmp / "run" / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["scale"]) for r in rows] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    assert b.lr_scheduler.last_epoch == 6
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert (summary["steps"], summary["skipped"], summary["framework"]) == (8, 2, "transformers")
    assert summary["status"] == "ok" and summary["precision"] == "fp16"


def test_a_plain_trainer_resumes_a_checkpoint_written_under_protect_trainer(runs):
    """Using ampctl once does not lock the checkpoints in: transformers' own resume (no ampctl)
    continues from checkpoint-4 to the end."""
    tmp = runs["tmp"]
    plain, _, watch, _ = _trainer(tmp / "out-plain", 6, set(), protect=False)
    plain.train(resume_from_checkpoint=str(tmp / "out" / "checkpoint-4"))
    assert plain.state.global_step == 6 and sorted(watch.weights) == [5, 6]


@pytest.mark.parametrize("lr, status", [(1.0, "diverged"), (1e-3, "ok")])
def test_a_diverging_hf_run_is_called_diverged_and_its_healthy_twin_ok(tmp_path, lr, status):
    """The finding of issue #27 on the real HF Trainer: at lr 1.0 the first update wrecks the
    model (the loss 3.9 before it, 16-46 after), so no healthy row exists to compare with; the
    rule compares with the loss the run started from, stops the run at its third log step with
    status diverged (not ok, and not the fp16 range blamed at the scale floor later). At its
    normal lr the same run ends ok, no divergence event."""
    trainer, cb, _, _ = _trainer(
        tmp_path / "out",
        40,
        set(),
        lr=lr,
        run_dir=tmp_path / "run",
        scaler=LossScaler(init_scale=1024.0),
    )
    trainer.train()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    div = [e for e in events if e["kind"] == "divergence"]
    assert (cb.status, summary["status"]) == (status, status)
    if status == "ok":
        assert div == [] and trainer.state.global_step == 40
        assert not [e for e in events if e["kind"] in ("rollback", "abort")]
        return
    (d,) = div
    assert d["step"] == 6 and d["action"] == "stop" and trainer.state.global_step == 6
    assert (
        d["message"].startswith("the loss diverged: ")
        and "the loss the run started from" in d["message"]
    )
    assert 3.5 < d["min_loss"] < 4.5 and d["ratio"] > 5  # ln(64) = 4.16: the untrained model
    last = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]  # the row the rule held on
    assert last["step"] == 6 and summary["final_loss"] == last["loss"]
    assert not [e for e in events if e["kind"] == "abort"]
