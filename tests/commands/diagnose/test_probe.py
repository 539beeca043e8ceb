"""#36: diagnose's advice worked out from the run and tried before it is printed. The issue's
lr=1.0 case on the tiny BERT: an lr divergence whose forward overflows are its effect -- no
precision change; the lr from the run's rows, a ladder of candidates probed from a fresh start
(no checkpoint was written before the trouble), the best that held recommended; and, with
metrics.jsonl gone, the trouble still found before the checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch

from ampctl.commands.diagnose import diagnose
from ampctl.commands.diagnose.probe import ProbeOutcome, probe_advice
from ampctl.config import load_config
from ampctl.runlog.layout import checkpoint_step
from ampctl.train.trainer import Trainer
from tests.conftest import FAST


@pytest.fixture(scope="module")
def lr1(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("probe")
    run = root / "lr1"
    run.mkdir()
    cfg = load_config(
        [*FAST, "trainer.max_steps=80", "trainer.ckpt_every=4", "optim.lr=1.0",
         "logging.plot=false", "logging.act_grads=false", f"trainer.runs_dir={root}"]
    )  # fmt: skip
    assert Trainer(cfg, run).run().status == "diverged"
    return run


def _lr(override: str) -> float:
    return float(override.split("=", 1)[1])


def test_an_lr_divergence_gets_a_probed_lr_and_no_precision_change(lr1):
    rep = diagnose(lr1)
    assert rep["problems"][0]["kind"] == "lr_divergence"
    keys = [r["override"].split("=", 1)[0] for r in rep["recommendations"]]
    assert not [k for k in keys if k.startswith("precision")]  # the cause was the lr
    (lr,) = [r["override"] for r in rep["recommendations"] if r["override"].startswith("optim.lr")]
    probe = rep["resume"]["probe"]
    # the ladder came from the history (not lr/10): its first rung is below the lr the loss
    # rose at, and the recommendation is the best rung that held
    assert probe.startswith("probe (") and "held" in probe and "from a fresh start" in probe
    assert f"recommended: lr {lr.split('=')[1]}" in probe and _lr(lr) < 1.0 and _lr(lr) != 0.1
    assert "did not hold" in probe  # a rung too high was tried and refused
    assert rep["resume"]["command"].split("   #")[0].endswith(lr)
    # the run's own config, not the defaults: a fresh start of the same run
    assert "model.hidden_size=32" in rep["resume"]["command"]
    first = rep["verdict"]["first_bad_step"]
    for c in rep["checkpoints"]:
        if c["path"] == rep["resume"]["checkpoint"]:
            assert c["step"] < first


def test_no_probe_says_so(lr1):
    rep = diagnose(lr1, probe=False)
    assert rep["resume"]["probe"] == "probe: not run: --no-probe"
    (lr,) = [r for r in rep["recommendations"] if r["override"].startswith("optim.lr")]
    assert "not known to hold" in lr["reason"]


def test_without_its_history_the_trouble_is_still_before_the_checkpoints(lr1, tmp_path):
    run = tmp_path / "lr1"
    shutil.copytree(lr1, run)
    (run / "metrics.jsonl").unlink()
    newest = sorted((run / "checkpoints").iterdir())[-1]
    rep = diagnose(newest, probe=False)
    first = rep["verdict"]["first_bad_step"]
    assert first is not None and first < checkpoint_step(newest)
    chosen = rep["resume"]["checkpoint"]
    assert chosen is None or checkpoint_step(chosen) < first


def test_a_foreign_checkpoint_is_not_probed_and_says_why():
    out = probe_advice(
        fmt="lightning", cfg=None, cfg_reason=None, resume=None, overrides=[], ladder=[0.1],
        trust_code=False, device=torch.device("cpu"),
    )  # fmt: skip
    assert isinstance(out, ProbeOutcome) and not out.ran
    assert out.line().startswith("probe: not run: a lightning checkpoint")


def test_the_checkpoint_written_at_the_stop_is_never_a_resume_point(lr1):
    """Its weights may read fine, but its scaler and optimizer hold what the trouble left (the
    issue's lr=30 run resumed from such a state at scale 4 ended at 3.93 against 2.35)."""
    import torch as t

    stop = sorted((lr1 / "checkpoints").iterdir())[-1]
    assert t.load(stop, weights_only=True)["trainer"]["stopped"] is True
    rep = diagnose(lr1, probe=False)
    (mine,) = [c for c in rep["checkpoints"] if c["path"] == str(stop)]
    assert not mine["healthy"] and rep["resume"]["checkpoint"] != str(stop)
