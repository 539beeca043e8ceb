"""``ampctl bench``: every section and key, exact host-read counts, sane ratios, bad input.

Benchmarks are not tests: nothing here asserts a speed. The ratios must only be positive,
finite numbers measured on this run.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from ampctl.amp import fp8
from ampctl.cli import app
from ampctl.commands.bench import (
    SECTIONS,
    BenchError,
    bench,
    measure_device_ops,
    measure_precisions,
    plan,
    print_report,
    sized,
)
from ampctl.errors import UsageError
from ampctl.runlog.writers import new_run_dir
from tests.conftest import FAST

runner = CliRunner()

META_KEYS = {
    "device",
    "torch",
    "threads",
    "preset",
    "model",
    "params",
    "precision",
    "batch_size",
    "seq_len",
    "tokens_per_step",
    "steps",
    "wall_s",
}
OVERHEAD_KEYS = {
    "ratio",
    "total_ratio",
    "protected_median_s",
    "bare_median_s",
    "pairs",
    "warmup",
    "log_every",
    "log_steps",
    "goal",
    "protected",
    "baseline",
}
OVERFLOW_KEYS = {
    "ratio",
    "naive_median_s",
    "fused_median_s",
    "repeats",
    "layers",
    "hidden_size",
    "tensors",
    "elements",
    "device",
    "finite",
}
HOST_READ_KEYS = {
    "steps",
    "standard",
    "standard_total",
    "standard_by_method",
    "fused",
    "fused_total",
    "fused_by_method",
    "fused_error",
    "goal",
}
DEVICE_OPS_KEYS = {
    "bare",
    "clean",
    "log",
    "mean",
    "extra",
    "steps",
    "log_steps",
    "log_every",
    "counted",
}
ROW_KEYS = {"step_s", "tokens_per_s", "speed_vs_fp32", "speed_vs_bf16", "peak_mem_mib", "error"}


def _has_torchao() -> bool:
    try:
        fp8.require_torchao()
    except UsageError:
        return False
    return True


def _positive_finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory):
    """One real ``ampctl bench --json --steps 2`` on the tiny test model."""
    runs = tmp_path_factory.mktemp("bench") / "runs"
    result = runner.invoke(
        app, ["bench", *FAST, f"trainer.runs_dir={runs}", "--steps", "2", "--json"]
    )
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


def test_json_has_every_section_and_key(cli_json):
    res = json.loads(cli_json.stdout)  # stdout is the JSON and nothing else
    assert set(res) == {"meta", *SECTIONS}
    assert set(res["meta"]) == META_KEYS
    assert set(res["overhead"]) == OVERHEAD_KEYS
    assert set(res["overflow_check"]) == OVERFLOW_KEYS
    assert set(res["host_reads"]) == HOST_READ_KEYS
    assert set(res["device_ops"]) == DEVICE_OPS_KEYS
    assert set(res["precision"]) == {"timing", "memory_method", "steps", "rows"}
    assert list(res["precision"]["rows"]) == ["fp32", "bf16", "fp16", "fp16-pure", "fp8"]
    for row in res["precision"]["rows"].values():
        assert set(row) == ROW_KEYS
    meta = res["meta"]
    assert meta["device"] == "cpu" and meta["precision"] == "fp16" and meta["steps"] == 2
    assert meta["preset"] == "config" and meta["model"] == "BertForMaskedLM 2x32"
    assert meta["tokens_per_step"] == 4 * 16


def test_progress_goes_to_stderr(cli_json):
    lines = cli_json.stderr.strip().splitlines()
    assert lines and all(line.startswith("bench: ") for line in lines)
    assert any(line.startswith("bench: overhead:") for line in lines)
    assert any(line.startswith("bench: precision:") for line in lines)


def test_host_reads_are_exactly_one_and_zero(cli_json):
    hr = json.loads(cli_json.stdout)["host_reads"]
    n = plan(2)["host_read_steps"]
    assert hr["steps"] == n
    assert hr["standard"] == 1 and hr["standard_total"] == n
    assert hr["standard_by_method"] == {"item": n}  # the scaler's skip flag, once a step
    assert hr["fused"] == 0 and hr["fused_total"] == 0 and hr["fused_by_method"] == {}
    assert hr["fused_error"] is None


@pytest.mark.extras  # the fp8 row: measured with torchao, its install hint without
def test_ratios_and_times_are_positive_finite(cli_json):
    res = json.loads(cli_json.stdout)
    ov, oc = res["overhead"], res["overflow_check"]
    for x in (ov["ratio"], ov["total_ratio"], ov["protected_median_s"], ov["bare_median_s"]):
        assert _positive_finite(x)
    for x in (oc["ratio"], oc["naive_median_s"], oc["fused_median_s"]):
        assert _positive_finite(x)
    for name, row in res["precision"]["rows"].items():
        if name == "fp8" and not _has_torchao():  # [test] alone: the row says how to get it
            assert row == {**dict.fromkeys(ROW_KEYS), "error": fp8.HINT}
            continue
        assert row["error"] is None, name
        for key in ("step_s", "tokens_per_s", "speed_vs_fp32", "speed_vs_bf16", "peak_mem_mib"):
            assert _positive_finite(row[key]), (name, key, row[key])
    assert res["precision"]["rows"]["fp32"]["speed_vs_fp32"] == 1.0
    assert res["precision"]["rows"]["bf16"]["speed_vs_bf16"] == 1.0
    assert _positive_finite(res["meta"]["wall_s"])


def test_counts_follow_the_plan(cli_json):
    res = json.loads(cli_json.stdout)
    n = plan(2)
    ov = res["overhead"]
    assert (ov["pairs"], ov["warmup"], ov["goal"]) == (
        n["overhead_pairs"],
        n["overhead_warmup"],
        1.02,
    )
    # warm-up steps 1-2, timed steps 3-6; with log_every=4, step 4 is the one log step
    assert (ov["log_every"], ov["log_steps"]) == (4, 1)
    oc = res["overflow_check"]
    assert oc["repeats"] == n["overflow_repeats"] and oc["layers"] == 24 and oc["finite"] is True
    assert (
        oc["tensors"] == 24 * 16 + 10
    )  # 16 tensors a layer; embeddings 5, MLM head 5 (tied decoder)
    assert res["precision"]["steps"] == n["precision_steps"]
    assert "VmHWM" in res["precision"]["memory_method"]


def test_report_prints_every_figure(cli_json):
    res = json.loads(cli_json.stdout)
    console = Console(record=True, width=200)
    print_report(res, console=console)
    text = console.export_text()
    for fragment in (
        "protected / bare",
        "naive / fused",
        "host reads / step",
        "device ops: a clean step",
        "fused AdamW",
        "fp16-pure",
        "fp8",
        "vs bf16",
        "peak memory:",
        f"{res['overhead']['ratio']:.3f}",
    ):
        assert fragment in text, fragment


def test_a_row_error_is_printed_as_written_not_as_rich_markup(cli_json):
    res = json.loads(cli_json.stdout)
    res["precision"]["rows"]["fp8"]["error"] = fp8.HINT
    res["precision"]["rows"]["bf16"]["error"] = "[bold]not markup[/bold]"
    console = Console(record=True, width=300)
    print_report(res, console=console)
    text = console.export_text()
    assert 'pip install "ampctl[fp8]"' in text  # Rich would eat "[fp8]" as a style tag
    assert "[bold]not markup[/bold]" in text


def test_library_runs_chosen_sections_and_counts_fp32_reads(fast_cfg):
    # fp32: no loss scaling, but non-finite steps are still detected: the same 1 and 0
    res = bench(fast_cfg("precision=fp32"), 2, sections=["host_reads"])
    assert set(res) == {"meta", "host_reads"}
    assert (res["host_reads"]["standard"], res["host_reads"]["fused"]) == (1, 0)
    assert res["meta"]["params"] is None  # counted by the overhead section only


def test_fused_path_missing_is_reported_not_raised(fast_cfg):
    res = bench(fast_cfg("optim=sgd"), 2, sections=["host_reads"])
    hr = res["host_reads"]
    assert hr["standard"] == 1 and hr["fused"] is None
    assert hr["fused_error"] == (
        "optim.fused=True is not allowed: optim.fused must be false unless optim.name is adamw "
        "or adam (fused SGD cannot skip on the device)"
    )


def test_bad_steps_and_sections_are_usage_errors(fast_cfg):
    cfg = fast_cfg()
    with pytest.raises(BenchError, match=r"^--steps 1: must be an integer >= 2$"):
        bench(cfg, 1)
    with pytest.raises(
        BenchError,
        match=r"allowed sections are overhead, device_ops, overflow_check, host_reads, precision$",
    ):
        bench(cfg, 2, sections=["speed"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["foo=1"], "unknown key 'foo'"),
        (["scaler.init_scale=0"], "scaler.init_scale must be a finite number > 0"),
        (["conf=nope"], "conf=nope: no such preset"),
    ],
)
def test_bad_override_exits_2_with_one_line(args, fragment):
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ampctl: error: "), err
    assert fragment in err and "Traceback" not in result.output
    assert result.stdout == ""


def test_steps_below_two_is_refused_by_the_cli():
    result = runner.invoke(app, ["bench", "--steps", "1"])
    assert result.exit_code == 2
    assert "--steps" in result.stderr


def test_fp8_overhead_is_measured_against_a_bare_torchao_loop(fast_cfg):
    pytest.importorskip("torchao.float8")
    from ampctl.amp import fp8
    from ampctl.commands.bench.overhead import _BareLoop
    from ampctl.train.trainer import Trainer

    cfg = fast_cfg("precision=fp8", "model.num_layers=1")  # fp8 matmuls are slow on CPU
    ov = bench(cfg, 2, sections=["overhead"])["overhead"]
    assert ov["baseline"].startswith("torchao float8 loop: convert_to_float8_training")
    assert ov["protected"].startswith("Trainer.run (fp8") and _positive_finite(ov["ratio"])
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "bare"))
    bare = _BareLoop(cfg, tr)
    assert fp8.converted_layers(bare.model) == fp8.converted_layers(tr.model) != []
    assert not bare.scaler.is_enabled()


def test_fp8_row_without_torchao_says_how_to_install_it(fast_cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    rows = measure_precisions(fast_cfg(), 2, precisions=("fp8",))["rows"]
    assert rows == {
        "fp8": {
            "step_s": None,
            "tokens_per_s": None,
            "speed_vs_fp32": None,
            "speed_vs_bf16": None,
            "peak_mem_mib": None,
            "error": 'fp8 needs torchao: pip install "ampctl[fp8]"',
        }
    }


def test_device_ops_count_the_protection_beside_the_bare_loop(fast_cfg):
    # log_every=4: 5 uncounted steps, then steps 6-9 counted, step 8 a log step
    ops = measure_device_ops(fast_cfg(), 4)
    assert (ops["steps"], ops["log_steps"], ops["log_every"]) == (4, 1, 4)
    assert ops["bare"] > 0 and ops["clean"] is not None and ops["log"] is not None
    # a clean step costs GradScaler's ops and at most 6 more; a log step costs more than that
    assert ops["bare"] <= ops["clean"] <= ops["bare"] + 6
    assert ops["log"] > ops["clean"] + 10
    assert ops["mean"] == pytest.approx((3 * ops["clean"] + ops["log"]) / 4)
    assert ops["extra"] == {k: ops[k] - ops["bare"] for k in ("clean", "log", "mean")}


def test_device_ops_count_the_probe_hooks_inside_the_backward(fast_cfg):
    # the activation-gradient probe runs inside forward and backward, which are left out of the
    # count: its ops are counted all the same, so turning it off lowers the log step's count
    on = measure_device_ops(fast_cfg(), 4)
    off = measure_device_ops(fast_cfg("logging.act_grads=false"), 4)
    assert off["clean"] == on["clean"]
    # 8 leaf modules sampled, each fp16 activation gradient: abs, ==, <, two sums, two adds
    assert on["log"] - off["log"] >= 8 * 5


def test_sizes_resize_the_model_to_about_10m_and_50m_parameters(fast_cfg):
    from ampctl.train.builders import build_model

    cfg = fast_cfg("data.vocab_size=256", "data.seq_len=32")
    for size, (lo, hi) in {"~10M": (9e6, 13e6), "~50M": (45e6, 56e6)}.items():
        c = sized(cfg, size)
        assert c.model["_target_"] == cfg.model["_target_"]
        with torch.device("meta"):
            n = sum(p.numel() for p in build_model(c.model).parameters())
        assert lo <= n <= hi, (size, n)
    assert cfg.model["hidden_size"] == 32  # the configured one is left as it was


def test_sizes_refuse_a_model_they_cannot_resize(fast_cfg):
    import dataclasses

    cfg = fast_cfg()
    cfg = dataclasses.replace(cfg, model={"_target_": "my.Model", "width": 8})
    with pytest.raises(
        BenchError, match=r"^--sizes: model my.Model has no hidden_size, num_layers"
    ):
        bench(cfg, 2, sizes=True)
    with pytest.raises(BenchError, match=r"^--sizes repeats the overhead and device_ops sections"):
        bench(fast_cfg(), 2, sections=["overhead"], sizes=True)


def test_sizes_measure_each_size_and_print_a_table(fast_cfg, monkeypatch):
    import ampctl.commands.bench as b

    # two small sizes stand in for 10M and 50M (the real ones take minutes on a CPU)
    small = {
        "wide": {"hidden_size": 48, "num_layers": 1, "num_heads": 2, "ffn_size": 96},
        "deep": {"hidden_size": 32, "num_layers": 3, "num_heads": 2, "ffn_size": 64},
    }
    monkeypatch.setattr(b, "SIZES", small)
    res = bench(fast_cfg(), 2, sections=["overhead", "device_ops"], sizes=True)
    rows = res["sizes"]
    assert [r["size"] for r in rows] == ["configured", "wide", "deep"]
    assert [r["model"] for r in rows] == [
        "BertForMaskedLM 2x32",
        "BertForMaskedLM 1x48",
        "BertForMaskedLM 3x32",
    ]
    assert rows[0]["overhead"] is res["overhead"] and rows[0]["params"] == res["meta"]["params"]
    assert rows[1]["params"] != rows[2]["params"]
    for r in rows:
        assert _positive_finite(r["overhead"]["ratio"]) and r["device_ops"]["bare"] > 0
    console = Console(record=True, width=200)
    print_report(res, console=console)
    text = console.export_text()
    assert "At three model sizes" in text and "BertForMaskedLM 3x32" in text
