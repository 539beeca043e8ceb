"""Tests of the numeric core (ampctl/amp/), one thread: tiny tensors gain nothing from two.

Most of these files are also what ``scripts/mutation.sh`` runs per mutant (the list, and the slow
tests it leaves out, is in pyproject.toml), so each of their tests must stay fast.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    # overrides tests/conftest.py's two threads: tiny tensors gain nothing from a second thread
    torch.set_num_threads(1)
    yield


@pytest.fixture
def float64_default():
    """torch's default dtype float64 for one test (what a float64 user's process looks like)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
