"""Other tools' histories found beside a checkpoint (#40), written by the real libraries.

One tiny real training run (an MLP under a ``torch.amp.GradScaler`` on the CPU), healthy and a
broken twin (a NaN in the input from step 6 on: the loss and gradients are NaN, the scaler skips
every step from there and halves its scale each time), logged to ampctl's own metrics.jsonl and, with each tool's own
metric names, to: TensorBoard beside a DCP checkpoint laid out as torchtitan does
(``checkpoint/step-N``, ``tb/<timestamp>/``), TensorBoard as Megatron's ``--tensorboard-dir``
beside ``iter_N/mp_rank_00``, a W&B offline run and an MLflow sqlite store. Every one gives the
history section the run folder gives.
"""

from __future__ import annotations

import importlib.util
import math
import re
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch

from ampctl.commands.diagnose.readers.histories import METRIC_NAMES, NAME_ROLES, schema_table
from ampctl.runlog import RunWriter

from . import makers
from .conftest import diagnose_cli

STEPS = 8
NAN_AT = 6
DOCS = Path(__file__).resolve().parents[3] / "docs" / "diagnose.md"


# ---------------------------------------------------------------------------- the run
def train(broken: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[dict]]:
    """A real loop: GradScaler, unscale, clip (norm only), step, StepLR. Rows as ampctl writes
    them (lr: the rate this step used; scale: the scale this step used)."""
    torch.manual_seed(0)
    model = makers.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, STEPS + 1):
        x = torch.randn(4, 8, generator=g)
        if broken and step >= NAN_AT:  # the data went bad late, and stayed bad
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        row = {
            "step": step,
            "loss": loss.item(),
            "grad_norm": gn.item(),
            "lr": sched.get_last_lr()[0],
            "scale": scaler.get_scale(),
        }
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()
        rows.append(row)
    return model, opt, rows


def write_ampctl(out: Path, rows: list[dict]) -> Path:
    out.mkdir(parents=True)
    w = RunWriter(out)
    for r in rows:
        w.metrics(r)
    return out


def save_plain(path: Path, model, opt) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def write_tb(folder: Path, rows: list[dict], names: dict[str, str], extra: str | None = None):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(folder)) as w:
        for r in rows:
            for key, tag in names.items():
                w.add_scalar(tag, r[key], r["step"])
            if extra:
                w.add_scalar(extra, 1234.0, r["step"])


def write_torchtitan(out: Path, model, opt, rows: list[dict]) -> Path:
    """torchtitan's dump folder: DCP at checkpoint/step-N, TensorBoard at tb/<timestamp>/."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        ckpt = out / "checkpoint" / f"step-{STEPS}"
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(ckpt))
    names = {"loss": "loss_metrics/global_avg_loss", "grad_norm": "grad_norm", "lr": "lr"}
    write_tb(out / "tb" / "20261204-0400", rows, names, extra="throughput(tps)")
    return ckpt


def write_megatron(out: Path, model, opt, rows: list[dict]) -> Path:
    ckpt = save_plain(out / "checkpoints" / f"iter_{STEPS:07d}" / "mp_rank_00" / "m.pt", model, opt)
    names = {
        "loss": "lm loss",
        "grad_norm": "grad-norm",
        "lr": "learning-rate",
        "scale": "loss-scale",
    }
    write_tb(out / "tensorboard", rows, names, extra="num-zeros")
    return ckpt


def write_wandb(out: Path, model, opt, rows: list[dict], monkeypatch) -> Path:
    """The HF Trainer's names (WandbCallback: ``train/...`` and ``train/global_step``)."""
    wandb = pytest.importorskip("wandb")
    ckpt = save_plain(out / "model.pt", model, opt)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = wandb.Settings(mode="offline", silent=True, console="off")
    run = wandb.init(dir=str(out), project="t", settings=settings)
    for r in rows:
        run.log(
            {
                "train/loss": r["loss"],
                "train/grad_norm": r["grad_norm"],
                "train/learning_rate": r["lr"],
                "train/global_step": r["step"],
            }
        )
    run.finish()
    wandb.teardown()  # the service has written every record (finish alone may return before)
    return ckpt


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory) -> Path:
    """An empty MLflow sqlite store, made once (MLflow runs its schema migrations: seconds);
    each run logs into a copy."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    pytest.importorskip("alembic")
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def write_mlflow(out: Path, model, opt, rows: list[dict], store: Path) -> Path:
    """The HF Trainer's MLflowCallback names (``loss``, ``grad_norm``, ``learning_rate``)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    ckpt = save_plain(out / "model.pt", model, opt)
    shutil.copy(store, out / "mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run = client.create_run("0")
    ms = [
        Metric(k, float(r[src]), 0, r["step"])
        for r in rows
        for k, src in (("loss", "loss"), ("grad_norm", "grad_norm"), ("learning_rate", "lr"))
    ]
    client.log_batch(run.info.run_id, metrics=ms)
    client.set_terminated(run.info.run_id)
    return ckpt


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("histories")
    out = {}
    for name, broken in (("healthy", False), ("broken", True)):
        model, opt, rows = train(broken)
        out[name] = {"rows": rows, "model": model, "opt": opt, "root": root / name}
    return out


#: what the history section says that every source can say
FIELDS = ("metrics_rows", "first_nan_loss_step", "first_nonfinite_grad_norm_step", "break_step")


def section(rep: dict) -> dict:
    h = rep["history"]
    out = {k: h[k] for k in FIELDS}
    out["loss"] = h["loss"]
    out["grad_norm"] = h["grad_norm"]
    out["before_break"] = [
        {k: r[k] for k in ("step", "loss", "grad_norm", "learning_rate")} for r in h["before_break"]
    ]
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float):
        # TensorBoard keeps float32: the loss and norm are float32 already, the lr is not
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)
    return a == b


def _diagnose_all(r: dict, monkeypatch, store: Path) -> dict[str, tuple[int, dict]]:
    root, rows, model, opt = r["root"], r["rows"], r["model"], r["opt"]
    paths = {
        "ampctl": write_ampctl(root / "ampctl", rows),
        "torchtitan": write_torchtitan(root / "torchtitan", model, opt, rows),
        "megatron": write_megatron(root / "megatron", model, opt, rows),
        "wandb": write_wandb(root / "wandb-run", model, opt, rows, monkeypatch),
        "mlflow": write_mlflow(root / "mlflow-run", model, opt, rows, store),
    }
    out = {}
    for name, p in paths.items():
        code, rep, err = diagnose_cli(p)
        assert rep is not None, (name, err)
        out[name] = (code, rep)
    return out


def test_every_tool_gives_the_history_its_run_folder_gives(runs, monkeypatch, mlflow_store):
    pytest.importorskip("tensorboard")
    for kind in ("healthy", "broken"):
        got = _diagnose_all(runs[kind], monkeypatch, mlflow_store)
        want = section(got["ampctl"][1])
        assert want["metrics_rows"] == STEPS
        if kind == "broken":
            assert want["first_nan_loss_step"] == NAN_AT and want["break_step"] == NAN_AT
        else:
            assert want["break_step"] is None and want["first_nan_loss_step"] is None
        codes = {name: code for name, (code, _) in got.items()}
        assert set(codes.values()) == {0 if kind == "healthy" else 1}, (kind, codes)
        for name, (_, rep) in got.items():
            h = rep["history"]
            assert same(section(rep), want), (kind, name, section(rep), want)
            if name == "ampctl":
                continue
            assert h["source"] != "run folder" and h["columns"]["loss"], name
        # the scale Megatron logged (loss-scale) is the scale ampctl's metrics.jsonl holds
        mega = got["megatron"][1]["history"]
        assert mega["scale_trajectory"] == got["ampctl"][1]["history"]["scale_trajectory"]
        assert mega["columns"] == {
            "loss": "lm loss",
            "scale": "loss-scale",
            "grad_norm": "grad-norm",
            "learning_rate": "learning-rate",
        }
        titan = got["torchtitan"][1]["history"]
        assert titan["source"].endswith("tb") and any(
            "throughput(tps)" in n for n in titan["notes"]
        )
        assert not any("num-zeros" in n for n in mega["notes"])  # known, not a health figure
        wb = got["wandb"][1]["history"]
        if importlib.util.find_spec("wandb.sdk.internal.datastore") is None:
            assert any("no Python reader of .wandb files" in n for n in wb["notes"])
        assert wb["columns"]["loss"] == "train/loss"
    # the broken run's scale halved at each NaN step (the scaler skipped them)
    scales = [r["scale"] for r in runs["broken"]["rows"]]
    assert scales[NAN_AT] == scales[NAN_AT - 1] / 2 == scales[NAN_AT + 1] * 2


# ---------------------------------------------------------------------------- TensorBoard
def _tb_run(tmp_path: Path) -> Path:
    pytest.importorskip("tensorboard")
    _, _, rows = train(False)
    d = tmp_path / "tb" / "run"
    write_tb(d, rows, {"loss": "loss_metrics/global_avg_loss"})
    return d


def _masked_crc(data: bytes) -> int:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return masked_crc32c(data)


def test_a_tfevents_record_claiming_3gb_is_not_allocated(tmp_path):
    """A record whose length field (with a valid CRC, so tensorboard's reader believes it)
    claims 3 GB: the records before it are read, it is not (tensorboard's own reader would
    ask for 3 GB), and a note says so."""
    from ampctl.commands.diagnose.readers.tb_history import read_tensorboard, valid_records

    d = _tb_run(tmp_path)
    f = next(d.glob("events.out.tfevents.*"))
    before, _ = valid_records(f)
    head = struct.pack("<Q", 3 << 30)
    with open(f, "ab") as out:
        out.write(head + struct.pack("<I", _masked_crc(head)) + b"\0" * 64)
    count, why = valid_records(f)
    assert count == before and "claims 3.0 GiB" in why
    h = read_tensorboard(d)
    assert [r["step"] for r in h.rows] == list(range(1, STEPS + 1))
    assert any("claims 3.0 GiB" in n for n in h.notes)
    # under a 2 GiB address-space limit (the process peaks near 0.7 GiB): tensorboard's reader
    # asked for 3 GiB there, a MemoryError (seen with the frame walk taken out)
    import resource
    import subprocess
    import sys

    code = (
        "from pathlib import Path; import sys\n"
        "from ampctl.commands.diagnose.readers.tb_history import read_tensorboard\n"
        "h = read_tensorboard(Path(sys.argv[1])); print(len(h.rows), h.notes)"
    )
    limit = 2 << 30
    res = subprocess.run(
        [sys.executable, "-c", code, str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(f"{STEPS} ") and "MemoryError" not in res.stdout, res.stdout


def test_tb_reader_streams_not_event_accumulator(tmp_path, monkeypatch):
    """Every point is kept (EventAccumulator samples scalars to a reservoir) and the
    accumulator is never used."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing import event_accumulator

    from ampctl.commands.diagnose.readers.tb_history import read_tensorboard

    def refuse(*a, **k):
        raise AssertionError("EventAccumulator used")

    monkeypatch.setattr(event_accumulator.EventAccumulator, "__init__", refuse)
    from torch.utils.tensorboard import SummaryWriter

    d = tmp_path / "tb" / "big"
    with SummaryWriter(str(d)) as w:
        for s in range(1500):  # over the accumulator's default 1000-point reservoir
            w.add_scalar("grad_norm", float(s), s)
            w.add_scalar("lr", s / 4, s, new_style=True)  # a 0-d tensor, not simple_value
    h = read_tensorboard(tmp_path / "tb")
    assert len(h.rows) == 1500
    assert h.rows[-1] == {"step": 1499, "grad_norm": 1499.0, "learning_rate": 374.75}


def test_resumed_torchtitan_run_two_timestamps_later_wins(tmp_path):
    pytest.importorskip("tensorboard")
    from ampctl.commands.diagnose.readers.tb_history import read_tensorboard

    tb = tmp_path / "tb"
    write_tb(tb / "20261204-0100", [{"step": s, "loss": 1.0} for s in (1, 2, 3)], {"loss": "lr"})
    import time

    time.sleep(1.1)  # event files are named by the second they were opened
    write_tb(tb / "20261204-0200", [{"step": s, "loss": 2.0} for s in (3, 4)], {"loss": "lr"})
    h = read_tensorboard(tb)
    assert [(r["step"], r["learning_rate"]) for r in h.rows] == [
        (1, 1.0),
        (2, 1.0),
        (3, 2.0),
        (4, 2.0),
    ]
    assert any("2 event files" in n for n in h.notes)


def test_hf_runs_folder_when_trainer_state_is_missing(tmp_path):
    """An HF Trainer output_dir whose checkpoint-N lost its trainer_state.json: the Trainer's
    TensorBoard logs in runs/<date>_<host>/ (``train/loss``) are the history."""
    pytest.importorskip("tensorboard")
    from ampctl.commands.diagnose.readers.base import Found
    from ampctl.commands.diagnose.readers.histories import history_beside

    _, _, rows = train(True)
    out = tmp_path / "out"
    ckpt = out / "checkpoint-8"
    ckpt.mkdir(parents=True)
    names = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/learning_rate"}
    write_tb(out / "runs" / "Dec04_04-00-00_host", rows, names)
    h = history_beside(Found(format="hf-trainer", path=ckpt))
    assert h is not None and h.columns["loss"] == "train/loss" and len(h.rows) == STEPS
    assert math.isnan(h.rows[NAN_AT - 1]["loss"])


# ---------------------------------------------------------------------------- MLflow
def test_mlflow_store_is_opened_read_only(tmp_path, mlflow_store, monkeypatch):
    """Nothing is written: not the store, not beside it, not in the working directory; a
    database MLflow would write to is refused before MLflow opens it."""
    from ampctl.commands.diagnose.readers.mlflow_history import read_mlflow
    from ampctl.runlog.readers import RunFileError

    model, opt, rows = train(False)
    rows[3]["grad_norm"] = float("inf")  # MLflow's SQL store keeps inf as float max
    ckpt = write_mlflow(tmp_path, model, opt, rows, mlflow_store)
    db = ckpt.parent / "mlflow.db"
    before, listing = db.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    h = read_mlflow(db)
    assert db.read_bytes() == before and list(cwd.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*listing, "cwd"])
    assert h.rows[3]["grad_norm"] == float("inf") and any(
        "float max" in n or "inf" in n for n in h.notes
    )
    # an empty sqlite database: MLflow would create its tables; read-only, it is refused
    import sqlite3

    empty = tmp_path / "empty-mlflow.db"
    sqlite3.connect(empty).execute("create table t (x)").connection.commit()
    size = empty.stat().st_size
    with pytest.raises(RunFileError, match="not an MLflow store"):
        read_mlflow(empty)
    assert empty.stat().st_size == size


# ---------------------------------------------------------------------------- the table
def test_the_name_table_is_one_table_and_docs_show_it():
    """A name means one role in every tool that logs it, and docs/diagnose.md holds the table
    :func:`schema_table` renders from the code."""
    for tool, names in METRIC_NAMES.items():
        for name, role in names.items():
            assert NAME_ROLES[name] == role, (tool, name)
    text = DOCS.read_text()
    assert schema_table() in text, "docs/diagnose.md: paste schema_table()'s output"


def test_unknown_names_are_listed_not_guessed():
    from ampctl.commands.diagnose.readers.histories import build_history

    h = build_history("x", [{"step": 1, "my_loss": 1.0, "lm loss": 2.0, "gnorm": 3.0}])
    assert h.columns == {"loss": "lm loss"} and h.rows == [{"step": 1, "loss": 2.0}]
    assert re.search(r"my_loss, gnorm", h.notes[-1])


# ---------------------------------------------------------------------------- ampctl plot
def test_plot_draws_a_torchtitan_run_from_the_same_readers(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from typer.testing import CliRunner

    from ampctl.cli import app
    from ampctl.commands.plot import load_run_data

    model, opt, rows = train(True)
    dump = tmp_path / "dump"
    write_torchtitan(dump, model, opt, rows)
    data = load_run_data(dump)
    xs, losses, _ = data.series("loss")
    assert xs == [r["step"] for r in rows]
    assert same(losses, [r["loss"] for r in rows]) and math.isnan(losses[NAN_AT - 1])
    assert data.series("lr")[1] == pytest.approx([r["lr"] for r in rows])
    assert data.notes[0] == f"history read from {dump / 'tb'}"
    out = tmp_path / "titan.png"
    res = CliRunner().invoke(app, ["plot", str(dump), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the checkpoint folder: the tb/ beside it is found the way diagnose finds it
    res = CliRunner().invoke(app, ["plot", str(dump / "checkpoint"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    # a folder with nothing of any tool's: plot's own message, exit 2
    (tmp_path / "x" / "empty").mkdir(parents=True)
    res = CliRunner().invoke(app, ["plot", str(tmp_path / "x" / "empty")])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output


# ---------------------------------------------------------------------------- W&B, damaged
@pytest.fixture(scope="module")
def wandb_file(tmp_path_factory) -> Path:
    """One real offline run: 8 rows, one of them 3000 metrics wide (a record over a 32 KiB
    block: split into first/middle/last chunks)."""
    wandb = pytest.importorskip("wandb")
    out = tmp_path_factory.mktemp("wandb")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    try:
        run = wandb.init(
            dir=str(out), project="t", settings=wandb.Settings(mode="offline", console="off")
        )
        for s in range(1, STEPS + 1):
            row = {"trainer/global_step": s, "train_loss": 1.0 / s}
            if s == 4:
                row.update({f"layer{i}/grad_norm": float(i) for i in range(3000)})
            run.log(row)
        run.finish()
        wandb.teardown()
    finally:
        mp.undo()
    return next((out / "wandb").glob("offline-run-*/run-*.wandb"))


def test_wandb_record_over_blocks_and_damage(wandb_file, tmp_path):
    from ampctl.commands.diagnose.readers.wandb_history import read_wandb

    h = read_wandb(wandb_file.parent.parent)  # the wandb/ folder
    assert [r["step"] for r in h.rows] == list(range(1, STEPS + 1)), h.notes
    assert h.rows[3] == {"step": 4, "loss": 0.25} and h.columns == {"loss": "train_loss"}
    assert any(re.search(r"layer\d+/grad_norm.* and 2988 more", n) for n in h.notes), h.notes
    # a flipped byte in the middle: the rows before it are kept, the rest is named as not read
    data = bytearray(wandb_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "run-x.wandb"
    bad.write_bytes(bytes(data))
    h = read_wandb(bad)
    assert any("fails its CRC" in n for n in h.notes)
    assert len(h.rows) < STEPS
    # a chunk claiming more than the file holds: not read, no allocation of what it claims
    cut = tmp_path / "run-cut.wandb"
    cut.write_bytes(wandb_file.read_bytes()[: len(data) // 3])
    h = read_wandb(cut)
    assert any("the rest is not read" in n for n in h.notes), h.notes
    # not a W&B file at all: one line
    other = tmp_path / "run-other.wandb"
    other.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    from ampctl.runlog.readers import RunFileError

    with pytest.raises(RunFileError, match="not a W&B run file"):
        read_wandb(other)


# ---------------------------------------------------------------------------- trust
def test_an_event_file_linking_out_of_its_folder_is_a_finding(tmp_path):
    """A symlinked event file pointing outside its folder is not opened: the report says the
    history is unreadable, naming the link."""
    pytest.importorskip("tensorboard")
    model, opt, rows = train(False)
    outside = tmp_path / "outside"
    write_tb(outside, rows, {"loss": "lm loss"})
    run = tmp_path / "run"
    ckpt = save_plain(run / "model.pt", model, opt)
    (run / "tensorboard").mkdir()
    target = next(outside.glob("events.out.tfevents.*"))
    (run / "tensorboard" / target.name).symlink_to(target)
    code, rep, _ = diagnose_cli(ckpt)
    msg = next(p for p in rep["problems"] if p["kind"] == "unreadable_history")
    # named in the report, and no problem of the run by itself (#35): a note, exit 0
    assert "outside its folder" in msg["message"] and msg["severity"] == "note"
    assert code == 0 and rep["verdict"]["status"] == "healthy"


def test_mlflow_file_store_beside_a_checkpoint(tmp_path, monkeypatch):
    """An ``mlruns/`` file store (MLflow 3 writes one only with MLFLOW_ALLOW_FILE_STORE)."""
    pytest.importorskip("mlflow")
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    model, opt, rows = train(True)
    ckpt = save_plain(tmp_path / "model.pt", model, opt)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.create_run("0")
    ms = [Metric("ampctl/loss", r["loss"], 0, r["step"]) for r in rows]
    client.log_batch(run.info.run_id, metrics=ms)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    code, rep, _ = diagnose_cli(ckpt)
    h = rep["history"]
    assert h["columns"] == {"loss": "ampctl/loss"} and h["first_nan_loss_step"] == NAN_AT
    assert code == 1
    import os

    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # restored after the read
