"""Failures users report upstream (#40), each a real tiny run of the real library beside a
healthy twin, named after the issue it reproduces. The plain loop saves what such a loop saves
(``torch.save`` of model, optimizer, scaler, scheduler states) and logs to TensorBoard with its
own names (``loss``, ``lr``, ``scale``, ``grad_norm``); diagnose reads both.

Each test checks that the run reproduces the report (in the library's own numbers), that the
facts the cause is told by reach diagnose's report, and that the healthy twin raises no alarm.
Where the verdict does not name the cause yet, the docstring says what it needs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import diagnose_cli

pytest.importorskip("tensorboard")


def _log(out: Path, rows: list[dict]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(out / "tensorboard")) as w:
        for r in rows:
            for k, v in r.items():
                if k != "step":
                    w.add_scalar(k, v, r["step"])


# ---------------------------------------------------------------------------- pytorch #55585
def scheduler_loop(out: Path, *, fixed: bool, steps: int = 16) -> list[dict]:
    """fp16 autocast + GradScaler(init_scale=2**24) with a 10-step linear warmup: the first
    steps overflow and ``scaler.step`` skips ``optimizer.step``. ``fixed=False``: the loop of
    pytorch #55585 / transformers #11106 (``scheduler.step()`` every iteration: the warmup
    advances on skipped steps); ``fixed=True``: the scheduler steps only when the optimizer did
    (the scale did not drop: the Trainer's fix, transformers #11144)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        before = scaler.get_scale()
        rows.append(
            {
                "step": step,
                "loss": loss.item(),
                "grad_norm": gn.item(),
                "lr": sched.get_last_lr()[0],
                "scale": before,
            }
        )
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if not fixed or scaler.get_scale() >= before:
            sched.step()
    out.mkdir(parents=True)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scaler": scaler.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "step": steps,
        },
        out / "ckpt.pt",
    )
    _log(out, rows)
    return rows


def test_pytorch_55585_lr_scheduler_advances_on_skipped_steps(tmp_path):
    """The warmup ran on while GradScaler skipped the optimizer: the broken loop's lr reached
    its peak with one real step taken.

    Not named by the verdict yet (both say "healthy: N isolated skipped steps"). It needs: in
    the history, the learning rate changing across rows the scaler skipped (``History.rows``'
    ``learning_rate`` against ``skipped_steps``); or, in the checkpoint, the scheduler's
    ``last_epoch`` ahead of the optimizer's step count (Adam's ``state[i]["step"]``) by the
    skipped steps. The fix in the plain loop's terms: ``if scaler.get_scale() >= scale_before:
    scheduler.step()`` (the HF Trainer does this since transformers #11144)."""
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step"):
        bad = scheduler_loop(tmp_path / "bad", fixed=False)  # the warning users reported
    ok = scheduler_loop(tmp_path / "ok", fixed=True)
    skipped = [r["step"] for r in bad if r["grad_norm"] != r["grad_norm"] or r["grad_norm"] > 1e30]
    assert skipped == list(range(1, 10))  # the scale fell from 2**24 to 2**15
    first_real = skipped[-1] + 1
    assert bad[first_real - 1]["lr"] == pytest.approx(1e-2)  # the warmup is over already
    assert ok[first_real - 1]["lr"] == pytest.approx(1e-3)  # the warmup's first step
    state = torch.load(tmp_path / "bad" / "ckpt.pt", weights_only=True)
    opt_steps = int(state["optimizer"]["state"][0]["step"])
    assert state["lr_scheduler"]["last_epoch"] - opt_steps == len(skipped)

    for name in ("bad", "ok"):
        code, rep, _ = diagnose_cli(tmp_path / name / "ckpt.pt")
        h = rep["history"]
        assert h["source"] == str(tmp_path / name / "tensorboard")
        assert h["columns"]["learning_rate"] == "lr" and h["skipped_steps"] == skipped
        if name == "ok":
            assert code == 0 and rep["healthy"], rep["verdict"]


# ---------------------------------------------------------------------------- pytorch #98828
def growth_loop(out: Path, *, growth_interval: int, steps: int = 150) -> list[dict]:
    """pytorch #98828's own loop: ``nn.Linear(5, 1)``, Adam, a loss near 1e-8, a GradScaler
    with ``growth_interval=1``: the gradients never overflow, so the scale doubles every step.
    torch >= 2.1 caps the growth (pytorch #98876) at 2**127, float32's largest power of two;
    before, it became inf. The twin keeps the default ``growth_interval=2000``."""
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(net.parameters())
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    rows = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        x, y = torch.randn(1, 5), 1e-4 * torch.randn(1, 1)
        loss = ((net(x) - y) ** 2).mean()
        scaler.scale(loss).backward()
        rows.append({"step": step, "loss": loss.item(), "scale": scaler.get_scale()})
        scaler.step(opt)
        scaler.update()
    out.mkdir(parents=True)
    torch.save(
        {"model": net.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
        out / "ckpt.pt",
    )
    _log(out, rows)
    return rows


def test_pytorch_98828_gradscaler_scale_grows_until_it_overflows(tmp_path):
    """The scale climbed to float32's ceiling and sits there (backing off and growing back).

    Not named by the verdict yet (both twins get the same loss-trend verdict). It needs: a
    scaler whose scale is at or near 2**127 (``state.scaler.scale``; in the history the
    ``scale_trajectory`` reaching it), with ``growth_interval`` small: "the scale grew until
    it overflowed float32 (pytorch #98828): the gradients never overflow at this loss; use the
    default ``GradScaler(growth_interval=2000)``, or no GradScaler for bf16/fp32"."""
    bad = growth_loop(tmp_path / "bad", growth_interval=1)
    ok = growth_loop(tmp_path / "ok", growth_interval=2000)
    ceiling = 2.0**127
    assert max(r["scale"] for r in bad) == ceiling  # capped by torch, not inf
    assert all(r["scale"] == 65536.0 for r in ok)

    code, rep, _ = diagnose_cli(tmp_path / "bad" / "ckpt.pt")
    assert rep["state"]["scaler"]["scale"] == ceiling
    assert rep["state"]["scaler"]["growth_interval"] == 1
    assert max(s for _, s in rep["history"]["scale_trajectory"]) == ceiling
    code, rep, _ = diagnose_cli(tmp_path / "ok" / "ckpt.pt")
    assert rep["state"]["scaler"]["scale"] == 65536.0
    assert rep["history"]["scale_trajectory"] == [[1, 65536.0]]
    assert code == 0 and not any(p["severity"] == "error" for p in rep["problems"])


# ---------------------------------------------------------------------------- a bf16 spike
def spike_loop(out: Path, *, bad_batch: int | None, steps: int = 24) -> list[dict]:
    """bf16 autocast, AdamW, gradients clipped to norm 1: one batch ``1e3`` times too large
    (a corrupt sample, a unit mistake) at ``bad_batch``; the twin has none."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, generator=g)
        if step == bad_batch:
            x = x * 1e3
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        rows.append({"step": step, "loss": loss.item(), "grad_norm": gn.item()})
    out.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, out / "ckpt.pt")
    _log(out, rows)
    return rows


def test_bf16_loss_spike_from_one_bad_batch(tmp_path):
    """Named today: the verdict says the run recovered from a single loss at the bad batch's
    step (clipping kept the update bounded); the twin is healthy."""
    bad = spike_loop(tmp_path / "bad", bad_batch=12)
    ok = spike_loop(tmp_path / "ok", bad_batch=None)
    assert bad[11]["loss"] > 1000 * max(r["loss"] for r in ok)  # the spike is real
    assert bad[-1]["loss"] < 1.0  # and the run came back
    code, rep, _ = diagnose_cli(tmp_path / "bad" / "ckpt.pt")
    assert code == 0 and rep["verdict"]["status"] == "recovered", rep["verdict"]
    assert (
        "a single loss of" in rep["verdict"]["summary"]
        and "at step 12" in rep["verdict"]["summary"]
    )
    code, rep, _ = diagnose_cli(tmp_path / "ok" / "ckpt.pt")
    assert code == 0 and rep["verdict"]["status"] == "healthy", rep["verdict"]
