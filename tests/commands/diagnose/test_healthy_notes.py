"""#36: healthy vs recovered (docs/diagnose.md). Isolated skipped steps and skipped spikes on a
clean course are a healthy run's notes, every one of them; recovered takes an intervention."""

from __future__ import annotations

from ampctl.commands.diagnose.course import run_course
from ampctl.commands.diagnose.stages import GuardEvent, History, Row
from ampctl.commands.diagnose.verdict import judge


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
