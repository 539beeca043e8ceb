"""The two passes of ``.ci/run``: README's test command with only ``[test]`` installed, then the
tests that need an optional extra, once the extras are installed. Hooks imported by
``tests/conftest.py``; without the two environment variables below they do nothing. Under
pytest-xdist each worker deselects its own items and the controller, which receives every
report, records and judges the skips.

- ``AMPCTL_RECORD_IMPORT_SKIPS=PATH`` (pass 1): every test -- or test module -- that skipped
  because an import failed (``pytest.importorskip``: "could not import ...") is written to PATH,
  one node id a line.
- ``AMPCTL_ONLY_EXTRAS=PATH`` (pass 2): only the tests PATH names run, plus every test marked
  ``extras`` (one that takes another branch when an extra is there, e.g. bench's fp8 row); any
  of them that skips again because an import failed fails the run: a test that needs an extra
  is never left run by neither pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

RECORD = "AMPCTL_RECORD_IMPORT_SKIPS"
ONLY = "AMPCTL_ONLY_EXTRAS"
_skipped: list[str] = []


def _import_skip(report) -> bool:
    return report.skipped and "could not import" in str(report.longrepr)


def pytest_collectreport(report) -> None:
    if _import_skip(report):  # a module-level importorskip skips the whole file
        _skipped.append(report.nodeid)


def pytest_runtest_logreport(report) -> None:
    if _import_skip(report):  # in a fixture or in the test itself
        _skipped.append(report.nodeid)


def pytest_collection_modifyitems(config, items) -> None:
    path = os.environ.get(ONLY)
    if not path:
        return
    wanted = set(Path(path).read_text().splitlines())
    keep, drop = [], []
    for item in items:
        named = item.nodeid in wanted or item.nodeid.split("::", 1)[0] in wanted
        (keep if named or item.get_closest_marker("extras") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if hasattr(session.config, "workerinput"):
        return  # a pytest-xdist worker: its reports reach the controller, which writes and judges
    found = sorted(set(_skipped))
    if os.environ.get(RECORD):
        Path(os.environ[RECORD]).write_text("".join(f"{n}\n" for n in found))
    if os.environ.get(ONLY) and found:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(
                f"{len(found)} test(s) still skip for a missing import with the extras "
                f"installed: {', '.join(found)}",
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
