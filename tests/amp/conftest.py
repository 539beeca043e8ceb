"""Unit tests of the numeric core: tiny tensors, one thread, milliseconds each.

They are also what ``scripts/mutation.sh`` runs per mutant, so each must stay fast.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    # overrides tests/conftest.py's two threads: tiny tensors gain nothing from a second thread
    torch.set_num_threads(1)
    yield
