"""GPU checks (CUDA only; skipped elsewhere). Run them with ``bash tests/gpu/check.sh``.

LossScaler against ``torch.amp.GradScaler("cuda")`` on planted overflows, host reads (CPU-GPU
syncs) per step on the standard and fused-AdamW paths, a skipped step on the fused path, the
bench's CUDA code paths, fp8 (torchao) host reads and a few fp8 steps, and a few fp16 steps of
conf=bert_large end to end.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler
from ampctl.commands.bench import bench, measure_host_reads
from ampctl.config import load_config
from ampctl.runlog.writers import new_run_dir
from ampctl.train.checkpoint import load_checkpoint
from ampctl.train.trainer import Trainer, train
from tests.conftest import read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "trainer.device=cuda"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32)).cuda()


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_scaler_matches_gradscaler_on_cuda_with_planted_overflows(seed):
    rng = random.Random(seed)
    steps = 60
    planted = {s: rng.choice([math.inf, -math.inf, math.nan]) for s in rng.sample(range(steps), 12)}
    kw = dict(init_scale=2.0**14, growth_factor=2.0, backoff_factor=0.5, growth_interval=4)
    g = torch.Generator().manual_seed(seed)
    data = [
        (torch.randn(16, 64, generator=g).cuda(), torch.randn(16, 32, generator=g).cuda())
        for _ in range(steps)
    ]
    runs = []
    for make in (
        lambda: torch.amp.GradScaler("cuda", **kw),
        lambda: LossScaler(**kw, hysteresis=1, min_scale=2.0**-30, max_scale=2.0**60),
    ):
        model = _model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = make()
        scales, skips = [], []
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                out = model(x)
            scaler.scale((out.float() - y).pow(2).mean()).backward()
            if step in planted:
                with torch.no_grad():
                    model[0].weight.grad.view(-1)[7] = planted[step]
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            skips.append(
                all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            )
            scales.append(scaler.get_scale())
        runs.append((scales, skips, [p.detach().clone() for p in model.parameters()], scaler))
    (ref_scales, ref_skips, ref_w, _), (our_scales, our_skips, our_w, ours) = runs
    assert our_scales == ref_scales
    assert our_skips == ref_skips
    assert sum(our_skips) >= len(planted)
    for a, b in zip(ref_w, our_w, strict=True):
        assert torch.equal(a, b)
    assert [bool(k) for _, _, k in ours.history()][-steps:] == our_skips
    assert ours.skipped_steps == sum(our_skips)


def test_host_reads_per_step_on_cuda_are_one_and_zero(fast_cfg):
    hr = measure_host_reads(fast_cfg(CUDA), steps=4)
    assert (hr["standard"], hr["standard_total"]) == (1, 4)
    assert hr["standard_by_method"] == {"item": 4}
    assert (hr["fused"], hr["fused_total"]) == (0, 0)


def test_fp8_on_cuda_reads_one_and_zero_and_logs_its_casts(fast_cfg):
    pytest.importorskip("torchao.float8")
    hr = measure_host_reads(fast_cfg(CUDA, "precision=fp8"), steps=4)
    assert (hr["standard"], hr["fused"]) == (1, 0)
    cfg = fast_cfg(CUDA, "precision=fp8", "trainer.max_steps=24")
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "fp8"))
    assert res.status == "ok" and len(res.summary["fp8_layers"]) == 13
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert all(r["fp8_layers"] == 13 and r["fp8_nonfinite_layers"] == 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_fused_adamw_on_cuda_skips_a_planted_overflow(fast_cfg):
    def plant(trainer, step, phase):
        if step == 3 and phase == "after_backward":
            with torch.no_grad():
                trainer.params[0].grad.view(-1)[0] = math.inf

    cfg = fast_cfg(CUDA, "optim.fused=true")
    tr = Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, "fused"), fault=plant)
    assert tr.device.type == "cuda" and tr.optimizer.defaults.get("fused") is True
    changed = []
    for _ in range(6):
        before = [p.detach().clone() for p in tr.params]
        tr.train_step(log=False)
        changed.append(not all(torch.equal(b, p) for b, p in zip(before, tr.params, strict=True)))
    assert changed == [True, True, False, True, True, True]
    st = tr.scaler.stats()
    assert st["skipped_total"] == 1 and st["scale"] == 512.0  # 1024 halved once
    steps = {int(s["step"]) for s in tr.optimizer.state_dict()["state"].values()}
    assert steps == {5}  # the skipped step did not count in AdamW's bias correction


def test_bench_cuda_paths_run(fast_cfg):
    res = bench(fast_cfg(CUDA), 2, sections=["overhead", "overflow_check", "precision"])
    assert res["meta"]["device"].startswith("cuda")
    for x in (res["overhead"]["ratio"], res["overflow_check"]["ratio"]):
        assert math.isfinite(x) and x > 0
    assert res["overflow_check"]["hidden_size"] == 1024 and res["overflow_check"]["finite"] is True
    pr = res["precision"]
    assert "max_memory_allocated" in pr["memory_method"]
    names = ("fp32", "fp16", "fp16-pure")
    try:
        import torchao.float8  # noqa: F401

        names += ("fp8",)
    except ImportError:
        assert pr["rows"]["fp8"]["error"].startswith("fp8 needs torchao")
    for name in names:
        row = pr["rows"][name]
        assert row["error"] is None and row["step_s"] > 0 and row["peak_mem_mib"] > 0, name


def test_bert_large_fp16_trains_end_to_end(tmp_path):
    cfg = load_config(
        [
            "conf=bert_large",
            CUDA,
            "trainer.max_steps=4",
            "trainer.log_every=2",
            "trainer.ckpt_every=4",
            "trainer.keep_last=1",
            "data.batch_size=8",
            "data.seq_len=128",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ]
    )
    assert cfg.precision.name == "fp16" and cfg.scaler.init_scale == 1024.0
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, "large"))
    assert res.status == "ok" and res.exit_code == 0
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["precision"] == "fp16"
        assert 5.0 < r["loss"] < 15.0  # ~ln(30522) = 10.3 at initialisation
        assert math.isfinite(r["grad_norm"]) and r["nonfinite_grads"] == 0
    s = res.summary
    assert s["steps"] == 4 and s["precision"] == "fp16" and s["fp32_modules"] == ["bert.embeddings"]
    ck = load_checkpoint(res.run_dir)
    assert ck["step"] == 4 and ck["precision"]["in_fp32"] == ["bert.embeddings"]
    assert ck["model"]["bert.encoder.layer.23.output.dense.weight"].dtype == torch.float32
