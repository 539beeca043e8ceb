"""A saved config may not decide where ``train --resume`` reads and writes (issue 37): a path or
URI it names outside the run folder and the working directory is used only when the user repeats
it on the command line, a network URI never on its own; a layer count larger than the
checkpoint's tensors is refused before a model is built. Each CLI case edits a real checkpoint's
saved config and runs the real command in-process; marker files and snapshots prove that nothing
was read, trained or written."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.runlog import RunLayout
from ampctl.trust import ResourceRefused
from ampctl.trust_counts import check_counts
from ampctl.trust_paths import SavedPathRefused, check_saved_paths

runner = CliRunner()


# ---------------------------------------------------------------------------- the rule
def _check(saved, overrides=(), *, run, cwd):
    check_saved_paths(saved, list(overrides), run_root=run, source="checkpoint c.pt", cwd=cwd)


def test_paths_inside_the_run_or_the_working_directory_pass(tmp_path, monkeypatch):
    run, cwd = tmp_path / "runs" / "r", tmp_path / "work"
    run.mkdir(parents=True)
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # relative paths are used relative to it
    for saved in (
        {"data": {"path": "corpus.txt", "tokenizer": str(run / "tok"), "cache_dir": None}},
        {"data": {"path": "sub/*.txt"}},
        {"trainer": {"runs_dir": str(run.parent)}},  # the folder the run itself is in
        {"logging": {"mlflow": True, "mlflow_uri": f"sqlite:///{run}/mlflow.db"}},
        {"logging": {"mlflow": True, "mlflow_uri": f"file://{cwd}/mlruns"}},
        {"logging": {"mlflow": False, "mlflow_uri": "http://evil.example"}},  # MLflow off
        {"logging": {"wandb": True, "wandb_mode": "offline"}},
    ):
        _check(saved, run=run, cwd=cwd)


@pytest.mark.parametrize(
    ("saved", "key"),
    [
        ({"data": {"path": "/etc/hostname"}}, "data.path"),
        ({"data": {"path": "../../outside/*.txt"}}, "data.path"),
        ({"data": {"tokenizer": "/opt/tok.json"}}, "data.tokenizer"),
        ({"data": {"cache_dir": "/var/tmp/cache"}}, "data.cache_dir"),
        ({"trainer": {"runs_dir": "/srv/elsewhere"}}, "trainer.runs_dir"),
        ({"logging": {"mlflow": True, "mlflow_uri": "sqlite:////tmp/x/mlflow.db"}}, None),
        ({"logging": {"mlflow": True, "mlflow_uri": "/tmp/x/mlruns"}}, None),
    ],
)
def test_a_path_outside_is_refused_unless_the_user_repeats_it(tmp_path, saved, key):
    run, cwd = tmp_path / "r", tmp_path / "w"
    run.mkdir()
    cwd.mkdir()
    key = key or "logging.mlflow_uri"
    group, leaf = key.split(".")
    value = saved[group][leaf]
    with pytest.raises(SavedPathRefused) as e:
        _check(saved, run=run, cwd=cwd)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint c.pt: its saved config names {key}={value} (")
    assert msg.endswith(
        f"outside the run folder and the working directory: not used; to use it, repeat it on "
        f"the command line: {key}={value} (or give another {key}=...)"
    )
    _check(saved, [f"{key}={value}"], run=run, cwd=cwd)  # the user's own now
    _check(saved, [f"{key}=elsewhere"], run=run, cwd=cwd)  # not used at all


def test_a_network_uri_is_never_used_on_its_own(tmp_path):
    for uri in (
        "http://127.0.0.1:5000",
        "https://mlflow.example",
        "databricks",
        "postgresql://h/db",
        "http://[bad",
    ):
        saved = {"logging": {"mlflow": True, "mlflow_uri": uri}}
        with pytest.raises(SavedPathRefused, match="a network address: not used on its own"):
            _check(saved, run=tmp_path, cwd=tmp_path)
        _check(saved, [f"logging.mlflow_uri={uri}"], run=tmp_path, cwd=tmp_path)
    for key, url in (("data.path", "https://example.com/corpus.txt"), ("data.tokenizer", "hf://x")):
        group, leaf = key.split(".")
        with pytest.raises(SavedPathRefused) as e:
            _check({group: {leaf: url}}, run=tmp_path, cwd=tmp_path)
        assert (
            f"reads the {'training data' if leaf == 'path' else 'tokenizer'} from {key}={url}, a network address"
            in str(e.value)
        )
        _check({group: {leaf: url}}, [f"{key}={url}"], run=tmp_path, cwd=tmp_path)
    saved = {"logging": {"wandb": True, "wandb_mode": "online"}}
    with pytest.raises(
        SavedPathRefused, match=r"repeat it on the command line: logging.wandb_mode"
    ):
        _check(saved, run=tmp_path, cwd=tmp_path)
    _check(saved, ["logging.wandb_mode=online"], run=tmp_path, cwd=tmp_path)


def test_a_symlink_inside_the_working_directory_that_points_out_is_outside(tmp_path):
    (tmp_path / "w").mkdir()
    os.symlink("/etc", tmp_path / "w" / "data")
    with pytest.raises(SavedPathRefused):
        _check({"data": {"path": "data/hostname"}}, run=tmp_path / "r", cwd=tmp_path / "w")


def test_layer_counts_are_capped_by_the_tensors_before_a_build():
    check_counts({"num_layers": 2, "hidden_size": 64}, 40, source="s")
    check_counts({"text_config": {"num_hidden_layers": 3}}, 40, source="s")
    with pytest.raises(ResourceRefused) as e:
        check_counts({"model": {"n_layer": 1_000_000}}, 40, source="s")
    assert str(e.value) == (
        "s: the config asks for model.n_layer=1000000 layers but the checkpoint holds 40 "
        "tensors (each layer has at least one): the model is not built"
    )
    for bad in (1e6, -1, 2.5, float("nan")):
        with pytest.raises(ResourceRefused):
            check_counts({"num_layers": bad}, 40, source="s")


# ---------------------------------------------------------------------------- train --resume


@pytest.fixture
def edited(base_run, tmp_path, monkeypatch):
    """A copy of the run (the working directory: a folder beside it) whose checkpoint's saved
    config is edited as a stranger would."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    run = tmp_path / "r"
    shutil.copytree(base_run, run)

    def edit(**changes):
        path = RunLayout(run).checkpoint(4)
        ck = torch.load(path, weights_only=True)
        for dotted, value in changes.items():
            node = ck["config"]
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node[p]
            node[leaf] = value
        torch.save(ck, path)
        return run

    return edit


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _refused(r) -> str:
    assert r.exit_code == 2, r.output
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in r.output, r.output
    return err[0]


def test_resume_does_not_train_on_a_data_path_outside(edited, tmp_path):
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not yours\n" * 100)
    run = edited(**{"data.kind": "text", "data.vocab_size": 260, "data.path": str(secret)})
    before = _snapshot(run)
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    line = _refused(r)
    assert f"its saved config names data.path={secret} (the training data)" in line
    assert line.endswith(
        f"repeat it on the command line: data.path={secret} (or give another data.path=...)"
    )
    assert _snapshot(run) == before


def test_a_fork_is_made_under_a_saved_runs_dir_only_when_the_user_repeats_it(edited, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    run = edited(**{"trainer.runs_dir": str(elsewhere)})
    ck = str(RunLayout(run).checkpoint(4))
    r = runner.invoke(app, ["train", "--resume", ck, "trainer.max_steps=6", "--name", "f", "-q"])
    assert f"trainer.runs_dir={elsewhere} (where a new run folder is made)" in _refused(r)
    assert not elsewhere.exists()
    r = runner.invoke(
        app,
        ["train", "--resume", ck, "trainer.max_steps=6", f"trainer.runs_dir={elsewhere}"]
        + ["--name", "f", "-q"],
    )
    assert r.exit_code == 0, r.output
    assert RunLayout(elsewhere / "f").latest_checkpoint() is not None


def test_resume_sends_nothing_to_a_tracking_server_the_checkpoint_names(edited, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    uri = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        run = edited(**{"logging.mlflow": True, "logging.mlflow_uri": uri})
        before = _snapshot(run)
        r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
        assert _refused(r) == (
            f"ampctl: error: checkpoint {RunLayout(run).checkpoint(4).resolve()}: its saved "
            f"config sends the MLflow tracking store to logging.mlflow_uri={uri}, a network "
            f"address: not used on its own; to use it, repeat it on the command line: "
            f"logging.mlflow_uri={uri} (or give logging.mlflow_uri=null for a store in the run "
            "folder)"
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
        assert _snapshot(run) == before
    finally:
        server.close()


def test_resume_writes_no_mlflow_database_where_the_checkpoint_says(edited, tmp_path):
    db = tmp_path / "outside" / "mlflow.db"
    run = edited(**{"logging.mlflow": True, "logging.mlflow_uri": f"sqlite:///{db}"})
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    assert f"logging.mlflow_uri=sqlite:///{db} (the MLflow tracking store)" in _refused(r)
    assert not db.parent.exists()


def test_a_million_saved_layers_are_refused_before_any_build(edited):
    run = edited(**{"model.num_layers": 1_000_000})
    t0 = time.perf_counter()
    r = runner.invoke(app, ["train", "--resume", str(run), "trainer.max_steps=8", "-q"])
    line = _refused(r)
    assert time.perf_counter() - t0 < 20
    assert "the config asks for num_layers=1000000 layers but the checkpoint holds" in line
