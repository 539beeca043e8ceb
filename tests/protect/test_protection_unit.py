"""Protection driven by hand from a plain loop (its module docstring's use): a tiny model, planted
inf in a gradient or an overflowing module in the forward, and what each decision did to the
weights, the optimizer state, the owner's progress, the scale and the events -- exactly."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.checks import FieldError
from ampctl.amp.guard import GuardRules
from ampctl.amp.precision import PRECISIONS, make_precision
from ampctl.protect.protection import Protection, TrainAborted
from ampctl.protect.settings import GuardConfig

INF = float("inf")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield


class Amp(nn.Module):
    """Fine in fp32; with ``boost`` 1000 its square overflows fp16 (65504), with 1e20 fp32 too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.boost = 1.0
        self.flaky = 0  # overflow on this many more calls only (a fault that does not replay)

    def forward(self, x):
        boost = self.boost
        if self.flaky > 0:
            self.flaky -= 1
            boost = 1e20
        h = self.lin(x) * boost
        return 0.1 * (h * h) / (boost * boost)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.amp = Amp()
        self.head = nn.Linear(4, 1)
        self.gain = 1.0  # INF: the loss itself overflows, in no module

    def forward(self, x, y):
        h = x + self.amp(x)
        return ((self.head(h).float() - y) ** 2).mean() * self.gain


_g = torch.Generator().manual_seed(1)
BATCH = {"x": torch.randn(8, 4, generator=_g), "y": torch.randn(8, 1, generator=_g)}


class Progress:
    """The owner's position that a rollback rewinds."""

    def __init__(self) -> None:
        self.step = 0
        self.seen = 0

    def state_dict(self):
        return {"step": self.step, "seen": self.seen}

    def load_state_dict(self, state):
        self.step, self.seen = state["step"], state["seen"]


class Loop:
    """The module docstring's loop, with faults to plant."""

    def __init__(
        self,
        precision: str = "fp16",
        *,
        fused: bool = False,
        scaler: dict | None = None,
        progress: bool = True,
        start: bool = True,
        protection: dict | None = None,
        **guard,
    ) -> None:
        self.model = Tiny()
        prec = make_precision(precision, scaler_args={"init_scale": 1024.0, **(scaler or {})})
        prec.prepare(self.model)
        opt = torch.optim.AdamW(prec.optimizer_params(self.model), lr=1e-2, fused=fused)
        self.progress = Progress() if progress else None
        self.emitted: list[dict] = []
        self.prot = Protection(
            self.model,
            opt,
            prec,
            config=GuardConfig(**guard),
            emit=self.emitted.append,
            progress_state=self.progress.state_dict if self.progress is not None else None,
            **(protection or {}),
        )
        if start:
            self.prot.start()
        self.n = 0

    def step(self, plant: tuple[str, ...] = (), batches: list | None = None):
        prot = self.prot
        if self.progress is not None:
            self.progress.step += 1
            self.progress.seen += 8
            self.n = self.progress.step
        else:
            self.n += 1
        prot.optimizer.zero_grad()
        prot.precision.zero_grad()
        with prot.precision.autocast():
            loss = self.model(**BATCH)
        prot.precision.backward(loss)
        prot.precision.after_backward()
        params = dict(prot.precision.named_optimizer_params(self.model))
        for name in plant:
            params[name].grad.view(-1)[0] = INF
        prot.precision.unscale_(prot.optimizer)
        skipped = prot.precision.optimizer_step(prot.optimizer)
        self.apply(
            prot.after_step(
                self.n, skipped=skipped, batches=[BATCH] if batches is None else batches
            )
        )
        return skipped

    def apply(self, rewind) -> None:
        """The loop owns its position: a rollback hands it back and the loop restores it."""
        if rewind is not None and self.progress is not None and rewind.progress is not None:
            self.progress.load_state_dict(rewind.progress)

    def sync(self):
        self.apply(self.prot.sync())

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.prot.events]

    def state(self) -> dict:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.prot.optimizer.state_dict()),
            "progress": None if self.progress is None else self.progress.state_dict(),
        }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _records(reads: torch.Tensor) -> tuple[float, list[tuple[float, float]]]:
    """A pending read as (scale now, [(scale used, skipped) per step record])."""
    vals = reads.tolist()
    w = len(rec.COLUMNS)
    rows = [vals[1 + i : 1 + i + w] for i in range(0, len(vals) - 1, w)]
    return vals[0], [(r[rec.SCALE], r[rec.SKIPPED]) for r in rows]


def _strip(ev: dict) -> dict:
    return {k: v for k, v in ev.items() if k != "time"}


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("attribution_limit", 0, "an integer >= 1"),
        ("attribution_limit", 2.0, "an integer >= 1"),
        ("rollback_backoff", 0, "in (0, 1]"),
        ("rollback_backoff", 1.01, "in (0, 1]"),
        ("rollback_backoff", math.inf, "in (0, 1]"),
        ("fallback_chain", ["fp16", "fp4"], "a list of " + ", ".join(PRECISIONS)),
        ("snapshot_every", -1, "an integer >= 0 (0: no snapshots)"),
        ("snapshot_every", 1.0, "an integer >= 0 (0: no snapshots)"),
        ("rollback_after", -1, "an integer >= 0 (0 disables rollback)"),
    ],
)
def test_guard_config_refuses_a_bad_field(field, value, allowed):
    with pytest.raises(FieldError) as e:
        GuardConfig(**{field: value})
    assert str(e.value) == f"GuardConfig: {field}={value} is not allowed: {field} must be {allowed}"


def test_guard_config_boundaries_and_its_rules():
    cfg = GuardConfig(
        attribution_limit=1, rollback_backoff=1, snapshot_every=0, rollback_after=7, skip_window=9
    )
    assert (cfg.attribution_limit, cfg.rollback_backoff, cfg.snapshot_every) == (1, 1, 0)
    assert cfg.rules == GuardRules(rollback_after=7, skip_window=9)
    assert type(cfg.rules) is GuardRules
    assert GuardConfig(fallback_chain=["fp16-pure", "fp32"]).fallback_chain == ["fp16-pure", "fp32"]


# ------------------------------------------------------------------ clean steps and snapshots
def test_clean_steps_emit_nothing_and_refresh_the_snapshot_every_n_steps():
    loop = Loop(snapshot_every=2)
    assert loop.prot.snapshot.step == 0
    assert loop.prot.snapshot.scale.item() == 1024.0  # taken before the scaler's state existed
    steps = []
    for _ in range(4):
        assert loop.step() is False
        steps.append(loop.prot.snapshot.step)
    assert steps == [0, 2, 2, 4]
    assert loop.prot.events == [] and loop.emitted == []
    saved = loop.state()
    snap = loop.prot.snapshot
    assert _same(snap.model_state(), saved["model"])
    assert _same(snap.optimizer_state(), saved["optimizer"])
    assert snap.progress == {"step": 4, "seen": 32} and snap.masters() is None
    loop.step()  # the snapshot holds copies: training on does not change it
    assert snap.step == 4 and _same(snap.model_state(), saved["model"])
    assert _same(snap.optimizer_state(), saved["optimizer"])
    loop.step()  # refreshed in place, into the same buffers
    now = loop.state()
    assert loop.prot.snapshot is snap and snap.step == 6
    assert _same(snap.model_state(), now["model"]) and not _same(now["model"], saved["model"])
    assert _same(snap.optimizer_state(), now["optimizer"])


def test_a_skipped_step_does_not_count_towards_the_next_snapshot():
    loop = Loop(snapshot_every=2, rollback_after=0)
    loop.step()
    loop.step(plant=("head.weight",))
    assert loop.prot.snapshot.step == 0
    loop.step()
    assert loop.prot.snapshot.step == 3


def test_disabled_protection_does_nothing():
    loop = Loop(enabled=False, rollback_after=1)
    assert loop.prot.snapshot is None and not loop.prot.snapshots and not loop.prot.enabled
    for _ in range(3):
        assert loop.step(plant=("head.weight",)) is True
    assert loop.prot.events == [] and loop.prot.snapshot is None
    assert loop.prot._step == 3 and loop.prot.guard.consecutive == 0


# ------------------------------------------------------------------ overflow and attribution
def test_a_gradient_overflow_is_attributed_in_one_event():
    loop = Loop()
    loop.step()
    loop.step(plant=("head.weight", "amp.lin.bias"))
    assert len(loop.prot.events) == 1
    ev = loop.prot.events[0]
    assert loop.emitted == [ev]
    assert abs(ev["time"] - time.time()) < 60
    assert _strip(ev) == {
        "step": 2,
        "kind": "overflow",
        "message": "gradient overflow, step skipped; scale now 512; non-finite grads in "
        "amp.lin.bias, head.weight",
        "overflow": "gradient",
        "scale": 512.0,
        "params": ["amp.lin.bias", "head.weight"],
    }


def test_attribution_limit_and_attribution_off():
    loop = Loop(attribution_limit=1)
    loop.step(plant=("head.weight", "amp.lin.bias"))
    assert loop.prot.events[0]["params"] == ["amp.lin.bias"]
    loop = Loop(attribution=False)
    loop.step(plant=("head.weight",))
    assert _strip(loop.prot.events[0]) == {
        "step": 1,
        "kind": "overflow",
        "message": "gradient overflow, step skipped; scale now 512",
        "overflow": "gradient",
        "scale": 512.0,
    }


def test_events_are_kept_without_an_emit_function():
    model = Tiny()
    prec = make_precision("fp16")
    prot = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec)
    prot.emit(3, "warning", "hello", x=1)
    assert [_strip(e) for e in prot.events] == [
        {"step": 3, "kind": "warning", "message": "hello", "x": 1}
    ]
    assert prot.config == GuardConfig() and prot.progress_state is None


# ------------------------------------------------------------------ rollback
def test_rollback_restores_the_snapshot_bit_for_bit_and_cuts_the_scale():
    loop = Loop(snapshot_every=2, rollback_after=3, rollback_backoff=0.25)
    loop.step()
    loop.step()
    saved = loop.state()
    for _ in range(3):
        assert loop.step(plant=("head.weight",)) is True
    assert loop.kinds() == ["overflow", "overflow", "overflow", "rollback"]
    assert [e["scale"] for e in loop.prot.events[:3]] == [512.0, 256.0, 128.0]
    assert _strip(loop.prot.events[3]) == {
        "step": 2,
        "kind": "rollback",
        "message": "3 consecutive overflows: restored step 2, scale 128 -> 32",
        "to_step": 2,
        "from_step": 5,
    }
    assert _same(loop.state(), saved)  # weights, optimizer state and progress
    assert loop.prot.scaler.get_scale() == 32.0  # min(128, 1024) * 0.25
    assert loop.prot.scaler.skipped_steps == 3  # the skips happened
    assert loop.prot._step == 2
    assert loop.prot.guard.state_dict() == {"window": [], "consecutive": 0, "rollbacks": 1}
    # the restored optimizer state is a copy: training on leaves the snapshot as it was
    loop.step()
    loop.step()
    for _ in range(3):
        loop.step(plant=("head.weight",))
    assert loop.kinds()[-1] == "rollback" and loop.prot.events[-1]["to_step"] == 4


def test_a_second_rollback_to_the_same_snapshot_restores_it_unchanged():
    """The optimizer gets a copy of the snapshot's state: stepping on does not alter it."""
    loop = Loop(snapshot_every=3, rollback_after=2)
    for _ in range(3):
        loop.step()
    saved = loop.state()
    for _ in range(2):
        loop.step(plant=("head.weight",))
    assert loop.kinds()[-1] == "rollback" and _same(loop.state(), saved)
    loop.step()
    loop.step()  # Adam updates its moments in place
    for _ in range(2):
        loop.step(plant=("head.weight",))
    assert loop.prot.events[-1]["to_step"] == 3
    assert _same(loop.state(), saved)


def test_rollback_cut_uses_the_smaller_of_the_two_scales_and_the_floor():
    # the scale grew after the snapshot: the snapshot's scale is the smaller
    loop = Loop(scaler={"growth_interval": 1}, snapshot_every=100, rollback_after=3)
    for _ in range(4):
        loop.step()
    assert loop.prot.scaler.get_scale() == 16384.0
    for _ in range(3):
        loop.step(plant=("head.weight",))
    ev = loop.prot.events[-1]
    assert ev["message"] == "3 consecutive overflows: restored step 0, scale 2048 -> 256"
    assert loop.prot.scaler.get_scale() == 256.0  # min(2048, 1024) * 0.25
    # the cut never goes below min_scale
    loop = Loop(scaler={"min_scale": 64.0}, snapshot_every=100, rollback_after=3)
    for _ in range(3):
        loop.step(plant=("head.weight",))
    assert loop.prot.events[-1]["message"].endswith("scale 128 -> 64")
    assert loop.prot.scaler.get_scale() == 64.0


def test_rollback_without_snapshots_keeps_the_current_state():
    loop = Loop(snapshot_every=0, rollback_after=2, rollback_backoff=0.5)
    assert loop.prot.snapshot is None
    loop.step()
    saved = loop.state()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    ev = loop.prot.events[-1]
    assert _strip(ev) == {
        "step": 3,
        "kind": "rollback",
        "message": "2 consecutive overflows: restored step 3, scale 256 -> 128",
        "to_step": 3,
        "from_step": 3,
    }
    assert _same(loop.state()["model"], saved["model"])  # skipped steps never touched it
    assert loop.prot.scaler.get_scale() == 128.0 and loop.prot.snapshot is None


def test_rollback_restores_fp16_pure_masters():
    loop = Loop("fp16-pure", snapshot_every=1, rollback_after=2)
    loop.step()
    masters = [m.detach().clone() for m in loop.prot.precision.master.params]
    assert _same(loop.prot.snapshot.masters(), masters)
    loop.step()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    assert loop.kinds()[-1] == "rollback"
    assert loop.prot.events[-1]["to_step"] == 2
    loop2 = Loop("fp16-pure", snapshot_every=1, rollback_after=2)
    loop2.step()
    loop2.step()
    want = [m.detach().clone() for m in loop2.prot.precision.master.params]
    assert _same([m.detach() for m in loop.prot.precision.master.params], want)


def test_rollback_without_progress_rewinds_weights_only():
    loop = Loop(progress=False, snapshot_every=1, rollback_after=2)
    loop.step()
    saved = loop.state()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    assert loop.prot.snapshot.progress is None
    assert _same(loop.state(), saved) and loop.prot._step == 1


# ------------------------------------------------------------------ fallback and abort
def test_fallback_after_the_rollbacks_restores_and_switches_precision():
    loop = Loop(snapshot_every=1, rollback_after=2, max_rollbacks=1)
    loop.step()
    saved = loop.state()
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))  # rollback 1, to step 1
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))  # rollbacks spent: fall back
    assert loop.kinds() == ["overflow", "overflow", "rollback", "overflow", "overflow", "fallback"]
    assert _strip(loop.prot.events[-1]) == {
        "step": 1,
        "kind": "fallback",
        "message": "2 consecutive overflows, after 1 rollbacks at fp16: falling back fp16 -> bf16"
        "; restored step 1",
        "from_precision": "fp16",
        "to_precision": "bf16",
        "to_step": 1,
        "from_step": 3,
    }
    prec = loop.prot.precision
    assert prec.name == "bf16" and not prec.scaler.is_enabled()
    assert prec.scaler.skipped_steps == 4  # the counters come along
    assert loop.prot.guard.state_dict() == {"window": [], "consecutive": 0, "rollbacks": 0}
    assert _same(loop.state(), saved)
    assert loop.prot.snapshot.step == 1 and loop.prot._step == 1
    assert loop.step() is False  # trains on in bf16
    assert loop.prot.events[-1]["kind"] == "fallback"


def test_fallback_without_snapshots_keeps_no_snapshot():
    loop = Loop(snapshot_every=0, rollback_after=1, max_rollbacks=0)
    loop.step(plant=("head.weight",))
    assert loop.kinds() == ["overflow", "fallback"]
    assert loop.prot.precision.name == "bf16" and loop.prot.snapshot is None


def test_fp16_pure_fallback_needs_a_way_to_rebuild_the_optimizer():
    loop = Loop("fp16-pure", rollback_after=1, max_rollbacks=0)
    with pytest.raises(TrainAborted) as e:
        loop.step(plant=("head.weight",))
    reason = (
        "1 consecutive overflows, after 0 rollbacks at fp16-pure: falling back fp16-pure -> fp16"
        ", but this loop cannot rebuild its optimizer for fp16 (pass rebuild_optimizer= to "
        "Protection)"
    )
    assert str(e.value) == reason
    assert _strip(loop.prot.events[-1]) == {"step": 1, "kind": "abort", "message": reason}


def test_fp16_pure_fallback_rebuilds_the_optimizer_over_the_weights():
    built = []

    def rebuild(params):
        built.append(params)
        return torch.optim.AdamW(params, lr=1e-2)

    loop = Loop(
        "fp16-pure",
        rollback_after=1,
        max_rollbacks=0,
        snapshot_every=1,
        protection={"rebuild_optimizer": rebuild},
    )
    loop.step()
    masters = [m.detach().clone() for m in loop.prot.precision.master.params]
    state = copy.deepcopy(loop.prot.optimizer.state_dict()["state"])
    loop.step(plant=("head.weight",))
    assert loop.kinds()[-1] == "fallback" and loop.prot.precision.name == "fp16"
    assert built == [list(loop.model.parameters())]
    assert (
        loop.prot.optimizer is not None
        and loop.prot.optimizer.param_groups[0]["params"] == (built[0])
    )
    assert _same(loop.prot.optimizer.state_dict()["state"], state)
    assert _same([p.detach() for p in loop.model.parameters()], masters)
    assert loop.prot.scaler.get_scale() == 1024.0  # the snapshot's scale
    assert loop.step() is False


def test_floor_abort_and_floor_warn():
    loop = Loop(scaler={"init_scale": 2.0, "min_scale": 1.0}, floor_policy="abort")
    loop.step(plant=("head.weight",))  # at the floor, once: the scaler copes
    with pytest.raises(TrainAborted) as e:
        loop.step(plant=("head.weight",))
    reason = "loss scale at its minimum and still overflowing (2 in a row)"
    assert str(e.value) == reason
    assert loop.kinds() == ["overflow", "overflow", "abort"]
    assert _strip(loop.prot.events[-1]) == {"step": 2, "kind": "abort", "message": reason}
    loop = Loop(scaler={"init_scale": 2.0, "min_scale": 1.0}, floor_policy="warn")
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    assert _strip(loop.prot.events[-1]) == {"step": 2, "kind": "warning", "message": reason}


def test_a_scale_above_the_floor_is_not_at_the_floor():
    loop = Loop(
        scaler={"init_scale": 8.0, "min_scale": 1.0}, floor_policy="abort", rollback_after=0
    )
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))  # 4 then 2: above the floor
    assert loop.kinds() == ["overflow", "overflow"]
    with pytest.raises(TrainAborted):
        loop.step(plant=("head.weight",))  # 1: at the floor, and 3 in a row


def test_without_loss_scaling_there_is_no_floor():
    loop = Loop("bf16", floor_policy="abort", rollback_after=0)
    for _ in range(3):
        assert loop.step(plant=("head.weight",)) is True
    assert loop.kinds() == ["overflow"] * 3
    assert loop.prot.events[0]["message"] == (
        "gradient overflow, step skipped; scale now 1; non-finite grads in head.weight"
    )


# ------------------------------------------------------------------ forward overflow
def test_forward_overflow_promotes_the_module_where_it_first_appears():
    loop = Loop()
    loop.model.amp.boost = 1000.0
    assert loop.step() is True
    ev, promo = loop.prot.events
    assert (ev["overflow"], ev["scale"]) == ("forward", 1024.0)  # no back-off
    assert ev["message"].startswith("forward overflow, step skipped; scale now 1024")
    assert _strip(promo) == {
        "step": 1,
        "kind": "promotion",
        "message": "forward overflow first appears in amp (non-finite, float16): now runs in fp32",
        "module": "amp",
        "dtype": "float16",
    }
    assert loop.prot.precision.in_fp32 == ["amp"]
    assert loop.step() is False  # cured
    assert loop.prot.guard.consecutive == 0


def test_forward_overflow_locate_only_without_promotion():
    loop = Loop(promote=False)
    loop.model.amp.boost = 1000.0
    loop.step()
    assert _strip(loop.prot.events[1]) == {
        "step": 1,
        "kind": "locate",
        "message": "forward overflow first appears in amp (float16)",
        "module": "amp",
        "dtype": "float16",
    }
    assert loop.prot.precision.in_fp32 == []


def test_a_promotion_that_does_not_cure_is_undone_and_an_fp32_module_is_never_promoted():
    """The finding of issue #27: LayerNorms that already ran in fp32 were 'promoted'. A module
    that overflows in fp32 is not a precision problem: a promotion that did not cure is undone
    (the module was not the cause) and it is not promoted again; in an fp32 run nothing is."""
    loop = Loop(rollback_after=0)
    loop.model.amp.boost = 1e20  # overflows fp32 as well
    loop.step()
    assert loop.kinds() == ["overflow", "promotion"]
    loop.step()
    assert _strip(loop.prot.events[-1]) == {
        "step": 2,
        "kind": "promotion_undone",
        "message": "amp overflows in fp32 too (promoted at step 1): not the cause, moved back to "
        "fp16",
        "module": "amp",
        "promoted_at": 1,
    }
    assert loop.prot.precision.in_fp32 == []
    loop.step()
    assert _strip(loop.prot.events[-1]) == {
        "step": 3,
        "kind": "locate",
        "message": "forward overflow first appears in amp, which overflowed in fp32 too when it "
        "was moved there: not a precision problem (look at the learning rate and the data)",
        "module": "amp",
        "dtype": "float16",
    }
    assert loop.prot.precision.in_fp32 == []
    loop = Loop("fp32", rollback_after=0)
    loop.model.amp.boost = 1e20
    loop.step()
    assert loop.prot.events[-1]["message"] == (
        "forward overflow first appears in amp, which computes in float32 already: not a "
        "precision problem (look at the learning rate and the data)"
    )
    assert loop.prot.precision.in_fp32 == []


def test_forward_overflow_of_the_loss_itself_names_the_model():
    loop = Loop()
    loop.model.gain = INF
    loop.step()
    assert _strip(loop.prot.events[-1]) == {
        "step": 1,
        "kind": "locate",
        "message": "forward overflow: the loss itself is not finite while every module's "
        "output is (look at the loss function, the labels and the learning rate)",
        "module": "<model>",
        "dtype": "float32",
    }


def test_forward_overflow_that_does_not_replay():
    loop = Loop()
    loop.model.amp.flaky = 1
    loop.step()
    assert _strip(loop.prot.events[-1]) == {
        "step": 1,
        "kind": "locate",
        "message": "forward overflow did not reproduce on replay (non-deterministic or "
        "data-dependent)",
    }


def test_forward_overflow_without_locating():
    for loop, batches in ((Loop(locate_forward=False), None), (Loop(), [])):
        loop.model.amp.boost = 1000.0
        loop.step(batches=batches)
        assert loop.kinds() == ["overflow"]


def test_forward_replay_runs_every_batch_and_takes_the_first_culprit():
    loop = Loop()
    loop.model.amp.boost = 1000.0
    calls = []
    real = loop.prot.forward

    def forward(model, batch):
        calls.append(batch["tag"])
        return real(model, {k: v for k, v in batch.items() if k != "tag"})

    loop.prot.forward = forward
    b1, b2 = dict(BATCH, tag=1), dict(BATCH, tag=2)
    loop.step(batches=[b1, b2])
    assert calls == [1, 2]
    assert loop.kinds() == ["overflow", "promotion"]


class _Ranks:
    """Stands in for a DistContext: every rank's located module, in rank order."""

    enabled = True

    def __init__(self, others: list) -> None:
        self.others = others

    def all_gather_object(self, obj):
        return [*self.others, obj]


def test_ranks_agree_on_the_first_located_module():
    loop = Loop(protection={"dist": _Ranks([None, ("head", "float16")])})
    loop.model.amp.boost = 1000.0
    loop.step()
    assert loop.prot.events[-1]["message"] == (
        "forward overflow first appears in head (non-finite, float16): now runs in fp32"
    )
    loop = Loop()
    loop.prot.dist = _Ranks([None])  # this rank's own finding counts
    loop.model.amp.boost = 1000.0
    loop.step()
    assert loop.prot.events[-1]["module"] == "amp"
    loop = Loop()
    loop.prot.dist = _Ranks([None])  # nobody reproduced it
    loop.model.amp.flaky = 1
    loop.step()
    assert loop.prot.events[-1]["message"].startswith("forward overflow did not reproduce")
    off = _Ranks([("head", "float16")])
    off.enabled = False
    for dist in (off, _Gathers()):  # a context without `enabled` is a single process too
        loop = Loop()
        loop.prot.dist = dist
        loop.model.amp.boost = 1000.0
        loop.step()
        assert loop.prot.events[-1]["module"] == "amp"


class _Gathers:
    def all_gather_object(self, obj):
        return [("head", "float16"), obj]


# ------------------------------------------------------------------ the fused path
def test_fused_path_decides_at_the_read_with_the_same_steps():
    loop = Loop(fused=True, snapshot_every=1, rollback_after=3)
    assert loop.prot.pending_reads() is None
    loop.sync()  # nothing waits: nothing to read
    loop.step()
    assert loop.step(plant=("head.weight",)) is None
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    loop.step()  # runs after the decision's step: discarded by the rollback
    assert loop.prot.events == []
    reads = loop.prot.pending_reads()
    assert reads.dtype == torch.float64
    assert _records(reads) == (
        128.0,
        [(1024.0, 0.0), (1024.0, 1.0), (512.0, 1.0), (256.0, 1.0), (128.0, 0.0)],
    )  # the scale now, then (scale used, skipped) of each step since the first waiting one
    loop.apply(loop.prot.on_read(reads.tolist()))
    assert loop.kinds() == ["overflow", "overflow", "overflow", "rollback"]
    first = loop.prot.events[0]
    assert _strip(first) == {
        "step": 2,
        "kind": "overflow",
        "message": "gradient overflow, step skipped; scale now 512",
        "overflow": "gradient",
        "scale": 512.0,
        "params": None,
        "attribution": "unavailable: with a fused optimizer the skip is read at the next log "
        "step, when this step's gradients are gone",
        "decided_at_step": 5,
    }
    assert [e.get("decided_at_step") for e in loop.prot.events[:3]] == [5, 5, 5]
    assert [e["scale"] for e in loop.prot.events[:3]] == [512.0, 256.0, 128.0]
    assert _strip(loop.prot.events[3]) == {
        "step": 0,
        "kind": "rollback",
        "message": "3 consecutive overflows: restored step 0, scale 128 -> 32",
        "to_step": 0,
        "from_step": 4,
        "discarded_steps": 1,
    }
    assert loop.progress.step == 0 and loop.prot.pending_reads() is None
    assert loop.prot.scaler.get_scale() == 32.0


def test_fused_path_snapshots_only_at_a_clean_read_far_enough_apart():
    loop = Loop(fused=True, snapshot_every=3)
    loop.step()
    loop.step()
    loop.sync()
    assert loop.prot.snapshot.step == 0  # 2 steps since the last one
    loop.step()
    loop.sync()
    assert loop.prot.snapshot.step == 3  # exactly 3
    loop.step()
    loop.step()
    assert _records(loop.prot.pending_reads()) == (
        1024.0,
        [(1024.0, 0.0), (1024.0, 0.0)],
    )  # only the steps since the last read
    loop.sync()
    assert loop.prot.snapshot.step == 3  # 2 steps since the snapshot
    loop.step()
    loop.step(plant=("head.weight",))
    loop.sync()
    assert loop.prot.snapshot.step == 3  # the last step overflowed
    assert loop.kinds() == ["overflow"]
    assert loop.prot.events[0]["scale"] == 512.0  # the scale now, after the last step
    assert "decided_at_step" not in loop.prot.events[0]  # decided at its own step


def test_fused_path_without_start_snapshots_at_the_first_clean_read():
    loop = Loop(fused=True, snapshot_every=2)
    loop.prot.snapshot = None  # as if start() had not been called
    loop.step()
    loop.sync()
    assert loop.prot.snapshot is None  # 1 step: not yet
    loop.step()
    loop.sync()
    assert loop.prot.snapshot.step == 2


def test_fused_path_warns_when_the_history_is_shorter_than_the_wait():
    loop = Loop(fused=True, scaler={"history_size": 2}, rollback_after=0)
    loop.step(plant=("head.weight",))
    loop.step()
    loop.step()
    loop.step(plant=("head.weight",))
    loop.sync()
    assert [_strip(e)["kind"] for e in loop.prot.events] == ["warning", "overflow"]
    assert _strip(loop.prot.events[0]) == {
        "step": 4,
        "kind": "warning",
        "message": "the scaler's history holds 2 of the 4 steps since the last read: guard "
        "decisions for the older ones are lost (raise scaler.history_size above "
        "trainer.log_every)",
    }
    assert loop.prot.events[1]["step"] == 4  # the steps it still holds are decided


def test_fused_path_forward_overflow_replays_on_the_later_weights():
    loop = Loop(fused=True)
    loop.model.amp.boost = 1000.0
    loop.step()
    loop.model.amp.boost = 1.0
    loop.step()
    loop.model.amp.boost = 1000.0
    loop.sync()
    assert loop.kinds() == ["overflow", "promotion"]
    assert loop.prot.events[0]["scale"] == 1024.0
    assert loop.prot.events[1]["message"] == (
        "forward overflow first appears in amp (non-finite, float16): now runs in fp32 "
        "(replayed on the weights of step 2)"
    )
    loop = Loop(fused=True)
    loop.model.amp.flaky = 1
    loop.step()
    loop.step()
    loop.sync()
    assert loop.prot.events[-1]["message"].endswith(
        "data-dependent) (replayed on the weights of step 2)"
    )


def test_on_read_with_nothing_pending_does_nothing():
    loop = Loop(fused=True)
    loop.prot.on_read([1.0, 2.0])
    assert loop.prot.events == [] and loop.prot.snapshot.step == 0


# ------------------------------------------------------------------ switching and state
def test_switch_precision_keeps_fp32_modules_counters_and_hooks():
    loop = Loop(scaler={"history_size": 7})
    loop.step(plant=("head.weight",))
    loop.prot.precision.to_fp32(loop.model, "head")  # a promotion
    hook = loop.prot.scaler.reduce_flags = lambda flags: flags
    opt = loop.prot.optimizer
    loop.prot.switch_precision("bf16", scale=64.0)
    new = loop.prot.precision
    assert new.name == "bf16" and new.in_fp32 == ["head"] and new.scaler.history_size == 7
    assert new.scaler.reduce_flags is hook and new.scaler.skipped_steps == 1
    assert new.scaler.get_scale() == 1.0 and new.scaler.device == torch.device("cpu")
    assert loop.prot.optimizer is opt  # nothing to rebuild
    loop.prot.switch_precision("fp16", scale=64.0)
    assert loop.prot.scaler.get_scale() == 64.0 and loop.prot.precision.in_fp32 == ["head"]
    loop.prot.switch_precision("fp16", scale=INF)  # not a scale: the counters' own is kept
    assert loop.prot.scaler.get_scale() == 64.0
    loop.prot.switch_precision("fp16")
    assert loop.prot.scaler.get_scale() == 64.0


def test_switch_precision_reapplies_configured_fp32_modules_once():
    model = Tiny()
    prec = make_precision("fp16", fp32_modules=["amp"], device_type="cuda")
    prec.prepare(model)
    prot = Protection(model, torch.optim.SGD(model.parameters(), lr=0.1), prec)
    prot.switch_precision("bf16")
    assert prot.precision.in_fp32 == ["amp"] and prot.precision.fp32_modules == ["amp"]
    assert prot.precision.device_type == "cuda"


def test_device_of_the_protection():
    loop = Loop()
    assert loop.prot._device() == torch.device("cpu")  # from the parameters: no scaler state
    loop.step()
    assert loop.prot._device() == torch.device("cpu")  # the scaler's
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    prot = Protection(nn.ReLU(), opt, make_precision("fp16"))
    assert prot._device() == torch.device("cpu")  # nothing to go by
    meta = nn.Linear(2, 2, device="meta")
    prot = Protection(meta, torch.optim.SGD(meta.parameters()), make_precision("fp16"))
    assert prot._device() == torch.device("meta")  # the parameters'
    prot.scaler.init_state("cpu")
    assert prot._device() == torch.device("cpu")  # the scaler's state wins


def test_state_dict_is_the_guards_history_and_the_spike_window():
    loop = Loop(rollback_after=0)
    loop.step(plant=("head.weight",))
    assert loop.prot.state_dict() == {
        "window": [1],
        "consecutive": 1,
        "rollbacks": 0,
        "spike": {"loss": None, "norm": None},  # no window statistics yet
        # no row yet; no course set aside (memory: the run before a stop, across a resume)
        "divergence": {"losses": [], "steps": [], "good_step": 0, "start": None, "memory": None},
        "promoted_at": {},
        "not_the_cause": [],
    }
    other = Loop()
    other.prot.load_state_dict(
        {"window": [0, 1], "consecutive": 1, "rollbacks": 2, "spike": {"loss": [2.0, 0.5, 9]}}
    )
    assert other.prot.guard.state_dict() == {"window": [0, 1], "consecutive": 1, "rollbacks": 2}
    # a resumed run judges spikes from its first step: the threshold is back on the scaler
    assert other.prot.scaler.spike_thresholds == (2.0 + 6.0 * 0.5, float("inf"))
    old = Loop()
    old.prot.load_state_dict({"window": [1], "consecutive": 1, "rollbacks": 0})  # ampctl 0.2
    assert old.prot.scaler.spike_thresholds == (float("inf"), float("inf"))


def test_start_keeps_an_existing_snapshot_and_sets_the_step():
    loop = Loop()
    snap = loop.prot.snapshot
    loop.prot.start(5)
    assert loop.prot.snapshot is snap and loop.prot._step == 5
    loop = Loop(snapshot_every=0)
    loop.prot.start(3)
    assert loop.prot.snapshot is None and loop.prot._step == 3


# ------------------------------------------------------------------ more edges
def test_without_start_the_first_snapshot_comes_after_snapshot_every_clean_steps():
    loop = Loop(snapshot_every=2, start=False)
    assert loop.prot.snapshot is None and loop.prot._step == 0
    loop.step()
    assert loop.prot.snapshot is None
    loop.step()
    assert loop.prot.snapshot.step == 2


def test_start_defaults_to_step_zero():
    loop = Loop(start=False)
    loop.prot.start()
    assert loop.prot.snapshot.step == 0 and loop.prot._step == 0


def test_forward_overflows_at_the_floor_are_not_a_floor_problem():
    loop = Loop(
        scaler={"init_scale": 1.0, "min_scale": 1.0},
        floor_policy="abort",
        locate_forward=False,
        rollback_after=0,
    )
    loop.model.gain = INF
    for _ in range(3):
        loop.step()
    assert loop.kinds() == ["overflow"] * 3
    assert [e["overflow"] for e in loop.prot.events] == ["forward"] * 3


def test_a_device_without_bf16_falls_back_to_fp32(monkeypatch):
    from ampctl.protect import protection

    seen = []

    def no_bf16(device):
        seen.append(torch.device(device).type)
        return False

    monkeypatch.setattr(protection, "bf16_supported", no_bf16)
    loop = Loop(rollback_after=1, max_rollbacks=0)
    loop.step(plant=("head.weight",))
    assert loop.prot.events[-1]["to_precision"] == "fp32"
    assert seen == ["cpu"]


def test_fused_path_without_attribution_says_nothing_about_it():
    loop = Loop(fused=True, attribution=False)
    loop.step(plant=("head.weight",))
    loop.sync()
    assert _strip(loop.prot.events[0]) == {
        "step": 1,
        "kind": "overflow",
        "message": "gradient overflow, step skipped; scale now 512",
        "overflow": "gradient",
        "scale": 512.0,
    }


def test_fused_path_fallback_discards_the_steps_run_after_it():
    loop = Loop(fused=True, rollback_after=1, max_rollbacks=0, snapshot_every=1)
    loop.step(plant=("head.weight",))
    loop.step()
    loop.step()
    loop.sync()
    ev = loop.prot.events[-1]
    assert (ev["kind"], ev["to_step"], ev["from_step"], ev["discarded_steps"]) == (
        "fallback",
        0,
        1,
        2,
    )
    assert loop.prot.precision.name == "bf16" and loop.progress.step == 0


def test_taking_a_snapshot_reads_nothing_on_the_host():
    from ampctl.hostreads import count_host_reads

    loop = Loop()
    loop.step()
    with count_host_reads() as reads:
        loop.prot.take_snapshot(1)
    assert reads.total == 0
    assert loop.prot.snapshot.scale is not loop.prot.scaler.get_scale_tensor()
    assert loop.prot.snapshot.scale.item() == 1024.0


def test_rollback_restores_fp16_pure_masters_that_moved_since_the_snapshot():
    loop = Loop("fp16-pure", snapshot_every=100, rollback_after=2)
    masters = [m.detach().clone() for m in loop.prot.precision.master.params]
    weights = loop.state()["model"]
    loop.step()
    loop.step()  # two updates: masters and weights move on
    assert not _same([m.detach() for m in loop.prot.precision.master.params], masters)
    loop.step(plant=("head.weight",))
    loop.step(plant=("head.weight",))
    assert loop.prot.events[-1]["to_step"] == 0
    assert _same([m.detach() for m in loop.prot.precision.master.params], masters)
    assert _same(loop.state()["model"], weights)
