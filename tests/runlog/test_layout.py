"""What counts as a run folder."""

from __future__ import annotations

from ampctl.runlog import is_run_dir


def test_an_empty_events_file_is_not_yet_a_run(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    assert not is_run_dir(d)
    (d / "events.jsonl").write_text("")  # every run opens one at its start
    assert not is_run_dir(d)  # nothing recorded: the folder can still be started afresh
    (d / "events.jsonl").write_text('{"step": 1, "kind": "overflow"}\n')
    assert is_run_dir(d)
    (d / "events.jsonl").write_text("")
    (d / "metrics.jsonl").write_text("")
    assert is_run_dir(d)  # metrics, summary or checkpoints make it one, as before
