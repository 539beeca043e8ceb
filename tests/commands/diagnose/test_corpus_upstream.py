"""Failures users report upstream (#40), each a real tiny run of the real library beside a
healthy twin, named after the issue it reproduces (corpus/upstream_runs.py; their verdicts are
corpus cases, checked with the others in test_corpus.py).

Each test checks that the run reproduces the report in the library's own numbers (its message,
the scale trajectory, the NaN), that diagnose names the cause with the fix in the loop's own
terms, and that the healthy twin raises no alarm.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .corpus.upstream_runs import LOG

pytest.importorskip("tensorboard")

WO = "encoder.block.1.layer.1.DenseReluDense.wo"


def _scalars(run: Path, name: str) -> dict[int, float]:
    """A scalar the run logged to TensorBoard, by step, as TensorBoard reads it back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(name)}


def _said(run: Path) -> list[str]:
    f = run / LOG
    return f.read_text().splitlines() if f.exists() else []


def _healthy(corpus, target: Path) -> dict:
    code, rep, _ = corpus.diagnose(target)
    assert code == 0 and rep["problems"] == [] and rep["recommendations"] == [], rep["verdict"]
    return rep


# ---------------------------------------------------------------------------- transformers #5651
def test_transformers_5651_t5_wo_output_passes_fp16_max(corpus):
    """transformers' T5: after the jump, encoder block 1's ``wo`` gives ~1e5 in fp32 and inf
    in fp16 (the report: 66246 > 65504), the loss is non-finite from the next step on; diagnose
    replays the saved folder, names ``wo`` and moves it to fp32 in the loop's terms."""
    pytest.importorskip("transformers")
    from transformers import T5ForConditionalGeneration

    run, ok = corpus.run("t5-wo-overflow"), corpus.run("t5-healthy")
    model = T5ForConditionalGeneration.from_pretrained(run / "checkpoint-8")
    outs = []
    model.get_submodule(WO).register_forward_hook(lambda m, i, o: outs.append(o.detach()))
    ids = (torch.arange(16)[None] * 2 + 5) % 64
    model(input_ids=ids, labels=ids)
    with torch.autocast("cpu", dtype=torch.float16):
        model(input_ids=ids, labels=ids)
    fp32, fp16 = outs
    assert torch.isfinite(fp32).all() and fp32.abs().max() > 65504
    assert fp16.dtype == torch.float16 and torch.isinf(fp16).any()
    loss = _scalars(run, "loss")
    assert [s for s, v in loss.items() if not math.isfinite(v)] == list(range(7, 13))

    code, rep, _ = corpus.diagnose(run / "checkpoint-12")
    p = rep["problems"][0]
    assert code == 1 and p["kind"] == "forward_overflow" and p["module"] == WO
    assert rep["replay"]["precision"] == "fp16"  # the history logs a loss scale
    assert rep["replay"]["forward_first_bad"]["fp32_finite"] is True
    fix = rep["recommendations"][0]
    assert fix["override"] == f"precision.fp32_modules=[{WO}]"
    assert "torch.autocast(device_type, enabled=False)" in fix["yours"]
    assert rep["resume"]["checkpoint"] == str(run / "checkpoint-4")
    _healthy(corpus, ok / "checkpoint-12")


# ---------------------------------------------------------------------------- pytorch #55585
def test_pytorch_55585_lr_scheduler_advances_on_skipped_steps(corpus):
    """The warmup ran on while GradScaler skipped the optimizer: torch's warning, the broken
    loop's lr at its peak at the first real step, the scheduler ahead of Adam's step count by
    the skips; diagnose names it with the plain loop's line; the gated twin is healthy."""
    bad, ok = corpus.run("scheduler-on-skips"), corpus.run("scheduler-gated")
    (warning,) = _said(bad)
    assert warning.startswith(
        "UserWarning: Detected call of `lr_scheduler.step()` before `optimizer.step()`"
    )
    assert _said(ok) == []
    grad_norm = _scalars(bad, "grad_norm")
    skipped = [s for s, g in grad_norm.items() if not math.isfinite(g)]
    assert skipped == list(range(1, 10))  # the scale fell from 2**24 to 2**15
    assert _scalars(bad, "lr")[10] == pytest.approx(1e-2)  # the warmup is over already
    assert _scalars(ok, "lr")[10] == pytest.approx(1e-3)  # the warmup's first step
    state = torch.load(bad / "ckpt.pt", weights_only=True)
    opt_steps = int(state["optimizer"]["state"][0]["step"])
    assert state["lr_scheduler"]["last_epoch"] - opt_steps == len(skipped)

    code, rep, _ = corpus.diagnose(bad / "ckpt.pt")
    assert code == 1 and [p["kind"] for p in rep["problems"]] == ["scheduler_on_skipped_steps"]
    assert rep["problems"][0]["message"].startswith(
        "the lr scheduler stepped on 9 step(s) the GradScaler skipped (1–9): the lr moved from "
        "0.001 to 0.01"
    )
    assert rep["history"]["columns"]["learning_rate"] == "lr"
    assert _healthy(corpus, ok / "ckpt.pt")["history"]["skipped_steps"] == skipped


# ---------------------------------------------------------------------------- pytorch #98828
def test_pytorch_98828_gradscaler_scale_grows_until_it_overflows(corpus):
    """The scale doubled every step to float32's ceiling (capped by torch at 2**127, inf
    before 2.1); diagnose names it and gives GradScaler's default interval back."""
    bad, ok = corpus.run("scale-growth-1"), corpus.run("scale-growth-default")
    scale = _scalars(bad, "scale")
    assert [scale[s] for s in (1, 2, 3)] == [2.0**16, 2.0**17, 2.0**18]
    assert max(scale.values()) == 2.0**127  # capped by torch, not inf
    assert set(_scalars(ok, "scale").values()) == {65536.0}

    code, rep, _ = corpus.diagnose(bad / "ckpt.pt")
    assert rep["state"]["scaler"]["scale"] == 2.0**127
    assert rep["state"]["scaler"]["growth_interval"] == 1
    assert code == 1 and [p["kind"] for p in rep["problems"]] == ["scale_at_ceiling"]
    assert "(2^127)" in rep["problems"][0]["message"]
    (fix,) = rep["recommendations"]
    assert fix["override"] == "scaler.growth_interval=2000"
    assert fix["yours"] == "torch.amp.GradScaler(growth_interval=2000)"
    assert _healthy(corpus, ok / "ckpt.pt")["state"]["scaler"]["scale"] == 65536.0


# ---------------------------------------------------------------------------- pytorch #157436
def test_pytorch_157436_scale_collapses_to_5e_23_with_none_gradients_on_ranks(corpus):
    """Two ranks (gloo): the other task's head has ``None`` gradients on each; averaged after
    ``scaler.unscale_``, one rank's overflow reaches the other's weights unchecked, NaN comes
    back, and both ranks' scales halve once per skipped step from 131072 to 5.29e-23 (2^-74,
    the report's number); averaged before, both skip the one step and go on."""
    bad, ok = corpus.run("ranks-unscaled-before-average"), corpus.run("ranks-averaged-first")
    assert _said(bad) == ["rank 0: None gradients before averaging: params ['4', '5']"]
    rank0 = torch.load(bad / "ckpt_101.pt", weights_only=True)
    rank1 = torch.load(bad / "rank1-scaler.pt", weights_only=True)
    assert rank0["scaler"]["scale"] == rank1["scale"] == 2.0**-74
    assert f"{2.0**-74:.3g}" == "5.29e-23"
    assert not torch.isfinite(rank0["model"]["trunk.0.weight"]).all()
    scale, loss = _scalars(bad, "scale"), _scalars(bad, "loss")
    assert scale[10] == 131072.0 and all(math.isfinite(loss[s]) for s in range(1, 12))
    assert all(math.isnan(loss[s]) for s in range(12, 102))
    assert all(scale[s] == 2 * scale[s + 1] for s in range(12, 101))  # one halving a step
    for f in ("ckpt_101.pt", "rank1-scaler.pt"):
        sc = torch.load(ok / f, weights_only=True)
        assert sc.get("scaler", sc)["scale"] == 65536.0  # the one overflow, both ranks

    code, rep, _ = corpus.diagnose(bad / "ckpt_101.pt")
    p = rep["problems"][0]
    assert code == 1 and p["kind"] == "unchecked_update"
    assert "131072 to 5.29e-23: 91 halvings, one per skipped step" in p["message"]
    assert "average the gradients before `scaler.unscale_(optimizer)`" in p["message"]
    assert rep["recommendations"] == []  # neither the lr nor the precision
    assert _healthy(corpus, ok / "ckpt_101.pt")["history"]["skipped_steps"] == [10]


# ---------------------------------------------------------------------------- LLaVA #363
def test_llava_363_attempting_to_unscale_fp16_gradients(corpus):
    """Lightning's GradScaler refuses the fp16 head's gradients at the first step with the
    report's message; the checkpoint Lightning saved on the exception holds fp16 weights and
    no optimizer state; diagnose names it with the Lightning flag. The twin trains an fp32 head
    over the same fp16 base (LLaVA's LoRA setup) and is healthy."""
    pytest.importorskip("lightning")
    bad, ok = corpus.run("fp16-trainable"), corpus.run("fp16-base-fp32-head")
    assert _said(bad) == ["ValueError: Attempting to unscale FP16 gradients."]
    ck = torch.load(bad / "checkpoints" / "on_exception.ckpt", weights_only=True)
    assert ck["global_step"] == 0 and ck["optimizer_states"][0]["state"] == {}
    assert {t.dtype for t in ck["state_dict"].values()} == {torch.float16}

    code, rep, _ = corpus.diagnose(bad / "checkpoints" / "on_exception.ckpt")
    (p,) = rep["problems"]
    assert code == 1 and p["kind"] == "fp16_weights_under_scaler"
    assert '"Attempting to unscale FP16 gradients"' in p["message"]
    assert (
        'fix: keep the weights you train in float32 under Trainer(precision="16-mixed")'
        in (p["message"])
    )
    assert _said(ok) == []
    twin = torch.load(ok / "checkpoints" / "epoch=0-step=6.ckpt", weights_only=True)
    assert twin["state_dict"]["base.0.weight"].dtype == torch.float16
    assert twin["state_dict"]["head.weight"].dtype == torch.float32
    _healthy(corpus, ok / "checkpoints" / "epoch=0-step=6.ckpt")


# ---------------------------------------------------------------------------- marin #7271
def test_marin_7271_success_reported_with_a_checkpoint_poisoned_by_a_nan_backward(corpus):
    """Step 13's loss is finite, its backward NaN, AdamW applies it; step 14's loss is NaN, the
    loop stops, saves its final checkpoint and reports success. Diagnose names the poisoned
    checkpoint, the NaN backward's step and the fix, and resumes from before it."""
    bad, ok = corpus.run("nan-backward-saved"), corpus.run("no-padding")
    assert _said(bad) == [
        "NaN loss at step 14. Stopping training.",
        "training finished at step 14: succeeded",
    ]
    loss, grad_norm = _scalars(bad, "loss"), _scalars(bad, "grad_norm")
    assert math.isfinite(loss[13]) and math.isnan(grad_norm[13]) and max(loss) == 13
    final = torch.load(bad / "ckpt_14.pt", weights_only=True)["model"]
    assert all(torch.isnan(t).all() for t in final.values())
    before = torch.load(bad / "ckpt_10.pt", weights_only=True)["model"]
    assert all(torch.isfinite(t).all() for t in before.values())

    code, rep, _ = corpus.diagnose(bad / "ckpt_14.pt")
    p = rep["problems"][0]
    assert code == 1 and p["kind"] == "poisoned_checkpoint" and p["step"] == 13
    assert "the backward of step 13 made the NaN" in p["message"]
    assert rep["resume"]["checkpoint"] == str(bad / "ckpt_10.pt")
    assert _said(ok) == ["training finished at step 20: succeeded"]
    _healthy(corpus, ok / "ckpt_20.pt")


# ---------------------------------------------------------------------------- a bf16 spike
def test_bf16_loss_spike_from_one_bad_batch(corpus):
    """The verdict says the run recovered from a single loss at the bad batch's step
    (clipping kept the update bounded); the twin is healthy."""
    bad, ok = corpus.run("bf16-spike"), corpus.run("bf16-no-spike")
    spiked, clean = _scalars(bad, "loss"), _scalars(ok, "loss")
    assert spiked[12] > 1000 * max(clean.values())  # the spike is real
    assert spiked[24] < 1.0  # and the run came back
    code, rep, _ = corpus.diagnose(bad / "ckpt.pt")
    assert code == 0 and rep["verdict"]["status"] == "recovered", rep["verdict"]
    assert "a single loss of" in rep["verdict"]["summary"]
    assert "at step 12" in rep["verdict"]["summary"]
    assert _healthy(corpus, ok / "ckpt.pt")["verdict"]["status"] == "healthy"
