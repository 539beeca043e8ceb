"""The verdict (verdict.py) on planted courses, histories and checkpoints: how much to lower the
lr and why (from the history, never a fixed factor), the problems a run's course shows and their
texts, the cause of a collapsed scale, the order of the causes, the resume point, the story of the
run in words, and the verdict itself (broken, recovered, healthy): isolated skipped steps and
skipped spikes on a clean course are a healthy run's notes, every one of them, recovered takes an
intervention (#36, docs/diagnose.md). Pure functions: milliseconds.
"""

from __future__ import annotations

import math

import pytest

from ampctl.commands.diagnose import verdict as V
from ampctl.commands.diagnose.course import (
    CheckpointFacts,
    Course,
    run_course,
)
from ampctl.commands.diagnose.stages import (
    Aborted,
    Burst,
    Episode,
    Gradients,
    GradNormTrend,
    GuardEvent,
    History,
    Problem,
    Replay,
    Row,
    ScalerState,
)
from ampctl.commands.diagnose.verdict import history_problems, judge, lr_change, params_in

from .conftest import dep, history, rows

INF, NAN = math.inf, math.nan


def ev(step, kind, message="", **data):
    return GuardEvent(step, kind, message, data)


def hist(r=(), events=(), **kw):
    return History(source="run folder", rows=list(r), guard_events=list(events), **kw)


def course(d=None, *eps, first_bad=None):
    return Course(episodes=list(eps), departure=d, first_bad_step=first_bad)


def ep(kind, start, end, resolved=True, text="t"):
    return Episode(kind, start, end, resolved, text)


# ---------------------------------------------------------------------------- the lr
def test_the_guards_lr_cut_gives_the_cut_lr_either_way_it_is_written():
    h = hist(rows([3.0] * 5), [ev(4, "divergence", action="rollback", lr_factor=0.25)])
    ch = lr_change(course(), h, 1e-3)
    assert ch.lr == pytest.approx(2.5e-4) and not ch.known
    assert ch.why == "the guard's divergence rule rolled back at step 4 and cut the lr 4x"
    h = hist(rows([3.0] * 5), [ev(4, "divergence", action="rollback", lr_factor=4.0)])
    assert lr_change(course(), h, 1e-3).lr == pytest.approx(2.5e-4)
    # no configured lr: nothing to cut
    assert lr_change(course(), h, None).lr is None
    # a factor that is no positive number is not one (a bool, 0, inf, text): the next event's
    for bad in (True, 0, -0.5, INF, "0.5"):
        h = hist(
            rows([3.0] * 5),
            [
                ev(3, "divergence", action="rollback", lr_factor=bad),
                ev(4, "divergence", action="rollback", lr_factor=0.5),
            ],
        )
        assert lr_change(course(), h, 1e-3).lr == pytest.approx(5e-4)


def test_after_a_rollback_the_lr_the_run_went_on_clean_at():
    r = rows([3.0] * 8, lr=[1e-3] * 6 + [2e-4, 2.5e-4])
    back = ev(4, "divergence", action="rollback", lr_factor=0.5, from_step=6, to_step=4)
    h = hist(r, [back])
    ch = lr_change(course(), h, 1e-3)
    # the rows after step 6 (the rule fired there): at most 2.5e-4, known to work
    assert ch.lr == pytest.approx(2.5e-4) and ch.known
    assert ch.why == (
        "the guard's divergence rule rolled back at step 6 and cut the lr 2x; the run went on "
        "clean at lr 0.00025"
    )
    # the configured lr no more than 5% above it: the cut lr
    assert lr_change(course(), h, 1.05 * 2.5e-4).lr == pytest.approx(1.05 * 2.5e-4 / 2)
    # not clean since: the cut lr, not known to hold
    storm = ep("storm", 7, 8, resolved=False)
    assert not lr_change(course(None, storm), h, 1e-3).known
    # no lr logged after the step it fired at: the cut lr
    h = hist(rows([3.0] * 6, lr=[1e-3] * 6), [back])
    assert lr_change(course(), h, 1e-3).lr == pytest.approx(5e-4)


def test_a_stop_after_the_lr_rose_goes_back_to_the_lr_the_loss_last_fell_at():
    losses = [4.2, 4.1, 4.0, 3.9, 3.95, 11.3]
    lr = [1e-3] * 4 + [0.3, 0.3]
    stop = ev(6, "divergence", action="stop", since=4)
    h = hist(rows(losses, lr=lr), [stop])
    ch = lr_change(course(), h, 0.1)
    assert ch.lr == pytest.approx(1e-3) and ch.known
    assert ch.why == "the loss last fell at step 4, at lr 0.001 (it rose at lr 0.3, step 5)"
    assert ch.ladder[:2] == [pytest.approx(1e-3), pytest.approx(1e-3 / 300)]
    # no lr logged: below the configured one, not known to hold
    h = hist(rows(losses), [stop])
    ch = lr_change(course(), h, 0.1)
    assert ch.lr == pytest.approx(0.05) and not ch.known
    assert ch.why == "the run diverged at its lr 0.1: lower it"
    # no divergence event and no departure: nothing is worked out without an lr
    assert lr_change(course(), hist(rows(losses)), None) is None
    assert lr_change(course(), None, None) is None


def test_number_and_fin():
    assert [V._number(x) for x in (1, 0.5, 0, -1, INF, NAN, True, "1", None)] == [
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        False,
        False,
    ]
    assert [V._fin(x) for x in (0.0, -1.0, INF, NAN, None)] == [True, True, False, False, False]


# ---------------------------------------------------------------------------- history problems
def test_an_lr_divergence_not_back_is_the_first_problem():
    d = dep(resolved_at=None)
    (p,) = history_problems(None, course(d), None)
    assert (p.kind, p.step, p.severity) == ("lr_divergence", 10, "error")
    assert p.message == (
        "the loss rose from 2 (step 5) to 3.5 (step 11), and did not come back: the learning "
        "rate is too high"
    )


def test_an_lr_divergence_from_the_first_updates_with_the_warmup_named():
    d = dep(
        resolved_at=30,
        never_improved=True,
        lr_at_min=0.1,
        lr_peak=0.4,
        lr_peak_step=9,
        lr_back=0.1,
    )
    (p,) = history_problems(None, course(d), None)
    assert p.message == (
        "the loss rose from 2 (step 5) to 3.5 (step 11) at the first updates, before it ever "
        "fell, as the lr grew from 0.1 to 0.4 (step 9), and was back at its level of step 5 only "
        "at step 30, the lr down to 0.1: the learning rate is too high"
    )
    # the lr back at no more than 5% below its peak: not named
    for back in (0.4 / 1.05, None):
        d.lr_back = back
        (p,) = history_problems(None, course(d), None)
        assert p.message.endswith("only at step 30: the learning rate is too high")
    # no warmup: the lr is not named even when it is lower
    d = dep(resolved_at=30, never_improved=True, lr_at_min=0.1, lr_peak=0.1, lr_back=0.01)
    (p,) = history_problems(None, course(d), None)
    assert p.message == (
        "the loss rose from 2 (step 5) to 3.5 (step 11) at the first updates, before it ever "
        "fell, and was back at its level of step 5 only at step 30: the learning rate is too high"
    )


def test_an_lr_divergence_before_non_finite_steps_names_its_peak_before_them():
    d = dep(resolved_at=20)
    storm = ep("storm", 15, 22, resolved=True)
    early = ep("nonfinite_loss", 9, 9, resolved=True)  # before the departure: not what it led to
    r = rows([2.0, 3.0, 4.0, 5.0, 4.5, 100.0], start=10)  # 10..15: the peak before 15 is 5.0
    (p,) = history_problems(hist(r), course(d, early, storm), None)
    assert p.message == (
        "the loss rose from 2 (step 5) to 5 (step 13), before the gradients went non-finite at "
        "step 15: the learning rate is too high"
    )
    # no finite row in between: the departure's own peak
    r = rows([NAN] * 5, start=10)
    (p,) = history_problems(hist(r), course(d, storm), None)
    assert "to 3.5 (step 11), before the gradients went non-finite at step 15" in p.message
    (p,) = history_problems(None, course(d, storm), None)
    assert "to 3.5 (step 11), before the gradients went non-finite at step 15" in p.message
    # the first of the non-finite episodes after it
    nf = ep("nonfinite_loss", 12, 12)
    (p,) = history_problems(None, course(d, nf, storm), None)
    assert "non-finite at step 12:" in p.message


def test_a_guard_stop_without_a_departure_is_an_lr_divergence():
    h = hist(
        rows([3.0] * 3),
        [
            ev(5, "divergence", "warned", action="warn"),
            ev(6, "divergence", "the loss diverged: 5x", action="stop"),
        ],
    )
    (p,) = history_problems(h, course(), None)
    assert (p.kind, p.step) == ("lr_divergence", 6)
    assert p.message == "the guard stopped the run at step 6: the loss diverged: 5x"
    # a departure that came back, with a stop: the stop
    (p,) = history_problems(h, course(dep(resolved_at=20)), None)
    assert p.message.startswith("the guard stopped the run at step 6")
    h = hist(rows([3.0] * 3), [ev(5, "divergence", "w", action="warn")])
    assert history_problems(h, course(), None) == []


def test_a_non_finite_loss_to_the_end_is_nan_loss():
    nf = ep("nonfinite_loss", 7, 9, resolved=False)
    (p,) = history_problems(None, course(None, nf), None)
    assert (p.kind, p.step) == ("nan_loss", 7)
    assert (
        p.message == "the loss became non-finite at step 7 and stayed so to the end of the record"
    )
    h = hist(nan_filtered_steps=[7, 8])
    (p,) = history_problems(h, course(None, nf), None)
    assert p.message == (
        "the loss became non-finite at step 7 and stayed so to the end of the record (logged as "
        "0.0 by the Trainer's NaN filter at 2 step(s))"
    )
    assert history_problems(None, course(None, ep("nonfinite_loss", 7, 9)), None) == []


def test_an_overflow_storm_still_going_names_the_parameters():
    storm = ep("storm", 11, 20, resolved=False, text="10 steps skipped at 11–20 in a row")
    (p,) = history_problems(None, course(None, storm), None)
    assert (p.kind, p.step, p.params) == ("overflow_storm", 11, None)
    assert p.message == (
        "overflow storm: 10 steps skipped at 11–20 in a row: the gradients were non-finite at "
        "every scale the scaler tried"
    )
    events = [ev(s, "overflow", params=["a.w", "b.w", "c.w", "d.w"]) for s in (11, 12)]
    events.append(ev(25, "overflow", params=["z.w"]))  # after the storm: not its
    (p,) = history_problems(hist(events=events), course(None, storm), None)
    assert p.params == ["a.w", "b.w", "c.w", "d.w"]
    assert p.message == (
        "overflow storm: 10 steps skipped at 11–20 in a row; non-finite gradients in a.w, b.w, "
        "c.w: the gradients were non-finite at every scale the scaler tried"
    )
    assert history_problems(None, course(None, ep("storm", 1, 9)), None) == []


def test_an_aborted_run_and_a_grad_norm_explosion():
    h = hist(aborted=Aborted(step=12, message="3 rollbacks"))
    (p,) = history_problems(h, course(), None)
    assert (p.kind, p.step, p.message) == (
        "run_aborted",
        12,
        "the guard aborted the run at step 12: 3 rollbacks",
    )
    gn = GradNormTrend(baseline=2.0, peak=300.0, peak_step=20, ratio=150.0, exploded=True)
    # an explosion alone is no problem: with a break, or another problem, it is
    assert history_problems(hist(grad_norm=gn), course(), None) == []
    (p,) = history_problems(hist(grad_norm=gn, break_step=22), course(), None)
    assert (p.kind, p.step) == ("grad_norm_explosion", 20)
    assert p.message == "grad norm rose to 300 at step 20, 150x its earlier median 2"
    kinds = [
        x.kind for x in history_problems(hist(grad_norm=gn, aborted=h.aborted), course(), None)
    ]
    assert kinds == ["run_aborted", "grad_norm_explosion"]
    calm = GradNormTrend(baseline=2.0, peak=3.0, peak_step=20, ratio=1.5, exploded=False)
    assert history_problems(hist(grad_norm=calm, break_step=22), course(), None) == []


def test_overflow_right_after_growth_is_a_warning_when_it_recurs_and_wastes_10_percent():
    def bursts(*lengths, after=True):
        return [Burst(10 * i, 10 * i + n - 1, n, 1024.0, after) for i, n in enumerate(lengths, 1)]

    gi = ScalerState(kind="ampctl", enabled=True, scale=1.0, growth_interval=100)
    h = hist(bursts=bursts(5, 5), scaler_records=100)
    (p,) = history_problems(h, course(), gi)
    assert (p.kind, p.severity, p.step) == ("overflow_after_growth", "warning", None)
    assert p.message == (
        "2 overflow burst(s) right after the scale grew (steps 10, 20), 10.0% of the recorded "
        "steps skipped, growth_interval 100"
    )
    assert history_problems(h, course(), None)[0].message.endswith(
        "10.0% of the recorded steps skipped"
    )
    # under 10%, or only once, or not after growth: none
    assert history_problems(hist(bursts=bursts(5, 4), scaler_records=100), course(), gi) == []
    assert history_problems(hist(bursts=bursts(20), scaler_records=100), course(), gi) == []
    assert (
        history_problems(hist(bursts=bursts(5, 5, after=False), scaler_records=100), course(), gi)
        == []
    )
    # the steps of the first 5
    h = hist(bursts=bursts(*[2] * 7), scaler_records=10)
    assert "(steps 10, 20, 30, 40, 50)" in history_problems(h, course(), None)[0].message
    # no record count: its bursts are the share
    h = hist(bursts=bursts(1, 1), scaler_records=0)
    assert "200.0% of the recorded steps" in history_problems(h, course(), None)[0].message
    assert V._growth_problems(None, gi) == []


# ---------------------------------------------------------------------------- collapse
def grads(ideal):
    z = 0.0
    return Gradients(1.0, z, z, z, z, z, z, z, z, z, z, z, ideal, z, z, z, None, None, None, [])


def rep(ideal, ran=True):
    return Replay(ran=ran, reason=None, precision="fp16", device="cpu", gradients=grads(ideal))


def test_the_cause_of_a_collapsed_scale():
    s0 = ScalerState(kind="GradScaler", enabled=True, scale=0.0, backoff_factor=0.0)
    assert V._collapse_cause(s0, course(), None) == (
        "backoff",
        "backoff_factor 0 sets the scale to 0 on the first overflow",
    )
    floor = ScalerState(kind="ampctl", enabled=True, scale=1.0, min_scale=1.0, at_floor=True)
    assert V._collapse_cause(floor, course(), rep(0.5)) == (
        "floor",
        "the floor min_scale 1 is above S* = 65504 / max|g| = 0.5: even the lowest scale allowed "
        "overflows",
    )
    every = "the gradients were non-finite at every scale the scaler tried"
    generic = (
        "overflow",
        "persistent overflow: a scale falls only on an overflow, so it halved on step after step: "
        + every,
    )
    # S* at the floor or above, the replay not run, not at the floor, no floor: not the floor
    assert V._collapse_cause(floor, course(), rep(1.0)) == generic
    assert V._collapse_cause(floor, course(), rep(0.5, ran=False)) == generic
    assert V._collapse_cause(floor, course(), None) == generic
    off = ScalerState(kind="ampctl", enabled=True, scale=1.0, min_scale=1.0, at_floor=False)
    assert V._collapse_cause(off, course(), rep(0.5)) == generic
    nofloor = ScalerState(kind="ampctl", enabled=True, scale=1.0, min_scale=0.0, at_floor=True)
    assert V._collapse_cause(nofloor, course(), rep(0.5)) == generic
    assert V._collapse_cause(None, course(), rep(0.5)) == generic
    # a storm: the one still going, else the last
    a, b = ep("storm", 1, 9, text="storm A"), ep("storm", 20, 29, text="storm B")
    c = ep("storm", 40, 49, resolved=False, text="storm C")
    assert V._collapse_cause(None, course(None, a, c, b), None) == (
        "overflow",
        f"persistent overflow: storm C: {every}",
    )
    assert V._collapse_cause(None, course(None, a, b), None)[1] == (
        f"persistent overflow: storm B: {every}"
    )


def test_a_broken_state_after_an_outlier_loss_names_the_batch():
    spike = ep("loss_spike", 7, 7, text="a single loss of 1e+21 at step 7")
    later = ep("loss_spike", 30, 30, text="a single loss of 5e+20 at step 30")
    tail = (
        "; a single loss of 1e+21 at step 7 (one batch, an outlier: the loss was back on the next "
        "step): its gradient is the likely cause"
    )
    for kind in ("nonfinite_optimizer_state", "extreme_optimizer_state", "nonfinite_weights"):
        ps = [Problem("scale_collapsed", "s"), Problem(kind, "m"), Problem(kind, "m2")]
        V._name_spikes(ps, course(None, spike, later), CheckpointFacts("c", 20, []))
        assert [p.message for p in ps] == ["s", "m" + tail, "m2"]
    # the spike at the checkpoint's own step counts; one after it does not
    ps = [Problem("nonfinite_weights", "m")]
    V._name_spikes(ps, course(None, later), CheckpointFacts("c", 30, []))
    assert "at step 30" in ps[0].message
    ps = [Problem("nonfinite_weights", "m")]
    V._name_spikes(ps, course(None, later), CheckpointFacts("c", 29, []))
    assert ps[0].message == "m"
    # no checkpoint, or no step: the last spike
    for own in (None, CheckpointFacts("c", None, [])):
        ps = [Problem("nonfinite_weights", "m")]
        V._name_spikes(ps, course(None, spike, later), own)
        assert "at step 30 (one batch" in ps[0].message
    ps = [Problem("nonfinite_master", "m")]
    V._name_spikes(ps, course(None, spike), None)
    assert ps[0].message == "m"


# ---------------------------------------------------------------------------- order, folding
def test_problems_are_ordered_cause_first_and_warnings_last():
    ps = [
        Problem("zzz_warning", "w", severity="warning"),
        Problem("gradient_underflow", "u"),
        Problem("unknown_error", "x"),
        Problem("overflow_storm", "o"),
        Problem("lr_divergence", "l"),
        Problem("nonfinite_weights", "n"),
        Problem("unreadable_file", "f"),
        Problem("scale_at_floor", "a"),
    ]
    assert [p.kind for p in V._ordered(ps)] == [
        "unreadable_file",
        "lr_divergence",
        "nonfinite_weights",
        "scale_at_floor",
        "overflow_storm",
        "gradient_underflow",
        "unknown_error",
        "zzz_warning",
    ]
    assert V._RANK["refused_file"] == 0 and V._RANK["gradient_underflow"] == len(V.ORDER) - 1
    assert V.GROWTH_WASTE == 0.10


def test_a_collapsed_scale_names_its_cause_and_folds_the_storm_and_the_underflow():
    ps = [
        Problem("scale_collapsed", "the scale fell to 0.5"),
        Problem("overflow_storm", "storm"),
        Problem("gradient_underflow", "under"),
        Problem("nan_loss", "nan"),
    ]
    out = V._fold_collapse(ps, "overflow", "persistent overflow")
    assert [(p.kind, p.message) for p in out] == [
        ("scale_collapsed", "the scale fell to 0.5; cause: persistent overflow"),
        ("nan_loss", "nan"),
    ]
    ps = [
        Problem("scale_at_floor", "at floor"),
        Problem("overflow_storm", "storm"),
        Problem("gradient_underflow", "under"),
    ]
    out = V._fold_collapse(ps, "floor", "the floor")
    assert [(p.kind, p.message) for p in out] == [
        ("scale_at_floor", "at floor; cause: the floor"),
        ("gradient_underflow", "under"),
    ]
    # no collapsed scale (a bad scale): the storm stays
    ps = [Problem("bad_scale", "b"), Problem("overflow_storm", "storm")]
    assert [p.message for p in V._fold_collapse(ps, "backoff", "c")] == ["b", "storm"]


# ---------------------------------------------------------------------------- checkpoints
def test_the_resume_point_is_the_newest_healthy_checkpoint_before_the_trouble():
    facts = [
        CheckpointFacts("c5", 5, []),
        CheckpointFacts("c20", 20, []),
        CheckpointFacts("c15", 15, ["nonfinite_weights"]),
        CheckpointFacts("c10", 10, []),
        CheckpointFacts("cx", None, []),
    ]
    out, resume = V._checkpoints(facts, 15)
    assert [(c.path, c.healthy, c.problems, c.after_trouble) for c in out] == [
        ("c5", True, [], None),
        ("c20", True, [], True),  # written after the first sign of trouble
        ("c15", False, ["nonfinite_weights"], None),
        ("c10", True, [], None),
        ("cx", True, [], None),
    ]
    assert resume == "c10"
    # written at the first bad step: after it too
    assert V._checkpoints(facts, 10)[1] == "c5"
    assert V._checkpoints(facts, None)[1] == "c20"
    # only a checkpoint without a step: it
    assert V._checkpoints([CheckpointFacts("cx", None, [])], 3)[1] == "cx"
    assert V._checkpoints([CheckpointFacts("c", 1, ["x"])], None)[1] is None
    assert V._checkpoints([], 3) == ([], None)


def test_why_that_resume_point():
    assert V._resume_why(None, "c", course(), False) is None
    assert V._resume_why(12, "c10", course(first_bad=12), False) == (
        "the newest checkpoint with a healthy state written before the first sign of trouble "
        "(step 12)"
    )
    assert V._resume_why(12, None, course(first_bad=12), False) == (
        "no checkpoint with a healthy state was written before the first sign of trouble (step 12)"
    )
    # the checkpoint's own state is the trouble
    assert V._resume_why(12, "c10", course(), True) == (
        "the newest checkpoint with a healthy state written before this checkpoint, whose own "
        "state is broken"
    )
    assert V._resume_why(12, "c10", course(first_bad=30), True).endswith("trouble (step 12)")


# ---------------------------------------------------------------------------- events
@pytest.mark.parametrize(
    ("event", "text"),
    [
        (ev(20, "rollback", to_step=16), "rolled back to 16"),
        (ev(20, "rollback"), "rolled back to 20"),
        (ev(9, "abort"), "the guard aborted the run at step 9"),
        (
            ev(9, "fallback", from_precision="fp16", to_precision="bf16"),
            "fell back fp16 -> bf16 at step 9",
        ),
        (ev(9, "fallback"), "fell back None -> None at step 9"),
        (ev(9, "promotion", module="enc.0"), "the guard moved enc.0 to fp32 at step 9"),
        (
            ev(9, "promotion_undone", module="enc.0"),
            "moved enc.0 back from fp32 at step 9: not the cause",
        ),
        (ev(9, "demotion", module="enc.0"), "demoted enc.0 fp8 -> bf16 at step 9"),
        (
            ev(9, "rerun", verdict="transient"),
            "step 9 did not reproduce on rerun: hardware/transient",
        ),
        (
            ev(9, "rerun", verdict="transient", rank=3),
            "step 9 did not reproduce on rerun: hardware/transient, rank 3",
        ),
        (
            ev(9, "rerun", verdict="reproduced"),
            "step 9 reproduced on rerun (overflow): data or numerics at step 9",
        ),
        (
            ev(9, "rerun", verdict="reproduced", cause="nan loss", batch=4, rank=0),
            "step 9 reproduced on rerun (nan loss): data or numerics at step 9, batch 4, rank 0",
        ),
        (
            ev(9, "divergence", action="rollback", lr_factor=0.5, to_step=4, from_step=6),
            "the loss diverged at step 6: rolled back to 4, lr x0.5",
        ),
        (ev(9, "divergence", action="rollback"), "the loss diverged at step 9: rolled back"),
        (
            ev(9, "divergence", action="rollback", lr_factor=-1, to_step="x"),
            "the loss diverged at step 9: rolled back",
        ),
        (
            ev(9, "divergence", action="warn", ratio=3.456, min_loss=2.34567),
            "the loss diverged at step 9 (3.46x its lowest, 2.346): the guard warned",
        ),
        (
            ev(9, "divergence", "5x the loss the run started from", ratio=5.0, min_loss=4.0),
            "the loss diverged at step 9 (5x the loss it started from, 4): the guard stopped the run",
        ),
        (
            ev(9, "divergence", action="stop", ratio=5.0),
            "the loss diverged at step 9: the guard stopped the run",
        ),
        (
            ev(9, "divergence", action="stop", min_loss=4.0),
            "the loss diverged at step 9: the guard stopped the run",
        ),
        (ev(9, "overflow"), None),
        (ev(9, "spike"), None),
        (ev(9, "resume"), None),
    ],
)
def test_the_events_in_words(event, text):
    assert V._event_text(event) == text


def test_spikes_are_told_once_counted():
    assert V._spikes(None) is None
    assert V._spikes(hist(events=[ev(3, "rollback")])) is None
    assert V._spikes(hist(events=[ev(3, "spike")])) == "1 spike skipped at 3"
    h = hist(events=[ev(s, "spike") for s in range(1, 7)])
    assert V._spikes(h) == "6 spikes skipped at 1, 2, 3, 4, 5, 6"
    h = hist(events=[ev(s, "spike") for s in range(1, 8)])
    assert V._spikes(h) == "7 spikes skipped at 1, 2, 3, 4, 5, 6 ..."


def test_overflow_words():
    e = ep("storm", 11, 13, text="storm text")
    assert V._overflow_words(None, e) == "3 overflows at 11–13"
    assert V._overflow_words(None, ep("isolated", 5, 5)) == "1 overflow at 5"
    h = hist(events=[ev(5, "overflow", params=["w", "v", "u", "t"])])
    assert V._overflow_words(h, ep("isolated", 5, 5)) == (
        "1 overflow at 5 (non-finite gradients in w, v, u)"
    )
    assert V._overflow_words(h, ep("departure", 5, 9, text="rose")) == "rose"


def test_an_isolated_skip_is_told_only_when_the_guard_acted_on_it():
    e = ep("isolated", 10, 12)
    for kind in ("rollback", "fallback", "promotion", "demotion", "spike", "rerun", "divergence"):
        assert V._acted_on(hist(events=[ev(13, kind)]), e) is True
        assert V._acted_on(hist(events=[ev(10, kind)]), e) is True
    assert V._acted_on(hist(events=[ev(14, "rollback")]), e) is False
    assert V._acted_on(hist(events=[ev(9, "fallback")]), e) is False
    assert V._acted_on(hist(events=[ev(11, "overflow")]), e) is False
    assert V._acted_on(None, e) is False
    # a rollback is written at the step it restored: its from_step is where it acted
    assert V._acted_on(hist(events=[ev(5, "rollback", from_step=13)]), e) is True
    assert V._acted_on(hist(events=[ev(5, "rollback", from_step=14)]), e) is False
    assert V._acted_on(hist(events=[ev(5, "rollback", from_step=10)]), e) is True
    assert V._acted_on(hist(events=[ev(15, "rollback", from_step=9)]), e) is False


def test_the_story_in_step_order_repeats_counted():
    eps = [
        ep("storm", 30, 37, text="storm"),
        ep("isolated", 5, 5),  # not acted on: not told
        ep("isolated", 50, 50),  # acted on (the rollback at 51)
        ep("calibration", 1, 2),
        ep("departure", 40, 45, text="the loss rose"),
        ep("loss_spike", 20, 20, text="a single loss"),
        ep("nonfinite_loss", 60, 60, text="nan"),
    ]
    events = [
        ev(51, "rollback", to_step=48),
        ev(8, "spike"),
        ev(9, "spike"),
        ev(25, "overflow", discarded=True),
        ev(26, "overflow", discarded=True),
        ev(24, "overflow"),
        ev(70, "promotion", module="m"),
        ev(70, "promotion", module="m"),
        ev(70, "promotion", module="m"),
        ev(3, "divergence", action="rollback", from_step=55, to_step=48),
    ]
    story = V._story(hist(events=events), course(None, *eps))
    assert story == [
        "2 spikes skipped at 8, 9",
        "a single loss",
        "2 overflow(s) on steps a rollback discarded",
        "8 overflows at 30–37",
        "the loss rose",
        "1 overflow at 50",
        "rolled back to 48",
        "the loss diverged at step 55: rolled back to 48",
        "nan",
        "the guard moved m to fp32 at step 70 (3x)",
    ]
    assert V._story(None, course()) == []


def test_the_same_event_twice_is_counted_only_when_it_is_the_same():
    events = [
        ev(5, "rollback", to_step=4),
        ev(6, "rollback", to_step=4),
        ev(7, "rollback", to_step=44),
    ]
    assert V._story(hist(events=events), course()) == ["rolled back to 4 (2x)", "rolled back to 44"]


# ---------------------------------------------------------------------------- params
def test_params_in_names_what_keeps_overflowing():
    events = [
        ev(1, "overflow", params=["a", "b", "a"]),  # once per event
        ev(2, "overflow", params=["a", "c"]),
        ev(3, "overflow", params=["a", "b", 7]),
        ev(4, "overflow", params=["a", "c"], discarded=True),
        ev(5, "overflow", params=None),
        ev(6, "spike", params=["s"]),
        ev(9, "overflow", params=["c", "d"]),
    ]
    h = hist(events=events)
    # a: 3, b: 2, c: 2, d: 1 -> at least half of 3 (2 of them)
    assert params_in(h) == ["a", "b", "c"]
    assert params_in(h, 2, 3) == ["a", "c", "b"]  # ties in the order first named
    assert params_in(h, 9, 9) == ["c", "d"]
    assert params_in(h, 3, 3) == ["a", "b"]
    assert params_in(h, 2, 2) == ["a", "c"]
    assert params_in(h, 10, 20) == []
    assert params_in(None) == []
    # the most named first
    h = hist(events=[ev(1, "overflow", params=["x", "y"]), ev(2, "overflow", params=["y"])])
    assert params_in(h) == ["y", "x"]


# ---------------------------------------------------------------------------- notes
def test_the_healthy_note_counts_the_isolated_skips():
    assert V._healthy_note(course()) == ""
    assert V._healthy_note(course(None, ep("storm", 1, 9))) == ""
    one = course(None, ep("isolated", 7, 7))
    assert V._healthy_note(one) == (
        ": 1 isolated skipped step (7), each followed by clean steps with the loss on course "
        "(fewer than 8 in a row: the scaler backing off, as dynamic loss scaling does)"
    )
    many = course(
        None, ep("calibration", 1, 3), *[ep("isolated", s, s + 1) for s in range(10, 80, 10)]
    )
    note = V._healthy_note(many)
    assert note.startswith(": 17 isolated skipped steps (1, 10, 20, 30, 40, 50 ...), each")
    six = course(None, *[ep("isolated", s, s) for s in range(10, 70, 10)])
    assert V._healthy_note(six).startswith(": 6 isolated skipped steps (10, 20, 30, 40, 50, 60), ")


def test_clean_end():
    assert V._clean_end(course()) is True
    assert V._clean_end(course(None, ep("storm", 1, 9), ep("isolated", 20, 20))) is True
    assert V._clean_end(course(None, ep("storm", 1, 9), ep("isolated", 20, 20, False))) is False


# ---------------------------------------------------------------------------- the verdict
def test_a_run_with_isolated_skips_is_healthy_with_a_note():
    h = hist(rows([3.0 - 0.01 * i for i in range(40)]), skipped_steps=[12, 25])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=0.1)
    v = j.verdict
    assert (v.status, v.kind, v.cause, v.first_bad_step, v.events) == (
        "healthy",
        None,
        None,
        None,
        [],
    )
    assert v.summary == (
        "healthy: 2 isolated skipped steps (12, 25), each followed by clean steps with the loss "
        "on course (fewer than 8 in a row: the scaler backing off, as dynamic loss scaling does)"
    )
    assert [e.kind for e in v.episodes] == ["isolated", "isolated"]
    assert (j.problems, j.lr, j.collapse, j.storm_params, j.resume, j.resume_why) == (
        [],
        None,
        None,
        [],
        None,
        None,
    )
    j = judge(own=None, siblings=[], problems=[], h=None, scaler=None, rep=None, lr=None)
    assert (j.verdict.status, j.verdict.summary) == ("healthy", "healthy")


def test_a_run_that_recovered_names_what_it_went_through():
    losses = [3.0 - 0.01 * i for i in range(40)]
    h = hist(rows(losses), [ev(8, "spike"), ev(30, "promotion", module="m")], skipped_steps=[])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=0.1)
    assert j.verdict.status == "recovered" and j.verdict.kind is None and j.verdict.cause is None
    assert j.verdict.summary == (
        "recovered: 1 spike skipped at 8, the guard moved m to fp32 at step 30, clean since"
    )
    # not clean at the end (a storm still going is a problem; a departure still going too):
    # an unresolved isolated run is no problem but not clean
    h = hist(rows(losses[:38]), [ev(30, "promotion", module="m")], skipped_steps=[39, 40])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=0.1)
    assert j.verdict.summary == "recovered: the guard moved m to fp32 at step 30"


def test_a_broken_run_names_its_cause_and_where_to_resume():
    losses = [3.0 - 0.01 * i for i in range(20)]
    h = hist(
        rows(losses),
        [ev(s, "overflow", params=["enc.w"]) for s in range(21, 31)],
        skipped_steps=list(range(21, 31)),
    )
    own = CheckpointFacts("c30", 30, ["scale_collapsed"], scale=0.5)
    sib = [
        CheckpointFacts("c20", 20, []),
        CheckpointFacts("c25", 25, []),
        CheckpointFacts("c10", 10, []),
    ]
    j = judge(
        own=own,
        siblings=sib,
        problems=[Problem("scale_collapsed", "the scale fell to 0.5")],
        h=h,
        scaler=None,
        rep=None,
        lr=0.1,
    )
    v = j.verdict
    storm = "10 steps skipped at 21–30 in a row, still skipping at the end of the record"
    assert [p.kind for p in j.problems] == ["scale_collapsed"]  # the storm folded into its cause
    assert v.summary == (
        f"broken: the scale fell to 0.5; cause: persistent overflow: {storm}: the gradients were "
        "non-finite at every scale the scaler tried"
    )
    assert (v.status, v.kind, v.cause) == ("broken", "scale_collapsed", j.problems[0].message)
    assert (v.first_bad_step, j.resume, j.collapse, j.lr) == (21, "c20", "overflow", None)
    assert j.resume_why == (
        "the newest checkpoint with a healthy state written before the first sign of trouble "
        "(step 21)"
    )
    assert j.storm_params == ["enc.w"]
    assert v.events == ["10 overflows at 21–30 (non-finite gradients in enc.w)"]
    assert [(c.path, c.after_trouble) for c in j.checkpoints] == [
        ("c30", None),
        ("c20", None),
        ("c25", True),
        ("c10", None),
    ]


def test_a_checkpoint_whose_own_state_is_broken_is_the_trouble():
    h = hist(rows([3.0 - 0.01 * i for i in range(40)]))
    own = CheckpointFacts("c30", 30, ["nonfinite_weights"])
    sib = [CheckpointFacts("c35", 35, []), CheckpointFacts("c20", 20, [])]
    j = judge(
        own=own,
        siblings=sib,
        problems=[Problem("nonfinite_weights", "weights hold NaN")],
        h=h,
        scaler=None,
        rep=None,
        lr=0.1,
    )
    assert (j.verdict.first_bad_step, j.resume) == (30, "c20")
    assert j.resume_why == (
        "the newest checkpoint with a healthy state written before this checkpoint, whose own "
        "state is broken"
    )
    # the course's trouble earlier than it: that
    h = hist(rows([3.0 - 0.01 * i for i in range(20)]), skipped_steps=list(range(21, 31)))
    j = judge(own=own, siblings=sib, problems=[], h=h, scaler=None, rep=None, lr=0.1)
    assert j.verdict.first_bad_step == 21
    # a broken checkpoint without a step leaves the first bad step alone
    anon = CheckpointFacts("cx", None, ["nonfinite_weights"])
    j = judge(own=anon, siblings=sib, problems=[], h=None, scaler=None, rep=None, lr=0.1)
    assert (j.verdict.first_bad_step, j.resume, j.resume_why) == (None, "c35", None)


def test_without_a_loss_scaler_a_non_finite_state_says_nothing_checked_the_gradients():
    extra = (
        "; nothing checked the gradients before the optimizer applied them (no loss scaler): one "
        "non-finite step is enough"
    )
    ps = [
        Problem("nonfinite_weights", "w"),
        Problem("nonfinite_master", "m"),
        Problem("nonfinite_optimizer_state", "o"),
    ]
    j = judge(
        own=None, siblings=[], problems=ps, h=None, scaler=None, rep=None, lr=None, scaled=False
    )
    assert [p.message for p in j.problems] == ["w" + extra, "m" + extra, "o"]
    ps = [Problem("nonfinite_weights", "w")]
    j = judge(own=None, siblings=[], problems=ps, h=None, scaler=None, rep=None, lr=None)
    assert j.problems[0].message == "w"


def test_the_lr_advice_comes_with_a_divergence_or_a_rollback_only():
    # a loss that rose at the first updates: an lr divergence, an lr below the configured one
    h = hist(rows([3.9, 8.0, 9.0, 8.5, 9.5]))
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=1.0)
    assert j.verdict.kind == "lr_divergence" and j.lr.lr < 1.0 and not j.lr.known
    assert j.verdict.first_bad_step == 1 and j.resume_why.startswith("no checkpoint")
    # a rollback that cured it: the advice, and recovered
    back = ev(4, "divergence", action="rollback", lr_factor=0.5, from_step=6, to_step=4)
    h = hist(rows([4.2, 4.1, 4.0, 3.9, 3.8, 3.7]), [back])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=1e-3)
    assert j.verdict.status == "recovered" and j.lr.lr == pytest.approx(5e-4)
    # a warned divergence: no advice
    h = hist(rows([4.2, 4.1, 4.0, 3.9, 3.8, 3.7]), [ev(6, "divergence", action="warn")])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=1e-3)
    assert j.lr is None and j.verdict.status == "recovered"


def test_the_collapse_cause_is_asked_only_for_a_collapsed_scale():
    s0 = ScalerState(kind="GradScaler", enabled=True, scale=0.0, backoff_factor=0.0)
    for kind in ("scale_collapsed", "scale_at_floor"):
        j = judge(
            own=None,
            siblings=[],
            problems=[Problem(kind, "s")],
            h=None,
            scaler=s0,
            rep=None,
            lr=None,
        )
        assert j.collapse == "backoff"
        assert j.problems[0].message == (
            "s; cause: backoff_factor 0 sets the scale to 0 on the first overflow"
        )
    j = judge(
        own=None,
        siblings=[],
        problems=[Problem("bad_scale", "s")],
        h=None,
        scaler=s0,
        rep=None,
        lr=None,
    )
    assert (j.collapse, j.problems[0].message) == (None, "s")


def test_the_outlier_batch_is_named_in_the_verdict():
    losses = [1.0 - 0.01 * i for i in range(20)]
    losses[10] = 1e21
    h = hist(rows(losses))
    own = CheckpointFacts("c20", 20, ["nonfinite_optimizer_state"])
    j = judge(
        own=own,
        siblings=[],
        problems=[Problem("nonfinite_optimizer_state", "exp_avg_sq holds NaN")],
        h=h,
        scaler=None,
        rep=None,
        lr=None,
    )
    assert j.verdict.summary == (
        "broken: exp_avg_sq holds NaN; a single loss of 1e+21 at step 11 (one batch, an outlier: "
        "the loss was back on the next step): its gradient is the likely cause"
    )
    assert j.verdict.events == ["a single loss of 1e+21 at step 11"]


def test_a_repeated_event_whose_text_has_a_parenthesis_is_told_once_counted():
    """The rule fired at the same step again after each rollback: one line, counted."""
    again = ev(4, "divergence", action="rollback", from_step=6, to_step=4, ratio=3.0, min_loss=2.0)
    story = V._story(hist(events=[again, again, again]), course())
    assert story == ["the loss diverged at step 6 (3x its lowest, 2): rolled back to 4 (3x)"]
    other = ev(4, "divergence", action="rollback", from_step=6, to_step=4, ratio=4.0, min_loss=2.0)
    story = V._story(hist(events=[again, other]), course())
    assert story == [
        "the loss diverged at step 6 (3x its lowest, 2): rolled back to 4",
        "the loss diverged at step 6 (4x its lowest, 2): rolled back to 4",
    ]


# ---------------------------------------------------------------------------- edges (mutants)
def test_a_factor_between_1_and_2_is_the_cut_itself():
    h = hist(rows([3.0] * 3), [ev(2, "divergence", action="rollback", lr_factor=1.5)])
    assert lr_change(course(), h, 3.0).lr == pytest.approx(2.0)


def test_a_checkpoint_without_a_step_is_older_than_one_at_step_0():
    facts = [CheckpointFacts("cx", None, []), CheckpointFacts("c0", 0, [])]
    assert V._checkpoints(facts, None)[1] == "c0"


def test_seven_isolated_runs_are_shown_six_and_more():
    seven = course(None, *[ep("isolated", s, s) for s in range(10, 80, 10)])
    assert V._healthy_note(seven).startswith(
        ": 7 isolated skipped steps (10, 20, 30, 40, 50, 60 ...), each"
    )


def test_overflow_words_name_the_episodes_own_parameters_and_count_two():
    h = hist(events=[ev(3, "overflow", params=["early"]), ev(6, "overflow", params=["own"])])
    assert V._overflow_words(h, ep("storm", 5, 6)) == (
        "2 overflows at 5–6 (non-finite gradients in own)"
    )


def test_the_story_orders_by_step_then_as_found():
    eps = [ep("departure", 30, 40, text="the loss rose")]
    events = [
        ev(30, "promotion", module="m"),
        ev(20, "fallback", from_precision="fp16", to_precision="bf16", from_step=99),
        ev(25, "overflow", discarded=True),
    ]
    assert V._story(hist(events=events), course(None, *eps)) == [
        "fell back fp16 -> bf16 at step 20",  # its own step, whatever from_step it carries
        "1 overflow(s) on steps a rollback discarded",
        "the loss rose",  # found before the event of the same step
        "the guard moved m to fp32 at step 30",
    ]


def test_an_lr_divergence_edges():
    # a storm at the departure's own step is not what the rise led to
    d = dep(resolved_at=None)
    (p,) = history_problems(None, course(d, ep("storm", 10, 20, resolved=True)), None)
    assert p.message.endswith("and did not come back: the learning rate is too high")
    # the row at the departure's step counts for the peak before the non-finite steps
    r = rows([6.0, 3.0, 4.0], start=10)
    (p,) = history_problems(hist(r), course(dep(resolved_at=30), ep("storm", 13, 20)), None)
    assert "to 6 (step 10), before the gradients went non-finite at step 13" in p.message
    # the lr named when it came back more than 5% below its peak
    d = dep(resolved_at=30, never_improved=True, lr_at_min=0.1, lr_peak=0.4, lr_back=0.3)
    (p,) = history_problems(None, course(d), None)
    assert "only at step 30, the lr down to 0.3: the learning" in p.message


def test_judge_hands_its_parts_what_they_need():
    # the history: an aborted run
    h = hist(rows([3.0] * 5), aborted=Aborted(step=4, message="too many rollbacks"))
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=None)
    assert [p.kind for p in j.problems] == ["run_aborted"]
    assert j.course.first_step == 1 and j.course.last_step == 5
    # the scaler: its growth interval, and its record when there is no history
    bursts = [Burst(10, 14, 5, 1.0, True), Burst(20, 24, 5, 1.0, True)]
    gi = ScalerState(kind="ampctl", enabled=True, scale=1.0, growth_interval=100)
    h = hist(rows([3.0] * 5), bursts=bursts, scaler_records=100)
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=gi, rep=None, lr=None)
    assert j.problems[0].message.endswith(", growth_interval 100")
    rec_rows = [(u, 1.0, 0, 3.0) for u in range(1, 4)] + [(u, 1.0, 1, 3.0) for u in range(4, 12)]
    s = ScalerState(kind="ampctl", enabled=True, scale=1.0, rows=rec_rows)
    j = judge(own=None, siblings=[], problems=[], h=None, scaler=s, rep=None, lr=None)
    assert [p.kind for p in j.problems] == ["overflow_storm"] and j.verdict.first_bad_step == 4
    # the replay: the floor above S*
    floor = ScalerState(kind="ampctl", enabled=True, scale=1.0, min_scale=1.0, at_floor=True)
    j = judge(
        own=None,
        siblings=[],
        problems=[Problem("scale_at_floor", "at the floor"), Problem("gradient_underflow", "u")],
        h=None,
        scaler=floor,
        rep=rep(0.5),
        lr=None,
    )
    assert j.collapse == "floor" and [p.kind for p in j.problems] == [
        "scale_at_floor",
        "gradient_underflow",
    ]
    # an overflow collapse: the underflow at the collapsed scale is not listed
    j = judge(
        own=None,
        siblings=[],
        problems=[Problem("scale_collapsed", "s"), Problem("gradient_underflow", "u")],
        h=None,
        scaler=None,
        rep=None,
        lr=None,
    )
    assert j.collapse == "overflow" and [p.kind for p in j.problems] == ["scale_collapsed"]
    # the checkpoint: a spike after it is not its cause
    losses = [1.0] * 30
    losses[10] = losses[25] = 1e21
    own = CheckpointFacts("c20", 20, ["nonfinite_weights"])
    j = judge(
        own=own,
        siblings=[],
        problems=[Problem("nonfinite_weights", "w")],
        h=hist(rows(losses)),
        scaler=None,
        rep=None,
        lr=None,
    )
    assert "a single loss of 1e+21 at step 11 (one batch" in j.problems[0].message


# ======================================================= the lr and the verdict from a run's course
# ---------------------------------------------------------------------------- the lr
def test_the_lr_comes_from_the_history_not_a_factor():
    # the loss rose at the first updates, no lr logged: the configured one is too high, and
    # nothing below it is known (an unchecked ladder for the probe)
    course = run_course(history([3.9, 8.0, 9.0, 8.5, 9.5]), None, [])
    ch = lr_change(course, None, 1.0)
    assert ch.lr == 0.5 and not ch.known and ch.ladder[0] == 0.5
    # the loss fell while a warmup raised the lr, and rose once the lr passed 0.1 (where it
    # last fell): that lr
    lr = [0.025 * (i + 1) for i in range(12)]
    losses = [4.0, 3.8, 3.6, 3.4, 3.6, 5.0, 6.0, 7.0, 7.5, 8.0, 8.0, 8.0]
    h = history(losses, lr=lr)
    course = run_course(h, None, [])
    ch = lr_change(course, h, 0.3)
    assert course.departure.lr_at_min == 0.125 and course.departure.lr_at_step == 0.2
    assert ch.known and ch.lr == pytest.approx(0.1) and "last fell at step 4" in ch.why
    # the loss rose from its first row while a warmup raised the lr: no lr is known to have
    # worked; below the first bad row's lr: the lr of the first update, not known to hold
    h = history([4.0, 4.6, 5.0, 5.4, 5.5, 5.6, 5.6], lr=[0.075, 0.15, 0.225, 0.3, 0.3, 0.29, 0.28])
    course = run_course(h, None, [])
    ch = lr_change(course, h, 0.3)
    assert course.departure.never_improved and course.departure.lr_rose
    assert not ch.known and ch.lr < 0.15
    # the guard's divergence rule rolled back and cut it: the cut lr
    h = history([3.0] * 10, events=[(30, "divergence", {"action": "rollback", "lr_factor": 0.5})])
    assert lr_change(run_course(h, None, []), h, 1e-3).lr == pytest.approx(5e-4)


def test_the_guards_divergence_events_give_the_lr_the_run_worked_at():
    # it stopped the run after the lr jumped 300x: back to the lr the loss last fell at
    losses = [4.2, 4.1, 4.0, 3.9, 3.95, 11.3]
    lr = [1e-3] * 4 + [0.3, 0.3]
    stop = (6, "divergence", {"action": "stop", "since": 4})
    h = history(losses, events=[stop], lr=lr)
    course = run_course(h, None, [])
    assert course.departure is None  # one high row: the rule fired before a level could move
    ch = lr_change(course, h, 0.3)
    assert ch.lr == pytest.approx(1e-3) and ch.known and "last fell at step 4" in ch.why
    # ... the same at one lr: nothing below it is known, a ladder below it (not known)
    h = history(losses, events=[stop], lr=[1e-3] * 6)
    ch = lr_change(run_course(h, None, []), h, 1e-3)
    assert not ch.known and ch.lr < 1e-3
    # it rolled back and cut the lr, and the run went on clean: the lr it went on at
    back = (4, "divergence", {"action": "rollback", "lr_factor": 0.5, "to_step": 4, "from_step": 6})
    h = history([4.2, 4.1, 4.0, 3.9, 3.8, 3.7, 3.6, 3.5], events=[back], lr=[1e-3] * 6 + [5e-4] * 2)
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
    h = history(losses, skipped=range(5, 9))
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
    h = history(
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


# ======================================================================= healthy vs recovered (#36)
def _hist(events, skipped=()):
    rows = [Row(step=10 * (i + 1), loss=5.0 - 0.01 * i, learning_rate=3e-3) for i in range(30)]
    return History(
        source="run folder",
        rows=rows,
        guard_events=[GuardEvent(s, k, "", dict(d)) for s, k, d in events],
        skipped_steps=list(skipped),
    )


def test_the_default_run_s_skipped_spikes_and_its_overflow_are_healthy_notes():
    # the default run: two spikes skipped (138, 207) and one overflow (281), clean
    h = _hist(
        [(138, "spike", {}), (207, "spike", {}), (281, "overflow", {"params": ["w"]})],
        skipped=[138, 207, 281],
    )
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=3e-3)
    v = j.verdict
    assert v.status == "healthy" and j.problems == []
    assert "2 spikes skipped at 138, 207" in v.summary
    assert "281" in v.summary  # the overflow is a note too
    assert not v.summary.startswith("recovered")


def test_an_intervention_makes_it_recovered():
    h = _hist([(138, "spike", {}), (200, "rollback", {"to_step": 190, "from_step": 203})])
    j = judge(own=None, siblings=[], problems=[], h=h, scaler=None, rep=None, lr=3e-3)
    assert j.verdict.status == "recovered" and "rolled back to 190" in j.verdict.summary
    assert run_course(h, None, []).departure is None


# ---------------------------------------------------------------------------- resume points
def test_exploded_but_finite_weights_move_the_resume_point_before_them():
    """The issue's FSDP2 case without its history: the checkpoint at 15 had weights ~1e4x the
    first's (loss ~1e5, still finite): the resume point is the one before, never 15 or 19."""
    from ampctl.commands.diagnose.course import CheckpointFacts

    facts = [
        CheckpointFacts("c19", 19, [], weight_amax=3e4),
        CheckpointFacts("c15", 15, [], weight_amax=2e4),
        CheckpointFacts("c10", 10, [], weight_amax=2.1),
        CheckpointFacts("c5", 5, [], weight_amax=1.2),
    ]
    j = judge(own=facts[0], siblings=facts[1:], problems=[], h=None, scaler=None, rep=None, lr=1.0)
    assert j.verdict.first_bad_step == 11 and j.resume == "c10"
    assert j.problems[0].kind == "extreme_weights" and "exploded after step 10" in (
        j.problems[0].message
    )
    after = {c.path for c in j.checkpoints if c.after_trouble}
    assert after == {"c19", "c15"}
    # weights that grew as training grows them (a few times): no trouble, the newest
    healthy = [CheckpointFacts(f"c{s}", s, [], weight_amax=a) for s, a in ((19, 6.0), (5, 1.2))]
    j = judge(own=healthy[0], siblings=healthy[1:], problems=[], h=None, scaler=None, rep=None,
              lr=1.0)  # fmt: skip
    assert j.verdict.status == "healthy" and j.resume == "c19"


def test_with_a_history_exploded_weights_still_move_the_resume_point_before_them():
    """The FSDP2 case with a sparse history: the loss logged every 5 steps looked flat until the
    NaN at 19, but the checkpoint at 15 holds weights 1e4x step 5's: resume from 10, not 15."""
    from ampctl.commands.diagnose.course import CheckpointFacts

    rows = [Row(step=s, loss=2.0, learning_rate=1.0) for s in (5, 10, 15)]
    rows.append(Row(step=19, loss=float("nan"), learning_rate=1.0))
    h = History(source="tb", rows=rows)
    facts = [
        CheckpointFacts("c19", 19, ["nonfinite_weights"], weight_amax=float("nan")),
        CheckpointFacts("c15", 15, [], weight_amax=2e4),
        CheckpointFacts("c10", 10, [], weight_amax=2.1),
        CheckpointFacts("c5", 5, [], weight_amax=1.2),
    ]
    j = judge(own=facts[0], siblings=facts[1:], problems=[], h=h, scaler=None, rep=None, lr=1.0)
    assert j.verdict.first_bad_step == 11 and j.resume == "c10"
    # a run that came back from the growth (a clean course, nothing wrong now): the newest
    clean = [Row(step=s, loss=2.0 - s / 100, learning_rate=1.0) for s in (5, 10, 15, 19)]
    ok = [CheckpointFacts("c19", 19, [], weight_amax=3e4), *facts[1:]]
    j = judge(own=ok[0], siblings=ok[1:], problems=[], h=History(source="tb", rows=clean),
              scaler=None, rep=None, lr=1.0)  # fmt: skip
    assert j.verdict.status == "healthy" and j.resume == "c19"
