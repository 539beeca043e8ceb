"""The MLflow and W&B sinks from the integrations, with the real libraries, offline:
``ProtectedRun(logging=...)`` writes the same figures, events, config and plot as ``ampctl
train``; under the HF Trainer with ``report_to=["mlflow", "wandb"]`` ampctl's figures join the
Trainer's own MLflow and W&B runs instead of opening second ones."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
pytest.importorskip("wandb")

from ampctl.amp import LossScaler  # noqa: E402
from ampctl.integrations import ProtectedRun  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402
from tests.integrations.conftest import TinyNet, batches  # noqa: E402
from tests.integrations.test_run import _loop  # noqa: E402
from tests.ui.readback import (  # noqa: E402
    assert_series_equal,
    local_uri,
    make_template,
    mlflow_run,
    numeric_series,
    seed_store,
    wandb_file,
    wandb_history,
)
from tests.ui.test_wandb_sink import series  # noqa: E402


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    return make_template(tmp_path_factory)


@pytest.fixture(autouse=True)
def _no_stray_runs(monkeypatch):
    """End what a failed test left active, before monkeypatch restores the environment and the
    working directory (an MLflow run ended later would be written to ./mlflow.db)."""
    import mlflow
    import wandb

    yield
    if wandb.run is not None:
        wandb.run.finish()
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _mlflow_histories(client, run):
    return {
        k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
        for k in run.data.metrics
    }


def test_protected_run_with_logging_writes_the_same_to_both(tmp_path, mlflow_template):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler(init_scale=1024.0, growth_interval=1000)
    d = tmp_path / "run"
    seed_store(mlflow_template, d)
    run = ProtectedRun(
        model,
        opt,
        scaler,
        run_dir=d,
        log_every=2,
        max_steps=6,
        logging={"mlflow": True, "wandb": True, "plot": True},
    )
    with run:
        _loop(run, model, opt, scaler, range(1, 7), plant={3}, data=batches(8))
    rows = read_jsonl(d / "metrics.jsonl")
    events = read_jsonl(d / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("overflow", 3)]
    expected = numeric_series(rows)
    assert {"loss", "scale", "skipped", "overflow_rate", "grad_norm", "lr"} <= set(expected)
    # MLflow
    client, mrun = mlflow_run(local_uri(d))
    got = _mlflow_histories(client, mrun)
    assert_series_equal(expected, got)
    assert got["ampctl/events/overflow"] == [(3, 1.0)]
    assert mrun.data.params["integration"] == "loop"
    assert mrun.data.params["scaler.init_scale"] == "1024.0"
    names = {a.path for a in client.list_artifacts(mrun.info.run_id, "ampctl")}
    assert names == {"ampctl/plot.png", "ampctl/summary.json", "ampctl/events.jsonl"}
    assert mrun.info.status == "FINISHED"
    # W&B
    f = wandb_file(d)
    hist = wandb_history(f)
    wgot = series(hist)
    assert_series_equal(expected, {k: v for k, v in wgot.items() if "/events/" not in k})
    assert wgot["ampctl/events/overflow"] == [(3, 1.0)]
    (img,) = [h for h in hist if h.get("ampctl/plot/_type") == "image-file"]
    assert (f.parent / "files" / img["ampctl/plot/path"]).read_bytes() == (
        d / "plot.png"
    ).read_bytes()


def test_hf_trainer_figures_join_its_own_mlflow_and_wandb_runs(
    tmp_path, mlflow_template, monkeypatch
):
    pytest.importorskip("transformers")
    import shutil

    import mlflow
    import wandb
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from ampctl.integrations.transformers import protect_trainer
    from tests.integrations.test_transformers import Tokens

    monkeypatch.chdir(tmp_path)  # anything either library puts relative to the cwd stays here
    store = tmp_path / "hf.db"
    shutil.copyfile(mlflow_template, store)
    uri = f"sqlite:///{store}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    monkeypatch.setenv("WANDB_MODE", "offline")  # the Trainer's own W&B run: the test's choice
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "hfwandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "hfwandb").mkdir()
    wandb.teardown()  # W&B reads its environment once per process: let it read this one
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        use_cpu=True,
        fp16=True,
        report_to=["mlflow", "wandb"],
        disable_tqdm=True,
        run_name="hf-run",
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    protect_trainer(trainer, tmp_path / "ampctl", scaler=LossScaler(init_scale=1024.0))
    trainer.train()
    d = tmp_path / "ampctl"
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    # no second run: nothing of MLflow or W&B in ampctl's run folder
    assert not (d / "mlruns.db").exists() and not (d / "wandb").exists()
    # MLflow: the one run is the Trainer's, with its own figures and ampctl's
    client, mrun = mlflow_run(uri)
    assert mrun.info.run_name == "hf-run"
    got = _mlflow_histories(client, mrun)
    assert "loss" in got and "learning_rate" in mrun.data.params  # the Trainer's
    assert_series_equal(numeric_series(rows), got)  # ampctl's
    assert mrun.data.params["ampctl.integration"] == "transformers"
    assert mlflow.active_run() is None  # the Trainer ended its run; ampctl did not open one
    # W&B: the Trainer's run is still open (the Trainer never finishes it); ampctl logged into it
    assert wandb.run is not None and wandb.run.name == "hf-run"
    wandb.run.finish()
    f = wandb_file(tmp_path / "hfwandb")
    hist = wandb_history(f)
    assert any("train/loss" in h for h in hist)
    wgot = series(hist)
    assert_series_equal(
        numeric_series(rows), {k: v for k, v in wgot.items() if "/events/" not in k}
    )
    assert json.loads(json.dumps(mrun.data.params["ampctl.trainer.max_steps"])) == "6"


def test_lightning_callback_passes_logging_to_the_sinks(tmp_path, mlflow_template):
    pytest.importorskip("lightning")
    from ampctl.integrations.lightning import AmpctlCallback
    from tests.integrations.test_lightning import Lit, _loader, _trainer

    d = tmp_path / "lit"
    seed_store(mlflow_template, d)
    torch.manual_seed(0)
    cb = AmpctlCallback(d, precision="fp16", log_every=2, logging={"mlflow": True, "plot": False})
    _trainer(6, [cb], tmp_path).fit(Lit(plant={3}), _loader())
    rows = read_jsonl(d / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    client, mrun = mlflow_run(local_uri(d))
    got = _mlflow_histories(client, mrun)
    assert_series_equal(numeric_series(rows), got)
    assert got["ampctl/events/overflow"] == [(3, 1.0)]
    assert mrun.data.params["integration"] == "lightning"
    assert not (d / "plot.png").exists()  # plot=False
