"""Read what the MLflow and W&B sinks wrote, with the libraries' own readers, offline.

MLflow: ``MlflowClient`` on the run folder's SQLite store. W&B: the offline run's ``.wandb`` file,
parsed record by record with W&B's own protobuf ``Record`` (wandb >= 0.2x no longer ships a
Python reader of its datastore: the framing is LevelDB's log format behind a 7-byte W&B header,
read below). Nothing here touches the network.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768  # LevelDB log blocks
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


# ---------------------------------------------------------------------------- W&B
def wandb_file(run_dir: Path, timeout: float = 60.0) -> Path:
    """The one offline run's ``.wandb`` file under ``<run_dir>/wandb``, once it is complete:
    ``run.finish()`` returns before W&B's service process has written the run out (measured: a
    file still holding only its header right after ``finish()``), so wait for its exit record."""
    (found,) = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    return wait_complete(found, timeout)


def wait_complete(path: Path, timeout: float = 60.0) -> Path:
    """``path`` once its exit record is written (AssertionError after ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while not any(r.HasField("exit") for r in wandb_records(path)):
        assert time.monotonic() < end, f"{path}: no exit record after {timeout} s"
        time.sleep(0.1)
    return path


def wandb_records(path: Path) -> Iterator[Any]:
    """Each ``wandb_internal_pb2.Record`` of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # a zero-filled block trailer
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:  # a record still being written
            return
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF, (path, pos)
        pos += 7 + length
        buf = chunk if kind in (_FULL, _FIRST) else buf + chunk
        if kind in (_FULL, _LAST):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def _items(items) -> dict[str, Any]:
    return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}


def wandb_history(path: Path) -> list[dict[str, Any]]:
    return [_items(r.history.item) for r in wandb_records(path) if r.HasField("history")]


def wandb_config(path: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    for r in wandb_records(path):
        if r.HasField("run"):
            cfg.update(_items(r.run.config.update))
        if r.HasField("config"):
            cfg.update(_items(r.config.update))
    return cfg


def wandb_summary(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in wandb_records(path):
        if r.HasField("summary"):
            out.update(_items(r.summary.update))
    return out


def wandb_exit_code(path: Path) -> int | None:
    codes = [r.exit.exit_code for r in wandb_records(path) if r.HasField("exit")]
    return codes[-1] if codes else None


# ---------------------------------------------------------------------------- MLflow
def mlflow_run(uri: str):
    """``(client, run)`` of the one run in the store at ``uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def local_uri(run_dir: Path) -> str:
    return f"sqlite:///{Path(run_dir).resolve() / 'mlruns.db'}"


def make_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its schema migrated (the ``mlflow_template`` fixtures call
    it once per session): copied into a run folder, the sink opens an existing store (as on a
    resume) instead of migrating a new one (seconds each). The CLI test keeps the migration."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlruns.db"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # SQLAlchemy's, inside mlflow
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def seed_store(template: Path, run_dir: Path) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, Path(run_dir) / "mlruns.db")


# ---------------------------------------------------------------------------- comparing
def same(a: float, b: float) -> bool:
    """Equal figures (NaN equals NaN; MLflow keeps +-inf as the largest float)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a):
        return abs(b) >= 1.7e308 and (b > 0) == (a > 0)
    return a == b


def numeric_series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as ``{key: [(step, value), ...]}`` over its numeric keys."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k == "step" or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            out.setdefault(k, []).append((int(r["step"]), float(v)))
    return out


def assert_series_equal(expected: dict, got: dict, prefix: str = "ampctl/") -> None:
    for key, series in expected.items():
        have = got.get(prefix + key)
        assert have is not None, f"{prefix}{key} missing; have {sorted(got)}"
        assert [s for s, _ in have] == [s for s, _ in series], key
        assert all(same(a, b) for (_, a), (_, b) in zip(series, have, strict=True)), (
            key,
            series,
            have,
        )
