"""The run folder's streaming readers (ampctl.runlog.readers): the JSONL reader keeps one line in
memory at a time, with a per-line cap, never a file cap; JsonArrayStream reads one JSON object
file in one pass, the entries of its large array one at a time with a per-entry cap
(trainer_state.json's log_history), never a cap on the file.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest

from ampctl.runlog import read_jsonl
from ampctl.runlog.readers import JsonArrayStream, iter_jsonl
from ampctl.trust import iter_lines

# ================================================================================== JsonArrayStream
STATE = {
    "best_metric": None,
    "epoch": 1.0,
    "global_step": 30,
    "log_history": [
        {"loss": 1.0 + i / 3, "step": i, "grad_norm": math.nan if i == 3 else 0.5, "s": 'a\\"}b'}
        for i in range(20)
    ],
    "max_steps": 30,
    "trial_params": {"x": [1, 2, {"y": "}]"}]},
}


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1 << 16])
def test_entries_and_keys_are_those_json_reads_whatever_the_chunk(tmp_path, chunk):
    p = tmp_path / "trainer_state.json"
    text = json.dumps(STATE, indent=2, sort_keys=True)
    p.write_text(text)
    whole = json.loads(text)
    st = JsonArrayStream(p, "log_history", chunk=chunk)
    assert json.dumps(list(st)) == json.dumps(whole.pop("log_history"))
    assert st.top == whole and st.error is None and st.note() is None and st.found_array


def test_an_overlong_entry_is_skipped_by_its_structure_and_the_rest_read(tmp_path, monkeypatch):
    import ampctl.trust as trust

    monkeypatch.setattr(trust, "MAX_WHOLE_FILE", 1024)  # not a cap this reader has
    state = json.loads(json.dumps(STATE))
    state["log_history"][5]["pad"] = ["x]}" * 2000, {"deep": [[["]"]]]}]
    p = tmp_path / "trainer_state.json"
    p.write_text(json.dumps(state))
    for chunk in (5, 128, 1 << 16):
        st = JsonArrayStream(p, "log_history", entry_limit=1000, chunk=chunk)
        steps = [e["step"] for e in st]
        assert steps == [i for i in range(20) if i != 5] and st.bad_entries == [6]
        assert st.top["max_steps"] == 30 and st.error is None
        assert st.note() == (
            f"{p}: skipped 1 unreadable log_history entry (6: longer than 1,000 characters)"
        )


@pytest.mark.parametrize(
    "content, entries, error",
    [
        (pickle.dumps({"a": 1}), [], "holds pickle bytes (a pickled Python object), not text"),
        (b'{"log_history": [{"a": 1}, {"b": 2}, {"c": ', [{"a": 1}, {"b": 2}], "is not valid"),
        (b"[1, 2]", [], "holds a list, not an object"),
        (b"", [], "is not valid JSON (no object at character 1)"),
        (b'{"log_history": [{"a": 1}] "x": 2}', [{"a": 1}], "is not valid JSON (',' or '}'"),
    ],
)
def test_what_is_not_json_stops_the_stream_and_says_where(tmp_path, content, entries, error):
    p = tmp_path / "s.json"
    p.write_bytes(content)
    st = JsonArrayStream(p, "log_history")
    assert list(st) == entries
    assert st.error.startswith(error), st.error


def test_too_deep_an_entry_is_skipped_and_text_after_the_object_not_read(tmp_path):
    p = tmp_path / "s.json"
    p.write_text('{"log_history": [' + "[" * 50_000 + "]" * 50_000 + ', {"step": 1}]} trailing')
    st = JsonArrayStream(p, "log_history")
    assert list(st) == [{"step": 1}] and st.bad_why == "nested too deeply to read"
    assert st.trailing and "text after the JSON object not read" in st.note()


# ================================================================================= the JSONL reader
def test_a_file_over_the_whole_file_cap_is_read_line_by_line(tmp_path, monkeypatch):
    import ampctl.trust as trust

    monkeypatch.setattr(trust, "MAX_WHOLE_FILE", 1024)  # the cap of a file read whole
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(500)))
    assert p.stat().st_size > 1024
    stream = iter_jsonl(p)
    assert [r["step"] for r in stream] == list(range(500))
    assert stream.error is None and stream.bad_count == 0


def test_an_overlong_line_is_skipped_and_counted_and_the_rest_read(tmp_path):
    p = tmp_path / "m.jsonl"
    long = json.dumps({"step": 1, "pad": "x" * 5000})
    p.write_text('{"step": 0}\n' + long + '\nnot json\n{"step": 2}\n[1]\n{"step": 3}')
    stream = iter_jsonl(p, line_limit=1000)
    assert [r["step"] for r in stream] == [0, 2, 3]
    assert stream.bad_lines == [2, 3, 5] and stream.bad_count == 3
    assert stream.note() == f"{p}: skipped 3 unreadable line(s) (2, 3, 5)"
    rows = read_jsonl(p, line_limit=1000)
    assert [r["step"] for r in rows] == [0, 2, 3] and rows.bad_lines == [2, 3, 5]


def test_iter_lines_holds_no_more_than_the_line_limit(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"a" * 10 + b"\n" + b"b" * 100_000 + b"\n" + b"c\r\n" + b"d")
    assert list(iter_lines(p, line_limit=64, chunk=16)) == [
        (1, b"a" * 10),
        (2, None),
        (3, b"c"),
        (4, b"d"),
    ]
    # a line of exactly the limit is taken whole
    p.write_bytes(b"e" * 64 + b"\n")
    assert list(iter_lines(p, line_limit=64)) == [(1, b"e" * 64)]


def test_pickle_bytes_are_named_not_parsed(tmp_path):
    import pickle

    p = tmp_path / "m.jsonl"
    p.write_bytes(pickle.dumps({"step": 1}))
    stream = iter_jsonl(p)
    assert list(stream) == []
    assert stream.error == "holds pickle bytes (a pickled Python object), not text"


def test_a_symlink_out_of_its_folder_is_not_opened(tmp_path):
    (tmp_path / "secret.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "m.jsonl").symlink_to(tmp_path / "secret.jsonl")
    stream = iter_jsonl(tmp_path / "run" / "m.jsonl")
    assert list(stream) == [] and "outside its folder" in stream.error
