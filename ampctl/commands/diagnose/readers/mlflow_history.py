"""An MLflow store as a history, through ``MlflowClient``, reading only.

* a ``sqlite`` file (``mlflow.db``, ampctl's own ``mlruns.db``): first checked with Python's
  ``sqlite3`` opened read-only (``file:PATH?mode=ro``): an SQLite database that holds MLflow's
  tables (``experiments``, ``runs``, ``metrics``, ``alembic_version``) and at least one
  experiment. Anything else is refused with one line before MLflow sees it: MLflow's SQL store
  creates its tables and a default experiment in a database without them, and retries a file
  it cannot inspect with growing sleeps. A store that passes is opened as ``sqlite:////PATH``
  and only read (SQLite's read-only form, ``sqlite:///file:PATH?mode=ro&uri=true``, makes
  MLflow create a folder named ``file:`` in the working directory, so it is not used);
* an ``mlruns/`` file store: opened only when it already holds the default experiment
  (``0/meta.yaml``; MLflow's file store writes one when it is missing), with
  ``MLFLOW_ALLOW_FILE_STORE=true`` while it is read (MLflow 3 refuses a file store without it).

The newest run of the store (by start time) is read; only the metrics named in
:data:`~.history_names.METRIC_NAMES` are fetched (``get_metric_history``, one metric at a
time), the others are listed in a note. MLflow's SQL store keeps +-inf as
+-1.7976931348623157e308 (``sys.float_info.max``): read back as inf, with a note.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ampctl.errors import first_line
from ampctl.runlog.readers import RunFileError
from ampctl.trust import checked_file

from .base import ForeignHistory
from .history_names import NAME_ROLES, build_history, not_read

__all__ = ["read_mlflow", "store_uri"]

_INF = sys.float_info.max


def store_uri(path: Path) -> str:
    """The read-only tracking URI of a store file or ``mlruns/`` folder. Raises
    :class:`RunFileError` for one that may not be opened."""
    if path.is_dir():
        if not (path / "0" / "meta.yaml").is_file():
            raise RunFileError(
                path,
                "has no default experiment (0/meta.yaml): MLflow's file store would write one, "
                "so it is not opened",
            )
        return path.resolve().as_uri()
    checked_file(path)
    with open(path, "rb") as f:
        if f.read(16) != b"SQLite format 3\x00":
            raise RunFileError(path, "is not an SQLite database (an MLflow sqlite: store)")
    _check_sqlite(path)
    return f"sqlite:///{path.resolve()}"


_MLFLOW_TABLES = ("experiments", "runs", "metrics", "alembic_version")


def _check_sqlite(path: Path) -> None:
    """An SQLite file that MLflow would only read: its tables and one experiment, checked with
    ``sqlite3`` opened read-only. Raises :class:`RunFileError`."""
    import sqlite3

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise RunFileError(path, f"is not a readable SQLite database: {e}") from None
    try:
        names = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
        missing = [t for t in _MLFLOW_TABLES if t not in names]
        if missing:
            raise RunFileError(
                path,
                f"is not an MLflow store: an SQLite database without MLflow's tables "
                f"({', '.join(missing)}); MLflow would create them, so it is not opened",
            )
        if con.execute("select count(*) from experiments").fetchone()[0] == 0:
            raise RunFileError(
                path, "is not an MLflow store MLflow only reads: it holds no experiment"
            )
    except sqlite3.Error as e:
        raise RunFileError(path, f"is not a readable SQLite database: {e}") from None
    finally:
        con.close()


@contextlib.contextmanager
def _file_store_allowed(needed: bool) -> Iterator[None]:
    """MLflow 3 opens a file store only with ``MLFLOW_ALLOW_FILE_STORE=true``: set while the
    store is opened here (an existing store is read, nothing is migrated), then restored."""
    key = "MLFLOW_ALLOW_FILE_STORE"
    old = os.environ.get(key)
    if needed:
        os.environ[key] = "true"
    try:
        yield
    finally:
        if needed and old is None:
            os.environ.pop(key, None)
        elif needed:
            os.environ[key] = old


def read_mlflow(path: Path) -> ForeignHistory | None:
    """The newest run's history in an MLflow store beside a checkpoint. Without mlflow
    installed: a history with no rows and a note. Raises :class:`RunFileError` for a store
    that cannot be read."""
    uri = store_uri(path)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        return not_read(path, "an MLflow store", "mlflow-skinny", "mlflow")
    with warnings.catch_warnings(), _file_store_allowed(path.is_dir()):
        warnings.simplefilter("ignore")
        return _read(MlflowClient, uri, path)


def _read(client_class: Any, uri: str, path: Path) -> ForeignHistory | None:
    try:
        client = client_class(tracking_uri=uri)
        exps = client.search_experiments()
        runs = client.search_runs(
            [e.experiment_id for e in exps], max_results=1000, order_by=["start_time DESC"]
        )
    except Exception as e:  # noqa: BLE001 - any failure of the store: one line
        raise RunFileError(
            path, f"is not an MLflow store MlflowClient reads: {first_line(e)}"
        ) from None
    if not runs:
        return None
    run = runs[0]
    keys = list(run.data.metrics)
    notes = []
    if len(runs) > 1:
        notes.append(f"{len(runs)} MLflow runs in the store: the newest ({run.info.run_id}) read")
    unknown = [k for k in keys if k not in NAME_ROLES]
    known = [k for k in keys if NAME_ROLES.get(k) is not None]
    flagged: list[str] = []

    def rows() -> Iterator[dict[str, Any]]:
        for k in known:
            for m in client.get_metric_history(run.info.run_id, k):
                v = float(m.value)
                if abs(v) >= _INF:
                    v = float("inf") if v > 0 else float("-inf")
                    if k not in flagged:
                        flagged.append(k)
                yield {"step": int(m.step), k: v}

    try:
        h = build_history(
            f"{path} (MLflow run {run.info.run_id})", rows(), notes=notes, unknown=unknown
        )
    except Exception as e:  # noqa: BLE001
        raise RunFileError(path, f"MLflow metric history unreadable: {first_line(e)}") from None
    if h is not None:
        if flagged:
            h.notes.append(
                f"{', '.join(flagged)}: MLflow stored +-inf as +-{_INF:.6g}; read back as inf"
            )
    return h
