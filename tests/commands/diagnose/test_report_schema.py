"""The report's schema, as :mod:`ampctl.commands.diagnose.report`'s docstring writes it, and the
report as the code writes it cannot drift apart: every object the docstring lists has exactly the
keys of the record (:mod:`.stages`) that writes it, every record is listed somewhere, every key
of real ``--json`` reports is documented where it stands, and a record is written as its fields.
"""

from __future__ import annotations

import re
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from ampctl.commands.diagnose import report, stages
from ampctl.commands.diagnose.readers.base import FileNote
from ampctl.commands.diagnose.stages import (
    INTERNAL,
    OPTIONAL,
    Problem,
    Replay,
    to_json,
)

from .conftest import diagnose_cli

_TOKEN = re.compile(r'"[^"]*"|\.\.\.[\w ;:]*|[{}\[\]:|,]|[A-Za-z_]\w*')
Keys = tuple[str, ...]  # the keys from the report's top to an object (lists are transparent)


def documented(doc: str) -> tuple[dict[Keys, set[str] | None], set[str]]:
    """The schema block of ``doc``: each object's path -> the keys it lists (None where it lists
    them elsewhere or not at all: ``{... same ...}``, ``...details``, ``{kind: count}``); and
    the keys of the BadTensor line."""
    block = doc.split("::\n", 1)[1].split("\n\n``", 1)[0]
    text = "\n".join(line.split("#", 1)[0] for line in block.splitlines())
    out: dict[Keys, set[str] | None] = {}
    stack: list[list] = [["[", (), None]]  # [bracket, path, the last key in it]
    prev = None
    for tok in _TOKEN.findall(text):
        kind, path, last = stack[-1]
        if tok in "{[":
            stack.append([tok, path + (last,) if kind == "{" else path, None])
            if tok == "{":
                out.setdefault(stack[-1][1], set())
        elif tok in "}]":
            stack.pop()
        elif kind == "{" and tok.startswith('"') and prev not in (":", "|"):
            stack[-1][2] = tok[1:-1]
            if out[path] is not None:
                out[path].add(tok[1:-1])
        elif kind == "{" and (tok.startswith("...") or (tok[0].isalpha() and prev in "{,")):
            out[path] = None
        prev = tok
    bad = re.search(r"BadTensor: ``\{(.*?)\}``", doc, re.S)
    return out, set(re.findall(r'"(\w+)"', bad.group(1)))


def records(cls: type, path: Keys = ()) -> dict[Keys, type]:
    """Each path of the report where a record of :mod:`.stages` is written -> its class."""
    out = {path: cls}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("internal"):
            continue
        t = hints[f.name]
        while typing.get_origin(t) in (list, typing.Union, type(int | None)):
            t = next(a for a in typing.get_args(t) if a is not type(None))
        if is_dataclass(t):
            out.update(records(t, path + (f.metadata.get("key", f.name),)))
    return out


def keys(cls: type, optional: bool = True) -> set[str]:
    """The JSON keys of a record (without ``optional``: only those it always writes)."""
    return {
        f.metadata.get("key", f.name)
        for f in fields(cls)
        if not f.metadata.get("internal") and (optional or not f.metadata.get("optional"))
    }


def test_every_record_is_documented_with_exactly_its_keys():
    doc, bad_tensor = documented(report.__doc__)
    found = records(stages.Report)
    listed = {p: cls for p, cls in found.items() if doc.get(p) is not None}
    # where a record stands the text lists its keys, all but optional ones it never writes there
    for p, cls in listed.items():
        assert keys(cls, optional=False) <= doc[p] <= keys(cls), p
    # each record's every key is listed where it stands, or (optional) in at least one place
    for cls in set(listed.values()):
        assert set().union(*(doc[p] for p, c in listed.items() if c is cls)) == keys(cls), cls
    assert bad_tensor == keys(stages.BadTensor)
    # a record that the text lists only as "same as" another is listed in full somewhere
    assert set(found.values()) - {stages.BadTensor} == set(listed.values())
    # and the text lists no object that is not there (a mapping of the code's: checked below)
    mappings = {("files",), ("history", "resumes"), ("fp8", "layers", "formats")}
    assert {p for p in doc if doc[p] is not None} - set(found) == mappings
    assert doc[("files",)] == keys(FileNote)  # the files are FileNote.as_dict()


def test_the_parser_sees_a_drift():
    """The checks above can fail: an undocumented or a stale key changes what they compare."""
    text = report.__doc__
    doc, _ = documented(text.replace('"max_scaled_replay",', ""))
    assert not keys(stages.Gradients, optional=False) <= doc[("replay", "gradients")]
    doc, _ = documented(text.replace('"elapsed_s"', '"elapsed_s", "started_at"'))
    assert "started_at" in doc[("replay",)] and not doc[("replay",)] <= keys(stages.Replay)
    assert documented(text)[0][("state", "master")] is None  # {... same ...}


def _key_paths(value, path: Keys = ()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, k
            yield from _key_paths(v, path + (k,))
    elif isinstance(value, list):
        for v in value:
            yield from _key_paths(v, path)


CASES = ["ampctl-fp8-saturated", "ampctl-forward-overflow", "own-recovered", "ampctl-lr"]
DEEPSPEED = Path(__file__).parent / "data" / "deepspeed" / "zero2-bf16-nan"


@pytest.mark.parametrize("case", [*CASES, "deepspeed"])
def test_every_key_of_a_real_report_is_documented(corpus, case):
    """Real runs of the corpus (fp8 layers, a forward overflow, a run folder without
    checkpoints, a diverged run) and a DeepSpeed folder (the files read)."""
    if "fp8" in case:
        pytest.importorskip("torchao")
    if case == "deepspeed":
        code, rep, err = diagnose_cli(DEEPSPEED, "--no-probe")
    else:
        code, rep, err = corpus.diagnose(corpus.run(case))
    assert code in (0, 1), err
    doc, bad_tensor = documented(report.__doc__)
    open_ = {p for p, listed in doc.items() if listed is None}
    missing = {
        (path, k)
        for path, k in _key_paths(rep)
        if path not in open_ and k not in (bad_tensor if path[-1:] == ("bad",) else doc[path])
    }
    assert missing == set()


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
