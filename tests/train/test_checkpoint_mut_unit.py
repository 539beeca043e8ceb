"""The CUDA RNG state in a checkpoint, with torch.cuda's calls planted (issue #31: mutants of
ampctl.train.checkpoint that a CPU-only run left alive)."""

from __future__ import annotations

import torch

from ampctl.runlog import RunLayout
from ampctl.train import checkpoint as ck
from ampctl.train.checkpoint import rng_state, save_checkpoint, set_rng_state

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
