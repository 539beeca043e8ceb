"""A sink that dies mid-run -- MLflow's SQLite store locked by another process, the W&B run
folder removed -- costs at most one warning: training goes on, metrics.jsonl is complete, and
the next run with the same store works. (The extras pass: MLflow and W&B are installed there.)"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from ampctl.runlog import new_run_dir
from ampctl.train.trainer import train
from tests.conftest import read_jsonl

LOCKER = """
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=0)
con.execute("BEGIN EXCLUSIVE")  # no one else reads or writes the store until we end
print("locked", flush=True)
sys.stdin.readline()
con.execute("ROLLBACK")
"""


def _history(uri: str, run_dir, key: str = "ampctl/loss") -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ampctl")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == run_dir.name]
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def test_mlflow_store_locked_by_another_process(fast_cfg, tmp_path_factory, monkeypatch):
    pytest.importorskip("mlflow")
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from tests.ui.readback import local_uri, make_template, seed_store

    # MLflow's SQLite sessions wait 20 s for a locked store (PRAGMA busy_timeout = 20000) before
    # the call fails; 1 s here: the same failure and the same one warning, 19 s sooner
    text = sqlalchemy.sql.text
    monkeypatch.setattr(
        sqlalchemy.sql, "text", lambda s, *a, **k: text(s.replace("= 20000;", "= 1000;"), *a, **k)
    )

    template = make_template(tmp_path_factory)
    lockers: list[subprocess.Popen] = []

    def lock_store(tr, step, phase):
        if step == 6 and not lockers:  # after the first row (step 4) went out
            p = subprocess.Popen(
                [sys.executable, "-c", LOCKER, str(tr.run_dir / "mlruns.db")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert p.stdout.readline() == "locked\n"
            lockers.append(p)

    cfg = fast_cfg("logging.mlflow=true")
    run_dir = new_run_dir(cfg.trainer.runs_dir, "locked")
    seed_store(template, run_dir)
    try:
        res = train(cfg, run_dir, fault=lock_store)
    finally:
        for p in lockers:
            p.communicate("\n", timeout=60)  # the other process ends: the store is free again
    assert res.status == "ok" and res.exit_code == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [4, 8, 12]
    (ev,) = read_jsonl(run_dir / "events.jsonl")  # one warning, at the first row it missed
    assert ev["kind"] == "warning" and ev["step"] == 8
    assert ev["message"].startswith("logging.mlflow: metrics failed (")
    assert "locked" in ev["message"] and "\n" not in ev["message"]
    uri = local_uri(run_dir)
    assert _history(uri, run_dir)[0][0] == 4  # what went out before the lock is kept
    # the next run with the same store works
    cfg2 = fast_cfg("logging.mlflow=true", f"logging.mlflow_uri={uri}")
    again = new_run_dir(cfg2.trainer.runs_dir, "after")
    res2 = train(cfg2, again)
    assert res2.status == "ok" and read_jsonl(again / "events.jsonl") == []
    want = [(r["step"], r["loss"]) for r in read_jsonl(again / "metrics.jsonl")]
    assert _history(uri, again) == want


def test_wandb_folder_removed_mid_run(fast_cfg):
    pytest.importorskip("wandb")
    import wandb

    from tests.ui.readback import wandb_file, wandb_history

    def remove_folder(tr, step, phase):
        if step == 6:
            shutil.rmtree(tr.run_dir / "wandb")

    cfg = fast_cfg("logging.wandb=true")
    run_dir = new_run_dir(cfg.trainer.runs_dir, "wbgone")
    try:
        res = train(cfg, run_dir, fault=remove_folder)
    finally:
        if wandb.run is not None:
            wandb.run.finish()
    assert res.status == "ok" and res.exit_code == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [4, 8, 12]
    (ev,) = read_jsonl(run_dir / "events.jsonl")  # W&B itself raises nothing: the sink looks
    assert ev["kind"] == "warning" and ev["step"] == 8
    assert ev["message"].startswith("logging.wandb: metrics failed (FileNotFoundError: the W&B")
    assert "was removed during the run" in ev["message"] and "\n" not in ev["message"]
    # the next run with W&B works
    again = new_run_dir(cfg.trainer.runs_dir, "wbnext")
    res2 = train(cfg, again)
    assert res2.status == "ok" and read_jsonl(again / "events.jsonl") == []
    hist = wandb_history(wandb_file(again))
    got = [(h["ampctl/step"], h["ampctl/loss"]) for h in hist if "ampctl/loss" in h]
    assert got == [(r["step"], r["loss"]) for r in read_jsonl(again / "metrics.jsonl")]
