"""ampctl diagnose on checkpoints of precision=fp8 runs (real torchao on CPU, one encoder layer:
7 fp8 layers): the replay converts the model as the run had it and reports each fp8 layer's
cast headroom in e4m3/e5m2 terms; a planted large weight is named first with the exclusion."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao.float8")

from ampctl.amp import fp8  # noqa: E402
from ampctl.config import load_config  # noqa: E402
from ampctl.runlog.writers import new_run_dir  # noqa: E402
from ampctl.train.checkpoint import latest_checkpoint  # noqa: E402
from ampctl.train.trainer import Trainer  # noqa: E402
from tests.conftest import FAST  # noqa: E402

from .conftest import diagnose_cli, kinds, problem  # noqa: E402

PLANTED = "bert.encoder.layer.0.output.dense"  # its output is normalized: nothing propagates
BIG = 2000.0  # > e4m3's max 448: headroom log2(448 / 2000) = -2.16
EXCLUDE = list(fp8.DEFAULT_EXCLUDE)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("fp8")
    cfg = load_config(
        [
            *FAST,
            f"trainer.runs_dir={root}",
            "precision=fp8",
            "model.num_layers=1",
            "trainer.max_steps=2",
            "trainer.log_every=2",
            "trainer.ckpt_every=2",
        ]
    )
    res = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "healthy")).run()
    assert res.status == "ok"
    return res.run_dir


def _variant(run: Path, dest: Path, change) -> Path:
    """A copy of the run folder whose checkpoint ``change(ck)`` edited."""
    shutil.copytree(run, dest)
    ckpt = latest_checkpoint(dest / "checkpoints")
    ck = torch.load(ckpt, weights_only=True)
    change(ck)
    torch.save(ck, ckpt)
    return dest


def _plant(ck) -> None:
    ck["model"][f"{PLANTED}.weight"][3, 5] = BIG


def test_a_healthy_fp8_checkpoint_has_no_finding(fp8_run):
    code, rep, err = diagnose_cli(fp8_run)
    assert code == 0 and err == "" and rep["problems"] == [] and rep["recommendations"] == []
    assert rep["schema"] == "ampctl-diagnose/2" and rep["replay"]["precision"] == "fp8"
    f = rep["fp8"]
    assert f["ran"] and f["recipe"] == "tensorwise" and f["exclude"] == EXCLUDE
    assert len(f["layers"]) == 7 and sorted(m["name"] for m in f["layers"]) == sorted(
        f["converted"]
    )
    heads = [m["headroom_log2"] for m in f["layers"]]
    assert heads == sorted(heads) and heads[0] > 1  # least headroom first, all of it healthy
    for m in f["layers"]:
        assert m["formats"] == {"in": "e4m3", "w": "e4m3", "go": "e5m2"}
        assert m["findings"] == [] and not m["nonfinite"]
        assert 0 < m["w_amax"] < 1 and 0 < m["go_amax"]  # the backward reached every layer
        assert m["w_headroom_log2"] == pytest.approx(math.log2(448 / m["w_amax"]))
        assert m["go_headroom_log2"] == pytest.approx(math.log2(57344 / m["go_amax"]))
        assert m["sat"] < 0.1 and m["go_under"] < 0.01


def test_a_planted_large_weight_is_named_first_with_the_exclusion(fp8_run, tmp_path):
    run = _variant(fp8_run, tmp_path / "planted", _plant)
    code, rep, _ = diagnose_cli(run)
    assert code == 1 and kinds(rep) == ["fp8_headroom"]
    first = rep["fp8"]["layers"][0]
    assert first["name"] == PLANTED and first["w_amax"] == BIG
    assert first["headroom_log2"] == first["w_headroom_log2"] == pytest.approx(math.log2(448 / BIG))
    assert first["headroom_log2"] < 0
    assert first["w_under"] > 0.05  # the outlier sets the scale: small weights flush to zero
    assert [m["name"] for m in rep["fp8"]["layers"] if m["findings"]] == [PLANTED]
    p = problem(rep, "fp8_headroom")
    assert p["layers"] == [PLANTED] and "weight amax 2000 is above e4m3's max 448" in p["message"]
    override = f"precision.fp8_exclude=[{','.join([*EXCLUDE, PLANTED])}]"
    assert [r["override"] for r in rep["recommendations"]] == [override]
    assert rep["resume"]["command"].endswith(f"'{override}'")  # on --resume, quoted for a shell
    # the override parses as the plugin's exclusion list
    assert load_config(["precision=fp8", override]).precision.fp8_exclude == [*EXCLUDE, PLANTED]


def test_demoted_layers_stay_demoted_in_the_replay(fp8_run, tmp_path):
    def demote(ck):
        _plant(ck)
        ck["precision"]["fp8"]["demoted"] = {PLANTED: "saturation above 10.0%"}

    code, rep, _ = diagnose_cli(_variant(fp8_run, tmp_path / "demoted", demote))
    f = rep["fp8"]
    assert f["demoted"] == {PLANTED: "saturation above 10.0%"}
    assert PLANTED not in f["converted"] and PLANTED not in [m["name"] for m in f["layers"]]
    assert len(f["layers"]) == 6 and code == 0 and rep["problems"] == []


def test_the_render_shows_the_fp8_table(fp8_run, tmp_path):
    from typer.testing import CliRunner

    from ampctl.cli import app

    run = _variant(fp8_run, tmp_path / "planted", _plant)
    res = CliRunner().invoke(
        app, ["diagnose", str(run), "--device", "cpu", "-b", "1"], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 1, res.output
    out = " ".join(res.stdout.replace("│", " ").split())
    assert "fp8 casts (tensorwise): max |x| (headroom below e4m3 max 448 / e5m2 max 57344)" in out
    table = out[out.index("fp8 casts (tensorwise)") :]
    assert table.index(PLANTED) < table.index("cls.predictions.transform.dense")  # first row
    assert "2e+03 (2^-2.2)" in table and "[fp8_headroom]" in table


def test_without_torchao_the_replay_is_skipped_with_the_hint(fp8_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # the import fails as if absent
    code, rep, err = diagnose_cli(fp8_run)
    assert code == 0 and err == ""
    hint = 'fp8 needs torchao: pip install "ampctl[fp8]"'
    assert rep["replay"] == {"ran": False, "reason": hint, "precision": "fp8", "device": "cpu"}
    assert rep["fp8"] == {"ran": False, "reason": hint}
    assert rep["history"]["metrics_rows"] == 1 and rep["state"]["weights"]["tensors"] > 0
