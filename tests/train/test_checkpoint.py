"""Checkpoint files (ampctl.train.checkpoint): atomic writes under planted failures, weights_only
loads, clear refusals; and the CUDA RNG state in a checkpoint, with torch.cuda's calls planted
(issue #31: mutants that a CPU-only run left alive).
"""

from __future__ import annotations

import datetime
import errno
import io
import pickle
import random
import re
from pathlib import Path

import pytest
import torch

from ampctl import files
from ampctl.runlog import RunLayout
from ampctl.train import checkpoint as ck
from ampctl.train.checkpoint import (
    FORMAT,
    CheckpointError,
    CheckpointWriteError,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((4,), v)}, "note": "x"}


def _names(run: RunLayout) -> list[str]:
    return sorted(p.name for p in run.checkpoints_dir.iterdir())


def test_save_then_load_round_trip_in_a_new_run_folder(tmp_path):
    run = RunLayout(tmp_path / "runs" / "r")  # neither folder exists yet
    path = save_checkpoint(run, 7, _state(1.5))
    assert path == run.checkpoint(7)
    assert _names(run) == ["step_00000007.pt"]  # the temp file is gone
    obj = load_checkpoint(path)
    assert obj["format"] == FORMAT == "ampctl-checkpoint/1"
    assert obj["step"] == 7 and obj["note"] == "x"
    assert torch.equal(obj["model"]["w"], torch.full((4,), 1.5))
    assert obj["path"] == str(path)
    assert load_checkpoint(run.root)["step"] == 7  # a run folder: its latest checkpoint


def test_keep_last_prunes_the_oldest(tmp_path):
    run = RunLayout(tmp_path / "r")
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(run, step, _state(step))
    assert _names(run) == ["step_00000003.pt", "step_00000004.pt", "step_00000005.pt"]
    save_checkpoint(run, 6, _state(6), keep_last=1)
    assert _names(run) == ["step_00000006.pt"]
    assert latest_checkpoint(run.checkpoints_dir) == run.checkpoint(6)


def _failing_save(cut: int, exc: BaseException):
    """torch.save that writes the first ``cut`` bytes of the real payload, then fails."""
    real = torch.save

    def save(obj, f, *a, **k):
        buf = io.BytesIO()
        real(obj, buf, *a, **k)
        f.write(buf.getvalue()[:cut])
        f.flush()
        raise exc

    return save


def test_disk_full_inside_the_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = RunLayout(tmp_path / "r")
    prev = save_checkpoint(run, 1, _state(1.0))
    monkeypatch.setattr(torch, "save", _failing_save(100, OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(run, 2, _state(2.0))
    assert str(e.value) == (
        f"could not write the step-2 checkpoint in {run.checkpoints_dir}: No space left; the "
        f"previous checkpoint {prev} is intact"
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert _names(run) == ["step_00000001.pt"]
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(run.root)["model"]["w"], torch.full((4,), 1.0))


def test_a_failure_without_strerror_and_without_a_previous_checkpoint(tmp_path, monkeypatch):
    run = RunLayout(tmp_path / "r")
    monkeypatch.setattr(torch, "save", _failing_save(0, OSError("quota exceeded")))
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(run, 3, _state(3.0))
    assert str(e.value) == (
        f"could not write the step-3 checkpoint in {run.checkpoints_dir}: quota exceeded; the "
        "previous checkpoint (none) is intact"
    )
    assert _names(run) == []


def test_a_failure_before_the_temp_file_exists(tmp_path, monkeypatch):
    def denied(self, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", denied)
    run = RunLayout(tmp_path / "r")
    with pytest.raises(CheckpointWriteError) as e:
        save_checkpoint(run, 1, _state(1.0))
    assert str(e.value) == (
        f"could not write the step-1 checkpoint in {run.checkpoints_dir}: Permission denied; "
        "the previous checkpoint (none) is intact"
    )


def test_a_file_where_the_checkpoints_folder_should_be_is_reported_in_one_line(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    (root / "checkpoints").write_text("a file where the folder should be")
    with pytest.raises(CheckpointWriteError, match="could not write the step-1 checkpoint"):
        save_checkpoint(RunLayout(root), 1, _state(1.0))


def test_an_interrupt_inside_the_write_removes_the_temp_file_and_propagates(tmp_path, monkeypatch):
    run = RunLayout(tmp_path / "r")
    prev = save_checkpoint(run, 1, _state(1.0))
    monkeypatch.setattr(torch, "save", _failing_save(50, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run, 2, _state(2.0))
    assert _names(run) == ["step_00000001.pt"]
    assert latest_checkpoint(run.checkpoints_dir) == prev


def test_the_final_name_appears_only_by_rename(tmp_path, monkeypatch):
    """The payload goes to the temp name; the final name is created by os.replace."""
    run = RunLayout(tmp_path / "r")
    seen = []
    real = files.os.replace

    def replace(src, dst):
        seen.append((str(src), str(dst), run.checkpoint(4).exists(), src.stat().st_size > 0))
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    save_checkpoint(run, 4, _state(4.0))
    [(src, dst, existed, written)] = seen
    assert re.fullmatch(r"\.step_00000004\.pt\.[0-9a-f]{12}\.tmp", Path(src).name)
    assert (Path(src).parent, dst, existed, written) == (
        run.checkpoints_dir,
        str(run.checkpoint(4)),
        False,
        True,
    )


def test_fsync_dir_tolerates_what_cannot_be_opened(tmp_path):
    files.fsync_dir(tmp_path)
    files.fsync_dir(tmp_path / "missing")


# ------------------------------------------------------------------ resolving and loading
def test_resolve_a_file_a_run_folder_or_a_checkpoints_folder(tmp_path):
    run = RunLayout(tmp_path / "r")
    for step in (1, 2, 3):
        save_checkpoint(run, step, _state(step))
    assert resolve_checkpoint(run.checkpoint(2)) == run.checkpoint(2)
    assert resolve_checkpoint(run.root) == run.checkpoint(3)
    assert resolve_checkpoint(str(run.checkpoints_dir)) == run.checkpoint(3)


def test_resolve_refuses_a_missing_path_and_an_empty_folder(tmp_path):
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(tmp_path / "nope")
    assert str(e.value) == (
        f"{str(tmp_path / 'nope')!r} does not exist: give a checkpoint file or a run folder"
    )
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(tmp_path)
    assert str(e.value) == (
        f"{str(tmp_path)!r} holds no checkpoint (looked for checkpoints/step_*.pt)"
    )
    assert latest_checkpoint(tmp_path / "nope") is None


def test_load_refuses_an_empty_file(tmp_path):
    p = tmp_path / "step_00000001.pt"
    p.write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(e.value) == f"{str(p)!r} is empty (0 bytes): not a checkpoint"


def test_load_refuses_a_truncated_file_in_one_line(tmp_path):
    run = RunLayout(tmp_path / "r")
    good = save_checkpoint(run, 1, _state(1.0))
    bad = tmp_path / "cut.pt"
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(bad)
    msg = str(e.value)
    assert msg.startswith(f"{str(bad)!r} is not a readable checkpoint (truncated or corrupt?): ")
    assert "\n" not in msg


def test_load_refuses_pickled_objects(tmp_path):
    p = tmp_path / "evil.pt"
    torch.save({"format": FORMAT, "when": datetime.date(2020, 1, 1)}, p)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(e.value) == (
        f"{str(p)!r} was refused: it holds pickled objects beyond tensors and plain containers "
        "(code could run on load); ampctl loads checkpoints with weights_only=True only"
    )


@pytest.mark.parametrize(
    "error, verdict",
    [
        (pickle.UnpicklingError("Unsupported global: x.y"), "refused"),
        (pickle.UnpicklingError("Trying to load a GLOBAL"), "refused"),
        (pickle.UnpicklingError("Unsupported class z"), "refused"),
        (RuntimeError("Weights only load failed. Long story\nmore"), "not data"),
        (RuntimeError("PytorchStreamReader failed\nsecond line"), "first line"),
        (RuntimeError(""), "type name"),
    ],
)
def test_load_turns_every_failure_into_one_line(tmp_path, monkeypatch, error, verdict):
    p = tmp_path / "x.pt"
    p.write_bytes(b"12345")
    seen = {}

    def load(path, **kw):
        seen.update(kw)
        raise error

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p, map_location="meta")
    assert seen == {"map_location": "meta", "weights_only": True}
    prefix = f"{str(p)!r} is not a readable checkpoint (truncated or corrupt?): "
    expected = {
        "refused": f"{str(p)!r} was refused: it holds pickled objects beyond tensors and plain "
        "containers (code could run on load); ampctl loads checkpoints with weights_only=True only",
        "not data": prefix + "not data that torch.load(weights_only=True) accepts",
        "first line": prefix + "PytorchStreamReader failed",
        "type name": prefix + "RuntimeError",
    }[verdict]
    assert str(e.value) == expected
    assert e.value.__cause__ is None and e.value.__suppress_context__


@pytest.mark.parametrize("payload", [[1, 2], {"format": "other/1"}, {"step": 1}])
def test_load_refuses_what_is_not_an_ampctl_checkpoint(tmp_path, payload):
    p = tmp_path / "other.pt"
    torch.save(payload, p)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(p)
    assert str(e.value) == (
        f"{str(p)!r} is not an ampctl checkpoint (no 'ampctl-checkpoint/1' format tag)"
    )


def test_load_maps_to_the_given_device(tmp_path):
    path = save_checkpoint(RunLayout(tmp_path / "r"), 1, _state(2.0))
    assert load_checkpoint(path, map_location="meta")["model"]["w"].device.type == "meta"
    assert load_checkpoint(path)["model"]["w"].device.type == "cpu"


# ------------------------------------------------------------------ RNG
def test_rng_state_survives_a_checkpoint_and_restores_both_generators(tmp_path):
    state = rng_state()
    assert set(state) == {"torch", "python"}
    want = (torch.rand(3), random.random())
    path = save_checkpoint(RunLayout(tmp_path / "r"), 1, {"rng": state})
    loaded = load_checkpoint(path)["rng"]
    torch.rand(5)
    random.random()
    set_rng_state(loaded)
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]


def test_set_rng_state_without_python_state_sets_torch_only():
    state = {"torch": torch.get_rng_state()}
    want = torch.rand(2)
    random.seed(5)
    py = random.random()
    random.seed(5)
    set_rng_state(state)
    assert torch.equal(torch.rand(2), want)
    assert random.random() == py  # untouched


def test_load_refuses_a_checkpoint_larger_than_the_memory_allowed_before_reading_it(
    tmp_path, monkeypatch
):
    from ampctl.trust import ResourceRefused, human_size, max_memory, torch_file_sizes

    path = save_checkpoint(RunLayout(tmp_path / "r"), 1, _state(1.0))
    total, _ = torch_file_sizes(path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("loaded before the check"))
    with max_memory(16), pytest.raises(ResourceRefused) as e:
        load_checkpoint(path)
    assert str(e.value) == (
        f"{str(path)!r} ({human_size(total)} of tensors) needs about {human_size(total)} of "
        f"memory, more than the {human_size(16)} allowed (--max-memory): nothing was allocated"
    )  # a checkpoint the loop resumes from: no --max-memory hint of its own


# =============================================== the CUDA RNG state, torch.cuda planted (issue #31)
CUDA_STATE = [torch.tensor([1, 2, 3], dtype=torch.uint8)]


def _cuda(monkeypatch, *, available: bool, initialized: bool) -> list:
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: CUDA_STATE)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", calls.append)
    return calls


def test_rng_state_holds_the_cuda_generators_once_cuda_is_initialized(monkeypatch):
    _cuda(monkeypatch, available=True, initialized=True)
    state = rng_state()
    assert set(state) == {"torch", "python", "cuda"}
    assert state["cuda"] is CUDA_STATE


def test_rng_state_leaves_cuda_alone_until_it_is_initialized(monkeypatch):
    _cuda(monkeypatch, available=True, initialized=False)
    assert set(rng_state()) == {"torch", "python"}
    _cuda(monkeypatch, available=False, initialized=True)
    assert set(rng_state()) == {"torch", "python"}


def test_set_rng_state_restores_the_cuda_generators_when_cuda_is_there(monkeypatch):
    calls = _cuda(monkeypatch, available=True, initialized=True)
    set_rng_state({"torch": torch.get_rng_state(), "cuda": CUDA_STATE})
    assert calls == [CUDA_STATE]


def test_set_rng_state_skips_the_cuda_generators_without_cuda_or_without_a_state(monkeypatch):
    calls = _cuda(monkeypatch, available=False, initialized=False)
    set_rng_state({"torch": torch.get_rng_state(), "cuda": CUDA_STATE})
    assert calls == []
    calls = _cuda(monkeypatch, available=True, initialized=True)
    set_rng_state({"torch": torch.get_rng_state()})
    assert calls == []


def test_pruning_tolerates_an_old_checkpoint_that_vanished_meanwhile(tmp_path, monkeypatch):
    # another process removed an old checkpoint between the listing and the pruning
    run = RunLayout(tmp_path / "r")
    save_checkpoint(run, 1, {"x": 1})
    listed = ck.list_checkpoints
    gone = run.checkpoint(0)
    monkeypatch.setattr(ck, "list_checkpoints", lambda d: [gone, *listed(d)])
    path = save_checkpoint(run, 2, {"x": 2}, keep_last=1)
    assert listed(run.checkpoints_dir) == [path]
    assert not gone.exists()
