"""Bad input everywhere: one line on stderr, exit code 2, no traceback, nothing overwritten."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from tests.conftest import FAST

runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, list(args), catch_exceptions=False)
    return result


def assert_bad(result, *fragments: str):
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ampctl: error: ")
    for f in fragments:
        assert f in err, (f, err)


@pytest.fixture
def runs(tmp_path):
    return tmp_path / "runs"


def train_args(runs, *extra):
    return ["train", *FAST, f"trainer.runs_dir={runs}", "--quiet", *extra]


@pytest.mark.parametrize(
    "override, fragments",
    [
        (
            "scaler.init_scal=3",
            ["unknown key 'scaler.init_scal'", "did you mean 'scaler.init_scale'"],
        ),
        ("trainer.max_step=3", ["did you mean 'trainer.max_steps'"]),
        (
            "trainer.max_steps=abc",
            ["trainer.max_steps=abc: wrong type, trainer.max_steps must be an integer"],
        ),
        (
            "scaler.init_scale=0",
            ["scaler.init_scale=0.0 is not allowed: scaler.init_scale must be a finite number > 0"],
        ),
        ("scaler.init_scale=-5", ["scaler.init_scale must be a finite number > 0"]),
        ("scaler.growth_factor=1", ["scaler.growth_factor must be a number > 1"]),
        ("scaler.backoff_factor=1.5", ["scaler.backoff_factor must be in (0, 1)"]),
        ("scaler.backoff_factor=0", ["scaler.backoff_factor must be in (0, 1)"]),
        ("scaler.growth_interval=0", ["scaler.growth_interval must be an integer >= 1"]),
        ("scaler.hysteresis=0", ["scaler.hysteresis must be an integer >= 1"]),
        (
            "scaler.min_scale=1e9",
            [
                "scaler.min_scale=1000000000.0 is not allowed",
                "scaler.min_scale must be <= max_scale (16777216.0)",
            ],
        ),
        ("optim.lr=-0.1", ["optim.lr must be a number > 0"]),
        ("trainer.max_steps=0", ["trainer.max_steps must be an integer >= 1"]),
        ("conf=nope", ["conf=nope: no such preset; available: bert_base, bert_large, config"]),
        (
            "precision=fp4",
            [
                "precision=fp4: no such option; precision can be one of bf16, fp16, fp16-pure, "
                "fp32, fp8"
            ],
        ),
        ("optim=lamb", ["optim=lamb: no such option; optim can be one of adamw, sgd"]),
        ("data=text", ["data.path is missing: data=text needs data.path=FILE_OR_DIR"]),
        (
            "model._target_=no.such.Model",
            ["model._target_='no.such.Model': cannot import module 'no.such'"],
        ),
        ("model._target_=collections.OrderedDict", ["returned OrderedDict, not a torch.nn.Module"]),
        ("trainer.device=tpu", ["trainer.device must be one of auto, cpu, cuda, cuda:N"]),
        ("+foo=1", ["unknown key 'foo'"]),
        ("a=b=c=[", ["cannot parse override"]),
    ],
)
def test_bad_overrides(runs, override, fragments):
    assert_bad(run(*train_args(runs, override)), *fragments)
    assert not runs.exists() or not any(runs.iterdir())  # no empty run folders left behind


def test_missing_and_empty_data_path(runs, tmp_path):
    assert_bad(
        run(
            *train_args(
                runs, "data=text", "data.vocab_size=260", f"data.path={tmp_path / 'none.txt'}"
            )
        ),
        "does not exist",
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_bad(
        run(*train_args(runs, "data=text", "data.vocab_size=260", f"data.path={empty}")), str(empty)
    )


class NoLoss(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return {"logits": self.lin(torch.zeros(1, 2))}


def test_model_without_loss(runs):
    res = run(*train_args(runs, "model._target_=tests.test_cli.NoLoss"))
    assert_bad(res, "returned dict with no scalar loss")


def test_existing_run_name_is_refused_and_untouched(runs):
    target = runs / "taken"
    target.mkdir(parents=True)
    (target / "metrics.jsonl").write_text("precious\n")
    assert_bad(run(*train_args(runs, "--name", "taken")), "exists already")
    assert (target / "metrics.jsonl").read_text() == "precious\n"


def test_bad_checkpoints_on_resume(tmp_path, runs):
    missing = tmp_path / "nope.pt"
    assert_bad(run("train", "--resume", str(missing)), "does not exist")
    empty_dir = tmp_path / "emptyrun"
    empty_dir.mkdir()
    assert_bad(run("train", "--resume", str(empty_dir)), "holds no checkpoint")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert_bad(run("train", "--resume", str(empty)), "is empty")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all" * 10)
    assert_bad(run("train", "--resume", str(junk)), "is not a readable checkpoint")
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    assert_bad(run("train", "--resume", str(foreign)), "is not an ampctl checkpoint")


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/ampctl-pwned",))


def test_pickle_payload_is_refused(tmp_path):
    if os.path.exists("/tmp/ampctl-pwned"):
        os.remove("/tmp/ampctl-pwned")
    evil = tmp_path / "evil.pt"
    torch.save({"format": "ampctl-checkpoint/1", "x": Evil()}, evil)  # as a real attack would
    assert_bad(run("train", "--resume", str(evil)), "was refused", "weights_only=True")
    raw = tmp_path / "raw.pt"
    with open(raw, "wb") as f:
        pickle.dump({"format": "ampctl-checkpoint/1", "x": Evil()}, f, protocol=4)
    assert_bad(run("train", "--resume", str(raw)), "is not a readable checkpoint")
    assert not os.path.exists("/tmp/ampctl-pwned")


def test_truncated_and_incompatible_checkpoints(runs, tmp_path):
    ok = run(*train_args(runs, "--name", "src"))
    assert ok.exit_code == 0, ok.output
    ck = sorted((runs / "src" / "checkpoints").glob("step_*.pt"))[-1]
    data = ck.read_bytes()
    cut = tmp_path / "cut" / "checkpoints"
    cut.mkdir(parents=True)
    (cut / "step_00000012.pt").write_bytes(data[: len(data) // 2])
    assert_bad(run("train", "--resume", str(cut / "step_00000012.pt")), "truncated or corrupt")
    # a checkpoint from another model: resume with a different hidden size
    assert_bad(
        run("train", "--resume", str(ck), "model.hidden_size=48"),
        "does not fit the configured model",
    )
    assert sorted((runs / "src" / "checkpoints").glob("step_*.pt"))[-1].read_bytes() == data


def test_print_config_shows_the_seed_settings_for_bert_large():
    res = run("train", "conf=bert_large", "--print-config")
    assert res.exit_code == 0
    out = res.stdout
    for line in [
        "num_layers: 24",
        "hidden_size: 1024",
        "num_heads: 16",
        "ffn_size: 4096",
        "vocab_size: 30522",
        "seq_len: 512",
        "batch_size: 64",
        "lr: 0.0001",
        "clip_grad_norm: 1.0",
        "init_scale: 1024.0",
        "growth_interval: 500",
        "- '*embeddings*'",
    ]:
        assert line in out, line


def test_help_explains_every_command():
    for cmd in (
        "train",
        "sweep-scale",
        "diagnose",
        "bench",
        "plot",
        "tokenizer",
        "tokenizer train",
    ):
        res = run(*cmd.split(), "--help")
        assert res.exit_code == 0 and "Usage" in res.output


def test_help_paragraphs_wrap_at_the_terminal_not_at_the_source_lines():
    """A command's description is wrapped to the terminal's width: no line of a paragraph ends
    half-way across an 80-column terminal while the sentence goes on below it (Typer keeps a
    docstring's own line breaks, which broke sentences mid-line)."""
    for cmd in ("train", "sweep-scale", "diagnose", "bench", "plot", "tokenizer train"):
        res = CliRunner().invoke(app, [*cmd.split(), "--help"], env={"COLUMNS": "80"})
        head = res.output.split("╭", 1)[0].splitlines()[3:]  # after the usage line
        paragraphs = "\n".join(line.rstrip() for line in head).split("\n\n")
        for para in paragraphs:
            lines = [x for x in para.splitlines() if x.strip()]
            short = [x for x in lines[:-1] if len(x) < 60]
            assert short == [], (cmd, short)


def test_debug_flag_shows_the_traceback(runs):
    res = runner.invoke(app, ["--debug", *train_args(runs, "scaler.init_scale=0")])
    assert res.exit_code == 2 and "Traceback" in res.output + res.stderr


def test_python_dash_m_entry_point():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ampctl", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0
    for cmd in ("train", "sweep-scale", "diagnose", "bench", "plot"):
        assert cmd in out.stdout


def test_no_numpy_warning_from_torch_on_a_core_install(tmp_path):
    """A core install has no NumPy; torch warns about it at import, ampctl never needs it."""
    import subprocess
    import sys

    block = "import sys; sys.modules['numpy'] = None; "  # as if NumPy were not installed
    # what every command does: the CLI module first, torch when the command needs it
    cmd = "import ampctl.cli; import torch; print('trainer:')"
    procs = {  # both at once (one core each)
        name: subprocess.Popen(
            [sys.executable, "-W", "default", "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for name, code in (("torch", block + "import torch"), ("ampctl", block + cmd))
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert "Failed to initialize NumPy" in out["torch"].stderr  # what a user would have seen
    assert out["ampctl"].returncode == 0, out["ampctl"].stderr
    assert "Failed to initialize NumPy" not in out["ampctl"].stderr
    assert "trainer:" in out["ampctl"].stdout


def test_resume_shows_the_run_dir_as_given_and_a_name_of_itself_says_drop_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
    fresh = ["trainer.runs_dir=runs", "trainer.ckpt_every=4", "logging.plot=false", "--quiet"]
    first = run("train", *FAST, "trainer.max_steps=4", *fresh, "--name", "x")
    assert first.exit_code == 0, first.output
    assert "run_dir: runs/x\n" in first.stdout
    files = {p: p.read_bytes() for p in (tmp_path / "runs").rglob("*") if p.is_file()}
    assert_bad(
        run("train", "--resume", "runs/x", "--name", "x"),
        "--resume runs/x --name x: --name starts a new run folder (a fork of the checkpoint) and "
        "runs/x is the run being resumed; to continue it, drop --name: "
        "ampctl train --resume runs/x",
    )
    assert {p: p.read_bytes() for p in (tmp_path / "runs").rglob("*") if p.is_file()} == files
    again = run("train", "--resume", "runs/x", "trainer.max_steps=8", "--quiet")
    assert again.exit_code == 0, again.output
    assert "run_dir: runs/x\n" in again.stdout  # the form a fresh run prints, not /tmp/.../x
    assert json.loads((tmp_path / "runs/x/summary.json").read_text())["steps"] == 8


def test_help_texts_name_what_ships():
    """The presets, the precisions and the command summaries in --help are what ampctl has:
    read from conf/ and the plugin registry, so a new preset or precision cannot be left out."""
    import re

    from ampctl.amp.precision import PRECISIONS
    from ampctl.config import available_presets

    flat = lambda text: re.sub(r"[\s│]+", " ", text)  # noqa: E731 - undo the panel wrapping
    top = flat(run("--help").output)
    assert "(fp16/bf16/fp8)" in top
    # every command's summary is one whole sentence on one line of the list
    for cmd in ("train", "sweep-scale", "diagnose", "bench", "plot"):
        summary = re.search(rf" {cmd} (.+?\.) ", top).group(1)
        assert summary[0].isupper() and "  " not in summary, (cmd, summary)
    for cmd in ("train", "bench", "sweep-scale"):
        text = flat(run(cmd, "--help").output)
        for preset in available_presets():
            assert preset in text, (cmd, preset)
    diag = flat(run("diagnose", "--help").output)
    assert all(p in diag for p in PRECISIONS)
