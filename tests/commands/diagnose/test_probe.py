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


# ---------------------------------------------------------------------------- other tools' runs
def test_an_hf_folder_is_probed_from_its_config_json(corpus):
    """The HF Trainer's lr=1.0 run (no checkpoint before the trouble): the GPT-2 class from
    config.json (nothing of the folder imported), trained afresh on synthetic batches of its
    shape; the lr recommended in TrainingArguments' terms is the rung that held best."""
    pytest.importorskip("transformers")
    from tests.commands.diagnose.corpus.cases import BY_NAME

    rep = diagnose(corpus.target(BY_NAME["hf/lr-1.0"]), device="cpu")
    probe = rep["resume"]["probe"]
    assert probe.startswith("probe (") and "from a fresh start" in probe, probe
    assert "synthetic token batches of the model's shape" in probe
    (lr,) = [r for r in rep["recommendations"] if r["override"].startswith("optim.lr=")]
    value = lr["override"].split("=")[1]
    assert f"recommended: lr {value}" in probe and "held best" in lr["reason"]
    assert lr["yours"] == f"TrainingArguments(learning_rate={value})"


def test_a_protectedrun_folder_is_probed_with_the_users_rebuild_factory(corpus):
    """A ProtectedRun folder keeps no model: without --rebuild the probe says what would run
    it; with the user's factory named on the command line, its model and batches are trained."""
    from tests.commands.diagnose.corpus.cases import BY_NAME

    run = corpus.target(BY_NAME["own/divergence-stop"])
    rep = diagnose(run, device="cpu")
    assert "pass --rebuild MODULE:FUNCTION" in rep["resume"]["probe"]
    factory = "tests.commands.diagnose.corpus.ampctl_runs:rebuild"
    rep = diagnose(run, device="cpu", rebuild=factory)
    probe = rep["resume"]["probe"]
    assert f"the batches of {factory}" in probe and "held" in probe, probe
    (lr,) = [r for r in rep["recommendations"] if r["override"].startswith("optim.lr=")]
    assert float(lr["override"].split("=")[1]) <= 0.001  # never above what the history gives
    assert lr["yours"].startswith("torch.optim.AdamW(params, lr=")
    rep = diagnose(run, device="cpu", rebuild="no_such_module:make")
    assert "cannot import it" in rep["resume"]["probe"]


def test_the_probe_covers_the_rest_of_the_warmup_then_four_patiences():
    """The issue's lr=30 run: a 24-step probe from a fresh start (20 of them warmup) ranked lr
    0.015 best; followed for 300 steps it stalled at 3.95 (the default run: 2.38). The probe
    runs the warmup out and then 4 patiences at the lr itself."""
    from ampctl.commands.diagnose.probe import PATIENCES, PROBE_EVERY, _probe_config

    cfg = load_config([*FAST, "optim.warmup_steps=20", "trainer.max_steps=300"])
    patience = cfg.guard.divergence_patience
    run, _ = _probe_config(cfg, [], 0, False, "cpu")
    assert run.trainer.stop_at == 20 + PATIENCES * patience * PROBE_EVERY
    run, _ = _probe_config(cfg, [], 12, False, "cpu")  # from a checkpoint inside the warmup
    assert run.trainer.stop_at == 12 + 8 + PATIENCES * patience * PROBE_EVERY
    run, _ = _probe_config(cfg, ["optim.warmup_steps=50"], 100, False, "cpu")  # past it
    assert run.trainer.stop_at == 100 + PATIENCES * patience * PROBE_EVERY


def test_a_coarse_ladder_is_refined_around_its_best_never_above_its_first_rung():
    from ampctl.commands.diagnose.probe import ProbeOutcome, Trial, _between, _walk

    ladder = [1.5, 0.15, 0.015, 0.0015]  # the lr=30 run's, 10x apart
    assert _between(0.015, ladder, [1.5, 0.15, 0.015, 0.0015]) == [0.0047, 0.047]
    assert _between(1.5, ladder, [1.5, 0.15]) == [0.47]  # not above 1.5
    # a rung tried is not tried again (as printed, two digits: 0.0045 / 10^0.5 is 0.0014)
    assert _between(0.0045, [0.045, 0.0045], [0.045, 0.0045, 0.0014]) == [0.014]
    assert _between(0.1, [0.1, 0.05], [0.1, 0.05]) == []  # 2x apart: fine enough
    # the walk: down while each rung holds better, then halfway around the best
    loss = {1.5: None, 0.15: 4.19, 0.015: 3.79, 0.0015: 4.01, 0.0047: 3.49, 0.047: 4.19}

    def one(lr, ov):
        got = loss[lr]
        return Trial(lr, "ok" if got else "diverged", 5.5, got or 25.0, 44, got is not None)

    out = _walk(ProbeOutcome(True), [], ladder, one, budget_s=60)
    assert [t.lr for t in out.trials] == [1.5, 0.15, 0.015, 0.0015, 0.0047, 0.047]
    assert out.chosen.lr == 0.0047
