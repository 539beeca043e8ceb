"""Corpus runs of ampctl's own: ``ampctl train`` (the library call the command makes, with the
trainer's planted-fault hook where a case needs one) and a plain loop under
:class:`ampctl.integrations.ProtectedRun` (the README's own-loop pattern).

The guard's ``divergence`` events are real (the divergence rule of #27 stopping or rolling back
a loop whose lr jumped), and so is a transient fault's ``rerun`` (``guard.rerun=true``). A
reproducible ``rerun``, ``promotion_undone`` and discarded-overflow events are
:data:`HAND_WRITTEN`: a real ProtectedRun run folder with those events appended by hand, in the
fields their writer (``ampctl/protect/``) gives them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

FAST = [
    "trainer.max_steps=24",
    "trainer.log_every=2",
    "trainer.ckpt_every=6",
    "trainer.keep_last=10",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.vocab_size=64",
    "model.hidden_size=32",
    "model.ffn_size=64",
    "model.num_heads=2",
    "optim.warmup_steps=2",
    "scaler.init_scale=16384",  # S* of this model is ~2^15.7: 1024 would underflow
    "scaler.growth_interval=100",
    "logging.plot=false",
]


def train_run(out: Path, *overrides: str, fault=None) -> Path:
    """``ampctl train`` with the corpus's tiny config and ``overrides`` into ``out``."""
    from ampctl.config import load_config
    from ampctl.train.trainer import train

    cfg = load_config([*FAST, f"trainer.runs_dir={out.parent}", *overrides])
    out.mkdir(parents=True)
    train(cfg, out, fault=fault)
    return out


def _scale_at(name: str, step: int, factor: float):
    """A fault: the weight ``name`` multiplied by ``factor`` after the backward of ``step``."""

    def fault(tr, s: int, phase: str) -> None:
        if s == step:
            with torch.no_grad():
                tr.model.get_parameter(name).mul_(factor)

    return fault


INTERMEDIATE = "bert.encoder.layer.0.intermediate.dense"


def healthy(out: Path) -> Path:
    """init_scale 2^17: the first steps overflow while the scale backs off to its level."""
    return train_run(out, "scaler.init_scale=131072")


def guard_off_healthy(out: Path) -> Path:
    return train_run(out, "guard=off", "trainer.max_steps=30")


def lr_diverged(out: Path) -> Path:
    """lr 0.3 under a plain skip-and-halve scaler (guard=off): the loss rises from its first
    logged row (4.17, the untrained model's ln 64) while the warmup takes the lr to 0.3 (step 8),
    peaks 34% higher at step 12, and is back only at step 20, once the cosine decay has brought
    the lr down to 0.165. No step goes non-finite: the lr alone took it off course."""
    return train_run(
        out, "guard=off", "optim.lr=0.3", "optim.warmup_steps=8", "trainer.max_steps=30"
    )


def forward_overflow(out: Path) -> Path:
    """At step 10 the encoder's intermediate projection jumps 3x10^5-fold: its fp16 output
    overflows (finite in fp32) on every step after; guard=off keeps skipping."""
    return train_run(out, "guard=off", fault=_scale_at(f"{INTERMEDIATE}.weight", 10, 3e5))


def promoted(out: Path) -> Path:
    """The same fault under the default guard: it locates the module, moves it to fp32, and
    the run goes on."""
    return train_run(out, fault=_scale_at(f"{INTERMEDIATE}.weight", 10, 3e5))


def underflow(out: Path) -> Path:
    """The scale pinned at 1 (no loss scaling) with 4096 tokens per step: the loss's mean makes
    every gradient small, fp16's activation gradients fall below its normal range."""
    return train_run(
        out, *_UNDERFLOW, "scaler.init_scale=1", "scaler.min_scale=1", "scaler.max_scale=1"
    )


def underflow_twin(out: Path) -> Path:
    return train_run(out, *_UNDERFLOW, "scaler.init_scale=65536")


_UNDERFLOW = (
    "conf=gpt2_tiny",
    "data.batch_size=64",
    "data.seq_len=64",
    "trainer.max_steps=4",
    "trainer.ckpt_every=4",
    "trainer.log_every=2",
    "optim.warmup_steps=1",
)


def floor_too_high(out: Path) -> Path:
    """min_scale 2^20 (a bad floor): every step overflows at the floor (guard=off skips on)."""
    return train_run(out, "guard=off", "scaler.init_scale=1048576", "scaler.min_scale=1048576")


def rerun_transient(out: Path) -> Path:
    """``guard.rerun=true``: an infinite gradient planted in one weight at step 10 (after the
    backward: a transient fault) overflows; the guard reruns the step from the same state and
    batch, finds it clean, and retries it with the rerun's gradients."""

    def fault(tr, s: int, phase: str) -> None:
        if s == 10:
            tr.model.get_parameter(f"{FP8_LAYER}.weight").grad.view(-1)[0] = float("inf")

    return train_run(out, "guard.rerun=true", fault=fault)


FP8_LAYER = "bert.encoder.layer.0.output.dense"
_FP8 = ("precision=fp8", "model.num_layers=1", "trainer.max_steps=8", "trainer.ckpt_every=4")


def fp8_healthy(out: Path) -> Path:
    return train_run(out, *_FP8)


def fp8_saturated(out: Path) -> Path:
    """fp8 with the guard's demotion off: at step 6 one weight of an fp8 layer jumps to 2000,
    above e4m3's max 448."""

    def fault(tr, s: int, phase: str) -> None:
        if s == 6:
            with torch.no_grad():
                w = tr.model.get_parameter(f"{FP8_LAYER}.weight")
                w.view(-1)[7] = 2000.0

    return train_run(out, *_FP8, "guard.fp8_demote=false", fault=fault)


# ---------------------------------------------------------------------------- ProtectedRun
def own_loop(
    run_dir: Path,
    *,
    steps: int = 40,
    inf_grads: range = range(0),
    loss_factor: dict[int, float] | None = None,
    guard: dict[str, Any] | None = None,
    init_scale: float = 2.0**16,
    lr_at: dict[int, float] | None = None,
) -> Path:
    """A plain fp16 loop under ProtectedRun (the README's own-loop pattern), tiny. Planted:
    ``inf_grads`` steps get an infinite gradient in one weight; ``loss_factor`` multiplies a
    step's loss (a spike); ``lr_at`` sets the optimizer's lr from a step on (a bad schedule)."""
    from ampctl.amp import LossScaler
    from ampctl.integrations import ProtectedRun
    from ampctl.train.data import SyntheticSource
    from ampctl.train.models import BertForMaskedLM

    torch.manual_seed(0)
    data = SyntheticSource(vocab_size=64, seq_len=16, batch_size=4)
    model = BertForMaskedLM(
        vocab_size=64, max_position=16, hidden_size=32, num_layers=1, num_heads=2, ffn_size=64,
        dropout=0.0, attn_impl="eager",
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=init_scale)
    planted = model.bert.encoder.layer[0].output.dense.weight
    with ProtectedRun(
        model, opt, scaler, run_dir=run_dir, max_steps=steps, log_every=2, display=None,
        guard=guard,
    ) as run:  # fmt: skip
        for step in range(1, steps + 1):
            if step in (lr_at or {}):
                for g in opt.param_groups:
                    g["lr"] = lr_at[step]
            batch = data.next_batch()
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch).loss
            loss = loss * (loss_factor or {}).get(step, 1.0)
            scaler.scale(loss).backward()
            if step in inf_grads:
                planted.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            run.after_step(loss, batch)
    return run_dir


OWN_PARAM = "bert.encoder.layer.0.output.dense.weight"


def rebuild(config: dict | None) -> dict:
    """The own loop's model, batches and optimizer, as ``ampctl diagnose --rebuild`` takes them
    (``tests.commands.diagnose.corpus.ampctl_runs:rebuild``): what a user writes for their loop."""
    from ampctl.train.data import SyntheticSource
    from ampctl.train.models import BertForMaskedLM

    torch.manual_seed(0)
    data = SyntheticSource(vocab_size=64, seq_len=16, batch_size=4)
    model = BertForMaskedLM(
        vocab_size=64, max_position=16, hidden_size=32, num_layers=1, num_heads=2, ffn_size=64,
        dropout=0.0, attn_impl="eager",
    )  # fmt: skip
    return {
        "model": model,
        "batch": data.batch_at,
        "optimizer": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    }


def own_healthy(out: Path) -> Path:
    return own_loop(out)


def own_recovered(out: Path) -> Path:
    """Three overflows at 21-23, a rollback to the last snapshot (20), clean since."""
    return own_loop(out, inf_grads=range(21, 24))


def own_storm(out: Path) -> Path:
    """Every step from 25 on overflows, the guard rolls back after 3 in a row (not enough:
    the gradient stays infinite) until it aborts."""
    from ampctl.protect.protection import TrainAborted

    try:
        own_loop(out, inf_grads=range(25, 41), guard={"max_rollbacks": 2, "floor_policy": "abort"})
    except TrainAborted:
        pass
    return out


def own_spikes(out: Path) -> Path:
    """The spike rule on a short window: the loss of step 30 made 3 times larger is skipped (a
    spike event), the run goes on.

    One spike: with a second one at 34 (as this run had before the divergence rule of #27), the
    guard's divergence rule, judging the median of 3 log rows of which 2 held a spike's loss
    (7.5, 3.8, 7.5), stopped the run as diverged at step 34, and the spike rule had not flagged
    the second spike (nor one at 36 after a first at 26: observed, cause not traced). That is the
    guard's behaviour on such a run (ampctl/protect/), not what this case is about."""
    return own_loop(
        out,
        loss_factor={30: 3.0},
        guard={"spike_window": 16, "spike_min_steps": 16},
        init_scale=2.0**12,
    )


def own_divergence_stop(out: Path) -> Path:
    """The loop's lr set from 0.001 to 0.3 from step 20 on (a bad schedule): two overflows, the loss
    up from 3.98 to 16, and the guard's divergence rule stops the run (``TrainDiverged``; its
    snapshot of step 20 is newer than the last good row, 18, so it cannot roll back)."""
    from ampctl.protect.protection import TrainDiverged

    try:
        own_loop(out, lr_at={20: 0.3})
    except TrainDiverged:
        pass
    return out


def own_divergence_rollback(out: Path) -> Path:
    """The same lr jump a step later (from step 21) under ``guard.divergence_action=rollback``: the rule fires
    at step 30, restores the snapshot of step 20 (its lr 0.001) with the lr cut 2x, and the run
    goes on clean at 0.0005 to step 40."""
    return own_loop(out, lr_at={21: 0.3}, guard={"divergence_action": "rollback"})


# ---------------------------------------------------------------------------- hand-written
def _append(run_dir: Path, events: list[dict[str, Any]], status: str | None = None) -> Path:
    with open(run_dir / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps({"time": 0.0, **e}) + "\n")
    if status is not None:
        summary = json.loads((run_dir / "summary.json").read_text())
        summary["status"] = status
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def _from(base: str):
    def make(out: Path, root: Path, events: list[dict[str, Any]], status: str | None = None):
        shutil.copytree(root / base, out)
        return _append(out, events, status)

    return make


def rerun_reproducible(out: Path, root: Path) -> Path:
    """HAND-WRITTEN: a spike at 28 that the rerun reproduced (a bad batch), in the fields the
    rerun's writer (``ampctl/protect/replays.py``) gives it."""
    return _from("own-healthy")(out, root, [
        {"step": 28, "kind": "spike", "loss": 40.0, "loss_threshold": 6.0, "grad_norm": 2.0,
         "grad_norm_threshold": 9.0, "scale": 65536.0, "message": "spike, step skipped"},
        {"step": 28, "kind": "rerun", "verdict": "reproducible", "cause": "spike", "rank": None,
         "rerun_loss": 40.0,
         "message": "rerun of step 28 (spike): fails again (loss 40): the data or the numerics"},
    ])  # fmt: skip


def promotion_undone(out: Path, root: Path) -> Path:
    """HAND-WRITTEN (issue #27): a promotion at 22 that did not cure the overflow, undone at 23
    (the fields of ``ampctl/protect/replays.py``'s events)."""
    return _from("own-recovered")(out, root, [
        {"step": 22, "kind": "promotion", "module": "bert.encoder.layer.0.output.dense",
         "message": "forward overflow first appears in ...: now runs in fp32"},
        {"step": 23, "kind": "promotion_undone", "module": "bert.encoder.layer.0.output.dense",
         "promoted_at": 22,
         "message": "bert.encoder.layer.0.output.dense overflows in fp32 too (promoted at step "
                    "22): not the cause, moved back to fp16"},
    ])  # fmt: skip


def discarded(out: Path, root: Path) -> Path:
    """HAND-WRITTEN (issue #27): overflows on steps a later rollback discarded (fused path)."""
    return _from("own-healthy")(out, root, [
        *({"step": s, "kind": "overflow", "overflow": "gradient", "scale": 65536.0,
           "discarded": True, "message": "gradient overflow (discarded by the rollback)"}
          for s in (31, 32)),
        {"step": 30, "kind": "rollback", "to_step": 30, "from_step": 32, "discarded_steps": 2,
         "message": "3 consecutive overflows: restored step 30"},
    ])  # fmt: skip


RUNS = {
    "ampctl-healthy": healthy,
    "ampctl-guard-off-healthy": guard_off_healthy,
    "ampctl-lr": lr_diverged,
    "ampctl-forward-overflow": forward_overflow,
    "ampctl-promoted": promoted,
    "ampctl-underflow": underflow,
    "ampctl-underflow-twin": underflow_twin,
    "ampctl-floor": floor_too_high,
    "ampctl-fp8-healthy": fp8_healthy,
    "ampctl-fp8-saturated": fp8_saturated,
    "ampctl-rerun-transient": rerun_transient,
    "own-healthy": own_healthy,
    "own-recovered": own_recovered,
    "own-storm": own_storm,
    "own-spikes": own_spikes,
    "own-divergence-stop": own_divergence_stop,
    "own-divergence-rollback": own_divergence_rollback,
}

#: Runs made from other runs of the corpus (``make(out, root)``): hand-written events.
HAND_WRITTEN = {
    "own-rerun-reproducible": rerun_reproducible,
    "own-promotion-undone": promotion_undone,
    "own-discarded": discarded,
}
