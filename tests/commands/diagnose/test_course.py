"""The verdict's rules as pure functions of numbers (course.py, verdict.py, stages.py): where the
loss left its course, which skipped steps are a storm, what the checkpoints say about the steps
between them, how much to lower the lr, the order of the causes, the resume point, the JSON."""

from __future__ import annotations

import json
import math
import random

import pytest
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.commands.diagnose.course import (
    STORM_MIN,
    CheckpointFacts,
    departure,
    loss_spikes,
    run_course,
)
from ampctl.commands.diagnose.stages import (
    INTERNAL,
    OPTIONAL,
    GuardEvent,
    History,
    Problem,
    Replay,
    Row,
    to_json,
)
from ampctl.commands.diagnose.verdict import judge, lr_change


def rows(losses, start=1, lr=None):
    return [
        Row(step=start + i, loss=v, learning_rate=None if lr is None else lr[i])
        for i, v in enumerate(losses)
    ]


def hist(losses=(), skipped=(), events=(), lr=None):
    return History(
        source="run folder",
        rows=rows(losses, lr=lr),
        skipped_steps=list(skipped),
        guard_events=[
            GuardEvent(step=e[0], kind=e[1], data=dict(e[2]) if len(e) > 2 else {}) for e in events
        ],
    )


# ---------------------------------------------------------------------------- the loss
def test_a_falling_loss_with_per_batch_noise_stays_on_course():
    rng = random.Random(0)
    noisy = [0.3 * math.exp(-i / 80) + 0.05 * rng.gauss(0, 1) + 0.15 for i in range(200)]
    assert departure(rows(noisy)) is None


def test_a_loss_that_doubles_at_the_first_updates_departs_and_never_improved():
    d = departure(rows([3.9, 29.9, 30.1, 26.8, 45.8, 37.3]))
    assert d is not None and d.never_improved and d.resolved_at is None
    assert (d.min_loss, d.min_step, d.last_good_step) == (3.9, 1, 1)
    assert (d.peak, d.peak_step) == (45.8, 5)


def test_a_loss_that_rises_later_and_comes_back_is_resolved():
    course = [4.0 - 0.05 * i for i in range(20)]  # 4.0 -> 3.05
    course += [4.5, 4.6, 4.7, 4.6]  # a sustained rise
    course += [3.05, 3.0, 2.95, 2.9, 2.9, 2.9, 2.85]  # back, and lower
    d = departure(rows(course))
    assert d is not None and not d.never_improved and d.resolved_at is not None
    # the level (a median of 5 rows) crosses at the third high row; the last row on course is
    # the one before the rise
    assert (d.step, d.last_good_step, d.min_step) == (23, 20, 20) and d.resolved_at > 24


def test_one_outlier_batch_is_a_spike_not_a_departure():
    course = [1.0 - 0.01 * i for i in range(20)]
    course[10] = 1e21
    assert departure(rows(course)) is None
    (spike,) = loss_spikes(rows(course))
    assert spike.step == 11


# ---------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize(
    ("skipped", "kinds"),
    [
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], ["calibration"]),  # at the start, then clean: its level
        ([12, 25], ["isolated", "isolated"]),  # growth probing
        (list(range(21, 21 + STORM_MIN)), ["storm"]),  # in a row, then clean: an ended storm
        ([37, 38], ["isolated"]),  # still going at the end, but only two
        ([35, 36, 37, 38, 39, 40], ["storm"]),  # still going at the end, half a storm or more
    ],
)
def test_skipped_steps_are_calibration_isolated_or_a_storm(skipped, kinds):
    h = hist([3.0 - 0.01 * i for i in range(40)], skipped)
    course = run_course(h, None, [])
    assert [e.kind for e in course.episodes] == kinds


def test_isolated_skips_leave_no_trouble_and_a_running_storm_is_the_first_sign():
    losses = [3.0 - 0.01 * i for i in range(40)]
    assert run_course(hist(losses, [12, 25]), None, []).first_bad_step is None
    course = run_course(hist(losses, range(31, 41)), None, [])
    assert course.first_bad_step == 31 and not course.episodes[-1].resolved


def test_checkpoints_tell_which_steps_were_skipped():
    """Adam counts the updates it applied; a skipped step halves the scale."""
    cks = [
        CheckpointFacts("c10", 10, [], scale=65536.0, applied=10),
        CheckpointFacts("c20", 20, [], scale=65536.0, applied=20),
        CheckpointFacts("c30", 30, [], scale=16384.0, applied=28),  # 2 skips, 2 halvings
        CheckpointFacts("c40", 40, [], scale=16.0, applied=28),  # none applied, scale fell
    ]
    course = run_course(None, None, cks)
    (storm,) = course.episodes
    assert (storm.kind, storm.start, storm.end, storm.resolved) == ("storm", 29, 40, False)
    assert course.first_bad_step == 29
    # a checkpoint that applied nothing while its scale stayed (a copy, not a storm): nothing
    same = [cks[0], CheckpointFacts("c100", 100, [], scale=65536.0, applied=10)]
    assert run_course(None, None, same).episodes == []


# ---------------------------------------------------------------------------- the lr
def test_the_lr_comes_from_the_history_not_a_factor():
    # the loss rose at the first updates, no lr logged: the configured one is too high, and
    # nothing below it is known (an unchecked ladder for the probe)
    course = run_course(hist([3.9, 8.0, 9.0, 8.5, 9.5]), None, [])
    ch = lr_change(course, None, 1.0)
    assert ch.lr == 0.5 and not ch.known and ch.ladder[0] == 0.5
    # the loss fell while a warmup raised the lr, and rose once the lr passed 0.1 (where it
    # last fell): that lr
    lr = [0.025 * (i + 1) for i in range(12)]
    losses = [4.0, 3.8, 3.6, 3.4, 3.6, 5.0, 6.0, 7.0, 7.5, 8.0, 8.0, 8.0]
    h = hist(losses, lr=lr)
    course = run_course(h, None, [])
    ch = lr_change(course, h, 0.3)
    assert course.departure.lr_at_min == 0.125 and course.departure.lr_at_step == 0.2
    assert ch.known and ch.lr == pytest.approx(0.1) and "last fell at step 4" in ch.why
    # the loss rose from its first row while a warmup raised the lr: no lr is known to have
    # worked; below the first bad row's lr: the lr of the first update, not known to hold
    h = hist([4.0, 4.6, 5.0, 5.4, 5.5, 5.6, 5.6], lr=[0.075, 0.15, 0.225, 0.3, 0.3, 0.29, 0.28])
    course = run_course(h, None, [])
    ch = lr_change(course, h, 0.3)
    assert course.departure.never_improved and course.departure.lr_rose
    assert not ch.known and ch.lr < 0.15
    # the guard's divergence rule rolled back and cut it: the cut lr
    h = hist([3.0] * 10, events=[(30, "divergence", {"action": "rollback", "lr_factor": 0.5})])
    assert lr_change(run_course(h, None, []), h, 1e-3).lr == pytest.approx(5e-4)


def test_the_guards_divergence_events_give_the_lr_the_run_worked_at():
    # it stopped the run after the lr jumped 300x: back to the lr the loss last fell at
    losses = [4.2, 4.1, 4.0, 3.9, 3.95, 11.3]
    lr = [1e-3] * 4 + [0.3, 0.3]
    stop = (6, "divergence", {"action": "stop", "since": 4})
    h = hist(losses, events=[stop], lr=lr)
    course = run_course(h, None, [])
    assert course.departure is None  # one high row: the rule fired before a level could move
    ch = lr_change(course, h, 0.3)
    assert ch.lr == pytest.approx(1e-3) and ch.known and "last fell at step 4" in ch.why
    # ... the same at one lr: nothing below it is known, a ladder below it (not known)
    h = hist(losses, events=[stop], lr=[1e-3] * 6)
    ch = lr_change(run_course(h, None, []), h, 1e-3)
    assert not ch.known and ch.lr < 1e-3
    # it rolled back and cut the lr, and the run went on clean: the lr it went on at
    back = (4, "divergence", {"action": "rollback", "lr_factor": 0.5, "to_step": 4, "from_step": 6})
    h = hist([4.2, 4.1, 4.0, 3.9, 3.8, 3.7, 3.6, 3.5], events=[back], lr=[1e-3] * 6 + [5e-4] * 2)
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=0.3)
    assert j.lr.lr == pytest.approx(5e-4) and "went on clean at lr 0.0005" in j.lr.why
    assert j.verdict.summary == (
        "recovered: the loss diverged at step 6: rolled back to 4, lr x0.5, clean since"
    )
    # the rule held against the run's first loss (#27): its min_loss is that loss, said so
    msg = (
        "the loss diverged: ... 5.2x the loss the run started from (4.16, before its first update)"
    )
    ev = GuardEvent(6, "divergence", msg, {"action": "stop", "ratio": 5.2, "min_loss": 4.16})
    h = History(source="run folder", rows=rows([4.2, 9.0, 21.0]), guard_events=[ev])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=1.0)
    assert j.verdict.events[-1] == (
        "the loss diverged at step 6 (5.2x the loss it started from, 4.16): the guard stopped the run"
    )


# ---------------------------------------------------------------------------- the verdict
def test_the_cause_comes_first_and_the_resume_point_is_before_the_trouble():
    losses = [3.9, 8.0, 9.0, 8.5, 9.5, 9.0, 9.2, 9.1]
    h = hist(losses, skipped=range(5, 9))
    cks = [
        CheckpointFacts("c8", 8, ["scale_collapsed"], scale=0.5, applied=4),
        CheckpointFacts("c4", 4, [], scale=65536.0, applied=4),
        CheckpointFacts("c2", 2, [], scale=65536.0, applied=2),
    ]
    j = judge(
        own=cks[0],
        siblings=cks[1:],
        problems=[Problem("scale_collapsed", "the GradScaler scale fell to 0.5 (below 1)")],
        h=h,
        scaler=None,
        rep=None,
        lr=0.1,
    )
    assert [p.kind for p in j.problems] == ["lr_divergence", "scale_collapsed"]
    assert j.verdict.status == "broken" and j.verdict.kind == "lr_divergence"
    assert j.verdict.first_bad_step == 1 and j.resume is None  # the loss rose at step 2
    assert [c.after_trouble for c in j.checkpoints] == [None, True, True]
    assert "cause: persistent overflow" in j.problems[1].message


def test_a_rollback_that_cured_the_storm_is_recovered():
    h = hist(
        [3.0 - 0.01 * i for i in range(40)],
        skipped=[21, 22, 23],
        events=[
            (21, "overflow", {"params": ["w"]}),
            (22, "overflow", {"params": ["w"]}),
            (23, "overflow", {"params": ["w"]}),
            (20, "rollback", {"to_step": 20, "from_step": 23}),
        ],
    )
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=None)
    assert j.problems == [] and j.verdict.status == "recovered"
    assert j.verdict.summary == (
        "recovered: 3 overflows at 21–23 (non-finite gradients in w), rolled back to 20, clean since"
    )


# ---------------------------------------------------------------------------- the JSON
def test_records_are_written_as_their_fields():
    from dataclasses import dataclass

    @dataclass
    class R:
        a: int
        b: int | None = OPTIONAL()
        c: list = INTERNAL()

    assert to_json(R(1)) == {"a": 1} and to_json(R(1, 2, [3])) == {"a": 1, "b": 2}
    skipped = Replay(ran=False, reason="why", precision="fp16", device="cpu")
    assert to_json(skipped) == {"ran": False, "reason": "why", "precision": "fp16", "device": "cpu"}
    p = Problem("k", "m", step=3)
    assert to_json(p) == {"kind": "k", "severity": "error", "message": "m", "step": 3}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/ckpt"], "'/no/such/ckpt' does not exist: give a checkpoint file or folder"),
        (["--batches", "0", "."], "--batches 0: must be an integer >= 1"),
    ],
)
def test_json_is_printed_on_bad_input_too(args, message):
    res = CliRunner().invoke(app, ["diagnose", *args, "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": message}
    assert res.stderr == f"ampctl: error: {message}\n"
