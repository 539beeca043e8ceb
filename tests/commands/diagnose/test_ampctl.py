"""ampctl diagnose on ampctl's own checkpoints: planted faults, history, replay,
recommendations, bad input. (The test model is not shipped with ampctl: the replay needs
``trust_code=True`` / ``--trust-code``, which the trust tests check.)"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from ampctl.amp.formats import ideal_scale, recommended_init_scale
from ampctl.cli import app
from ampctl.commands.diagnose import (
    diagnose as _diagnose,
)
from ampctl.commands.diagnose import (
    grad_norm_trend,
    overflow_bursts,
    run_diagnose,
)
from ampctl.commands.diagnose.stages import to_json
from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.checkpoint import FORMAT, latest_checkpoint, list_checkpoints
from ampctl.train.data import IGNORE_INDEX, PAD_ID
from ampctl.train.models import BertForMaskedLM
from ampctl.train.trainer import train
from tests.conftest import FAST

PAD = 4
TARGET = "tests.commands.diagnose.test_ampctl.DiagModel"


def diagnose(path, **kw):
    """The library call, trusting the test model (it does not ship with ampctl); the advice is
    not probed unless asked (test_probe.py and test_closed_loop.py try it)."""
    return _diagnose(path, trust_code=True, **{"probe": False, **kw})


PLANTED_STEP = 100
FP16_MAX = 65504.0


# ---------------------------------------------------------------------------- test models
class Amplifier(nn.Module):
    """Squares its input through a large intermediate: fine in fp32, inf in fp16 once boosted."""

    def __init__(self, dim: int, boost: float) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.boost = boost

    def forward(self, x):
        h = self.lin(x) * self.boost
        return 0.1 * (h * h) / (self.boost * self.boost)


class AdditiveMask(nn.Module):
    """Padding mask as an additive 0 / -inf tensor: an intentional -inf module output."""

    def forward(self, keep):
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


class DiagModel(nn.Module):
    """A tiny BERT with knobs for planting faults through the checkpoint's config.

    boost: an Amplifier between embeddings and encoder (1000 overflows fp16, not fp32).
    loss_factor: multiplies the loss (small: small gradients, as in a deep model).
    pad: the last ``pad`` positions of every other row are padding (-inf attention masks).
    """

    def __init__(self, boost: float = 1.0, loss_factor: float = 1.0, pad: int = 0, **kw) -> None:
        super().__init__()
        self.bert_mlm = BertForMaskedLM(**kw)
        self.amp = Amplifier(kw["hidden_size"], boost)
        self.mask = AdditiveMask()
        self.loss_factor = loss_factor
        self.pad = pad
        self.bert_mlm.bert.embeddings.register_forward_hook(lambda m, i, o: o + self.amp(o))

    def forward(self, input_ids, attention_mask=None, labels=None):
        if self.pad:
            keep = attention_mask.clone()
            keep[::2, -self.pad :] = False
            input_ids = input_ids.masked_fill(~keep, PAD_ID)
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
            attention_mask = self.mask(keep) == 0
        out = self.bert_mlm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return out.loss * self.loss_factor


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these models are tiny, and a second thread on a shared CPU only
    waits (runs after conftest's own thread setting)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _cfg(root: Path, *extra: str):
    return load_config(
        [
            *FAST,
            f"trainer.runs_dir={root / 'runs'}",
            "trainer.max_steps=6",
            "trainer.ckpt_every=3",
            "trainer.log_every=2",
            "model._target_=tests.commands.diagnose.test_ampctl.DiagModel",
            f"+model.pad={PAD}",
            "+model.boost=1.0",
            "+model.loss_factor=1.0",
            # pinned: the expected recommendations below are derived from these
            "optim.lr=0.001",
            "optim.clip_grad_norm=1.0",
            "scaler.growth_interval=100",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """A healthy 6-step fp16 run (checkpoints at steps 3 and 6), shared by the tests."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("diag")
    cfg = _cfg(root)
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "base"))
    assert res.status == "ok" and res.summary["skipped"] == 0
    return res.run_dir


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


def plant(run_dir: Path, edit) -> Path:
    """Edit the run's last real checkpoint and save it as a newer checkpoint of the same run
    (replacing an earlier plant)."""
    real = [
        p
        for p in list_checkpoints(run_dir / "checkpoints")
        if p.name != f"step_{PLANTED_STEP:08d}.pt"
    ]
    ck = torch.load(real[-1], weights_only=True)
    edit(ck)
    # a checkpoint at step 100 applied 100 updates: Adam counts them (diagnose reads skipped
    # steps from the count)
    for st in ck["optimizer"]["state"].values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"] = st["step"] + (PLANTED_STEP - ck["step"])
    ck["step"] = PLANTED_STEP
    path = run_dir / "checkpoints" / f"step_{PLANTED_STEP:08d}.pt"
    torch.save(ck, path)
    return path


def param_names(run_dir: Path) -> list[str]:
    """The optimizer's parameter order, from a model built independently of ampctl.diagnose."""
    ck = torch.load(list_checkpoints(run_dir / "checkpoints")[0], weights_only=True)
    kw = {k: v for k, v in ck["config"]["model"].items() if k != "_target_"}
    return [n for n, p in DiagModel(**kw).named_parameters() if p.requires_grad]


def kinds(report: dict) -> list[str]:
    return [p["kind"] for p in report["problems"]]


# ---------------------------------------------------------------------------- planted faults
def test_a_run_folder_from_before_events_jsonl_was_always_written_reads_alike(base_run, run_copy):
    assert (base_run / "events.jsonl").read_text() == ""  # written at the start, empty
    (run_copy / "events.jsonl").unlink()  # as older runs without events left them
    old, new = diagnose(run_copy, batches=1), diagnose(base_run, batches=1)
    assert old["healthy"] is True and old["problems"] == []
    assert {**old["history"], "run_dir": None} == {**new["history"], "run_dir": None}


def test_nan_weight_is_named_and_an_older_checkpoint_is_recommended(run_copy):
    name = "bert_mlm.bert.encoder.layer.1.attention.self.query.weight"

    def edit(ck):
        ck["model"][name][3, 5] = float("nan")

    planted = plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert rep["checkpoint"]["path"] == str(planted) and rep["checkpoint"]["step"] == PLANTED_STEP
    assert kinds(rep) == ["nonfinite_weights"]
    assert rep["problems"][0]["tensors"] == [name]
    msg = rep["problems"][0]["message"]
    assert msg.startswith(f"1 weight tensor(s) hold inf/NaN, first {name}; ")
    # the scaler checked every step and the course is clean: no update explains it (#36)
    assert "so no update put it there: not the lr nor the precision" in msg
    assert rep["recommendations"] == []
    (bad,) = rep["state"]["weights"]["bad"]
    assert (bad["name"], bad["nan"], bad["posinf"], bad["neginf"]) == (name, 1, 0, 0)
    assert rep["state"]["optimizer"]["bad"] == []
    assert rep["replay"]["ran"] is False and "already non-finite" in rep["replay"]["reason"]
    healthy = str(run_copy / "checkpoints" / "step_00000006.pt")
    assert [(c["step"], c["healthy"]) for c in rep["checkpoints"]] == [
        (PLANTED_STEP, False),
        (6, True),
        (3, True),
    ]
    assert rep["resume"] == {
        "checkpoint": healthy,
        "command": f"ampctl train --resume {healthy}",
        "why": "the newest checkpoint with a healthy state written before this checkpoint, "
        "whose own state is broken",
        "probe": "probe: not run: --no-probe",  # resuming unchanged is tried too (#36)
    }
    assert rep["verdict"]["status"] == "broken" and rep["verdict"]["kind"] == "nonfinite_weights"
    assert run_diagnose(run_copy, 2, None, "cpu", as_json=False, trust_code=True) == 1


def test_nan_loss_scale_in_the_checkpoint(run_copy):
    def edit(ck):
        ck["scaler"]["scale"] = float("nan")

    plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["bad_scale"]
    assert rep["replay"]["scale"] == 1024.0  # replayed at the configured init_scale instead
    healthy = str(run_copy / "checkpoints" / "step_00000006.pt")
    assert rep["resume"]["checkpoint"] == healthy


def test_inf_in_adam_state_names_the_parameter(run_copy):
    names = param_names(run_copy)
    name = "bert_mlm.bert.encoder.layer.0.output.dense.weight"
    idx = names.index(name)

    def edit(ck):
        pid = ck["optimizer"]["param_groups"][0]["params"][idx]
        ck["optimizer"]["state"][pid]["exp_avg_sq"].view(-1)[7] = float("inf")

    planted = plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["nonfinite_optimizer_state"]
    p = rep["problems"][0]
    assert p["params"] == [name] and p["tensors"] == [f"{name}.exp_avg_sq"]
    assert p["message"].startswith(f"optimizer state holds inf/NaN: exp_avg_sq of {name}; ")
    assert "no update put it there" in p["message"]
    (bad,) = rep["state"]["optimizer"]["bad"]
    assert (bad["param"], bad["key"], bad["posinf"]) == (name, "exp_avg_sq", 1)
    assert rep["state"]["weights"]["bad"] == []
    assert rep["replay"]["ran"] is True  # the weights are fine: the replay still runs
    # no fixed "halve it" (#36): the gradients were finite and normal (the scaler checked them),
    # so the inf came from no update; clipping is already at 1.0: resume unchanged
    assert rep["recommendations"] == []
    healthy = str(run_copy / "checkpoints" / "step_00000006.pt")
    assert str(planted) != healthy
    assert rep["resume"]["command"] == f"ampctl train --resume {healthy}"


def test_fp16_activation_overflow_names_the_module_and_fp32_cures_it(run_copy):
    def edit(ck):
        ck["config"]["model"]["boost"] = 1000.0

    planted = plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["forward_overflow"]
    fb = rep["replay"]["forward_first_bad"]
    assert fb["module"] == "amp" and fb["posinf"] and fb["dtype"] == "float16" and fb["fp32_finite"]
    assert rep["problems"][0]["module"] == "amp"
    amp_row = next(m for m in rep["replay"]["modules"] if m["name"] == "amp")
    assert amp_row["bad"] is True
    assert not any(math.isfinite(float(v)) for v in rep["replay"]["loss"])
    assert all(math.isfinite(v) for v in rep["replay"]["loss_fp32"])
    (rec,) = rep["recommendations"]
    assert rec["override"] == "precision.fp32_modules=[amp]"
    assert (
        rep["resume"]["command"]
        == f"ampctl train --resume {planted} 'precision.fp32_modules=[amp]'"
    )
    # the line parses as an override, and with it applied the same checkpoint replays cleanly
    assert load_config([rec["override"]]).precision.fp32_modules == ["amp"]

    def fixed(ck):
        ck["config"]["model"]["boost"] = 1000.0
        ck["config"]["precision"]["fp32_modules"] = ["amp"]

    plant(run_copy, fixed)
    again = diagnose(run_copy, batches=1)
    assert again["healthy"] and again["replay"]["forward_first_bad"] is None
    assert next(m for m in again["replay"]["modules"] if m["name"] == "amp")["dtype"] == "float32"

    # bf16 has fp32's range: the same checkpoint replayed with --precision bf16 does not overflow
    plant(run_copy, edit)
    bf16 = diagnose(run_copy, batches=1, precision="bf16")
    assert bf16["replay"]["precision"] == "bf16" and bf16["replay"]["forward_first_bad"] is None

    # forward overflows that keep coming (the scaler counted 3): bf16 is recommended too
    def persistent(ck):
        edit(ck)
        ck["scaler"]["forward_overflows"] = 3

    plant(run_copy, persistent)
    rep = diagnose(run_copy, batches=1)
    assert [r["override"] for r in rep["recommendations"]] == [
        "precision.fp32_modules=[amp]",
        "precision=bf16",
    ]


@pytest.mark.parametrize("afresh", [False, True])
def test_the_resume_line_pasted_into_a_shell_gives_ampctl_the_words_it_printed(tmp_path, afresh):
    """A list value is a glob to bash and zsh (zsh stops at one that matches nothing): the Resume
    line quotes every word, so a shell that fails on unmatched globs, in a folder holding a file
    the unquoted glob would match, hands ampctl exactly the overrides diagnose meant."""
    import shlex
    import subprocess

    from ampctl.commands.diagnose.recommend import resume_command
    from ampctl.commands.diagnose.stages import Recommendation

    overrides = ["precision.fp32_modules=[*ln_*]", "optim.betas=[0.9,0.95]", "optim.lr=0.01"]
    recs = [Recommendation(o, "why") for o in overrides]
    ckpt = str(tmp_path / "my runs" / "step_00000004.pt")
    (tmp_path / "precision.fp32_modules=l").touch()  # what [*ln_*] matches unquoted
    fresh = ["model=gpt2_tiny", "~data.path"]
    line = resume_command("ampctl", None if afresh else ckpt, recs, fresh=fresh)
    assert line.startswith("ampctl train")
    words = subprocess.run(
        ["bash", "-O", "failglob", "-c", "printf '%s\\n' " + line.removeprefix("ampctl train ")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    want = [*fresh, *overrides] if afresh else ["--resume", ckpt, *overrides]
    assert words == want
    assert shlex.split(line.split("   #", 1)[0])[2:] == want


def test_too_small_scale_shows_underflow_and_recommends_init_scale(run_copy):
    def edit(ck):
        ck["config"]["model"]["loss_factor"] = 1e-2  # gradients 100x smaller, as in a deep model
        ck["scaler"]["scale"] = 1.0

    plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["gradient_underflow"]
    g = rep["replay"]["gradients"]
    assert g["scale"] == 1.0
    assert g["lost_frac"] > 0.1 and g["underflow_frac"] > 0.1  # vs 0.3% at the run's scale
    assert g["lost_frac_at_recommended"] < 0.01
    rec = g["recommended_init_scale"]
    # S* = 65504 / max|g|, rounded down to a power of two, halved
    assert math.log2(rec).is_integer() and FP16_MAX / (4 * g["max_abs"]) < rec <= FP16_MAX / (
        2 * g["max_abs"]
    )
    assert [r["override"] for r in rep["recommendations"]] == [f"scaler.init_scale={int(rec)}"]
    assert load_config([f"scaler.init_scale={int(rec)}"]).scaler.init_scale == rec

    # the same gradients at the recommended scale: no underflow problem
    def at_rec(ck):
        ck["config"]["model"]["loss_factor"] = 1e-2
        ck["scaler"]["scale"] = float(rec)

    plant(run_copy, at_rec)
    fixed = diagnose(run_copy, batches=1)
    assert fixed["healthy"], fixed["problems"]
    assert fixed["replay"]["gradients"]["lost_frac"] == pytest.approx(g["lost_frac_at_recommended"])


def test_a_run_pinned_at_scale_1_is_told_its_activation_gradients_flush_and_how_to_lift_them(
    run_copy,
):
    """An unscaled fp16 run (scale pinned by min_scale = max_scale = 1): the replay counts the
    fp16 activation gradients below fp16's normal range, and the recommendation raises the
    ceiling too, since init_scale alone would be clamped back to 1."""

    def edit(ck):
        ck["config"]["model"]["loss_factor"] = 1e-3
        ck["config"]["scaler"].update(min_scale=1.0, max_scale=1.0)
        ck["scaler"].update(scale=1.0, min_scale=1.0, max_scale=1.0)

    plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["gradient_underflow"]
    g = rep["replay"]["gradients"]
    assert g["act_grad_underflow_frac"] > 0.5 and g["act_grad_zero_frac"] > 0.0
    assert g["recommended_init_scale"] == 1.0  # within the run's bounds: no help
    rec = g["recommended_init_scale_unbounded"]
    assert rec == recommended_init_scale(g["max_abs"], min_scale=0.0, max_scale=math.inf) > 1
    (p,) = rep["problems"]
    assert "fp16 activation-gradient elements fall below fp16's normal range" in p["message"]
    assert "the run's max_scale 1 keeps it there" in p["message"]
    assert [r["override"] for r in rep["recommendations"]] == [
        f"scaler.init_scale={int(rec)}",
        f"scaler.max_scale={int(max(rec, 2**24))}",
    ]


def test_scale_far_above_the_ideal_warns_of_backward_overflow(run_copy):
    def edit(ck):
        ck["scaler"]["scale"] = 2.0**24

    plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["backward_overflow"]
    assert rep["problems"][0]["severity"] == "warning"
    g = rep["replay"]["gradients"]
    assert g["headroom_log2"] < -1 and g["max_scaled"] > 2 * FP16_MAX
    assert rep["replay"]["backward_first_bad"] is not None  # the fp16 backward really overflows
    rec = g["recommended_init_scale"]
    assert [r["override"] for r in rep["recommendations"]] == [f"scaler.init_scale={int(rec)}"]
    assert rec * g["max_abs"] <= FP16_MAX / 2


def test_healthy_checkpoint_with_padding_masks_has_no_false_alarms(base_run):
    rep = diagnose(base_run, batches=2)
    assert rep["healthy"] is True
    assert rep["problems"] == [] and rep["recommendations"] == []
    r = rep["replay"]
    assert r["ran"] and r["precision"] == "fp16" and r["positions"] == [6, 7]
    assert r["forward_first_bad"] is None and r["backward_first_bad"] is None
    assert r["masked_modules"] == ["mask"]  # -inf from the padding mask: seen, not a fault
    assert not next(m for m in r["modules"] if m["name"] == "mask")["bad"]
    assert r["gradients"]["nonfinite_params"] == []
    h = rep["history"]
    assert h["first_overflow_step"] is None and h["first_nan_loss_step"] is None
    assert h["bursts"] == [] and h["scale_trajectory"] == [[1, 1024.0]]
    assert [row["step"] for row in h["before_break"]] == [2, 4, 6]
    latest = str(base_run / "checkpoints" / "step_00000006.pt")
    assert rep["resume"] == {"checkpoint": latest, "command": f"ampctl train --resume {latest}"}


def test_fp16_pure_masters_are_replayed_checked_and_named(tmp_path):
    cfg = _cfg(tmp_path, "precision=fp16-pure", "trainer.max_steps=3")
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "pure"))
    rep = diagnose(res.run_dir, batches=1)
    assert rep["healthy"], rep["problems"]
    assert rep["state"]["master"]["bad"] == [] and rep["replay"]["precision"] == "fp16-pure"
    assert math.isfinite(rep["replay"]["loss"][0])
    assert rep["replay"]["loss"][0] == pytest.approx(rep["replay"]["loss_fp32"][0], rel=1e-2)

    names = param_names(res.run_dir)
    name = "bert_mlm.bert.encoder.layer.0.intermediate.dense.bias"

    def edit(ck):
        ck["master"][names.index(name)][1] = float("-inf")

    plant(res.run_dir, edit)
    rep = diagnose(res.run_dir, batches=1)
    assert kinds(rep) == ["nonfinite_master"] and rep["problems"][0]["tensors"] == [name]
    (bad,) = rep["state"]["master"]["bad"]
    assert (bad["name"], bad["neginf"]) == (name, 1)
    healthy = str(res.run_dir / "checkpoints" / "step_00000003.pt")
    assert rep["resume"]["checkpoint"] == healthy and not rep["replay"]["ran"]


def test_real_forward_overflow_run_history_and_promotion(tmp_path):
    """A run that really went NaN: the guard located and promoted the module; diagnose reads it
    back from the events and recommends making it permanent."""
    cfg = _cfg(tmp_path, "trainer.max_steps=6")

    def fault(tr, step, phase):
        if step == 4:
            tr.model.amp.boost = 1000.0  # from now on the fp16 intermediate overflows

    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "nan"), fault=fault)
    rep = diagnose(res.run_dir, batches=1)
    h = rep["history"]
    assert h["first_nan_loss_step"] == 5 and h["first_overflow_step"] == 5
    assert h["first_overflow_source"] == "events" and h["promotions"] == ["amp"]
    assert h["events"] == {"overflow": 1, "promotion": 1}
    assert h["bursts"] == [
        {"start": 5, "end": 5, "length": 1, "scale": 1024.0, "after_growth": False}
    ]
    # the guard cured it: recovered (exit 0), the events named, the promotion made permanent
    assert kinds(rep) == [] and rep["healthy"]
    v = rep["verdict"]
    assert v["status"] == "recovered" and v["kind"] is None
    assert v["events"] == [
        "non-finite loss: 1 step skipped at 5",
        "the guard moved amp to fp32 at step 5",
    ]
    assert v["summary"] == (
        "recovered: non-finite loss: 1 step skipped at 5, the guard moved amp to fp32 at step 5, "
        "clean since"
    )
    assert rep["checkpoint"]["fp32_modules"] == ["amp"]
    assert [r["override"] for r in rep["recommendations"]] == ["precision.fp32_modules=[amp]"]


def test_overflow_bursts_after_growth_recommend_a_longer_growth_interval(run_copy):
    # (update, scale used, skipped): the scale grows to 2048 and overflows twice in a row, twice
    rows = [
        (1, 1024, 0),
        (2, 1024, 0),
        (3, 2048, 1),
        (4, 1024, 0),
        (5, 2048, 1),
        (6, 2048, 1),
        (7, 1024, 0),
    ]

    def edit(ck):
        ck["scaler"]["history"] = torch.tensor(rows, dtype=torch.float64)

    plant(run_copy, edit)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["overflow_after_growth"]
    assert rep["problems"][0]["severity"] == "warning"
    h = rep["history"]
    assert h["first_overflow_step"] == 3 and h["first_overflow_source"] == "scaler"
    assert [(b["start"], b["length"], b["after_growth"]) for b in h["bursts"]] == [
        (3, 1, True),
        (5, 2, True),
    ]
    assert h["scale_trajectory"][:4] == [[1, 1024.0], [3, 2048.0], [4, 1024.0], [5, 2048.0]]
    assert [r["override"] for r in rep["recommendations"]] == ["scaler.growth_interval=400"]


def test_grad_norm_explosion_before_nan_changes_no_lr_the_loss_does_not_give(run_copy):
    """The grad norm rose 100x and the loss went NaN, but the loss never left its course: the
    history shows no lr to go back to, so no fixed factor is printed (#36; clipping is on)."""
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    more = [
        dict(last, step=8 + 2 * i, grad_norm=g)
        for i, g in enumerate([3.0, 3.0, 3.0, 3.0, 3.0, 40.0, 300.0])
    ]
    more.append(dict(last, step=22, loss=float("nan"), grad_norm=float("nan")))
    with open(run_copy / "metrics.jsonl", "a") as f:
        for r in more:
            f.write(json.dumps(r) + "\n")  # NaN as the bare token, as the trainer writes it
    plant(run_copy, lambda ck: None)
    rep = diagnose(run_copy, batches=1)
    assert kinds(rep) == ["nan_loss", "grad_norm_explosion"]
    h = rep["history"]
    assert h["break_step"] == 22 and [r["step"] for r in h["before_break"]] == [12, 14, 16, 18, 20]
    assert h["grad_norm"]["peak"] == 300.0 and h["grad_norm"]["peak_step"] == 20
    assert rep["recommendations"] == []
    assert "no update put it there" not in rep["problems"][0]["message"]  # updates did


# ---------------------------------------------------------------------------- pure helpers
def test_overflow_bursts_pure():
    assert overflow_bursts([]) == []
    rows = [(1, 8.0, True), (2, 4.0, True), (3, 2.0, False), (4, 4.0, True)]
    assert to_json(overflow_bursts(rows)) == [
        {"start": 1, "end": 2, "length": 2, "scale": 8.0, "after_growth": False},
        {"start": 4, "end": 4, "length": 1, "scale": 4.0, "after_growth": True},
    ]
    # kinds of the scaler's record: 2 forward overflows are overflows, 3 spikes are not
    assert [b.start for b in overflow_bursts([(1, 8.0, 2), (2, 8.0, 3), (3, 8.0, 1)])] == [1, 3]


def test_grad_norm_trend_pure():
    assert grad_norm_trend([(1, 1.0)]) is None
    t = grad_norm_trend([(1, 2.0), (2, 2.0), (3, 4.0), (4, 2.0), (5, 2.0), (6, 2.0), (7, 19.0)])
    assert to_json(t) == {
        "baseline": 2.0,
        "peak": 19.0,
        "peak_step": 7,
        "ratio": 9.5,
        "exploded": False,
    }
    assert grad_norm_trend([(1, 1.0), (2, float("nan")), (3, 10.0)]).exploded is True


def test_recommended_scale_is_the_one_definition(run_copy):
    """diagnose recommends exactly ampctl.amp.formats.recommended_init_scale of its max|g|
    (the function sweep-scale uses too): one definition, no second rounding."""
    assert (ideal_scale(0.5), recommended_init_scale(0.5)) == (131008.0, 32768.0)

    def edit(ck):
        ck["scaler"]["scale"] = 2.0**24

    plant(run_copy, edit)
    g = diagnose(run_copy, batches=1)["replay"]["gradients"]
    assert g["recommended_init_scale"] == recommended_init_scale(g["max_abs"])
    assert g["ideal_scale"] == ideal_scale(g["max_abs"])


# ---------------------------------------------------------------------------- CLI, JSON, bad input
runner = CliRunner()


def test_json_output_has_the_same_findings(run_copy):
    names = param_names(run_copy)
    idx = names.index("bert_mlm.cls.predictions.transform.dense.weight")

    def edit(ck):
        pid = ck["optimizer"]["param_groups"][0]["params"][idx]
        ck["optimizer"]["state"][pid]["exp_avg_sq"].view(-1)[0] = float("nan")

    plant(run_copy, edit)
    res = runner.invoke(
        app,
        ["diagnose", str(run_copy), "--json", "--device", "cpu", "-b", "1", "--trust-code",
         "--no-probe"],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    got = json.loads(res.stdout)  # stdout is only JSON
    want = diagnose(run_copy, batches=1, device="cpu")
    got["replay"].pop("elapsed_s")
    want["replay"].pop("elapsed_s")
    assert got == want
    assert got["schema"] == "ampctl-diagnose/2" and kinds(got) == ["nonfinite_optimizer_state"]


def test_cli_rich_report_and_exit_codes(base_run):
    res = runner.invoke(
        app, ["diagnose", str(base_run), "--device", "cpu", "-b", "1", "--trust-code"]
    )
    assert res.exit_code == 0, res.output
    assert "Healthy: no problems found." in res.stdout and "1. State health" in res.stdout


class _Payload:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('ran')",))


def _bad_inputs(tmp: Path, base_run: Path) -> dict[str, tuple[Path, str]]:
    real = latest_checkpoint(base_run / "checkpoints")
    empty_dir = tmp / "nothing"
    empty_dir.mkdir()
    (tmp / "empty.pt").write_bytes(b"")
    data = real.read_bytes()
    (tmp / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp / "notes.txt").write_text("this is not a checkpoint\n")
    torch.save({"format": FORMAT, "step": 3}, tmp / "incomplete.pt")
    torch.save({"format": FORMAT, "model": {}, "x": _Payload()}, tmp / "payload.pt")
    with open(tmp / "raw.pkl", "wb") as f:
        pickle.dump({"format": FORMAT, "x": _Payload()}, f, protocol=2)
    return {
        "missing": (tmp / "nope.pt", "does not exist"),
        "no checkpoint": (empty_dir, "holds no checkpoint diagnose can read"),
        "empty": (tmp / "empty.pt", "is empty (0 bytes)"),
        "truncated": (tmp / "truncated.pt", "is not a readable checkpoint"),
        "text": (tmp / "notes.txt", "holds text ('this is not a checkpoint'), not a checkpoint"),
        "incomplete": (
            tmp / "incomplete.pt",
            "lacks model, config: not a complete ampctl checkpoint",
        ),
        "payload": (tmp / "payload.pt", "was refused"),
        "raw pickle": (tmp / "raw.pkl", "was refused: it is a raw pickle, not a file torch.save"),
    }


def test_bad_input_exits_2_with_one_line(base_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for label, (path, text) in _bad_inputs(tmp_path, base_run).items():
        res = runner.invoke(app, ["diagnose", str(path)])
        assert res.exit_code == 2, (label, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ampctl: error: '{path}'"), (
            label,
            res.stderr,
        )
        assert text in lines[0], (label, lines[0])
        assert "Traceback" not in res.output and res.stdout == ""
    assert not (tmp_path / "PWNED").exists()  # the payloads never ran


def test_bad_options_exit_2(base_run):
    for args, text in (
        (
            ["--precision", "fp4"],
            "--precision 'fp4' is not allowed: use one of fp32, bf16, fp16, fp16-pure, fp8",
        ),
        (["--device", "tpu"], "--device 'tpu' is not allowed: use auto, cpu, cuda or cuda:N"),
    ):
        res = runner.invoke(app, ["diagnose", str(base_run), *args])
        assert res.exit_code == 2, res.output
        assert res.stderr.strip() == f"ampctl: error: {text}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/ckpt"], "'/no/such/ckpt' does not exist: give a checkpoint file or folder"),
        (["--batches", "0", "."], "--batches 0: must be an integer >= 1"),
    ],
)
def test_json_is_printed_on_bad_input_too(args, message):
    res = CliRunner().invoke(app, ["diagnose", *args, "--json"])
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": message}
    assert res.stderr == f"ampctl: error: {message}\n"


def test_a_target_that_does_not_ship_needs_trust_code(base_run):
    """The test model is not ampctl's: without consent the state is still checked, the replay
    is skipped with one line naming the target and the flag."""
    rep = _diagnose(base_run, batches=1, device="cpu")
    assert rep["healthy"] and rep["state"]["weights"]["bad"] == []
    assert rep["replay"]["ran"] is False
    assert rep["replay"]["reason"] == (
        f"the checkpoint's config names model._target_={TARGET!r}, which does not ship with "
        "ampctl: it is not imported (a checkpoint is data); add --trust-code to replay"
    )


def test_branch_of_a_resumed_run_is_reported(run_copy):
    """A resume from step 3 set steps 4..6 aside in branches/001-step3: the main line says so,
    and the archived checkpoint is read with the main line's rows up to the fork."""
    from ampctl.runlog import RunLayout, prepare_resume

    lay = RunLayout(run_copy)
    prepare_resume(lay, lay.checkpoint(3), 3)
    rep = diagnose(run_copy, batches=1)
    assert rep["checkpoint"]["step"] == 3
    assert rep["branch"]["line"] == "main" and rep["branch"]["branches"] == ["branches/001-step3"]
    assert rep["branch"]["text"] == (
        "main line; resumed from step 3, discarded history in branches/001-step3"
    )
    archived = run_copy / "branches" / "001-step3" / "checkpoints" / "step_00000006.pt"
    rep = diagnose(archived, batches=1)
    assert rep["branch"]["line"] == "archived" and rep["checkpoint"]["step"] == 6
    assert [r["step"] for r in rep["history"]["before_break"]] == [2, 4, 6]
    res = runner.invoke(app, ["diagnose", str(run_copy), "-b", "1", "--device", "cpu"])
    assert "branch: main line; resumed from step 3" in res.stdout


def test_gpt2_optimizer_state_is_named_through_its_conv1d_layout(tmp_path):
    """GPT-2 checkpoints keep Conv1D's transposed weights in the state dict while the optimizer
    holds nn.Linear-shaped moments: the model order still names every entry."""
    cfg = load_config(
        [
            "conf=gpt2_tiny",
            *FAST,
            f"trainer.runs_dir={tmp_path}",
            "trainer.max_steps=3",
            "trainer.ckpt_every=3",
        ]
    )
    run = train(cfg, new_run_dir(cfg.trainer.runs_dir, "gpt2")).run_dir
    ckpt = latest_checkpoint(run / "checkpoints")
    ck = torch.load(ckpt, weights_only=True)
    names = [n for n in ck["model"] if n != "lm_head.weight"]  # tied to the embeddings
    i = names.index("transformer.h.0.attn.c_attn.weight")
    assert ck["model"][names[i]].shape != ck["optimizer"]["state"][i]["exp_avg"].shape
    ck["optimizer"]["state"][i]["exp_avg_sq"].view(-1)[0] = math.inf
    torch.save(ck, ckpt)
    rep = diagnose(ckpt, batches=1)
    assert kinds(rep)[0] == "nonfinite_optimizer_state"
    assert "exp_avg_sq of transformer.h.0.attn.c_attn.weight" in rep["problems"][0]["message"]
    assert rep["state"].get("optimizer_note") is None, rep["state"].get("optimizer_note")
