"""A run folder is data, round 3 (issue 37): it may not make ampctl write outside itself.

Each attack plants a symlink where ampctl writes (``.plot.png.tmp``, ``.config.yaml.tmp``,
``checkpoints/.step_00000004.pt.tmp``, ``metrics.jsonl``, ``checkpoints/``, a DeepSpeed
``global_stepN/``), runs the real command in-process, and asserts that the victim file outside
the run is byte for byte unchanged, the exit code and the one line. The writer itself
(:mod:`ampctl.files`) is tested under planted faults (a FIFO, a short write, a failing write).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampctl import files
from ampctl.cli import app
from ampctl.files import WriteRefused
from ampctl.runlog import RunLayout, RunWriter
from ampctl.train.checkpoint import load_checkpoint
from ampctl.trust_paths import FolderRefused
from tests.conftest import FAST

runner = CliRunner()
VICTIM = b"precious bytes outside the run\n"
DATA = Path(__file__).resolve().parents[1] / "commands" / "diagnose" / "data"


@pytest.fixture
def run(base_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "r"
    shutil.copytree(base_run, dest, symlinks=True)
    return dest


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim.txt"
    v.write_bytes(VICTIM)
    return v


def one_line(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in r.output, r.output
    return err[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def temp_files(folder: Path, planted: set[str]) -> list[str]:
    return [str(p) for p in folder.rglob("*.tmp") if str(p.relative_to(folder)) not in planted]


# ---------------------------------------------------------------------------- the writer
def test_write_text_replaces_a_link_at_the_target_and_never_writes_through_it(tmp_path, victim):
    target = tmp_path / "config.yaml"
    os.symlink(victim, target)
    files.write_text(target, "a: 1\n")
    assert victim.read_bytes() == VICTIM
    assert not target.is_symlink() and target.read_text() == "a: 1\n"
    assert list(tmp_path.glob(".*.tmp")) == []


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("old")
    with pytest.raises(OSError), files.write_file(target) as f:
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "summary.json"
    ]


def test_append_refuses_a_symlink_and_a_fifo_without_blocking(tmp_path, victim):
    link = tmp_path / "metrics.jsonl"
    os.symlink(victim, link)
    with pytest.raises(WriteRefused, match="is a symlink: ampctl does not append through a link"):
        files.append_line(link, '{"step": 1}')
    dangling = tmp_path / "events.jsonl"
    os.symlink(tmp_path / "made-by-the-link.txt", dangling)
    with pytest.raises(WriteRefused, match="is a symlink"):
        RunWriter(tmp_path).event({"kind": "x"})
    assert not (tmp_path / "made-by-the-link.txt").exists()
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(WriteRefused, match="is not a regular file"):
        files.append_line(fifo, "{}")  # O_NONBLOCK: refused, not a hang
    with pytest.raises(WriteRefused, match="is not a regular file"):
        files.touch(fifo)
    assert victim.read_bytes() == VICTIM


def test_a_short_append_is_cut_back_so_no_half_line_stays(tmp_path, monkeypatch):
    log = tmp_path / "metrics.jsonl"
    files.append_line(log, '{"step": 1}')
    real = os.write
    calls = []

    def disk_fills(fd, data):  # a disk that takes 5 bytes, then is full
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data[:5])

    monkeypatch.setattr(files.os, "write", disk_fills)
    with pytest.raises(OSError, match="No space left on device") as err:
        files.append_line(log, '{"step": 2, "loss": 1.5}')
    monkeypatch.undo()
    assert err.value.filename == str(log) and len(calls) == 2  # the short write was continued
    assert log.read_bytes() == b'{"step": 1}\n'


def test_write_new_overwrites_nothing(tmp_path, victim):
    files.write_new(tmp_path / "a.json", "{}")
    with pytest.raises(WriteRefused, match="exists already: nothing is overwritten"):
        files.write_new(tmp_path / "a.json", "[]")
    os.symlink(victim, tmp_path / "b.json")
    with pytest.raises(WriteRefused):
        files.write_new(tmp_path / "b.json", "[]")
    assert (tmp_path / "a.json").read_text() == "{}" and victim.read_bytes() == VICTIM


# ---------------------------------------------------------------------------- plot
def test_plot_writes_nothing_through_planted_links(run, victim):
    pytest.importorskip("matplotlib")
    os.symlink(victim, run / ".plot.png.tmp")
    os.symlink(victim, run / "plot.png")
    r = runner.invoke(app, ["plot", str(run)])
    assert r.exit_code == 0, r.output
    assert victim.read_bytes() == VICTIM
    png = run / "plot.png"
    assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.readlink(run / ".plot.png.tmp") == str(victim)  # left as it was, never opened
    assert temp_files(run, {".plot.png.tmp"}) == []


# ---------------------------------------------------------------------------- train --resume
def test_resume_writes_nothing_through_planted_temp_links(run, victim):
    planted = {
        ".config.yaml.tmp",
        ".summary.json.tmp",
        "checkpoints/.step_00000004.pt.tmp",
        "checkpoints/.step_00000008.pt.tmp",
    }
    for name in planted:
        os.symlink(victim, run / name)
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    assert r.exit_code == 0, r.output
    assert victim.read_bytes() == VICTIM
    assert load_checkpoint(run)["step"] == 8
    assert not (run / "config.yaml").is_symlink()
    assert temp_files(run, planted) == []


@pytest.mark.parametrize("log", ["metrics.jsonl", "events.jsonl"])
def test_resume_refuses_a_symlinked_log_and_trains_nothing(run, victim, log):
    (run / log).unlink()
    os.symlink(victim, run / log)
    before = snapshot(run)
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    line = one_line(r)
    assert line == (
        f"ampctl: error: '{run / log}' is a symlink: ampctl does not append through a link (a "
        "run folder is data and may not make ampctl write outside it); remove the link"
    )
    assert victim.read_bytes() == VICTIM
    assert snapshot(run) == before  # nothing ran: no checkpoint 8, no row, no summary


def test_a_checkpoints_folder_linked_out_of_the_run_is_refused_for_writing_and_reading(
    run, tmp_path, victim
):
    outside = tmp_path / "outside"
    shutil.move(run / "checkpoints", outside)
    os.symlink(outside, run / "checkpoints")
    os.symlink(victim, outside / ".step_00000008.pt.tmp")
    before = snapshot(outside)
    want = (
        f"the checkpoints folder '{run / 'checkpoints'}' is a symlink to '{outside}', outside "
        f"the run folder '{run}': not used (a run folder is data and its links may not reach "
        "out of it)"
    )
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    assert one_line(r) == f"ampctl: error: {want}"
    r = runner.invoke(app, ["diagnose", str(run), "--device", "cpu", "-b", "1"])
    assert one_line(r) == f"ampctl: error: {want}"
    with pytest.raises(FolderRefused):  # a checkpoint file named through the link, too
        load_checkpoint(run / "checkpoints" / "step_00000004.pt")
    with pytest.raises(FolderRefused):  # and the folder itself
        load_checkpoint(run / "checkpoints")
    assert snapshot(outside) == before and victim.read_bytes() == VICTIM


def test_a_deepspeed_tag_folder_linked_out_of_the_checkpoint_is_refused(tmp_path):
    src = DATA / "deepspeed" / "zero0-fp32"
    outside = tmp_path / "outside"
    shutil.copytree(src / "global_step3", outside / "global_step3")
    ds = tmp_path / "ds"
    ds.mkdir()
    os.symlink(outside / "global_step3", ds / "global_step3")
    (ds / "latest").write_text("global_step3")
    r = runner.invoke(app, ["diagnose", str(ds), "--device", "cpu", "-b", "1"])
    assert one_line(r) == (
        f"ampctl: error: the DeepSpeed tag folder '{ds / 'global_step3'}' is a symlink to "
        f"'{outside / 'global_step3'}', outside the run folder '{ds}': not used (a run folder "
        "is data and its links may not reach out of it)"
    )
    shutil.rmtree(ds)
    shutil.copytree(src, ds)  # the same checkpoint without the link is read
    assert runner.invoke(app, ["diagnose", str(ds), "--device", "cpu", "-b", "1"]).exit_code in (
        0,
        1,
    )


# ---------------------------------------------------------------------------- names, --out
def test_a_run_name_with_a_newline_is_refused_and_no_folder_is_made(tmp_path):
    runs = tmp_path / "runs"
    r = runner.invoke(app, ["train", *FAST, f"trainer.runs_dir={runs}", "--name", "evil\n", "-q"])
    assert one_line(r) == (
        "ampctl: error: --name 'evil\\n': use letters, digits and . _ - = , + (no slashes or "
        "spaces)"
    )
    assert not runs.exists() or list(runs.iterdir()) == []


@pytest.mark.parametrize("kind", ["file", "link"])
def test_tokenizer_train_overwrites_no_tokenizer_config(tmp_path, victim, kind):
    out = tmp_path / "tok"
    out.mkdir()
    cfg = out / "tokenizer_config.json"
    if kind == "file":
        cfg.write_bytes(VICTIM)
    else:
        os.symlink(tmp_path / "made-through-the-link.json", cfg)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 20)
    r = runner.invoke(app, ["tokenizer", "train", str(corpus), "--out", str(out)])
    assert one_line(r) == (
        f"ampctl: error: --out '{out}' already holds a tokenizer_config.json: choose another "
        "folder (nothing is overwritten)"
    )
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer_config.json"]
    assert (cfg.read_bytes() == VICTIM) if kind == "file" else not cfg.exists()


# ---------------------------------------------------------------------------- notes
def test_a_python_yaml_tag_in_config_yaml_is_said_when_the_checkpoints_config_is_used(
    run, tmp_path
):
    marker = tmp_path / "MARKER"
    (run / "config.yaml").write_text(f'x: !!python/object/apply:os.system ["touch {marker}"]\n')
    r = runner.invoke(app, ["diagnose", str(run), "--json", "--device", "cpu", "-b", "1"])
    assert r.exit_code in (0, 1), r.output
    import json

    notes = json.loads(r.stdout)["notes"]
    assert any(
        n.startswith("the run folder's config.yaml is not read (") and "YAML tag" in n
        for n in notes
    ), notes
    assert not marker.exists()


def test_dcp_values_not_read_are_in_the_json_notes(tmp_path):
    from tests.commands.diagnose import makers
    from tests.commands.diagnose.conftest import diagnose_cli

    code, rep, _ = diagnose_cli(makers.make_dcp(tmp_path / "dcp"))
    assert code == 0
    assert any("non-tensor value(s) not read" in n and "step" in n for n in rep["notes"])


def test_the_checkpoint_written_is_a_real_one(run):
    ck = torch.load(run / "checkpoints" / "step_00000004.pt", weights_only=True)
    assert ck["step"] == 4 and RunLayout(run).latest_checkpoint().name == "step_00000004.pt"


@pytest.mark.parametrize("name", ["tensorboard", "branches", "mlruns.db"])
def test_resume_refuses_a_folder_or_store_the_trackers_write_linked_out_of_the_run(
    run, tmp_path, victim, name
):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(victim if name.endswith(".db") else outside, run / name)
    before = snapshot(run)
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    line = one_line(r)
    assert f"'{run / name}' is a symlink" in line, line
    assert snapshot(run) == before and list(outside.iterdir()) == []
    assert victim.read_bytes() == VICTIM


def test_the_library_written_names_are_the_sinks_own():
    from ampctl.runlog.writers import LIBRARY_FILES, LIBRARY_FOLDERS
    from ampctl.ui import mlflow_sink

    assert mlflow_sink.LOCAL_STORE in LIBRARY_FILES
    assert {mlflow_sink.LOCAL_ARTIFACTS, RunLayout.TENSORBOARD, "wandb"} == set(LIBRARY_FOLDERS)
