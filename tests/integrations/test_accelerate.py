"""install_scaler + protected_run in a real Accelerate loop on the CPU: fp16 really runs, a planted
overflow is skipped (weights unchanged) and recorded, save_state / load_state resume the scaler,
the guard and the run folder; a fused optimizer's skip reaches ``step_was_skipped``; Accelerate's
FSDP2 scaler-load path works on a LossScaler."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from ampctl.amp import LossScaler  # noqa: E402
from ampctl.errors import UsageError  # noqa: E402
from ampctl.integrations.accelerate import (  # noqa: E402
    AmpctlAcceleratedOptimizer,
    install_scaler,
    protected_run,
)
from tests.conftest import read_jsonl  # noqa: E402
from tests.integrations.conftest import TinyNet, batches, plant_inf  # noqa: E402


def _accelerator(**kw) -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(mixed_precision="fp16", cpu=True, **kw)


def _loop(acc, run, model, opt, steps, *, plant=(), watch=None, save=None):
    """The Accelerate loop of the module docstring of ampctl.integrations.accelerate."""
    data = batches(12)
    state = {"step": 0}
    handle = plant_inf(acc.unwrap_model(model).head.weight, lambda: state["step"] in plant)
    for step in steps:
        state["step"] = step
        batch = data[step - 1]
        loss = model(**batch)["loss"]
        acc.backward(loss)
        before = copy.deepcopy(acc.unwrap_model(model).state_dict())
        opt.step()
        if watch is not None:
            watch[step] = (before, copy.deepcopy(acc.unwrap_model(model).state_dict()))
        run.after_step(loss, batch)
        opt.zero_grad()
        if save is not None and step == save[0]:
            acc.save_state(save[1])
    handle.remove()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("acc")
    torch.manual_seed(0)
    acc = _accelerator()
    scaler = install_scaler(acc, LossScaler(init_scale=1024.0))
    net = TinyNet()
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    run = protected_run(acc, model, opt, run_dir=tmp / "run", log_every=2, max_steps=8)
    watch: dict = {}
    _loop(acc, run, model, opt, range(1, 9), plant={3, 6}, watch=watch, save=(4, tmp / "ck"))
    run.finish()
    first = {
        "events": read_jsonl(tmp / "run" / "events.jsonl"),
        "rows": read_jsonl(tmp / "run" / "metrics.jsonl"),
        "seen": set(acc.unwrap_model(model).seen),
        "scale": scaler.get_scale(),
        "opt": opt,
        "watch": watch,
    }
    # a new process: install before prepare, build the run, load_state, continue from step 5
    torch.manual_seed(1)
    acc2 = _accelerator()
    scaler2 = install_scaler(acc2)
    model2 = TinyNet()
    model2, opt2 = acc2.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2))
    run2 = protected_run(acc2, model2, opt2, run_dir=tmp / "run", log_every=2, max_steps=8)
    acc2.load_state(tmp / "ck")
    loaded = scaler2.stats()
    _loop(acc2, run2, model2, opt2, range(5, 9), plant={6})
    run2.finish()
    return {"tmp": tmp, "first": first, "loaded": loaded, "scaler2": scaler2, "run2": run2}


def test_fp16_on_the_cpu_really_runs_fp16_with_the_loss_scaler(runs):
    first = runs["first"]
    assert first["seen"] == {torch.float16}
    assert isinstance(first["opt"], AmpctlAcceleratedOptimizer)
    assert isinstance(first["opt"].scaler, LossScaler)


def test_planted_overflow_is_skipped_backs_off_and_is_recorded(runs):
    first = runs["first"]
    for step in (3, 6):
        before, after = first["watch"][step]
        assert all(torch.equal(before[k], after[k]) for k in before), step
    assert [(e["kind"], e["step"], e["scale"], e["params"]) for e in first["events"]] == [
        ("overflow", 3, 512.0, ["head.weight"]),
        ("overflow", 6, 256.0, ["head.weight"]),
    ]
    assert [(r["step"], r["skipped"], r["scale"]) for r in first["rows"]] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    assert first["scale"] == 256.0


def test_load_state_resumes_the_scaler_the_guard_and_the_run_folder(runs):
    tmp = runs["tmp"]
    assert (tmp / "ck" / "ampctl_run.json").is_file()
    assert runs["loaded"]["scale"] == 512.0 and runs["loaded"]["skipped_total"] == 1
    assert runs["run2"].step == 8 and runs["scaler2"].get_scale() == 256.0
    events = read_jsonl(tmp / "run" / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [
        ("overflow", 3),
        ("resume", 4),
        ("overflow", 6),
    ]
    rows = read_jsonl(tmp / "run" / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["scale"]) for r in rows] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 2, 256.0),
        (8, 2, 256.0),
    ]
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    assert (summary["steps"], summary["skipped"], summary["framework"]) == (8, 2, "accelerate")


def test_a_fused_optimizers_skip_reaches_step_was_skipped():
    torch.manual_seed(0)
    acc = _accelerator()
    install_scaler(acc, LossScaler(init_scale=1024.0))
    net = TinyNet()
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
    skipped = []
    for step, batch in enumerate(batches(3), 1):
        acc.backward(model(**batch)["loss"])
        if step == 2:
            net.head.weight.grad[0, 0] = float("inf")
        opt.step()
        skipped.append(acc.optimizer_step_was_skipped)
        opt.zero_grad()
    assert skipped == [False, True, False]
    assert acc.scaler.skipped_steps == 1


def test_install_after_prepare_on_the_cpu_is_refused_and_optimizers_prepared_before_get_it():
    acc = _accelerator()
    net = TinyNet()
    model = acc.prepare(net)
    with pytest.raises(UsageError, match=r"call it before accelerator\.prepare\(model\)"):
        install_scaler(acc)
    acc = _accelerator()
    opt = acc.prepare(torch.optim.SGD(TinyNet().parameters(), lr=0.1))
    scaler = install_scaler(acc)
    assert opt.scaler is scaler and isinstance(opt, AmpctlAcceleratedOptimizer)
    assert install_scaler(acc) is scaler  # a second call keeps it
    with pytest.raises(UsageError, match="not an ampctl LossScaler"):
        install_scaler(acc, torch.amp.GradScaler("cpu"))
    del model


def _lazy_init_on_load() -> bool:
    """Whether the installed Accelerate's load_state calls the scaler's lazy init (its FSDP2
    branch up to 1.15; 1.16 calls ``load_state_dict`` alone, as for any scaler)."""
    import inspect

    import accelerate.checkpointing as checkpointing

    sources = inspect.getsource(Accelerator.load_state) + inspect.getsource(checkpointing)
    return "_lazy_init_scale_growth_tracker" in sources


def test_accelerates_fsdp2_scaler_load_path_works_on_a_loss_scaler(tmp_path, monkeypatch):
    """Accelerate's load_state, FSDP2 branch: ``scaler.load_state_dict(torch.load(...))`` then
    ``scaler._lazy_init_scale_growth_tracker(scaler._device)`` before the optimizer loads. FSDP2
    needs GPUs; only ``is_fsdp2`` is forced here, the code that runs is Accelerate's."""
    torch.manual_seed(0)
    acc = _accelerator()
    install_scaler(acc, LossScaler(init_scale=1024.0))
    net = TinyNet()
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for step, batch in enumerate(batches(2), 1):
        acc.backward(model(**batch)["loss"])
        if step == 2:
            net.head.weight.grad[0, 0] = float("inf")
        opt.step()
        opt.zero_grad()
    acc.save_state(tmp_path / "ck")
    acc2 = _accelerator()
    scaler2 = install_scaler(acc2)
    net2 = TinyNet()
    model2, opt2 = acc2.prepare(net2, torch.optim.AdamW(net2.parameters(), lr=1e-2))
    monkeypatch.setattr(Accelerator, "is_fsdp2", property(lambda self: True))
    assert scaler2._scale is None  # no state yet: the lazy init creates it from the loaded one
    acc2.load_state(tmp_path / "ck")
    monkeypatch.undo()
    if _lazy_init_on_load():  # accelerate <= 1.15: the FSDP2 branch creates the state at once
        assert scaler2._scale is not None and scaler2._scale.device.type == "cpu"
    assert scaler2.get_scale() == 512.0 and scaler2.skipped_steps == 1
    acc2.backward(model2(**batches(1)[0])["loss"])
    opt2.step()
    assert scaler2.num_updates == 3 and not acc2.optimizer_step_was_skipped
