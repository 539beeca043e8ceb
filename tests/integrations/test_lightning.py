"""AmpctlCallback in real Lightning fits on the CPU: fp16 autocast really runs, a planted gradient
overflow is skipped (weights unchanged), the scale backs off, the run folder records it, the lr
schedule does not advance on the skip, ckpt_path resume continues the run, the scale floor falls
back to bf16, and GradScaler's private idioms work from a user's callback."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from ampctl.amp import LossScaler  # noqa: E402
from ampctl.integrations import IntegrationError  # noqa: E402
from ampctl.integrations.lightning import AmpctlCallback, AmpctlPrecision  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402
from tests.integrations.conftest import TinyNet, batches, plant_inf  # noqa: E402


class Lit(L.LightningModule):
    def __init__(self, plant=()) -> None:
        super().__init__()
        self.net = TinyNet()
        self.plant = set(plant)
        plant_inf(self.net.head.weight, lambda: self.trainer.global_step + 1 in self.plant)

    def training_step(self, batch, batch_idx):
        loss = self.net(**batch)["loss"]
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Watch(Callback):
    """Weights before and after every optimizer step, by global step."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[dict, dict]] = {}
        self._before: dict | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._before = copy.deepcopy(pl_module.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps[trainer.global_step] = (self._before, copy.deepcopy(pl_module.state_dict()))


def _loader():
    return torch.utils.data.DataLoader(batches(16), batch_size=None)


def _trainer(max_steps, callbacks, tmp_path, **kw):
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    return L.Trainer(
        **kw,
        max_steps=max_steps,
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        default_root_dir=tmp_path,
    )


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """Fit A: 8 steps, overflows planted at 3 and 6, checkpoints at 4 and 8. Fit B: resumes A's
    step-4 checkpoint into the same run folder and runs to 8 with the overflow at 6 again."""
    tmp = tmp_path_factory.mktemp("lit")
    torch.manual_seed(0)
    a_model, a_watch = Lit(plant=(3, 6)), Watch()
    a_cb = AmpctlCallback(
        tmp / "run", log_every=2, scaler=LossScaler(init_scale=1024.0), precision="fp16"
    )
    ckpt = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4, save_top_k=-1)
    a = _trainer(8, [a_cb, a_watch, ckpt], tmp)
    a.fit(a_model, _loader())
    after_a = {
        "events": read_jsonl(tmp / "run" / "events.jsonl"),
        "rows": read_jsonl(tmp / "run" / "metrics.jsonl"),
        "scale": a_cb.run.scaler.get_scale(),
        "lr_steps": a.lr_scheduler_configs[0].scheduler.last_epoch,
    }
    (step4,) = [p for p in (tmp / "ckpt").iterdir() if "step=4" in p.name]
    torch.manual_seed(0)
    b_model = Lit(plant=(6,))
    b_cb = AmpctlCallback(tmp / "run", log_every=2, precision="fp16")
    b = _trainer(8, [b_cb], tmp)
    b.fit(b_model, _loader(), ckpt_path=step4, weights_only=True)
    return {
        "tmp": tmp,
        "a": a,
        "a_model": a_model,
        "a_cb": a_cb,
        "a_watch": a_watch,
        "after_a": after_a,
        "b": b,
        "b_cb": b_cb,
        "step4": step4,
    }


def test_fp16_autocast_runs_on_the_cpu_with_a_loss_scaler(fits):
    plugin = fits["a"].strategy.precision_plugin
    assert isinstance(plugin, AmpctlPrecision) and plugin.amp.name == "fp16"
    assert isinstance(plugin.scaler, LossScaler) and plugin.scaler is fits["a_cb"].run.scaler
    assert set(fits["a_model"].net.seen) == {torch.float16}


def test_planted_overflow_is_skipped_backs_off_and_is_recorded(fits):
    watch = fits["a_watch"].steps
    for step in (3, 6):
        before, after = watch[step]
        assert all(torch.equal(before[k], after[k]) for k in before), step
    before, after = watch[4]
    assert not torch.equal(before["net.head.weight"], after["net.head.weight"])
    a = fits["after_a"]
    assert [(e["kind"], e["step"], e["scale"], e["params"]) for e in a["events"]] == [
        ("overflow", 3, 512.0, ["net.head.weight"]),
        ("overflow", 6, 256.0, ["net.head.weight"]),
    ]
    assert [(r["step"], r["skipped"], r["scale"]) for r in a["rows"]] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    assert a["scale"] == 256.0
    # skip-aware lr: 8 optimizer steps, 2 skipped -> the step scheduler advanced 6 times
    assert a["lr_steps"] == 6
    assert "lr_scheduler_step" not in fits["a_model"].__dict__  # the wrapper is gone after fit


def test_ckpt_path_resume_continues_the_scaler_the_guard_and_the_run_folder(fits):
    ck = torch.load(fits["step4"], weights_only=True)
    assert ck["AmpctlPrecision"]["scale"] == 512.0
    assert ck["AmpctlPrecision"]["ampctl"] == {"precision": "fp16", "in_fp32": []}
    assert ck["callbacks"]["AmpctlCallback"]["step"] == 4
    b_cb, tmp = fits["b_cb"], fits["tmp"]
    assert b_cb.run.scaler.skipped_steps == 2 and b_cb.run.scaler.get_scale() == 256.0
    events = read_jsonl(tmp / "run" / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [
        ("overflow", 3),
        ("resume", 4),
        ("overflow", 6),
    ]
    assert str(fits["step4"]) in events[1]["message"]
    rows = read_jsonl(tmp / "run" / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["scale"]) for r in rows] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert (summary["steps"], summary["skipped"], summary["framework"]) == (8, 2, "lightning")
    assert fits["b"].lr_scheduler_configs[0].scheduler.last_epoch == 6


def test_at_the_scale_floor_the_plugin_falls_back_to_bf16(tmp_path):
    torch.manual_seed(0)
    model = Lit(plant=(2, 3))
    cb = AmpctlCallback(
        tmp_path / "run", log_every=2, scaler=LossScaler(init_scale=1.0), precision="fp16"
    )
    trainer = _trainer(5, [cb], tmp_path)
    trainer.fit(model, _loader())
    plugin = trainer.strategy.precision_plugin
    assert plugin.amp.name == "bf16" and plugin.precision == "bf16-mixed"
    assert model.net.seen[:3] == [torch.float16] * 3 and model.net.seen[-1] == torch.bfloat16
    (fb,) = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "fallback"]
    assert (fb["step"], fb["from_precision"], fb["to_precision"]) == (0, "fp16", "bf16")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["status"] == "ok"
    # a checkpoint keeps the precision reached: a resumed fit continues in bf16
    trainer.save_checkpoint(tmp_path / "fb.ckpt")
    model2 = Lit()
    trainer2 = _trainer(
        6, [AmpctlCallback(tmp_path / "run", log_every=2, precision="fp16")], tmp_path
    )
    trainer2.fit(model2, _loader(), ckpt_path=tmp_path / "fb.ckpt", weights_only=True)
    assert trainer2.strategy.precision_plugin.amp.name == "bf16"
    assert model2.net.seen == [torch.bfloat16]


class PublicIdioms(Callback):
    """GradScaler's private parts as public training code uses them, in a Lightning fit:
    isinstance to decide, ``_scale`` read for logging and written to clamp a minimum,
    ``_growth_tracker``, and ``_found_inf_per_device`` all-reduced across ranks (here rank 0
    of 1 reports another rank's overflow at step 4)."""

    MIN = 256.0

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, int]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        scaler = trainer.precision_plugin.scaler
        assert isinstance(scaler, torch.amp.GradScaler)
        found = scaler._found_inf_per_device(optimizer)
        assert scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] is found
        for v in found.values():
            if trainer.global_step + 1 == 4:
                v.fill_(1.0)  # what the all-reduce brings from a rank that overflowed
            torch.distributed.all_reduce(v, op=torch.distributed.ReduceOp.MAX)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        scaler = trainer.precision_plugin.scaler
        if isinstance(scaler, torch.amp.GradScaler) and scaler._scale < self.MIN:
            scaler._scale = torch.tensor(self.MIN)  # the clamp idiom
        scale = scaler._scale.item() if hasattr(scaler, "_scale") else 1.0
        self.seen.append((trainer.global_step, scale, int(scaler._growth_tracker)))


def test_public_gradscaler_idioms_work_inside_a_lightning_fit(tmp_path):
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, idioms = Lit(plant=(2,)), PublicIdioms()
        cb = AmpctlCallback(
            tmp_path / "run", log_every=2, scaler=LossScaler(init_scale=512.0), precision="fp16"
        )
        _trainer(6, [cb, idioms], tmp_path).fit(model, _loader())
    finally:
        dist.destroy_process_group()
    # step 2 planted: 512 -> 256; step 4: the reduced flag skips it (256 -> 128), clamped to 256
    assert idioms.seen == [
        (1, 512.0, 1),
        (2, 256.0, 0),
        (3, 256.0, 1),
        (4, 256.0, 0),
        (5, 256.0, 1),
        (6, 256.0, 2),
    ]
    assert [(e["kind"], e["step"]) for e in cb.run.events] == [("overflow", 2), ("overflow", 4)]
    assert cb.run.scaler.skipped_steps == 2


@pytest.mark.parametrize(("flag", "runs"), [("32-true", "fp32"), ("bf16-mixed", "bf16")])
def test_without_a_precision_the_callback_follows_the_trainer(tmp_path, flag, runs):
    """No silent precision of the callback's own: it runs what the Trainer says."""
    model = Lit()
    cb = AmpctlCallback(tmp_path / "run", log_every=2)
    trainer = _trainer(2, [cb], tmp_path, precision=flag)
    trainer.fit(model, _loader())
    assert trainer.strategy.precision_plugin.amp.name == runs
    assert not cb.run.scaler.is_enabled()  # bf16 and fp32 do not scale the loss
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["precision"] == runs


def test_a_precision_that_differs_from_the_trainers_is_refused_with_one_line(tmp_path):
    """On a CPU Lightning turns 16-mixed into bf16-mixed: asking the callback for fp16 on top of
    it is a contradiction, named with the way out."""
    warnings.filterwarnings("ignore", ".*AMP with fp16 is not supported on CPU.*")
    cb = AmpctlCallback(tmp_path / "run", precision="fp16")
    trainer = _trainer(2, [cb], tmp_path, precision="16-mixed")
    with pytest.raises(IntegrationError) as e:
        trainer.fit(Lit(), _loader())
    assert str(e.value) == (
        "AmpctlCallback: precision='fp16' but the Trainer runs precision='bf16-mixed': give the "
        "precision once, to the Trainer or to the callback (with the Trainer at '32-true') "
        "(Lightning turns precision='16-mixed' into 'bf16-mixed' on a CPU: for fp16 there leave "
        "the Trainer at '32-true' and pass precision='fp16' here)"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written
