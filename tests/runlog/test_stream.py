"""The streaming JSONL reader: one line in memory at a time, a per-line cap, never a file cap."""

import json

from ampctl.runlog import read_jsonl
from ampctl.runlog.readers import iter_jsonl
from ampctl.trust import iter_lines


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
