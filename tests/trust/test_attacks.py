"""A checkpoint is data, round 2 (issue 24): every attack file is built here with the real
library (``torch.distributed.checkpoint.save``, ``torch.save``, hand-written protocol-4 pickles,
sparse files through ``os.truncate``) and ``ampctl diagnose`` / ``ampctl train --resume`` run on
them through the CLI in one subprocess under a 4 GiB address-space limit. Each test asserts that no payload ran (no
marker file), the exit code, exactly one stderr line where the input is refused, its text, and a
bounded peak memory."""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import FAST

ROOT = Path(__file__).resolve().parents[2]
AS_LIMIT = 4 << 30
RSS_BOUND_MB = 1500  # every case below stays near 300-400 MB

# One subprocess, under RLIMIT_AS = 4 GiB, runs every case through the CLI in-process (a
# process per case would cost seconds of imports each): exit code, output, whether the marker
# appeared, what it opened or listed below the case's watched path (an audit hook), peak RSS.
BATCH = r"""
import json, os, resource, sys
spec, out = sys.argv[1], sys.argv[2]
touched, watch = [], [None]
def hook(event, args):
    if watch[0] and event in ("open", "os.scandir", "os.listdir") and args:
        p = args[0]
        if isinstance(p, (str, os.PathLike)) and os.fspath(p).startswith(watch[0]):
            touched.append(f"{event} {os.fspath(p)}")
sys.addaudithook(hook)
from typer.testing import CliRunner
from ampctl.cli import app
results = {}
for name, case in json.load(open(spec)).items():
    touched.clear()
    watch[0] = case["watch"]
    r = CliRunner().invoke(app, case["args"])
    watch[0] = None
    exc = r.exception if r.exception is not None and not isinstance(r.exception, SystemExit) else None
    results[name] = {
        "code": r.exit_code,
        "stdout": r.stdout,
        "stderr": [line for line in r.stderr.splitlines() if line.strip()],
        "exception": repr(exc) if exc is not None else None,
        "marker": bool(case["marker"]) and os.path.exists(case["marker"]),
        "touched": list(touched),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }
json.dump(results, open(out, "w"))
"""


@dataclass
class Case:
    args: list[str]
    watch: str | None = None
    marker: str | None = None


@dataclass
class Run:
    code: int
    stdout: str
    stderr: list[str]
    exception: str | None
    marker: bool
    touched: list[str]
    rss_mb: int


BUILDERS: dict[str, Any] = {}


def case(name: str):
    """Register ``build(folder, run_dir) -> Case`` as the case ``name``."""

    def register(build):
        BUILDERS[name] = build
        return build

    return register


def diagnose(path: Path, *extra: str, watch: Path | None = None, marker: Path | None = None):
    args = ["diagnose", str(path), "--device", "cpu", "-b", "1", *extra]
    return Case(args, str(watch) if watch else None, str(marker) if marker else None)


def refused(run: Run, code: int = 2) -> str:
    """The one stderr line of a refused input (no traceback, no payload, bounded memory)."""
    assert run.code == code and run.exception is None, (run.code, run.exception, run.stderr)
    assert len(run.stderr) == 1, run.stderr
    assert not run.marker and run.rss_mb < RSS_BOUND_MB, (run.marker, run.rss_mb)
    return run.stderr[0]


def report(run: Run, code: int) -> dict:
    assert run.code == code and run.exception is None, (run.code, run.exception, run.stderr)
    assert run.stderr == [], run.stderr
    assert not run.marker and run.rss_mb < RSS_BOUND_MB, (run.marker, run.rss_mb)
    return json.loads(run.stdout)


class Touch:
    """Pickles as a call of ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------------------- fixtures
def train_run(root: Path) -> Path:
    """A real ampctl run folder (3 steps of the tiny BERT, one checkpoint)."""
    from ampctl.config import load_config
    from ampctl.runlog import new_run_dir
    from ampctl.train.trainer import train

    torch.set_num_threads(1)
    cfg = load_config(
        [
            *FAST,
            f"trainer.runs_dir={root}",
            "trainer.max_steps=3",
            "trainer.ckpt_every=3",
            "data.vocab_size=260",  # room for byte-level text (data=text, --data)
        ]
    )
    return train(cfg, new_run_dir(cfg.trainer.runs_dir, "r")).run_dir


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Run]:
    """Every case built, then run in one subprocess under the 4 GiB address-space limit."""
    return run_cases(tmp_path_factory.mktemp("attacks"))


def run_cases(root: Path) -> dict[str, Run]:
    """Every case built under ``root``, then run in one subprocess under the 4 GiB
    address-space limit (also ``python -m tests.trust.table``)."""
    run_dir = train_run(root / "runs")
    cases = {}
    for name, build in BUILDERS.items():
        (root / name).mkdir()
        cases[name] = build(root / name, run_dir).__dict__
    spec, out = root / "cases.json", root / "results.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [sys.executable, "-c", BATCH, str(spec), str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=float(os.environ.get("AMPCTL_ATTACK_TIMEOUT", "600")),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: Run(**r) for name, r in json.loads(out.read_text()).items()}


def edited_run(run_dir: Path, dest: Path, edit) -> Path:
    """A copy of the run folder whose checkpoint's contents were changed by ``edit``."""
    shutil.copytree(run_dir, dest)
    ckpt = next((dest / "checkpoints").glob("step_*.pt"))
    ck = torch.load(ckpt, weights_only=True)
    edit(ck)
    torch.save(ck, ckpt)
    return dest


def hf_checkpoint(root: Path) -> Path:
    """An HF Trainer ``checkpoint-3`` folder: weights and a trainer_state.json."""
    d = root / "out" / "checkpoint-3"
    d.mkdir(parents=True)
    torch.save(torch.nn.Linear(4, 4).state_dict(), d / "pytorch_model.bin")
    rows = [{"step": s, "loss": 1.0, "grad_norm": 1.0} for s in (1, 2, 3)]
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": rows}))
    return d


def dcp_folder(path: Path, state: dict) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _short_unicode(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b


def dotted_call(command: str) -> bytes:
    """Protocol-4 opcodes calling ``torch.distributed.checkpoint.metadata`` + ``os.system``
    (a STACK_GLOBAL with a dotted name: plain pickle walks from the module to os.system)."""
    return (
        _short_unicode("torch.distributed.checkpoint.metadata")
        + _short_unicode("os.system")
        + b"\x93"  # STACK_GLOBAL
        + _short_unicode(command)
        + b"\x85R"  # TUPLE1, REDUCE
    )


# ---------------------------------------------------------------------------- DCP
@case("dcp-non-tensor")
def _(d, run_dir):
    marker = d / "MARKER"
    state = {"model": {"w": torch.randn(4, 4)}, "train_state": {"step": 3, "x": Touch(marker)}}
    return diagnose(dcp_folder(d / "step-3", state), "--json", marker=marker)


def test_dcp_non_tensor_values_are_listed_not_unpickled(results):
    rep = report(results["dcp-non-tensor"], 0)
    assert rep["checkpoint"]["step"] == 3  # from the folder's name
    note = next(f for f in rep["files"] if "non-tensor" in f["file"])
    assert note["read"] is False and "train_state.step, train_state.x" in note["why"]
    assert "--trust-code" in note["why"]
    assert rep["state"]["weights"]["tensors"] == 1


@case("dcp-benign")
def _(d, run_dir):
    return diagnose(
        dcp_folder(d / "ckpt", {"model": {"w": torch.ones(2)}, "train_state": {"step": 7}}),
        "--json",
    )


@case("dcp-benign-trusted")
def _(d, run_dir):
    ckpt = dcp_folder(d / "ckpt", {"model": {"w": torch.ones(2)}, "train_state": {"step": 7}})
    return diagnose(ckpt, "--json", "--trust-code")


def test_dcp_non_tensor_values_are_read_with_trust_code(results):
    assert report(results["dcp-benign"], 0)["checkpoint"]["step"] is None
    rep = report(results["dcp-benign-trusted"], 0)
    assert rep["checkpoint"]["step"] == 7
    assert not any("non-tensor" in f["file"] for f in rep["files"])


def _dotted_metadata(d: Path, stealth: bool) -> Case:
    marker = d / "MARKER"
    ckpt = dcp_folder(d / "step-3", {"model": {"w": torch.randn(4, 4)}})
    call = dotted_call(f"touch {marker}")
    if stealth:  # call it, drop the result, then build the real metadata: a normal report
        with open(ckpt / ".metadata", "rb") as f:
            real = pickle.dumps(pickle.load(f), protocol=2)
        payload = b"\x80\x04" + call + b"0" + real[2:]
    else:
        payload = b"\x80\x04" + call + b"."
    (ckpt / ".metadata").write_bytes(payload)
    return diagnose(ckpt, marker=marker)


case("dcp-dotted")(lambda d, _r: _dotted_metadata(d, False))
case("dcp-dotted-stealth")(lambda d, _r: _dotted_metadata(d, True))


@pytest.mark.parametrize("name", ["dcp-dotted", "dcp-dotted-stealth"])
def test_dcp_metadata_cannot_reach_os_system_through_a_dotted_name(results, name):
    line = refused(results[name])
    assert line.startswith("ampctl: error: '") and line.endswith(
        "/step-3/.metadata' was refused: it names "
        "torch.distributed.checkpoint.metadata.os.system, which is not one of DCP's metadata "
        "classes; code could run on load, and diagnose reads it with an allow-list unpickler only"
    )


@case("dcp-outside")
def _(d, run_dir):
    secret = d / "secret.distcp"
    secret.write_bytes(b"x" * 4096)
    ckpt = dcp_folder(d / "step-3", {"model": {"w": torch.randn(4, 4)}})
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    for info in md.storage_data.values():
        info.relative_path = "../secret.distcp"
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return diagnose(ckpt, watch=secret)


def test_dcp_records_may_not_point_out_of_the_folder(results):
    line = refused(results["dcp-outside"])
    assert "names the file '../secret.distcp', which is not a file of this checkpoint" in line
    assert results["dcp-outside"].touched == []


@case("dcp-huge")
def _(d, run_dir):
    ckpt = dcp_folder(d / "step-3", {"model": {"w": torch.randn(4, 4)}})
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    (entry,) = md.state_dict_metadata.values()
    entry.size = torch.Size([1 << 20, 1 << 20])  # 4 TiB of fp32
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return diagnose(ckpt)


def test_dcp_tensor_sizes_are_checked_before_allocating(results):
    line = refused(results["dcp-huge"])
    assert "(4.0 TiB of tensors) needs about 4.0 TiB of memory" in line  # one tensor at a time
    assert "nothing was allocated" in line


@case("dcp-damaged")
def _(d, run_dir):
    ckpt = dcp_folder(d / "step-3", {"model": {"w": torch.randn(4, 4)}})
    for f in ckpt.glob("*.distcp"):
        f.write_bytes(b"x" * f.stat().st_size)  # right sizes, no torch.save data
    return diagnose(ckpt)


def test_a_damaged_dcp_chunk_is_one_line(results):
    assert refused(results["dcp-damaged"]).endswith(
        "/step-3' is not a readable DCP checkpoint: a tensor record is not data "
        "torch.load(weights_only=True) accepts (damaged?)"
    )


# ---------------------------------------------------------------------------- sizes
@case("ds-latest")
def _(d, run_dir):
    ds = d / "ds"
    shutil.copytree(
        ROOT / "tests" / "commands" / "diagnose" / "data" / "deepspeed" / "zero0-fp32", ds
    )
    (ds / "latest").write_text("global_step3")
    os.truncate(ds / "latest", 8 << 30)  # sparse: free on disk
    return diagnose(ds)


def test_deepspeed_latest_over_the_cap_is_not_read(results):
    assert refused(results["ds-latest"]).endswith(
        "/ds/latest': is 8.0 GiB, over the 64.0 MiB limit for a file read whole: not read"
    )


@case("hf-state-1g")
def _(d, run_dir):
    ckpt = hf_checkpoint(d)
    os.truncate(ckpt / "trainer_state.json", 1 << 30)
    return diagnose(ckpt, "--json")


def test_huge_trainer_state_is_named_in_the_report_not_read(results):
    """1 GiB of NUL bytes after the document: named from its first bytes (never read whole,
    never refused for its size), a note that leaves the healthy checkpoint healthy (exit 0)."""
    rep = report(results["hf-state-1g"], 0)
    (p,) = [p for p in rep["problems"] if p["kind"] == "unreadable_history"]
    assert p["message"] == "history: trainer_state.json unreadable: holds binary data, not text"
    assert p["severity"] == "note" and rep["healthy"] and rep["verdict"]["status"] == "healthy"
    assert rep["history"] is None


@case("shared-40")
def _(d, run_dir):
    node = {"w": torch.zeros(2)}
    for _ in range(40):  # 2**40 paths to the one tensor
        node = {"a": node, "b": node}
    torch.save(node, d / "shared.pt")
    assert (d / "shared.pt").stat().st_size < 4096
    return diagnose(d / "shared.pt", "--json")


def test_shared_references_are_walked_once(results):
    assert report(results["shared-40"], 0)["state"]["weights"]["tensors"] == 1


@case("config-shared")
def _(d, run_dir):
    def share(ck):
        node = {"x": 1}
        for _ in range(40):
            node = {"a": node, "b": node}
        ck["config"]["trainer"]["extra"] = node

    return diagnose(edited_run(run_dir, d / "r", share))


def test_a_config_sharing_containers_is_refused(results):
    assert "one container appears at two places (shared references or YAML aliases)" in (
        refused(results["config-shared"])
    )


def _wide(ck):
    ck["config"]["model"].update(hidden_size=24576)


case("hidden")(lambda d, run_dir: diagnose(edited_run(run_dir, d / "r", _wide), "--json"))
case("hidden-resume")(
    lambda d, run_dir: Case(["train", "--resume", str(edited_run(run_dir, d / "r", _wide))])
)


def test_config_dimensions_are_checked_against_the_tensors(results):
    rep = report(results["hidden"], 0)
    reason = rep["replay"]["reason"]
    assert rep["replay"]["ran"] is False
    assert reason.endswith(
        "/step_00000003.pt: does not fit the configured model: the config builds "
        "bert.embeddings.word_embeddings.weight as [260, 24576], the checkpoint holds [260, 32] "
        "(40 tensors differ); nothing was allocated"
    )
    line = refused(results["hidden-resume"])
    assert "does not fit the configured model: the config builds" in line
    assert "nothing was allocated" in line


def _safetensors(d: Path, valid: bool) -> Path:
    n = 512 << 20  # 2 GiB of F32
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    header += " " * (-len(header) % 8)
    p = d / "w.safetensors"
    p.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0" * 64)
    if valid:
        os.truncate(p, 8 + len(header) + 4 * n)  # a valid, sparse 2 GiB file
    return p


case("st-short")(lambda d, _r: diagnose(_safetensors(d, False)))
case("st-valid")(lambda d, _r: diagnose(_safetensors(d, True)))
case("st-valid-1g")(lambda d, _r: diagnose(_safetensors(d, True), "--max-memory", "1G"))
case("max-memory-bad")(lambda d, _r: diagnose(d, "--max-memory", "lots"))


def test_safetensors_header_larger_than_the_file(results):
    assert refused(results["st-short"]).endswith(
        "/w.safetensors': tensor 'w' declares 2.0 GiB of data, but the file holds 64 B after "
        "its header (a tensor header larger than the file): not read"
    )
    assert refused(results["st-valid-1g"]).endswith(
        "/w.safetensors' (2.0 GiB of tensors) needs about 2.1 GiB of memory, more than the 1.0 "
        "GiB allowed (--max-memory): nothing was allocated; if the machine has the memory, pass "
        "--max-memory SIZE (e.g. --max-memory 64G)"
    )
    # without --max-memory the limit is what the 4 GiB address space leaves
    assert "address-space limit (RLIMIT_AS) leaves" in refused(results["st-valid"])
    assert refused(results["max-memory-bad"]) == (
        "ampctl: error: --max-memory 'lots' is not a size: give e.g. 8G, 512M or 1.5GiB"
    )


# ---------------------------------------------------------------------------- paths
def _point_data(run_dir: Path, d: Path, target: Path) -> Path:
    def edit(ck):
        ck["config"]["data"].update(kind="text", path=str(target))

    return edited_run(run_dir, d / "r", edit)


@case("data-file")
def _(d, run_dir):
    (d / "elsewhere" / "sub").mkdir(parents=True)
    (d / "elsewhere" / "sub" / "a.txt").write_text("private text " * 50)
    run = _point_data(run_dir, d, d / "elsewhere" / "sub" / "a.txt")
    return diagnose(run, "--json", watch=d / "elsewhere")


@case("data-folder")
def _(d, run_dir):
    (d / "elsewhere" / "sub").mkdir(parents=True)
    (d / "elsewhere" / "sub" / "a.txt").write_text("private text " * 50)
    return diagnose(_point_data(run_dir, d, d / "elsewhere"), "--json", watch=d / "elsewhere")


@pytest.mark.parametrize(("name", "target"), [("data-file", "sub/a.txt"), ("data-folder", "")])
def test_replay_opens_no_data_path_the_config_names(results, name, target):
    res = results[name]
    rep = report(res, 0)
    assert res.touched == []  # never opened, never listed
    assert rep["replay"]["ran"] is True
    data = rep["replay"]["data"]
    assert data.startswith("synthetic batches of the run's shape (4 x 16 tokens, ids below 260)")
    assert f"/{name}/elsewhere{'/' + target if target else ''}'" in data
    assert "no path it names is opened; pass --data PATH to replay your own text" in data


@case("data-given")
def _(d, run_dir):
    own = d / "own.txt"
    own.write_text("my own text " * 100)
    run = _point_data(run_dir, d, Path("/nonexistent/corpus"))
    return diagnose(run, "--json", "--data", str(own), watch=own)


def test_replay_reads_data_the_user_names(results):
    res = results["data-given"]
    rep = report(res, 0)
    assert rep["replay"]["ran"] is True
    assert rep["replay"]["data"].endswith("/data-given/own.txt (--data) in the run's batch shape")
    assert any(t.startswith("open ") and t.endswith("own.txt") for t in res.touched)


@case("state-symlink")
def _(d, run_dir):
    secret = d / "secret.json"
    secret.write_text(json.dumps({"global_step": 99, "log_history": []}))
    ckpt = hf_checkpoint(d)
    (ckpt / "trainer_state.json").unlink()
    (ckpt / "trainer_state.json").symlink_to(secret)
    return diagnose(ckpt, "--json", watch=secret)


def test_history_symlink_out_of_the_folder_is_not_followed(results):
    res = results["state-symlink"]
    rep = report(res, 0)  # named (a note), not judged: the checkpoint itself is healthy
    assert res.touched == []
    assert rep["checkpoint"]["step"] == 3  # not the 99 of the file it points to
    (p,) = [p for p in rep["problems"] if p["kind"] == "unreadable_history"]
    assert p["message"].startswith("history: trainer_state.json unreadable: is a symlink to '")
    assert p["message"].endswith(
        "/state-symlink/secret.json', outside its folder: not opened (a checkpoint is data and "
        "its links may not reach out of it)"
    )


# ---------------------------------------------------------------------------- parse errors
@case("yaml-tag")
def _(d, run_dir):
    marker = d / "MARKER"
    run = d / "r"
    shutil.copytree(run_dir, run)
    shutil.rmtree(run / "checkpoints")
    (run / "config.yaml").write_text(
        f"precision: !!python/object/apply:os.system ['touch {marker}']\n"
    )
    return diagnose(run, marker=marker)


def test_yaml_tags_in_a_run_config_are_one_line(results):
    assert refused(results["yaml-tag"]).endswith(
        "/yaml-tag/r/config.yaml': uses the YAML tag !!python/object/apply:os.system, which is "
        "not allowed (a run's config is data: plain YAML only, no tags that build Python objects)"
    )


DEEP = '{"log_history": ' + "[" * 100_000 + "]" * 100_000 + "}"
STATES = {
    "deep-json": (DEEP.encode(), "nested too deeply to read: 1 log_history entry skipped"),
    "pickle-bytes": (
        pickle.dumps({"global_step": 3}),
        "holds pickle bytes (a pickled Python object), not text",
    ),
}


def _state_case(d: Path, content: bytes, text: bool) -> Case:
    ckpt = hf_checkpoint(d)
    (ckpt / "trainer_state.json").write_bytes(content)
    return diagnose(ckpt) if text else diagnose(ckpt, "--json")


for _name, (_content, _) in STATES.items():
    case(f"state-{_name}")(lambda d, _r, c=_content: _state_case(d, c, False))
    case(f"state-{_name}-text")(lambda d, _r, c=_content: _state_case(d, c, True))


@pytest.mark.parametrize("name", list(STATES))
def test_unreadable_trainer_state_is_a_finding(results, name):
    why = STATES[name][1]
    rep = report(results[f"state-{name}"], 0)
    (p,) = [p for p in rep["problems"] if p["kind"] == "unreadable_history"]
    assert p["message"].startswith(f"history: trainer_state.json unreadable: {why}")
    # named in the report, never by itself a problem of the run: the checkpoint is healthy
    assert p["severity"] == "note" and rep["healthy"] and rep["verdict"]["status"] == "healthy"
    text = results[f"state-{name}-text"]
    assert text.code == 0 and text.stderr == []
    assert f"2. History: trainer_state.json unreadable: {why}" in text.stdout


@case("metrics-deep")
def _(d, run_dir):
    run = d / "r"
    shutil.copytree(run_dir, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return diagnose(run, "--json")


def test_deep_metrics_line_is_skipped_and_named(results):
    rep = report(results["metrics-deep"], 0)
    assert any("metrics.jsonl: skipped 1 unreadable line(s)" in n for n in rep["history"]["notes"])


@case("metrics-symlink")
def _(d, run_dir):
    run = d / "r"
    shutil.copytree(run_dir, run)
    secret = d / "secret.jsonl"
    secret.write_text('{"step": 1, "loss": 0.5}\n')
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(secret)
    return diagnose(run, "--json", watch=secret)


def test_a_run_history_file_that_cannot_be_read_is_a_finding(results):
    res = results["metrics-symlink"]
    rep = report(res, 0)  # named (a note), not judged
    assert res.touched == [] and rep["history"]["metrics_rows"] == 0
    (p,) = [p for p in rep["problems"] if p["kind"] == "unreadable_history"]
    assert p["message"].startswith("history: metrics.jsonl unreadable: is a symlink to '")
    assert rep["history"]["notes"] == []  # named once, as the finding


@case("raw-pickle")
def _(d, run_dir):
    (d / "payload.pkl").write_bytes(pickle.dumps(Touch(d / "MARKER"), protocol=4))
    return diagnose(d / "payload.pkl", marker=d / "MARKER")


@case("text")
def _(d, run_dir):
    (d / "notes.txt").write_text("experiment notes: lr 3e-4 diverged at step 1200\n")
    return diagnose(d / "notes.txt")


def test_raw_pickle_and_text_are_named_for_what_they_are(results):
    assert (
        f"/payload.pkl' was refused: it is a raw pickle, not a file torch.save wrote, and names "
        f"{os.system.__module__}.system; code could run on load"
    ) in refused(results["raw-pickle"])
    assert refused(results["text"]).endswith(
        "/notes.txt' holds text ('experiment notes: lr 3e-4 diverged at st'), not a checkpoint: "
        "diagnose reads files that torch.save or safetensors wrote, and checkpoint folders"
    )
