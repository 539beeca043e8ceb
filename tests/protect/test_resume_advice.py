"""Issue #36, the train side: the divergence rule remembers the run's course across a resume, the
lr of a hint is worked out from the run's rows (:mod:`ampctl.protect.advice`), and a run that
diverged or was aborted gets one hint that never resumes from a checkpoint in the trouble."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ampctl.amp.guard import Action, DivergenceRules, DivergenceWatch
from ampctl.protect.advice import fmt_lr, lr_advice
from ampctl.runlog.layout import checkpoint_step
from ampctl.runlog.writers import new_run_dir
from ampctl.train.trainer import Trainer

# the lr=1.0 run: its loss went from ~5.5 down to ~4 and up to ~25, where the rule
# stopped it; resumed from that state its rows stayed at ~20: under 5x its first loss (27.5),
# and, the rows set aside, no lower row to compare with: it trained on to "status ok"
BEFORE = [5.2, 4.6, 4.2, 4.0, 4.1, 3.9, 4.0, 25.0, 26.0]  # the rule stops it at 26
RESUMED = [20.2, 20.3, 20.24, 20.1, 20.3]


def _feed(watch: DivergenceWatch, rows: list[float], at: int = 0) -> list[Action]:
    return [watch.observe(at + 10 * i, x).action for i, x in enumerate(rows)]


def test_the_divergence_rule_remembers_the_run_s_best_loss_across_a_resume():
    watch = DivergenceWatch(DivergenceRules())
    watch.start = 5.5
    assert _feed(watch, BEFORE)[-1] is Action.ABORT
    saved = watch.state_dict()  # what the checkpoint written at the stop holds
    resumed = DivergenceWatch(DivergenceRules())
    resumed.load_state_dict(saved)
    assert resumed.memory is not None and resumed.memory.lowest <= 4.0
    acts = _feed(resumed, RESUMED, at=100)
    assert Action.ABORT in acts[:3]  # judged against the 4.0 it had reached: stopped again
    # the resume to step 60: two rows (44.3, 20.2) before the run ends, fewer than the
    # rule's patience: judged from the first row on against the course it had
    short = DivergenceWatch(DivergenceRules())
    short.load_state_dict(saved)
    assert _feed(short, [44.33, 20.24], at=100)[0] is Action.ABORT
    # stopped before it had patience rows of a course (7.8, then 17.7, 37.2, 51.2): the loss it
    # started from is the course it remembers
    early = DivergenceWatch(DivergenceRules())
    early.start = 5.526
    assert _feed(early, [7.845, 17.66, 37.2, 51.16])[-1] is Action.ABORT
    assert early.memory is not None and early.memory.lowest == 5.526
    resumed = DivergenceWatch(DivergenceRules())
    resumed.load_state_dict(early.state_dict())
    assert _feed(resumed, [44.33, 20.24], at=50)[0] is Action.ABORT
    # a checkpoint written before the memory was kept still loads (and judges as before)
    old = {k: v for k, v in saved.items() if k != "memory"}
    legacy = DivergenceWatch(DivergenceRules())
    legacy.load_state_dict(old)
    assert legacy.memory is None and _feed(legacy, RESUMED, at=100) == [Action.CONTINUE] * 5


def test_a_warning_starts_the_course_again():
    watch = DivergenceWatch(DivergenceRules(action="warn"))
    assert _feed(watch, BEFORE)[-1] is Action.WARN
    assert watch.memory is None and _feed(watch, RESUMED) == [Action.CONTINUE] * 5


def test_the_lr_is_the_one_the_loss_last_fell_at_not_a_factor():
    # a warmup to 0.3: the loss fell up to lr 0.1 (step 20), rose from 0.2 on
    rows = [(10, 4.0, 0.05), (20, 3.8, 0.1), (30, 4.5, 0.2), (40, 9.0, 0.3)]
    adv = lr_advice(rows, trouble=30, start=4.2)
    assert adv.known and adv.lr == 0.1 and adv.bad_lr == 0.2
    assert adv.ladder[:2] == [0.1, 0.05]  # the history's own spacing (0.2 / 0.1)
    # it came back once a decay brought the lr down: that lr, though lower ones fell before
    rows = [(10, 4.0, 0.1), (20, 6.0, 0.3), (30, 7.0, 0.25), (40, 5.0, 0.165), (50, 4.5, 0.12)]
    adv = lr_advice(rows, trouble=20, start=4.2)
    assert adv.known and adv.lr == 0.12 and "fell again" in adv.why
    # never fell (above its first loss from the first row on) in a warmup: below the first bad
    # row's lr, the lr of the first update -- a candidate, not known to work
    rows = [(10, 7.6, 0.45), (20, 18.6, 0.95)]
    adv = lr_advice(rows, trouble=11, start=5.5)
    assert not adv.known and math.isclose(adv.lr, 0.045) and adv.bad_lr == 0.45
    # no warmup, never fell: nothing is known
    adv = lr_advice([(10, 9.0, 1.0), (20, 30.0, 1.0)], trouble=None, start=5.0)
    assert not adv.known and math.isnan(adv.lr) and adv.ladder == []
    assert lr_advice([(10, 4.0, None)], trouble=None) is None
    assert [fmt_lr(x) for x in (0.045, 0.00031, 1.5, 30.0)] == ["0.045", "0.00031", "1.5", "30"]


def _run(cfg, name):
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, name))
    tr.hint_overrides = ["optim.lr=1.0", "name=lr1", "trainer.max_steps=80"]
    return tr.run()


def test_a_diverged_run_has_one_hint_that_never_resumes_into_the_trouble(fast_cfg, tmp_path):
    """lr 1.0 on the tiny BERT (the issue's first case): stopped as diverged. Its hint is one
    command, quoted for a shell (the runs folder here has a space); a checkpoint it names was
    written before the trouble; no placeholder."""
    import shlex

    cfg = fast_cfg(
        "trainer.max_steps=80",
        "trainer.ckpt_every=4",
        "optim.lr=1.0",
        f"trainer.runs_dir={tmp_path / 'my runs'}",
    )
    res = _run(cfg, "lr1")
    s = res.summary
    assert s["status"] == "diverged"
    hint = s["resume_hint"]
    assert "...." not in hint and "optim.lr=..." not in hint
    since = s["trouble_since"]
    assert since <= s["diverged_since"]
    words = shlex.split(hint)
    if "--resume" in hint:
        ckpt = words[words.index("--resume") + 1]
        assert Path(ckpt).is_file() and checkpoint_step(ckpt) <= since
        assert "optim.lr=" in hint
    elif hint.startswith("ampctl train"):  # a fresh start: the user's overrides, the lr changed
        assert "name=" not in hint and "trainer.max_steps=80" in hint
        assert "optim.lr=1.0" not in hint.split()
    else:  # no lr is known to have worked: diagnose's probe
        assert words == ["ampctl", "diagnose", str(res.run_dir)] and "no lr" in s["resume_note"]
    good = s["last_good_checkpoint"]
    assert good is None or checkpoint_step(good) <= since


@pytest.mark.parametrize("lr", ["1.0", "30"])
def test_the_summary_s_hint_and_the_last_line_agree(tmp_path, lr, monkeypatch):
    """The issue's lr=1.0 and lr=30 runs through ``ampctl train``: the summary's resume_hint is
    the one command the last line gives; no placeholder, no --resume into the trouble."""
    from typer.testing import CliRunner

    from ampctl.cli import app
    from tests.conftest import FAST

    monkeypatch.chdir(tmp_path)
    args = [*FAST, "trainer.max_steps=80", "trainer.ckpt_every=4", f"optim.lr={lr}"]
    res = CliRunner().invoke(
        app, ["train", "--plain", *args, "name=r", "logging.plot=false"], env={"COLUMNS": "300"}
    )
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    (hint,) = [ln.split("resume_hint: ", 1)[1] for ln in lines if ln.startswith("resume_hint: ")]
    assert lines[-1].startswith("Training stopped: the loss diverged") or lines[-1].startswith(
        "Training aborted"
    )
    assert lines[-1].endswith(f": {hint}")  # the same command, once
    assert "..." not in hint
    s = json.loads((tmp_path / "runs" / "r" / "summary.json").read_text())
    assert s["resume_hint"] == hint
    if "--resume" in hint:
        assert checkpoint_step(hint.split("--resume ", 1)[1].split()[0]) <= s["trouble_since"]


def test_a_rollback_writes_no_checkpoint_of_the_restored_state(fast_cfg):
    """lr 30: the guard rolls back to the start again and again; a checkpoint used to be written
    at step 0 each time (due at every multiple of ckpt_every), holding the backed-off scale, and
    was then offered as the last good checkpoint."""
    cfg = fast_cfg(
        "trainer.max_steps=80", "trainer.ckpt_every=4", "trainer.keep_last=10", "optim.lr=30"
    )
    res = _run(cfg, "lr30")
    steps = [checkpoint_step(p) for p in (res.run_dir / "checkpoints").iterdir()]
    assert 0 not in steps
    good = res.summary["last_good_checkpoint"]
    assert good is None or checkpoint_step(good) > 0


def test_a_resume_of_a_stopped_run_is_stopped_again_however_short(fast_cfg):
    """The issue: lr 1.0 stopped as diverged; ``ampctl train --resume`` of its newest checkpoint
    for two more log rows ended ``ok`` at 20.24 (it had reached ~4). The rule's memory of the
    course judges those rows: stopped again."""
    cfg = fast_cfg("trainer.max_steps=80", "trainer.ckpt_every=4", "optim.lr=1.0")
    res = _run(cfg, "lr1")
    assert res.summary["status"] == "diverged"
    stopped = res.summary["steps"]
    from typer.testing import CliRunner

    from ampctl.cli import app

    more = f"trainer.max_steps={stopped + 2 * cfg.trainer.log_every}"  # two more log rows
    got = CliRunner().invoke(app, ["train", "--plain", "--resume", str(res.run_dir), more])
    summary = json.loads((res.run_dir / "summary.json").read_text())
    assert got.exit_code == 1 and summary["status"] == "diverged", got.output
