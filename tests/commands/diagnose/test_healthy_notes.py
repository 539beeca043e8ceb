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
