"""``ampctl train logging.mlflow=true logging.wandb=true``, as a user types it on a machine with
only the extras and no network: a fresh MLflow store is made in the run folder, the W&B run is
offline, both get the figures and, at the end, the run's plot."""

from __future__ import annotations

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
pytest.importorskip("wandb")
pytest.importorskip("matplotlib")

from tests.conftest import read_jsonl  # noqa: E402
from tests.test_cli import run, train_args  # noqa: E402
from tests.ui.readback import (  # noqa: E402
    local_uri,
    mlflow_run,
    wandb_file,
    wandb_history,
)


def test_train_with_both_sinks_sends_figures_and_the_plot(tmp_path):
    import wandb

    runs = tmp_path / "runs"
    res = run(*train_args(runs, "logging.mlflow=true", "logging.wandb=true", "--name", "both"))
    assert res.exit_code == 0, res.output
    d = runs / "both"
    assert (d / "plot.png").is_file() and wandb.run is None
    rows = read_jsonl(d / "metrics.jsonl")
    assert not (d / "events.jsonl").exists() or read_jsonl(d / "events.jsonl") == []
    # MLflow: a store made here, the losses, the plot as an artifact, the run finished
    client, mrun = mlflow_run(local_uri(d))
    rid = mrun.info.run_id
    losses = [(m.step, m.value) for m in client.get_metric_history(rid, "ampctl/loss")]
    assert losses == [(r["step"], r["loss"]) for r in rows]
    names = {a.path for a in client.list_artifacts(rid, "ampctl")}
    assert names == {"ampctl/plot.png", "ampctl/summary.json"}
    plot = client.download_artifacts(rid, "ampctl/plot.png", str(tmp_path / "dl"))
    assert open(plot, "rb").read() == (d / "plot.png").read_bytes()
    assert mrun.info.status == "FINISHED"
    # W&B: the same losses, the plot as an image, byte for byte
    f = wandb_file(d)
    hist = wandb_history(f)
    assert [(h["ampctl/step"], h["ampctl/loss"]) for h in hist if "ampctl/loss" in h] == [
        (r["step"], r["loss"]) for r in rows
    ]
    (img,) = [h for h in hist if h.get("ampctl/plot/_type") == "image-file"]
    assert (f.parent / "files" / img["ampctl/plot/path"]).read_bytes() == (
        d / "plot.png"
    ).read_bytes()
