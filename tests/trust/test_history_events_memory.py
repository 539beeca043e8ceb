"""An events.jsonl of `{}` lines (under any cap) costs diagnose no memory: events are streamed and
only those with a kind are kept (#37)."""

import json
import tracemalloc

from ampctl.commands.diagnose.history import run_history


def test_an_events_file_of_empty_objects_is_streamed_not_kept(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 5.0 - s / 100, "skipped": 0}) + "\n"
            for s in range(1, 21)
        )
    )
    overflow = {"kind": "overflow", "step": 7, "message": "gradient overflow", "params": ["w"]}
    (run / "events.jsonl").write_text("{}\n" * 120_000 + json.dumps(overflow) + "\n")
    tracemalloc.start()
    h = run_history(run, None, None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert h is not None and h.events == {"overflow": 1} and h.first_overflow_step == 7
    assert peak < 3 << 20, peak  # 120k kept dicts would be ~14 MB
