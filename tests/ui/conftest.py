"""Fixtures of the sink tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    pytest.importorskip("mlflow")
    from tests.ui.readback import make_template

    return make_template(tmp_path_factory)
