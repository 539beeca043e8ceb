"""A checkpoint or a run folder is data from a stranger: nothing it names runs, nothing in it is
resolved, unless ampctl ships it or the user allows it on the command line."""

from __future__ import annotations

import sys

import pytest
import torch
from typer.testing import CliRunner

from ampctl.cli import app
from ampctl.runlog import RunLayout
from ampctl.trust import (
    UntrustedConfigError,
    check_saved_config,
    is_shipped_target,
    targets_in_overrides,
)
from tests.conftest import FAST

runner = CliRunner()


def test_shipped_targets_are_ampctls_own_models_only():
    assert is_shipped_target("ampctl.train.models.BertForMaskedLM")
    for other in (
        "subprocess.getoutput",
        "shutil.rmtree",
        "ampctl.runlog.new_run_dir",  # ships with ampctl, but is no model
        "ampctl.train.models.torch",  # a module reached through the models package
        "ampctl.train.modelsX.BertForMaskedLM",
        "",
    ):
        assert not is_shipped_target(other), other


def test_check_saved_config_names_the_key_and_the_way_to_allow_it():
    saved = {"model": {"_target_": "subprocess.getoutput", "cmd": "x"}}
    with pytest.raises(UntrustedConfigError) as e:
        check_saved_config(saved, source="checkpoint c.pt")
    assert str(e.value) == (
        "checkpoint c.pt: model._target_='subprocess.getoutput' does not ship with ampctl and a "
        "checkpoint is data, so it is not imported; if you trust it, add --trust-code or give "
        "model._target_=subprocess.getoutput on the command line"
    )
    check_saved_config(saved, source="c", trust_code=True)
    check_saved_config(saved, source="c", overrides=["model._target_=subprocess.getoutput"])
    with pytest.raises(UntrustedConfigError):  # another target than the one typed
        check_saved_config(saved, source="c", overrides=["model._target_=os.system"])
    with pytest.raises(UntrustedConfigError, match=r"trainer\.runs_dir holds the interpolation"):
        check_saved_config({"trainer": {"runs_dir": "${oc.env:HOME}"}}, source="c", trust_code=True)
    assert targets_in_overrides(["+model._target_='a.b'", "x=1"]) == {"model._target_": "a.b"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real ampctl checkpoint (6 steps of the tiny default model)."""
    root = tmp_path_factory.mktemp("trust")
    r = runner.invoke(
        app,
        ["train", *FAST, "trainer.max_steps=6", f"trainer.runs_dir={root}", "--name", "r", "-q"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    return RunLayout(root / "r").checkpoint(6)


def _edited(ckpt, tmp_path, **changes):
    ck = torch.load(ckpt, weights_only=True)
    for dotted, value in changes.items():
        node = ck["config"]
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    run = RunLayout(tmp_path / "edited")
    run.checkpoints_dir.mkdir(parents=True)
    torch.save(ck, run.checkpoint(6))
    return run


def _bad(result, *fragments):
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in result.output, err
    for f in fragments:
        assert f in err, (f, err)


def test_resume_runs_no_code_a_checkpoint_names(checkpoint, tmp_path):
    marker = tmp_path / "MARKER"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("still here")
    for target, args in (
        ("subprocess.getoutput", {"model.cmd": f"touch {marker}"}),
        ("subprocess.run", {"model.args": ["touch", str(marker)]}),
        ("shutil.rmtree", {"model.path": str(victim)}),
    ):
        run = _edited(checkpoint, tmp_path / target, **{"model._target_": target, **args})
        for cmd in (["train", "--resume", str(run.root), "-q"], ["plot", str(run.root)]):
            r = runner.invoke(app, cmd, catch_exceptions=False)
            if cmd[0] == "train":
                _bad(r, f"model._target_={target!r} does not ship with ampctl", "--trust-code")
        assert not marker.exists()
        assert (victim / "keep.txt").read_text() == "still here"


def test_resume_evaluates_no_interpolation(checkpoint, tmp_path, monkeypatch):
    secret = "s3cr3t-4mpctl-value"
    monkeypatch.setenv("AMPCTL_TEST_SECRET", secret)
    run = _edited(checkpoint, tmp_path, name="${oc.env:AMPCTL_TEST_SECRET}")
    r = runner.invoke(app, ["train", "--resume", str(run.root), "-q"], catch_exceptions=False)
    _bad(r, "name holds the interpolation '${oc.env:AMPCTL_TEST_SECRET}'")
    assert secret not in r.output
    for p in run.root.rglob("*"):
        if p.is_file() and p.suffix != ".pt":
            assert secret not in p.read_text(errors="replace"), p


def test_consent_on_the_command_line(checkpoint, tmp_path, monkeypatch):
    """A model the user's own module builds: refused by default, allowed by --trust-code or by
    repeating the target as an override."""
    (tmp_path / "mymodels.py").write_text(
        "from ampctl.train.models import BertForMaskedLM\n\n\n"
        "def tiny(**kw):\n    return BertForMaskedLM(**kw)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _edited(checkpoint, tmp_path, **{"model._target_": "mymodels.tiny"})
    r = runner.invoke(app, ["train", "--resume", str(run.root), "-q"], catch_exceptions=False)
    _bad(r, "model._target_='mymodels.tiny' does not ship with ampctl")
    assert "mymodels" not in sys.modules
    for extra in (["--trust-code"], ["model._target_=mymodels.tiny"]):
        steps = 7 if extra == ["--trust-code"] else 8
        r = runner.invoke(
            app,
            ["train", "--resume", str(run.root), f"trainer.max_steps={steps}", "-q", *extra],
            catch_exceptions=False,
        )
        assert r.exit_code == 0, r.output
    sys.modules.pop("mymodels", None)
