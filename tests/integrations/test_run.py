"""ProtectedRun in a hand-written fp16 loop: planted overflows are skipped, attributed, recorded
in the run folder, rolled back; forward overflows promote the module; resume continues the run."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampctl.amp import LossScaler
from ampctl.errors import UsageError
from ampctl.integrations import IntegrationError, LoopInfo, ProtectedRun
from ampctl.protect.protection import TrainAborted
from tests.conftest import read_jsonl
from tests.integrations.conftest import TinyNet, batches


def _loop(
    run, model, opt, scaler, steps, *, plant=(), data=None, watch=None, accum=1, numbered=False
):
    """The user's loop: autocast fp16, scale/backward, step, update, then ``run.after_step``.
    ``plant``: steps whose head.weight gradient gets an inf; ``watch``: step -> weights before
    and after; ``numbered``: pass the loop's step number to ``after_step``."""
    data = data or batches(max(steps) * accum + 1)
    for step in steps:
        opt.zero_grad()
        for i in range(accum):
            batch = data[(step - 1) * accum + i]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch)["loss"] / accum
            scaler.scale(loss).backward()
            if i < accum - 1:
                run.after_step(loss, batch)
        if step in plant:
            model.head.weight.grad[0, 0] = float("inf")
        before = copy.deepcopy(model.state_dict())
        scaler.step(opt)
        scaler.update()
        if watch is not None:
            watch[step] = (before, copy.deepcopy(model.state_dict()))
        run.after_step(loss, batch, step=step if numbered else None)


def _new(tmp_path, name="run", scaler=None, opt_kw=None, **kw):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **(opt_kw or {}))
    scaler = scaler or LossScaler(init_scale=1024.0, growth_interval=1000)
    kw.setdefault("log_every", 2)
    run = ProtectedRun(model, opt, scaler, run_dir=tmp_path / name, **kw)
    return model, opt, scaler, run


def test_planted_overflow_is_skipped_attributed_and_recorded(tmp_path):
    model, opt, scaler, run = _new(tmp_path, max_steps=6)
    watch: dict = {}
    with run:
        _loop(run, model, opt, scaler, range(1, 7), plant={3}, watch=watch)
    before, after = watch[3]
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step changed nothing
    assert not all(torch.equal(watch[4][0][k], watch[4][1][k]) for k in before)  # a clean one did
    assert set(model.seen) == {torch.float16}
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [(e["kind"], e["step"], e["scale"], e["params"]) for e in events] == [
        ("overflow", 3, 512.0, ["head.weight"])
    ]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["scale"]) for r in rows] == [
        (2, 0, 1024.0),
        (4, 1, 512.0),
        (6, 1, 512.0),
    ]
    assert rows[1]["overflow_rate"] == pytest.approx(1 / 4)
    assert all(r["grad_norm"] > 0 and r["precision"] == "fp16" for r in rows)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["skipped"] == 1 and summary["steps"] == 6
    assert summary["events"] == {"overflow": 1}


def test_three_overflows_in_a_row_roll_back_to_the_snapshot(tmp_path):
    model, opt, scaler, run = _new(tmp_path, max_steps=16, guard={"snapshot_every": 5})
    watch: dict = {}
    with run:
        _loop(run, model, opt, scaler, range(1, 17), plant={11, 12, 13}, watch=watch)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    rollback = [e for e in events if e["kind"] == "rollback"]
    assert [(e["step"], e["from_step"]) for e in rollback] == [(10, 13)]
    # the scale: 1024 -> 512 -> 256 -> 128 by the three overflows, then x0.25 by the rollback
    assert "scale 128 -> 32" in rollback[0]["message"]
    snap = watch[10][1]  # the weights after step 10 (the snapshot)
    # step 14 starts from the snapshot's weights: its "before" equals them
    assert all(torch.equal(watch[14][0][k], snap[k]) for k in snap)
    assert scaler.skipped_steps == 3


def test_fused_optimizer_decides_at_the_log_step_or_at_once_with_read_skips(tmp_path):
    for read, expect in ((False, None), (True, ["head.weight"])):
        model, opt, scaler, run = _new(
            tmp_path,
            f"fused-{read}",
            opt_kw={"fused": True},
            max_steps=6,
            loop=LoopInfo(read_skips=read),
        )
        watch: dict = {}
        with run:
            _loop(run, model, opt, scaler, range(1, 7), plant={3}, watch=watch)
        before, after = watch[3]
        assert all(torch.equal(before[k], after[k]) for k in before)
        (ev,) = read_jsonl(tmp_path / f"fused-{read}" / "events.jsonl")
        assert (ev["kind"], ev["step"], ev["scale"], ev["params"]) == ("overflow", 3, 512.0, expect)
        assert ev.get("decided_at_step") == (None if read else 4)


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    """after_step after every micro-batch: a call with no new scaler update only adds the
    micro-batch; rows count optimizer steps and their loss is the steps' summed contributions."""
    model, opt, scaler, run = _new(tmp_path, max_steps=4)
    data, step_losses = batches(8), []
    with run:
        for step in range(4):
            opt.zero_grad()
            total = 0.0
            for i in range(2):
                batch = data[2 * step + i]
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(**batch)["loss"] / 2
                scaler.scale(loss).backward()
                total += loss.item()
                if i == 1:
                    scaler.step(opt)
                    scaler.update()
                assert run.after_step(loss, batch) is None or (step, i) in ((1, 1), (3, 1))
            step_losses.append(total)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4] and run.step == 4 and scaler.num_updates == 4
    assert rows[0]["loss"] == pytest.approx(sum(step_losses[:2]) / 2, rel=1e-5)
    assert rows[1]["loss"] == pytest.approx(sum(step_losses[2:]) / 2, rel=1e-5)


def test_micro_batches_need_no_extra_call_the_loss_is_what_the_scaler_saw(tmp_path):
    """nanoGPT's shape: four micro-batches, ``after_step`` once per optimizer step with the last
    micro-batch's loss. The row's loss is the step's whole loss (every ``loss / 4`` the scaler
    was given), not a quarter of it."""
    model, opt, scaler, run = _new(tmp_path, max_steps=4)
    data, step_losses = batches(16), []
    with run:
        for step in range(4):
            opt.zero_grad()
            total = 0.0
            for i in range(4):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(**data[4 * step + i])["loss"] / 4
                scaler.scale(loss).backward()
                total += loss.item()
            scaler.step(opt)
            scaler.update()
            run.after_step(loss)  # the last micro-batch's loss only
            step_losses.append(total)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4]
    assert rows[0]["loss"] == pytest.approx(sum(step_losses[:2]) / 2, rel=1e-5)
    assert rows[1]["loss"] == pytest.approx(sum(step_losses[2:]) / 2, rel=1e-5)


def test_the_first_steps_number_resumes_the_folder_and_a_fresh_scaler_takes_its_scale(tmp_path):
    """A loop that saves no scaler (nanoGPT): the new process builds a fresh LossScaler and
    calls ``after_step(step=5)`` first. The run folder resumes at 4 (the rows and events after
    it set aside), and the scale and skip counters are those the folder recorded at step 4."""
    model, opt, scaler, run = _new(tmp_path, max_steps=8)
    data = batches(9)
    with run:
        _loop(run, model, opt, scaler, range(1, 7), plant={3}, data=data)
    assert scaler.get_scale() == 512.0
    model2, opt2, scaler2, run2 = _new(tmp_path, max_steps=8)  # fresh: scale 1024, no skips
    _loop(run2, model2, opt2, scaler2, range(5, 9), data=data, numbered=True)
    run2.finish()
    folder = tmp_path / "run"
    assert [r["step"] for r in read_jsonl(folder / "metrics.jsonl")] == [2, 4, 6, 8]
    events = read_jsonl(folder / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("overflow", 3), ("resume", 4)]
    assert events[1]["message"] == "resumed at step 4 (loop); the scale 512 from the run folder"
    rows = read_jsonl(folder / "metrics.jsonl")
    assert (rows[2]["scale"], rows[2]["skipped"]) == (512.0, 1)
    assert scaler2.skipped_steps == 1 and scaler2.get_scale() == 512.0


_DETACHED = """
import sys, torch
from ampctl.amp import LossScaler
from ampctl.integrations import ProtectedRun
from tests.integrations.conftest import TinyNet, batches
model = TinyNet()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = LossScaler(init_scale=1024.0)
run = ProtectedRun(model, opt, scaler, run_dir=sys.argv[1], log_every=2).attach()
for step, batch in enumerate(batches(3), 1):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch)["loss"]
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    run.after_step(loss, batch)
    opt.zero_grad()
if sys.argv[2] == "crash":
    raise RuntimeError("the loop broke")
if sys.argv[2] == "exit3":
    sys.exit(3)
"""


_ENDS = [("exit", "ok", 0), ("crash", "failed", 1), ("exit3", "failed", 3)]


@pytest.fixture(scope="module")
def detached(tmp_path_factory) -> dict[str, tuple[Path, subprocess.Popen]]:
    """The three loops' processes, started at once (one core each), by how they end."""
    root = tmp_path_factory.mktemp("detached")
    return {
        end: (
            root / end,
            subprocess.Popen(
                [sys.executable, "-c", _DETACHED, str(root / end / "run"), end],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=Path(__file__).resolve().parents[2],
            ),
        )
        for end, _, _ in _ENDS
    }


@pytest.mark.parametrize(("end", "status", "code"), _ENDS)
def test_attach_without_detach_still_writes_the_summary(detached, end, status, code):
    """``while True:`` loops: ``attach()`` instead of a ``with`` block; a process that ends
    without ``detach()`` -- normally or by an exception -- leaves its summary."""
    tmp_path, proc = detached[end]
    _, stderr = proc.communicate(timeout=120)
    res = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    assert res.returncode == code, res.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == (status, 3)
    assert ("RuntimeError: the loop broke" in res.stderr) == (end == "crash")


def test_resume_continues_the_run_folder_and_the_guard(tmp_path):
    model, opt, scaler, run = _new(tmp_path, max_steps=8)
    data = batches(9)
    run.start()
    _loop(run, model, opt, scaler, range(1, 5), plant={3}, data=data)
    ckpt = {
        "model": copy.deepcopy(model.state_dict()),
        "opt": copy.deepcopy(opt.state_dict()),
        "scaler": scaler.state_dict(),
        "run": json.loads(json.dumps(run.state_dict())),
    }
    _loop(run, model, opt, scaler, range(5, 7), data=data)  # logged, then "crashed"
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [2, 4, 6]
    run._release()  # the crash: the kernel drops a dead process's lock on the run folder

    model2, opt2, scaler2, run2 = _new(tmp_path, max_steps=8)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    scaler2.load_state_dict(ckpt["scaler"])
    run2.load_state_dict(ckpt["run"], resumed_from="ckpt-4")
    assert list(run2.protection.guard.window) == [False, False, True, False]
    with run2:
        _loop(run2, model2, opt2, scaler2, range(5, 9), plant={6}, data=data)
    folder = tmp_path / "run"
    assert [r["step"] for r in read_jsonl(folder / "metrics.jsonl")] == [2, 4, 6, 8]
    assert [(e["kind"], e["step"]) for e in read_jsonl(folder / "events.jsonl")] == [
        ("overflow", 3),
        ("resume", 4),
        ("overflow", 6),
    ]
    assert json.loads((folder / "summary.json").read_text())["skipped"] == 2


def test_forward_overflow_moves_the_module_to_fp32(tmp_path):
    class Boost(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x) * 100.0

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.boost = Boost()
            self.head = nn.Linear(8, 1)

        def forward(self, x, y):
            h = self.boost(x)  # fp16 under autocast: (x * 1000) * 100 overflows 65504
            return {"loss": (self.head(h * 0.001) - y).pow(2).mean()}

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = LossScaler(init_scale=1024.0)
    data = batches(5)
    data[2]["x"] = data[2]["x"] * 1000.0
    with ProtectedRun(model, opt, scaler, run_dir=tmp_path / "fwd", log_every=5) as run:
        for batch in data:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch)["loss"]
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            run.after_step(loss, batch)
    kinds = [(e["kind"], e["step"], e.get("module")) for e in run.events]
    assert ("promotion", 3, "boost") in kinds
    assert scaler.forward_overflows == 1 and run.precision.in_fp32 == ["boost"]
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.boost(data[2]["x"]).dtype == torch.float32  # now runs in fp32
        assert torch.isfinite(model(**data[2])["loss"])
    assert run.summary["promoted_modules"] == ["boost"]


def test_scale_floor_cannot_fall_back_in_a_foreign_loop_so_it_aborts(tmp_path):
    scaler = LossScaler(init_scale=1.0, min_scale=1.0)
    model, opt, scaler, run = _new(tmp_path, scaler=scaler, max_steps=6)
    with pytest.raises(TrainAborted, match="cannot switch its precision"):
        with run:
            _loop(run, model, opt, scaler, range(1, 7), plant={2, 3})
    assert run.summary["status"] == "aborted"
    (abort,) = [e for e in run.events if e["kind"] == "abort"]
    assert abort["step"] == 3 and "loss scale at its minimum" in abort["message"]


def test_bad_input_is_one_clear_usage_error(tmp_path):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        ({"scaler": torch.amp.GradScaler("cpu")}, "not an ampctl LossScaler"),
        ({"precision": "fp16-pure"}, "fp16-pure and fp8 need ampctl train"),
        ({"scaler": LossScaler(enabled=False, check_finite=False)}, "pure pass-through"),
        ({"guard": {"rollback_afterr": 2}}, "unknown fields ['rollback_afterr']"),
        ({"guard": {"skip_budget": 2}}, "guard.skip_budget=2 is not allowed"),
        ({"log_every": 0}, "log_every=0 is not allowed"),
    ]
    for kw, words in cases:
        with pytest.raises(UsageError, match=None) as e:
            ProtectedRun(model, opt, run_dir=tmp_path / "x", **kw)
        assert words in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(IntegrationError, match="holds a run already"):
        ProtectedRun(model, opt, run_dir=tmp_path / "old").start()
    assert (tmp_path / "old" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_core_ampctl_imports_no_framework_and_a_missing_one_says_how_to_install():
    code = (
        "import sys\n"
        "import ampctl, ampctl.cli, ampctl.integrations, ampctl.train.trainer\n"
        "bad = [m for m in ('lightning', 'accelerate', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "sys.modules['lightning'] = None\n"
        "try:\n"
        "    import ampctl.integrations.lightning\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "ampctl.integrations.lightning needs the 'lightning' package, which is not installed: "
        'pip install "ampctl[lightning]"'
    )


def test_the_nanogpt_shaped_example_trains_accumulates_and_resumes(tmp_path):
    """examples/nanogpt_style.py as a user runs it: 12 iterations from scratch (a checkpoint of
    model, optimizer and iter_num at 10, no scaler), then ``resume`` to 14. The run folder
    continues at 10: the row logged at 12 (the first run's last) is dropped, one resume event,
    the rows' loss is the whole step's loss (it falls), and the summary counts 14 steps."""
    example = Path(__file__).resolve().parents[2] / "examples" / "nanogpt_style.py"
    out = tmp_path / "out"
    for args in (("scratch", "12"), ("resume", "14")):
        res = subprocess.run(
            [sys.executable, str(example), str(out), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=example.parents[1],
        )
        assert res.returncode == 0, res.stderr
    folder = out / "ampctl"
    rows = read_jsonl(folder / "metrics.jsonl")
    assert [r["step"] for r in rows] == [10, 14]
    assert rows[0]["loss"] > rows[-1]["loss"]  # the whole step's loss falls: not loss / 4
    assert all(r["scale"] == 65536.0 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["loss"] > 1.5  # a quarter of the real loss would read ~0.6 here
    events = read_jsonl(folder / "events.jsonl")
    assert [(e["kind"], e["step"]) for e in events] == [("resume", 10)]
    assert "the scale 65536 from the run folder" in events[0]["message"]
    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("ok", 14)
    assert not (folder / "branches").exists()  # no checkpoint after 10 in the folder: the row
    # at 12 was logged by a run the resume replaces, so it is dropped, not archived


@pytest.mark.parametrize(
    ("code", "status"), [(0, "ok"), (None, "ok"), (3, "failed"), ("x", "failed")]
)
def test_a_with_block_left_by_system_exit_takes_its_status_from_the_exit_code(
    tmp_path, code, status
):
    model, opt, scaler, run = _new(tmp_path, max_steps=4)
    with pytest.raises(SystemExit), run:
        _loop(run, model, opt, scaler, range(1, 3))
        raise SystemExit(code)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == (status, 2)


def test_after_step_called_only_per_micro_batch_is_refused_with_the_fix(tmp_path):
    """A loop that reports each micro-batch before step()/update() and never after update():
    step 1 would be seen during step 2, after zero_grad() (its gradients gone, for the
    attribution and the rollback), and the last step never. The first such call says so."""
    model, opt, scaler, run = _new(tmp_path, max_steps=4)
    data = batches(8)
    with pytest.raises(IntegrationError) as err, run:
        for i, batch in enumerate(data):
            if i % 2 == 0:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch)["loss"] / 2
            scaler.scale(loss).backward()
            run.after_step(loss, batch)
            if i % 2 == 1:
                scaler.step(opt)
                scaler.update()
    assert i == 2 and scaler.num_updates == 1  # refused at step 2's first micro-batch
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("ProtectedRun.after_step: optimizer step 1 ")
    assert "call run.after_step(loss, batch) after scaler.update()" in msg
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("failed", 0)


def test_a_last_step_without_after_step_is_taken_by_finish(tmp_path):
    model, opt, scaler, run = _new(tmp_path, max_steps=4)
    data = batches(4)
    with run:
        _loop(run, model, opt, scaler, range(1, 4), data=data)
        opt.zero_grad()  # step 4: updated, the loop ends before its after_step
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**data[3])["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert run.step == 4
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [2, 4]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_a_rows_loss_is_over_the_applied_steps_not_a_skipped_spike_or_overflow(tmp_path):
    """The spike rule (a short window) skips a planted x1000 loss at step 10, and step 6 has a
    planted gradient overflow (its loss finite): each row's loss is the mean over the steps it
    applied (2948 in a row of ~2.6 was the spike averaged in); the skips are counted apart."""
    model, opt, scaler, run = _new(
        tmp_path, max_steps=12, guard={"spike_window": 8, "spike_min_steps": 4}
    )
    data, losses = batches(12), {}
    with run:
        for step in range(1, 13):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**data[step - 1])["loss"]
            if step == 10:
                loss = loss * 1000.0
            losses[step] = loss.item()
            scaler.scale(loss).backward()
            if step == 6:
                model.head.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            run.after_step(loss, data[step - 1])
    kinds = [(e["kind"], e["step"]) for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    assert kinds == [("overflow", 6), ("spike", 10)]
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    assert rows[6]["loss"] == pytest.approx(losses[5], rel=1e-6)
    assert rows[10]["loss"] == pytest.approx(losses[9], rel=1e-6)  # not (l9 + 1000 l10) / 2
    assert rows[8]["loss"] == pytest.approx((losses[7] + losses[8]) / 2, rel=1e-6)
    assert (rows[10]["skipped"], rows[10]["spikes"]) == (2, 1)
