"""Shared fixtures: a fast tiny config and helpers to run the trainer in-process."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

from ampctl.config import load_config
from tests.extras_ci import (  # noqa: F401 - .ci/run's two passes (see tests/extras_ci.py)
    pytest_collection_modifyitems,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
)

# A few steps of the tiny model; fast on 2 CPU cores.
FAST = [
    "trainer.max_steps=12",
    "trainer.log_every=4",
    "trainer.ckpt_every=6",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.vocab_size=64",
    "model.hidden_size=32",
    "model.ffn_size=64",
    "model.num_heads=2",
    "optim.warmup_steps=2",
    "scaler.init_scale=1024",
]


# One intra-op thread by default: the test models are tiny, and on a 2-core machine that other
# work shares, two OpenMP threads spin-wait for each other at every op: a 40-step test that takes
# 4.5 s idle took 18 s with one thread and 110 s with two next to one busy process. (Subprocess
# tests set OMP_NUM_THREADS=1 too.) scripts/mutation.sh needs 1 anyway: its workers are forked
# from the process that ran the tests, and an OpenMP pool started before a fork hangs the child.
THREADS = int(os.environ.get("AMPCTL_TEST_THREADS", "1"))


# A test about what a process leaves behind (killed mid-write, SIGKILLed, a rank of a process
# group) forks that process from the session's forkserver, which imports torch, torch._dynamo
# (the first optimizer imports it) and ampctl once: a fresh interpreter pays seconds of imports
# each on 2 cores. (Tests about the process itself -- its start, its output, its exit code
# under torchrun or a signal -- still start `python -m ampctl`.)
multiprocessing.set_forkserver_preload(
    ["torch", "torch._dynamo", "ampctl.cli", "ampctl.train.trainer", "typer.testing"]
)


def forked(target, *args, **kwargs) -> multiprocessing.Process:
    """``target(*args, **kwargs)`` in a process forked from the forkserver, started
    (``.exitcode``, ``.kill()``, ``.join()``); a SystemExit's code is its exit code."""
    ctx = multiprocessing.get_context("forkserver")
    proc = ctx.Process(target=target, args=args, kwargs=kwargs)
    proc.start()
    return proc


def ampctl_main(*args: str, output: str | None = None) -> None:
    """``ampctl ARGS`` as ``python -m ampctl`` runs it, one thread (a :func:`forked` target):
    stdout and stderr into the file ``output``."""
    torch.set_num_threads(1)
    if output is not None:
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.argv = ["ampctl", *args]
    from ampctl.cli import main

    main()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture(autouse=True)
def _same_working_directory():
    """A test that changes the working directory and leaves it changed fails (the directory is
    put back): under pytest-xdist the next test of the worker, and every trial or run it starts
    with ``python -m ampctl``, would run from there (`tests` not importable)."""
    here = os.getcwd()
    yield
    now = os.getcwd()
    if now != here:
        os.chdir(here)
        pytest.fail(f"the test left the working directory at {now} (use monkeypatch.chdir)")


@pytest.fixture
def fast_cfg(tmp_path):
    def make(*extra: str):
        return load_config([*FAST, f"trainer.runs_dir={tmp_path / 'runs'}", *extra])

    return make


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
