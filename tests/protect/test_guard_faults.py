"""The guard beyond non-finite gradients (issue #27), with planted faults in ampctl's loop on the
tiny BERT: a loss spike from one bad batch, a one-time NaN (transient), a NaN tied to a batch
(reproducible), a learning rate of 1.0 (divergence), and the data skip after a rollback. Each
asserts the event, the action and the final loss, beside its healthy twin."""

from __future__ import annotations

import importlib.util

import pytest

from ampctl.runlog import new_run_dir
from ampctl.train.builders import build_data_source
from ampctl.train.trainer import Trainer, train
from tests.conftest import read_jsonl
from tests.protect.planted import fingerprint

FAULTY = "model._target_=tests.protect.planted.Faulty"


def _fp(cfg, step: int) -> int:
    """The fingerprint of the batch step ``step`` (1-based, one micro-batch) trains on."""
    src = build_data_source(cfg.data, model=cfg.model, seed=cfg.trainer.seed)
    return fingerprint(src.batch_at(step - 1)["input_ids"])


def _train(cfg, name, **kw):
    res = train(cfg, new_run_dir(cfg.trainer.runs_dir, name), **kw)
    events = (
        read_jsonl(res.run_dir / "events.jsonl") if (res.run_dir / "events.jsonl").exists() else []
    )
    return res, events


SPIKE = (
    "precision=bf16",  # bf16 never overflows: only the spike rule can catch a finite bad batch
    "optim.clip_grad_norm=null",
    "trainer.max_steps=48",
    "trainer.log_every=4",
    "guard.spike_window=32",
    "guard.spike_min_steps=16",
    "logging.plot=false",
    FAULTY,
)


def test_a_loss_spike_is_skipped_on_the_device_and_the_run_ends_where_the_clean_one_does(fast_cfg):
    base = fast_cfg(*SPIKE)
    bad = _fp(base, 40)
    clean, clean_ev = _train(base, "clean")
    cfg = fast_cfg(*SPIKE, f"+model.spike_batches=[{bad}]")
    guarded, ev = _train(cfg, "guarded")
    unguarded, unguarded_ev = _train(
        fast_cfg(*SPIKE, f"+model.spike_batches=[{bad}]", "guard.spike=false"), "unguarded"
    )
    assert clean_ev == [] and unguarded_ev == []  # unguarded, a spike leaves no trace
    (spike,) = [e for e in ev if e["kind"] == "spike"]
    assert spike["step"] == 40 and spike["loss"] > 1e3 * spike["loss_threshold"] / 10
    assert spike["loss"] > spike["loss_threshold"] and spike["loss_z"] > 100
    assert spike["message"].startswith("spike, step skipped: loss ")
    assert guarded.summary["skipped"] == 1 and guarded.summary["status"] == "ok"
    # the count is on every row from the step it happened, and in the summary
    rows = read_jsonl(guarded.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r["spikes"] == 1] == [40, 44, 48]
    # the row of the spike's interval averages the steps it applied (37-39), not the x1e4 loss:
    # within a few percent of the clean run's row (the same weights up to step 39)
    row40 = next(r for r in rows if r["step"] == 40)
    clean40 = next(r for r in read_jsonl(clean.run_dir / "metrics.jsonl") if r["step"] == 40)
    assert abs(row40["loss"] - clean40["loss"]) < 0.05 * clean40["loss"], (row40, clean40)
    assert {r["spikes"] for r in rows if r["step"] < 40} == {0}
    assert guarded.summary["spikes"] == 1 and clean.summary["spikes"] == 0
    if importlib.util.find_spec("matplotlib") is not None:  # and a line on the run's figure
        from ampctl.commands.plot import build_run_figure

        ax_loss = build_run_figure(guarded.run_dir).axes[0]
        lines = [a for a in ax_loss.lines if a.get_gid() == "event:spike"]
        assert [list(a.get_xdata()) for a in lines] == [[40, 40]]
    final = {
        k: r.summary["final_loss"]
        for k, r in (("clean", clean), ("guarded", guarded), ("unguarded", unguarded))
    }
    assert abs(final["guarded"] - final["clean"]) < 0.01 * final["clean"], final
    assert final["unguarded"] > final["guarded"], final  # Adam took the spike: it trains on worse


def test_two_spikes_close_together_are_skipped_not_called_a_divergence(fast_cfg):
    """Two bad batches in neighbouring log rows (steps 38 and 42): both skipped as spikes, and
    the divergence rule judges the course without the spikes it skipped, so the run
    goes on to its end (it was stopped as diverged when the rows' losses counted the spikes)."""
    base = fast_cfg(*SPIKE)
    bad = [_fp(base, 38), _fp(base, 42)]
    res, ev = _train(fast_cfg(*SPIKE, f"+model.spike_batches=[{bad[0]},{bad[1]}]"), "two")
    assert [(e["kind"], e["step"]) for e in ev] == [("spike", 38), ("spike", 42)]
    assert res.summary["status"] == "ok" and res.summary["steps"] == 48
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    # the rows average the steps they applied; the spikes are counted apart, not averaged in
    assert max(r["loss"] for r in rows if r["step"] in (40, 44)) < 10
    assert [r["spikes"] for r in rows if r["step"] in (40, 44)] == [1, 2]


def test_no_spike_is_skipped_in_a_healthy_run(fast_cfg):
    """The healthy twin: the rule is on and active from step 17, and finds nothing."""
    res, ev = _train(fast_cfg(*SPIKE), "healthy")
    assert [e for e in ev if e["kind"] == "spike"] == [] and res.summary["skipped"] == 0
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert rows[-1]["step"] == 48


def test_a_one_time_nan_is_transient_its_step_is_retried_and_the_run_equals_the_clean_one(fast_cfg):
    """guard.rerun: a NaN planted in one gradient once (a flipped bit) is gone on the rerun; the
    step is retried, not skipped, so the run ends exactly where the clean run does."""
    args = ("precision=bf16", "trainer.max_steps=16", "guard.rerun=true", "logging.plot=false")
    hit = []

    def once(tr, step, phase):
        if step == 10 and not hit:
            hit.append(step)
            next(iter(tr.params)).grad.view(-1)[0] = float("nan")

    clean, _ = _train(fast_cfg(*args), "clean")
    faulty, ev = _train(fast_cfg(*args), "transient", fault=once)
    (rerun,) = [e for e in ev if e["kind"] == "rerun"]
    assert (rerun["step"], rerun["verdict"], rerun["cause"], rerun["rank"]) == (
        10,
        "transient",
        "overflow",
        None,
    )
    assert "a transient fault, the step was retried" in rerun["message"]
    assert [e["kind"] for e in ev] == ["rerun"]  # no overflow decision: the step was retried
    assert faulty.summary["final_loss"] == clean.summary["final_loss"]
    # nothing was skipped: the summary, every row and the scale say so
    assert faulty.summary["skipped"] == 0 and faulty.summary["overflow_rate"] == 0
    rows = read_jsonl(faulty.run_dir / "metrics.jsonl")
    assert {r["skipped"] for r in rows} == {0}
    assert faulty.summary["final_scale"] == clean.summary["final_scale"]


def test_a_nan_the_data_causes_is_reproducible(fast_cfg):
    base = fast_cfg("trainer.max_steps=12", "guard.rerun=true", "logging.plot=false", FAULTY)
    bad = _fp(base, 6)
    res, ev = _train(
        fast_cfg(
            "trainer.max_steps=12",
            "guard.rerun=true",
            "logging.plot=false",
            FAULTY,
            f"+model.nan_batches=[{bad}]",
        ),
        "reproducible",
    )
    (rerun,) = [e for e in ev if e["kind"] == "rerun"]
    assert (rerun["step"], rerun["verdict"], rerun["cause"]) == (6, "reproducible", "overflow")
    assert "the data or the numerics" in rerun["message"]
    over = [e for e in ev if e["kind"] == "overflow"]
    assert [(e["step"], e["overflow"]) for e in over] == [(6, "forward")]
    # the loss itself is NaN while every module's output is finite: named as such
    (loc,) = [e for e in ev if e["kind"] == "locate"]
    assert loc["module"] == "<model>" and res.summary["status"] == "ok"


@pytest.mark.parametrize(("lr", "status"), [(1.0, "diverged"), (3e-3, "ok")])
def test_a_diverging_run_stops_with_the_reason_and_its_healthy_twin_does_not(fast_cfg, lr, status):
    """The finding of issue #27: an lr far too high no longer ends 'ok'. lr 1.0 on the tiny BERT:
    the loss climbs from ~17 to over 100; the run stops, status diverged, exit 1, with the
    reason and the last good checkpoint. The same run at its normal lr: ok, no event of it."""
    cfg = fast_cfg(
        "trainer.max_steps=80", "trainer.ckpt_every=4", f"optim.lr={lr}", "logging.plot=false"
    )
    res, ev = _train(cfg, f"lr{lr}")
    assert (res.status, res.exit_code) == (status, 1 if status == "diverged" else 0)
    div = [e for e in ev if e["kind"] == "divergence"]
    if status == "ok":
        assert div == [] and res.summary["steps"] == 80
        return
    (d,) = div
    assert d["action"] == "stop" and d["ratio"] > 5 and d["message"].startswith("the loss diverged")
    assert res.summary["status"] == "diverged" and res.summary["steps"] < 80
    assert res.summary["diverged_since"] == d["since"]
    good = res.summary["last_good_checkpoint"]
    assert good is None or int(good.rsplit("_", 1)[1].split(".")[0]) <= d["since"]
    # the event's figures are the ones its reason names (the reference and the ratio)
    assert f"({d['min_loss']:.4g}, " in d["message"] and f"{d['ratio']:.1f}x" in d["message"]
    # the row the rule held on is the run's last row: the final loss is the one it judged
    last = read_jsonl(res.run_dir / "metrics.jsonl")[-1]
    assert last["step"] == d["step"] and res.summary["final_loss"] == last["loss"]


def test_a_rollback_can_skip_the_batches_that_caused_it(fast_cfg):
    """guard.skip_batches: two bad batches in a row (steps 9 and 10) roll back to the snapshot of
    step 8; the data then goes on past them and 5 more, so they are not met again. The skip is
    an event; a run without the skip meets them again after every rollback."""
    args = (
        "trainer.max_steps=20",
        "guard.rollback_after=2",
        "guard.snapshot_every=2",
        "logging.plot=false",
        FAULTY,
    )
    base = fast_cfg(*args)
    bad = f"+model.nan_batches=[{_fp(base, 9)},{_fp(base, 10)}]"
    tr = Trainer(
        fast_cfg(*args, bad, "guard.skip_batches=5"), new_run_dir(base.trainer.runs_dir, "skip")
    )
    res = tr.run()
    ev = read_jsonl(res.run_dir / "events.jsonl")
    (rb,) = [e for e in ev if e["kind"] == "rollback"]
    (skip,) = [e for e in ev if e["kind"] == "data_skip"]
    assert (rb["from_step"], rb["to_step"]) == (10, 8)
    # the snapshot of step 8 had consumed 8 batches; steps 9 and 10 consumed 2 more, and 5 more go
    assert (skip["from_position"], skip["to_position"], skip["batches"]) == (8, 15, 7)
    assert tr.data.position == 15 + (20 - 8) and res.status == "ok"  # on from there to step 20
    again = Trainer(fast_cfg(*args, bad), new_run_dir(base.trainer.runs_dir, "noskip")).run()
    rollbacks = [e for e in read_jsonl(again.run_dir / "events.jsonl") if e["kind"] == "rollback"]
    assert len(rollbacks) > 1  # without the skip, the same batches come back


def test_with_clipping_a_grad_norm_spike_on_a_clean_loss_is_not_skipped(fast_cfg):
    """#36: the default run (clipping at 1.0) had two healthy steps skipped by the grad-norm
    rule. Every gradient made 1000x larger at step 40 (its loss on course): clipped, the step
    moves the weights no more than any clipped step, so it trains (the spike rule judges it by
    its loss); the rule's grad-norm figure is the unclipped norm the clipping reports."""

    def big(tr, step, phase):
        if step == 40:
            for p in tr.params:
                if p.grad is not None:
                    p.grad.mul_(1e3)

    args = [a for a in SPIKE if a != FAULTY and not a.startswith("optim.clip_grad_norm")]
    res, ev = _train(fast_cfg(*args, "optim.clip_grad_norm=1.0"), "clipped", fault=big)
    assert [e for e in ev if e["kind"] == "spike"] == [] and res.summary["skipped"] == 0
    rows = read_jsonl(res.run_dir / "metrics.jsonl")
    assert max(r["grad_norm"] for r in rows if r["step"] == 40) > 100  # the spike was there
