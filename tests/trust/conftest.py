"""Fixtures of the trust tests."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from ampctl.cli import app
from tests.conftest import FAST


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A real run folder, one per test module: 4 steps of the tiny model, a checkpoint at step 4,
    no plot. Tests copy it before they touch it."""
    root = tmp_path_factory.mktemp("base")
    args = [*FAST, "trainer.max_steps=4", "trainer.ckpt_every=4", "trainer.log_every=2"]
    r = CliRunner().invoke(
        app,
        ["train", *args, "logging.plot=false", f"trainer.runs_dir={root}", "--name", "b", "-q"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    return root / "b"
