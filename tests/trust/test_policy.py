"""A checkpoint or a run folder is data from a stranger: nothing it names runs, nothing in it is
resolved, unless ampctl ships it or the user allows it on the command line."""

from __future__ import annotations

import os
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


# ---------------------------------------------------------------------------- resources
def test_files_read_whole_are_capped_regular_and_stay_in_their_folder(tmp_path):
    from ampctl.trust import FileRefused, read_bounded

    (tmp_path / "d").mkdir()
    small = tmp_path / "d" / "small.json"
    small.write_text("{}")
    assert read_bounded(small) == b"{}"
    with pytest.raises(FileRefused) as e:
        read_bounded(small, limit=1)
    assert e.value.reason == "is 2 B, over the 1 B limit for a file read whole: not read"
    inside = tmp_path / "d" / "link.json"
    inside.symlink_to(small)  # a link within its folder is followed
    assert read_bounded(inside) == b"{}"
    out = tmp_path / "d" / "out.json"
    out.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    with pytest.raises(FileRefused, match=r"is a symlink to '.*elsewhere\.json', outside its"):
        read_bounded(out)
    fifo = tmp_path / "d" / "fifo.json"
    os.mkfifo(fifo)  # opening it would block forever
    with pytest.raises(FileRefused, match=r"is not a regular file \(a FIFO or device\)"):
        read_bounded(fifo)


def test_a_saved_config_must_be_a_plain_tree():
    from ampctl.trust import ResourceRefused, check_tree

    check_tree({"a": [1, {"b": 2}], "c": {"d": None}}, source="c.pt")
    shared = {"x": 1}
    with pytest.raises(ResourceRefused, match="c.pt: one container appears at two places"):
        check_tree({"a": shared, "b": [shared]}, source="c.pt")
    deep: dict = {}
    node = deep
    for _ in range(150):
        node["n"] = node = {}
    with pytest.raises(ResourceRefused, match="nested deeper than 100 levels"):
        check_tree(deep, source="c.pt")
    with pytest.raises(ResourceRefused, match="holds more than 10 values"):
        check_tree(list(range(20)), source="c.pt", max_nodes=10)
    # the trust checks walk the same way: a shared config is refused before it is walked
    with pytest.raises(ResourceRefused):
        check_saved_config({"model": shared, "data": shared}, source="c.pt")


def test_memory_limit_and_sizes():
    from ampctl.errors import UsageError
    from ampctl.trust import ResourceRefused, check_memory, max_memory, memory_limit, parse_size

    assert parse_size("8G") == 8 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5g") == 3 << 29 and parse_size("4096") == 4096
    for bad in ("lots", "-1G", "0", "8X"):
        with pytest.raises(UsageError, match="is not a size"):
            parse_size(bad)
    with max_memory(1 << 20):
        assert memory_limit() == (1 << 20, "--max-memory")
        check_memory(1 << 20, what="w")
        with pytest.raises(ResourceRefused) as e:
            check_memory(3 << 20, what="'c.pt'")
    assert str(e.value) == (
        "'c.pt' needs about 3.0 MiB of memory, more than the 1.0 MiB allowed (--max-memory): "
        "nothing was allocated; if the machine has the memory, pass --max-memory SIZE (e.g. "
        "--max-memory 64G)"
    )
    limit, source = memory_limit()
    assert limit > 0 and source != "--max-memory"


def test_strict_run_file_readers_name_what_is_wrong(tmp_path):
    import pickle

    from ampctl.runlog.readers import RunFileError, load_config_text, load_json, read_json

    cases = {
        "deep.json": ("[" * 100_000 + "]" * 100_000, "is nested too deeply to read"),
        "pickle.json": (pickle.dumps({"a": 1}), "holds pickle bytes"),
        "bad.json": ('{"a": ', "is not valid JSON (Expecting value at line 1 column 7)"),
        "tag.yaml": ("a: !!python/object/apply:os.system ['true']\n", "uses the YAML tag"),
        "alias.yaml": ("a: &x [1, 2]\nb: *x\n", "one container appears at two places"),
        "list.yaml": ("- 1\n- 2\n", "holds a list, not a mapping of config keys"),
    }
    for name, (content, why) in cases.items():
        p = tmp_path / name
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(RunFileError) as e:
            (load_config_text if name.endswith(".yaml") else load_json)(p)
        assert e.value.reason.startswith(why), (name, e.value.reason)
        assert str(e.value).startswith(f"{str(p)!r}: ")
    assert read_json(tmp_path / "deep.json") is None  # the lenient reader: None, no exception
