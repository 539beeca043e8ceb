"""precision=fp8 in the protected loop (CPU, real torchao, tiny model): it trains, its cast health
rides on the log read only, the guard demotes the fp8 layer a gradient storm comes from (on the
replay of the skipped step) and a layer that saturates at every log step (saved and restored on
resume), a promotion to fp32 demotes the fp8 layers inside first, and a storm that demotion
cannot cure ends in the fallback fp8 -> bf16 with the parameters and optimizer state kept."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")

from ampctl.amp import fp8  # noqa: E402
from ampctl.hostreads import count_host_reads  # noqa: E402
from ampctl.runlog.writers import new_run_dir  # noqa: E402
from ampctl.train.checkpoint import load_checkpoint  # noqa: E402
from ampctl.train.trainer import Trainer  # noqa: E402
from tests.conftest import read_jsonl  # noqa: E402

# one encoder layer: fp8 matmuls are slow on CPU (torch._scaled_mm emulates them), so the
# fewer fp8 layers the faster the test; 7 are left: q, k, v, attn out, ffn in, ffn out, head
FP8 = ("precision=fp8", "model.num_layers=1")
LAYER = "bert.encoder.layer.0.intermediate.dense"  # an fp8 layer of the tiny test model


def _trainer(fast_cfg, name, *extra):
    cfg = fast_cfg(*FP8, *extra)
    return Trainer(cfg, new_run_dir(cfg.trainer.runs_dir, name))


def _finite(model: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def _events(res, kind=None):
    path = res.run_dir / "events.jsonl"
    evs = read_jsonl(path) if path.exists() else []
    return [e for e in evs if kind is None or e["kind"] == kind]


def test_fp8_run_trains_and_logs_the_worst_layer(fast_cfg):
    tr = _trainer(fast_cfg, "train", "trainer.max_steps=24", "trainer.log_every=4")
    res = tr.run()
    assert res.status == "ok"
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # 4.17 -> 3.70 measured
    layers = fp8.converted_layers(tr.model)
    assert len(layers) == 7 and LAYER in layers
    for r in rows:
        assert r["precision"] == "fp8" and r["fp8_layers"] == 7
        assert r["fp8_sat_layer"] in layers and r["fp8_under_layer"] in layers
        assert 0 < r["fp8_sat"] < 0.1 and 0 <= r["fp8_under"] < 0.01  # healthy casts
        assert r["fp8_nonfinite_layers"] == 0
    s = res.summary
    assert s["fp8_recipe"] == "tensorwise" and s["fp8_layers"] == layers
    assert s["fp8_excluded"] == {"cls.predictions.decoder": "excluded by pattern '*decoder'"}
    assert s["fp8_demoted"] == {} and not _events(res, "demotion")


@pytest.mark.parametrize(
    "fused, recipe, expected",
    [
        (False, "tensorwise", [1, 1, 1, 1, 2, 1, 1, 1]),
        (True, "rowwise", [0, 0, 0, 0, 1, 0, 0, 0]),
    ],
)
def test_host_reads_per_step_under_fp8(fast_cfg, monkeypatch, fused, recipe, expected):
    """The probe is opened on log steps only and its figures ride on the log read: a log step
    reads once more, the other steps read what bf16 reads (the skip flag; nothing when fused)."""
    import ampctl.amp.precision.fp8 as plugin

    opened = []
    real_probe = plugin.fp8.record_casts

    def counting_probe(model, *, enabled=True):
        opened.append(tr.step + 1)
        return real_probe(model, enabled=enabled)

    monkeypatch.setattr(plugin.fp8, "record_casts", counting_probe)
    tr = _trainer(
        fast_cfg,
        f"reads{fused}",
        f"optim.fused={str(fused).lower()}",
        f"precision.fp8_recipe={recipe}",
        "trainer.max_steps=20",
        "trainer.log_every=5",
        "trainer.ckpt_every=100",
    )
    layer = tr.model.get_submodule(LAYER)
    assert tr.precision.recipe == recipe  # the config reaches the plugin
    assert fp8.cast_formats(layer)["go"] == ("e4m3" if recipe == "rowwise" else "e5m2")
    tr.protection.start(tr.step)
    per_step, row = [], None
    for _ in range(8):
        with count_host_reads() as reads:
            row = tr.step_once() or row
        per_step.append(reads.total)
    assert per_step == expected
    assert opened == [5]  # sampled on the log step only
    assert row["fp8_layers"] == 7  # and it did see the fp8 layers
    assert all(not m._forward_hooks for m in tr.model.modules())  # leaving no hook behind


def _grad_storm(tr: Trainer, layer: str, from_step: int) -> None:
    """Make ``layer``'s output gradient +inf (no NaN: its amax is inf) on the steps after
    ``from_step``, for as long as that layer object is in the model (fp8): the storm comes from
    this layer's gradient cast, and leaving fp8 cures it."""

    def hook(module, args, out):
        if tr.step >= from_step and out.requires_grad:
            out.register_hook(lambda g: g + math.inf)

    tr.model.get_submodule(layer).register_forward_hook(hook)


def test_a_gradient_storm_in_one_fp8_layer_is_demoted_on_the_first_skipped_step(fast_cfg):
    """The skipped step is replayed with the cast probe: the layer whose gradient cast went
    non-finite first (the last in call order) is demoted, and the storm ends at once."""
    tr = _trainer(fast_cfg, "storm", "trainer.max_steps=10", "trainer.log_every=5")
    _grad_storm(tr, LAYER, from_step=5)  # from step 6, while LAYER is this fp8 layer object
    res = tr.run()
    assert res.status == "ok" and _finite(tr.model)
    kinds = [(e["kind"], e["step"]) for e in _events(res) if e["kind"] != "checkpoint"]
    assert kinds == [("overflow", 6), ("demotion", 6)]
    dem = _events(res, "demotion")[0]
    assert dem["module"] == LAYER and dem["to_precision"] == "bf16"
    assert dem["reason"] == (
        "non-finite output gradient (amax inf) on the replay of the skipped step"
    )
    assert type(tr.model.get_submodule(LAYER)) is nn.Linear  # bf16 under the autocast
    assert res.summary["skipped"] == 1 and res.summary["fp8_demoted"] == {LAYER: dem["reason"]}
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert [(r["fp8_layers"], r["fp8_nonfinite_layers"]) for r in rows] == [(7, 0), (6, 0)]


def test_persistent_saturation_is_demoted_at_log_steps_saved_and_restored(fast_cfg):
    """A layer whose input is binary (every value at +-amax, so every value lands on e4m3's
    max) saturates at every log step: after guard.fp8_patience log steps it is demoted; the
    checkpoint keeps the demotion and a resume puts it back before loading the weights."""
    tr = _trainer(
        fast_cfg,
        "sat",
        "trainer.max_steps=12",
        "trainer.log_every=2",
        "trainer.ckpt_every=8",
        "guard.fp8_patience=3",
    )

    def binary(module, args):
        return (torch.where(args[0] >= 0, 2.0, -2.0).to(args[0].dtype),)

    tr.model.get_submodule(LAYER).register_forward_pre_hook(binary)
    res = tr.run()
    assert res.status == "ok" and res.summary["skipped"] == 0
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert [(r["fp8_sat"], r["fp8_sat_layer"]) for r in rows[:3]] == [(1.0, LAYER)] * 3
    assert all(r["fp8_sat"] < 0.1 for r in rows[3:])  # demoted at the third log step
    dem = _events(res, "demotion")
    assert [(e["step"], e["module"]) for e in dem] == [(6, LAYER)]
    assert dem[0]["reason"] == "saturation above 10.0% in 3 samples in a row (last 100.0%)"

    ck = load_checkpoint(res.run_dir / "checkpoints" / "step_00000008.pt")
    assert ck["precision"]["fp8"]["demoted"] == {LAYER: dem[0]["reason"]}
    again = Trainer(tr.cfg, res.run_dir, resume=ck)
    assert type(again.model.get_submodule(LAYER)) is nn.Linear
    assert again.precision.demoted == {LAYER: dem[0]["reason"]}
    assert fp8.converted_layers(again.model) == res.summary["fp8_layers"]
    assert len(res.summary["fp8_layers"]) == 6 and LAYER not in res.summary["fp8_layers"]
    for name, value in again.model.state_dict().items():  # the step-8 weights, by key
        assert torch.equal(value, ck["model"][name]), name
    assert again.optimizer.state_dict()["state"]  # the optimizer state came back too


def test_a_forward_overflow_in_an_fp8_layer_demotes_it_before_promoting_it(fast_cfg):
    tr = _trainer(fast_cfg, "promote", "trainer.max_steps=10", "trainer.log_every=5")

    def inf_out(module, args, out):
        return torch.full_like(out, math.inf) if tr.step >= 5 else out

    # from step 6 the layer's output is inf for as long as it is this fp8 layer object
    tr.model.get_submodule(LAYER).register_forward_hook(inf_out)
    res = tr.run()
    assert res.status == "ok" and _finite(tr.model)
    evs = [(e["kind"], e["step"], e.get("module")) for e in _events(res)]
    assert evs[:3] == [("overflow", 6, None), ("demotion", 6, LAYER), ("promotion", 6, LAYER)]
    assert _events(res, "overflow")[0]["overflow"] == "forward"
    assert "promoted to fp32" in _events(res, "demotion")[0]["reason"]
    assert res.summary["promoted_modules"] == [LAYER]
    assert res.summary["skipped"] == 1
    assert type(tr.model.get_submodule(LAYER)) is nn.Linear


def test_a_storm_that_demotion_does_not_cure_falls_back_to_bf16_keeping_the_state(fast_cfg):
    """Inf in a gradient after the backward (not in a cast) while the run is fp8: rollback, then
    the fallback fp8 -> bf16 (the default chain's first precision safer than fp8), which demotes
    every layer and keeps the parameters and the optimizer state."""
    tr = _trainer(
        fast_cfg,
        "fallback",
        "trainer.max_steps=14",
        "guard.rollback_after=2",
        "guard.max_rollbacks=1",
        "guard.snapshot_every=2",
    )
    params_before = [id(p) for p in tr.model.parameters()]

    def fault(t, step, phase):
        if t.precision.name == "fp8" and step >= 6:
            next(iter(t.params)).grad.view(-1)[0] = math.inf

    tr.fault = fault
    res = tr.run()
    assert res.status == "ok" and _finite(tr.model)
    fb = _events(res, "fallback")
    assert [(e["from_precision"], e["to_precision"]) for e in fb] == [("fp8", "bf16")]
    assert len(_events(res, "rollback")) == 1
    assert res.summary["precision"] == "bf16" and fp8.converted_layers(tr.model) == []
    assert [id(p) for p in tr.model.parameters()] == params_before
    state = tr.optimizer.state_dict()["state"]
    assert len(state) == len(params_before)  # AdamW moments carried over the switch
    assert all(torch.isfinite(s["exp_avg"]).all() for s in state.values())
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert "fp8_layers" not in rows[-1] and rows[-1]["precision"] == "bf16"
