"""diagnose reads what other tools write: each format produced by its own library on CPU, a
healthy copy (exit 0) and one with a NaN weight and an inf Adam moment planted by the same
library (exit 1, both named), histories, and files that are never loaded."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from ampctl.commands.diagnose import name_optimizer_state

from . import makers
from .conftest import diagnose_cli, kinds, problem

HF_NAME = "bert.encoder.layer.0.intermediate.dense.weight"


class _Payload:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('ran')",))


# ---------------------------------------------------------------------------- Hugging Face
def test_hf_output_dir_healthy_lists_every_checkpoint_and_replays(hf_dirs):
    code, rep, _ = diagnose_cli(hf_dirs["healthy"])
    assert code == 0 and rep["format"] == "hf-trainer" and rep["healthy"]
    assert rep["checkpoint"]["path"].endswith("checkpoint-4") and rep["checkpoint"]["step"] == 4
    assert [(Path(c["path"]).name, c["healthy"]) for c in rep["checkpoints"]] == [
        ("checkpoint-4", True),
        ("checkpoint-2", True),
    ]
    assert rep["state"]["names"]["method"] == "by Trainer groups (decay, no decay)"
    assert rep["history"]["metrics_rows"] == 4 and rep["history"]["break_step"] is None
    r = rep["replay"]
    assert r["ran"] and r["data"].startswith("synthetic token batches") and r["precision"] == "fp32"
    assert all(v == v for v in r["loss"])  # finite on synthetic tokens within the vocabulary
    not_read = {f["file"] for f in rep["files"] if not f["read"]}
    assert {"training_args.bin", "rng_state.pth"} <= not_read


def test_hf_planted_nan_weight_and_inf_moment_are_named(hf_dirs):
    code, rep, _ = diagnose_cli(hf_dirs["nan"])
    assert code == 1 and kinds(rep) == ["nonfinite_weights", "nonfinite_optimizer_state"]
    assert problem(rep, "nonfinite_weights")["tensors"] == [HF_NAME]
    assert problem(rep, "nonfinite_optimizer_state")["params"] == [HF_NAME]
    (bad,) = rep["state"]["optimizer"]["bad"]
    assert (bad["param"], bad["key"], bad["posinf"]) == (HF_NAME, "exp_avg_sq", 1)
    healthy = str(hf_dirs["nan"] / "checkpoint-2")
    probe = rep["resume"].pop("probe")
    assert rep["resume"] == {
        "checkpoint": healthy,
        "command": f'trainer.train(resume_from_checkpoint="{healthy}")',
        "why": "the newest checkpoint with a healthy state written before this checkpoint, "
        "whose own state is broken",
    }
    # the advice is tried (#36): the model from config.json, resumed from the healthy checkpoint
    assert probe.startswith(f"probe (24 steps from {healthy}, synthetic token batches"), probe
    assert "resumed as it was: held" in probe
    # an fp32 Trainer run (no scaler) applied a non-finite update: skip such steps, in its terms
    (fix,) = rep["recommendations"]
    assert fix["override"] == "guard.enabled=true"
    assert fix["yours"].startswith("protect_trainer(trainer) (ampctl.integrations.transformers)")


def test_hf_real_divergence_history_reads_nan_filtered_zero_losses(hf_dirs):
    """lr=1e6: the Trainer's own run goes NaN at step 2; it logs loss 0.0 from then on."""
    code, rep, _ = diagnose_cli(hf_dirs["diverged"])
    h = rep["history"]
    assert code == 1 and h["nan_filtered_steps"] == [2, 3, 4, 5, 6]
    assert h["first_nan_loss_step"] == 2 and h["first_nonfinite_grad_norm_step"] == 2
    assert h["break_step"] == 2 and [r["step"] for r in h["before_break"]] == [1]
    assert kinds(rep) == ["nonfinite_weights", "nonfinite_optimizer_state", "nan_loss"]
    assert rep["verdict"]["first_bad_step"] == 2 and rep["history"]["skipped_steps"] == []
    assert "logged as 0.0" in problem(rep, "nan_loss")["message"]
    assert rep["resume"]["checkpoint"] is None  # checkpoint-3 is NaN too


def test_hf_folder_with_a_pickle_payload_refuses_that_file(hf_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "ckpt"
    shutil.copytree(hf_dirs["healthy"] / "checkpoint-4", dest)
    torch.save({"state": {}, "param_groups": [], "x": _Payload()}, dest / "optimizer.pt")
    code, rep, _ = diagnose_cli(dest)
    assert code == 1 and kinds(rep) == ["refused_file"]
    assert "optimizer.pt" in problem(rep, "refused_file")["message"]
    assert "builtins.exec" in problem(rep, "refused_file")["message"]
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------- Accelerate
def test_accelerate_save_state(fmt_root):
    pytest.importorskip("accelerate")
    ok = makers.make_accelerate(fmt_root / "acc")
    bad = makers.make_accelerate(fmt_root / "acc-nan", plant=True)
    code, rep, _ = diagnose_cli(ok)
    assert code == 0 and rep["format"] == "accelerate"
    assert {
        "file": "random_states_0.pkl",
        "read": False,
        "why": "pickled Python objects: never loaded",
    } in rep["files"]
    code, rep, _ = diagnose_cli(bad)
    assert code == 1 and problem(rep, "nonfinite_weights")["tensors"] == ["0.weight"]
    assert problem(rep, "nonfinite_optimizer_state")["params"] == ["2.weight"]
    assert rep["state"]["names"]["method"] == "by shape"
    assert rep["replay"]["ran"] is False


# ---------------------------------------------------------------------------- Lightning
def test_lightning_ckpt_and_its_metrics_csv(fmt_root):
    pytest.importorskip("lightning")
    version = makers.make_lightning(fmt_root / "lightning")
    code, rep, _ = diagnose_cli(version)
    assert code == 0 and rep["format"] == "lightning" and rep["checkpoint"]["step"] == 4
    assert rep["history"]["source"].endswith("metrics.csv") and rep["history"]["metrics_rows"] == 4
    assert rep["history"]["columns"]["loss"] == "train_loss"
    assert "not the model's class" in rep["replay"]["reason"]
    nan = makers.plant_lightning(version, fmt_root / "lightning-nan")
    code, rep, _ = diagnose_cli(nan)
    assert code == 1 and problem(rep, "nonfinite_weights")["tensors"] == ["net.0.weight"]
    assert problem(rep, "nonfinite_optimizer_state")["params"] == ["net.2.weight"]
    assert rep["history"]["first_nan_loss_step"] == 4 and rep["history"]["break_step"] == 4
    fix = next(r for r in rep["recommendations"] if r["override"] == "guard.enabled=true")
    assert fix["yours"].startswith("AmpctlCallback(run_dir) (ampctl.integrations.lightning)")
    # TensorBoardLogger instead of CSVLogger: the same history from the event files
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    tb = fmt_root / "lightning-tb" / "version_0"
    shutil.copytree(nan / "checkpoints", tb / "checkpoints")
    with SummaryWriter(str(tb)) as w:
        for step, loss in enumerate([0.9, 0.8, 0.7, 0.6, float("nan")]):
            w.add_scalar("train_loss", loss, step)
    code, rep, _ = diagnose_cli(tb)
    assert code == 1 and rep["history"]["source"] == str(tb)
    assert rep["history"]["first_nan_loss_step"] == 4 and rep["history"]["metrics_rows"] == 5


# ---------------------------------------------------------------------------- DCP
def test_dcp_folder_read_on_one_process(fmt_root, tmp_path, monkeypatch):
    ok = makers.make_dcp(fmt_root / "dcp")
    bad = makers.make_dcp(fmt_root / "dcp-nan", plant=True)
    code, rep, _ = diagnose_cli(ok)
    # the step and the optimizer's hyperparameters are non-tensor values (pickled): not read
    assert code == 0 and rep["format"] == "dcp" and rep["checkpoint"]["step"] is None
    unread = next(f for f in rep["files"] if "non-tensor" in f["file"])
    assert not unread["read"] and "step" in unread["why"]
    assert rep["state"]["names"]["method"] == "names in the checkpoint"
    code, rep, _ = diagnose_cli(ok, "--trust-code")  # DCP's own loader reads them
    assert code == 0 and rep["checkpoint"]["step"] == 3
    code, rep, _ = diagnose_cli(bad)
    assert code == 1 and problem(rep, "nonfinite_weights")["tensors"] == ["0.weight"]
    assert problem(rep, "nonfinite_optimizer_state")["params"] == ["2.weight"]
    # DCP's own reader would pickle.load .metadata; ours refuses a payload there
    monkeypatch.chdir(tmp_path)
    evil = tmp_path / "evil"
    shutil.copytree(ok, evil)
    (evil / ".metadata").write_bytes(pickle.dumps(_Payload()))
    code, _, err = diagnose_cli(evil)
    assert code == 2 and "was refused" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------- DeepSpeed
@pytest.mark.parametrize("name", ["zero0-fp32", "zero2-bf16"])
def test_deepspeed_checkpoints(name):
    """Checked-in checkpoints written by DeepSpeed 0.19 on CPU (data/make_deepspeed.py)."""
    code, rep, _ = diagnose_cli(makers.DEEPSPEED / name)
    assert code == 0 and rep["format"] == "deepspeed" and rep["checkpoint"]["step"] == 3
    code, rep, _ = diagnose_cli(makers.DEEPSPEED / f"{name}-nan")
    assert code == 1 and problem(rep, "nonfinite_weights")["tensors"] == ["0.weight"]
    assert problem(rep, "nonfinite_optimizer_state")["params"] == ["2.weight"]
    if name == "zero2-bf16":
        assert rep["checkpoint"]["precision"] == "bf16"
        assert problem(rep, "nonfinite_master")["tensors"] == ["0.weight"]


# ---------------------------------------------------------------------------- plain files
def test_state_dicts_and_safetensors(plain_files):
    for name, want in (
        ("model.pt", 0),
        ("model-nan.pt", 1),
        ("model.safetensors", 0),
        ("model-nan.safetensors", 1),
    ):
        code, rep, _ = diagnose_cli(plain_files[name])
        assert code == want, name
        assert rep["format"] == ("safetensors" if name.endswith("safetensors") else "state-dict")
        if want:
            assert problem(rep, "nonfinite_weights")["tensors"] == ["0.weight"]


def test_hand_rolled_dict_with_a_real_gradscaler(plain_files):
    code, rep, _ = diagnose_cli(plain_files["train_state.pt"])
    sc = rep["state"]["scaler"]
    assert code == 0 and sc["kind"] == "GradScaler" and sc["scale"] == 65536.0
    assert sc["skipped_total"] is None and sc["growth_tracker"] == 0  # not recorded: unknown
    assert (
        rep["checkpoint"]["step"] == 3 and rep["state"]["names"]["method"] == "by state-dict order"
    )
    code, rep, _ = diagnose_cli(plain_files["train_state-collapsed.pt"])
    assert code == 1 and kinds(rep) == ["scale_collapsed"]
    assert rep["state"]["scaler"]["scale"] == 2.0**16 / 2**24
    bf16 = next(r for r in rep["recommendations"] if r["override"] == "precision=bf16")
    assert bf16["yours"].startswith("torch.autocast(device_type, dtype=torch.bfloat16)")


# ---------------------------------------------------------------------------- choosing a reader
def test_format_flag_and_unreadable_inputs(plain_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = diagnose_cli(plain_files["model.pt"], "--format", "nope")
    assert code == 2 and "--format 'nope' is not allowed: use one of ampctl, hf-trainer" in err
    code, _, err = diagnose_cli(plain_files["model.pt"], "--format", "safetensors")
    assert code == 2 and "has no safetensors header (its length field does not fit)" in err
    code, rep, _ = diagnose_cli(plain_files["model.safetensors"], "--format", "safetensors")
    assert code == 0
    torch.save({"model": {"w": torch.zeros(2)}, "x": _Payload()}, tmp_path / "payload.pt")
    code, _, err = diagnose_cli(tmp_path / "payload.pt")
    assert code == 2 and "was refused" in err and "builtins.exec" in err
    assert not (tmp_path / "PWNED").exists()


def test_name_optimizer_state_by_order_by_shape_and_when_it_cannot():
    opt = {
        "state": {
            i: {"exp_avg": torch.zeros(s)} for i, s in enumerate([(4, 2), (4,), (3, 4), (3,)])
        },
        "param_groups": [{"params": [0, 2]}, {"params": [1, 3]}],
    }
    model_order = [("a.weight", (4, 2)), ("a.bias", (4,)), ("b.weight", (3, 4)), ("b.bias", (3,))]
    grouped = [model_order[0], model_order[2], model_order[1], model_order[3]]
    names, how, note = name_optimizer_state(
        opt, [("groups", grouped), ("model order", model_order)]
    )
    assert names == {0: "a.weight", 2: "b.weight", 1: "a.bias", 3: "b.bias"} and how == "by groups"
    names, how, note = name_optimizer_state(opt, [], model_order)  # no order: unique shapes
    assert names[2] == "b.weight" and how == "by shape" and note is None
    shared = [
        ("x", (4, 2)),
        ("y", (4, 2)),
        ("a.bias", (4,)),
        ("b.weight", (3, 4)),
        ("b.bias", (3,)),
    ]
    names, how, note = name_optimizer_state(opt, [], shared)
    assert names[0] == "param[0] (shape [4, 2])" and names[1] == "a.bias"
    assert note.startswith("1 of 4 optimizer entries cannot be named")


def test_hf_replay_on_real_text_through_the_saved_tokenizer(hf_dirs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ckpt = tmp_path / "checkpoint-4"
    shutil.copytree(hf_dirs["healthy"] / "checkpoint-4", ckpt)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(300)))
    code, rep, _ = diagnose_cli(ckpt, "--data", str(text))
    assert code == 0 and rep["replay"]["ran"] is False
    assert rep["replay"]["reason"].startswith(
        "--data needs the tokenizer saved beside the checkpoint"
    )
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(ckpt))
    code, rep, _ = diagnose_cli(ckpt, "--data", str(text), "--precision", "fp16")
    r = rep["replay"]
    assert code == 0 and r["ran"] and r["data"].startswith(str(text)) and r["precision"] == "fp16"
    assert r["gradients"]["scale"] == 65536.0  # no scaler.pt: GradScaler's default init_scale
