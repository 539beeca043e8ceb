"""Protection: carries out the overflow guard's decisions, in ampctl's loop or in anyone's.

The guard's rules (:func:`ampctl.amp.guard.decide`) say *what* to do when skipping and halving
is not enough; this object *does* it, and owns everything that takes: the in-memory snapshot of
the last good state, restoring it (rollback), attributing an overflow to the parameters whose
gradients were non-finite, locating the module whose output overflowed in the forward pass and
promoting it to fp32, demoting the fp8 layers whose casts go wrong (fp8 runs: a gradient
overflow is replayed with the cast probe and the layer whose cast went non-finite first is
demoted; at each log read :class:`~ampctl.amp.fp8.Fp8Health` applies the saturation and underflow
rules to the plugin's log-step probe), switching
the run to the next precision of the fallback chain, and the events that record each of these.

It takes the model, the optimizer and the precision plugin (which owns the loss scaler), not a
run config, so it works in a hand-written loop too::

    protection = Protection(model, optimizer, precision)
    for step, batch in enumerate(loader, 1):
        optimizer.zero_grad()
        with precision.autocast():
            loss = model(**batch).loss
        precision.backward(loss)
        precision.unscale_(optimizer)
        skipped = precision.optimizer_step(optimizer)
        protection.after_step(step, skipped=skipped, batches=[batch])

It is called once per optimizer step on every path. When the step's skip flag was read on the
host (the standard path: ``scaler.step`` reads it to decide whether to step) the guard decides
at once. With an optimizer that skips on the device (``AdamW(fused=True)``) nothing is read per
step, so the decisions wait for the next point where the loop reads anything -- its log step --
and are taken there from the scaler's on-device record of every step since (kind of each skip,
scale used). The events name the same steps and the decisions are the same as on the standard
path; a rollback decided late restores the snapshot from before the first overflow of the burst
(snapshots on that path are only taken at read points where the last step was clean, at least
``snapshot_every`` steps apart), and the steps run after the decision are discarded. Attribution needs the gradients of the overflowing
step, which are gone by then: the event says so. ``pending_reads`` / ``on_read`` let a loop fold
this into its one read; :meth:`sync` reads on its own.

Host reads: none on a clean step. A skipped step on the standard path reads once more (scale,
kind of overflow and the names of non-finite gradients, in one transfer); a rollback reads the
snapshot's scale; a forward-overflow replay reads its traces once, and so does a gradient-overflow
replay of an fp8 run (its per-layer cast figures). The log-step fp8 rules take host numbers that
rode on the loop's log read (:meth:`Protection.after_log`): no read of their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampctl.amp import records as rec
from ampctl.amp.fp8 import Fp8Health
from ampctl.amp.guard import Action, Decision, DivergenceWatch, OverflowGuard
from ampctl.amp.overflow import names_flagged, nonfinite_flags
from ampctl.amp.precision import Precision, bf16_supported
from ampctl.amp.spike import SpikeRule
from ampctl.protect.loss import ForwardLoss, default_forward
from ampctl.protect.replays import Replays
from ampctl.protect.settings import GuardConfig
from ampctl.protect.snapshot import Snapshot
from ampctl.protect.switch import switch_precision

__all__ = ["Protection", "Rewind", "TrainAborted", "TrainDiverged"]


class TrainAborted(RuntimeError):
    """The guard gave up (abort policy, or nothing left to fall back to)."""

    status = "aborted"


class TrainDiverged(TrainAborted):
    """The loss diverged (the divergence rule, action ``stop``): the run stops with status
    ``diverged``. ``since``: the first step of the diverging log rows (a checkpoint written before
    it is the last good one)."""

    status = "diverged"

    def __init__(self, reason: str, since: int) -> None:
        super().__init__(reason)
        self.since = since


@dataclass(frozen=True)
class Rewind:
    """What a rollback or a fallback restored, for the loop to put its own position back.

    The protection restores what it owns (weights, fp32 masters, optimizer state, scale); the
    loop owns its step counter, data position, RNG, lr schedule: it gets them back as it handed
    them over, ``progress`` (what its ``progress_state()`` returned when the snapshot of
    ``to_step`` was taken; None without ``progress_state`` or snapshot), and applies them."""

    kind: str  # "rollback" | "fallback"
    from_step: int  # the step whose decision restored
    to_step: int  # the step whose state is back
    progress: Any = None
    discarded_steps: int = 0  # steps that had run after from_step (fused path: decided late)
    skip_batches: int = 0  # guard.skip_batches: batches to move past the one that caused it
    lr_factor: float = 1.0  # a rollback for divergence cuts the lr by this factor


_ASK = object()  # take_snapshot: ask the loop for its position


@dataclass
class _Pending:
    """A step whose skip flag was not read on the host (fused optimizer)."""

    update: int  # the scaler's update number of the step (1-based)
    step: int
    batches: list[dict[str, torch.Tensor]] | None


Emit = Callable[[dict[str, Any]], None]  # emit(event): records one event dict


class Protection(Replays):
    """Snapshot, restore, attribution, forward locate + promotion and precision fallback, decided
    by the overflow guard (see the module docstring).

    Args:
        model: the model whose weights a rollback restores and whose gradients attribution
            names (unwrapped: under DDP/FSDP the inner module; the replays run its forward
            through ``forward``).
        optimizer: the optimizer, built over ``precision.optimizer_params(model)``.
        precision: the precision plugin, with its scaler.
        config: the guard's rules and knobs.
        emit: ``emit(event)`` receives each event, a dict with ``step``, ``kind``, ``message``,
            ``time`` and the kind's own keys (the loop writes it to events.jsonl and the
            display); every event is also kept in :attr:`events`.
        progress_state: ``progress_state()`` returns the loop's own position (step counter,
            data position, RNG ...) when a snapshot is taken; a rollback or fallback hands it
            back in the :class:`Rewind` it returns, and the loop restores it. None: the loop
            keeps its position (a rollback then restores weights, optimizer state and scale).
        forward: ``forward(model, batch) -> loss`` for the forward-overflow replay (run under
            the precision's autocast); default: ``model(**batch)`` and its ``.loss``.
        rebuild_optimizer: ``rebuild(params) -> optimizer`` used by a precision fallback when the
            optimized parameters change (fp16-pure's masters become the weights); without it a
            fallback from fp16-pure is turned into an abort with the reason.
        dist: a :class:`~ampctl.train.dist.DistContext` under torchrun (ranks agree on the
            located module); None in a single process.
        fallback_unavailable: why this loop cannot switch precision (e.g. a framework that owns
            autocast and the scaler); a fallback decision then aborts with this reason. None:
            fallbacks are carried out (see ``rebuild_optimizer``).
        rerun_clip: the loop's gradient clipping (its max norm), applied to a step retried after
            a clean rerun (``guard.rerun``); with it the spike rule judges the loss only (a clipped
            step's size is bounded whatever its norm). None: not clipped (or not known).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        config: GuardConfig | None = None,
        emit: Emit | None = None,
        progress_state: Callable[[], Any] | None = None,
        forward: ForwardLoss | None = None,
        rebuild_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
        dist: Any = None,
        fallback_unavailable: str | None = None,
        rerun_clip: float | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        self.config = config or GuardConfig()
        self.guard = OverflowGuard(self.config.rules)
        self.events: list[dict[str, Any]] = []
        self._emit_fn = emit
        self.progress_state = progress_state
        self.forward = forward or default_forward
        self.rebuild_optimizer = rebuild_optimizer
        self.dist = dist
        self.fallback_unavailable = fallback_unavailable
        self.snapshot: Snapshot | None = None
        self._clean_since_snapshot = 0
        self._pending: list[_Pending] = []
        self._step = 0  # the last step seen
        self.fp8_health = Fp8Health(self.config.fp8_rules)
        c = self.config
        self.spike = SpikeRule(
            z=c.spike_z,
            window=c.spike_window,
            min_steps=c.spike_min_steps,
            # with clipping on, a step whose gradient norm is far above its course moves the
            # weights no more than any clipped step: it is judged by its loss alone (#36: the
            # norm rule skipped healthy steps of the default run, whose loss was on course)
            grad_norm=c.spike_grad_norm and rerun_clip is None,
            enabled=c.enabled and c.spike,
        )
        self._read_end = 0
        self.divergence = DivergenceWatch(c.divergence_rules)
        self.promoted_at: dict[str, int] = {}  # modules the guard moved to fp32, and when
        self.not_the_cause: set[str] = set()  # moved to fp32, overflowed there too, moved back
        self.rerun_clip = rerun_clip
        self.retried = False  # the last step was skipped, rerun clean and applied
        self._rng_at_step: Any = None

    # ------------------------------------------------------------------ views
    scaler = property(lambda self: self.precision.scaler)
    enabled = property(lambda self: self.config.enabled)
    #: whether the guard keeps snapshots to roll back to
    snapshots = property(lambda self: self.enabled and self.config.snapshot_every > 0)

    def _device(self) -> torch.device:
        dev = self.scaler.device
        if dev is not None:
            return dev
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    # ------------------------------------------------------------------ events
    def emit(self, step: int, kind: str, message: str, **extra: Any) -> None:
        ev = {"step": step, "kind": kind, "message": message, "time": time.time(), **extra}
        self.events.append(ev)
        if self._emit_fn is not None:
            self._emit_fn(ev)

    # ------------------------------------------------------------------ the per-step call
    def start(self, step: int = 0) -> None:
        """Before the first step: keep the starting state as the first snapshot. No host read."""
        self._step = step
        if self.snapshots and self.snapshot is None:
            self.take_snapshot(step)

    def after_step(
        self,
        step: int,
        *,
        skipped: bool | None,
        batches: list[dict[str, torch.Tensor]] | None = None,
    ) -> Rewind | None:
        """Call once per optimizer step, after ``scaler.update()``, with the step number and
        the skip flag as the scaler read it (``precision.optimizer_step``'s return value; None
        when nothing was read, i.e. a fused optimizer). ``batches``: the step's micro-batches,
        for the forward-overflow replay. Returns the :class:`Rewind` of a rollback or fallback
        decided here (the loop restores its position from it), else None. No host read on a
        clean step (see the module docstring for the others). May raise :class:`TrainAborted`."""
        self._step = step
        self.retried = False
        if not self.enabled:
            return None
        if skipped is None:  # decided at the next read
            self._pending.append(_Pending(self.scaler.num_updates, step, batches))
            return None
        if not skipped:
            self._observe(step, kind=rec.CLEAN)
            self._maybe_snapshot(step)
            return None
        # one read for the skipped step: its record and the scale after it, with attribution
        names, record, scale_after = self._attribute()
        kind = rec.kind(record, check_loss=self.scaler.check_loss)
        if self.config.rerun and self._rerun(step, batches, record, kind) == "transient":
            # retried with the rerun's gradients: a clean step, at the scale it used
            self._keep_scale(record[rec.SCALE], scale_after)
            self.scaler.mark_applied()  # not skipped after all: the record says so
            self._observe(step, kind=rec.CLEAN)
            return None
        return self._observe(
            step,
            kind=kind,
            record=record,
            scale_after=scale_after,
            names=names,
            batches=batches,
        )

    # ------------------------------------------------------------------ the log read
    def log_figures(self, fig: Any) -> None:
        """Add what the protection needs from the log step's one read: the waiting decisions
        (fused path) and the spike rule's window. No host read."""
        pending = self.pending_reads()
        if pending is not None:
            fig.add("pending_decisions", pending, vector=True)
        self.spike.figures(fig, self.scaler)
        if self.divergence.start is None and self.enabled and self.config.divergence:
            first = self.scaler.first_loss()  # once: the divergence rule's starting point
            if first is not None:  # the mean over ranks of the finite ones
                ok = torch.isfinite(first)
                both = torch.stack([torch.where(ok, first, 0.0), ok.double()])
                fig.add("start_loss", both, "sum", vector=True)

    def on_log_read(self, step: int, values: dict[str, Any]) -> Rewind | None:
        """After the log read of ``step``: new spike thresholds from the window, the waiting
        decisions (:meth:`on_read`: may restore a snapshot, switch precision or raise
        :class:`TrainAborted`), then the divergence rule on the interval's loss without the
        spikes it skipped (may raise :class:`TrainDiverged` or roll back). No host read of its
        own."""
        self.spike.on_read(values, self.scaler)
        start = values.get("start_loss")
        if start is not None and self.divergence.start is None:  # NaN: no finite first loss
            self.divergence.start = start[0] / start[1] if start[1] > 0 else math.nan
        pending = values.get("pending_decisions")
        rewind = self.on_read(pending) if pending is not None else None
        if rewind is not None or not (self.enabled and self.config.divergence):
            return rewind
        # the run's course: the interval's losses without the spikes it skipped (an outlier
        # batch is not the course), else -- every loss a spike -- all its finite losses
        n = values.get("course_loss_n", 0.0)
        if n:
            loss = values["course_loss_sum"] / n
        else:
            n = values.get("loss_n", 0.0)
            loss = values["loss_sum"] / n if n else math.nan
        return self._watch_divergence(step, loss)

    def _watch_divergence(self, step: int, loss: float) -> Rewind | None:
        """The divergence rule on one row's loss, and its action: ``stop`` raises
        :class:`TrainDiverged`; ``rollback`` restores the last snapshot taken before the
        diverging rows began, with the lr cut (else it stops: no good state is kept);
        ``warn`` records it. Each is a ``divergence`` event."""
        watch = self.divergence
        decision = watch.observe(step, loss)
        if decision.action is Action.CONTINUE:
            return None
        since = watch.good_step  # the last row before the diverging ones
        # the figures the rule judged: its reference (the run's first loss or the lowest median
        # of `patience` rows) and the ratio of the last rows' median to it, as its reason says
        extra = {"loss": loss, "min_loss": watch.reference, "ratio": watch.ratio, "since": since}
        snap = self.snapshot
        if decision.action is Action.ROLLBACK and (snap is None or snap.step > since):
            decision = Decision(
                action=Action.ABORT,
                reason=f"{decision.reason}; no state from step {since} or before is kept to "
                "roll back to",
            )
        if decision.action is Action.WARN:
            self.emit(step, "divergence", decision.reason, action="warn", **extra)
            return None
        if decision.action is Action.ABORT:
            self.emit(step, "divergence", decision.reason, action="stop", **extra)
            raise TrainDiverged(decision.reason, since)
        cut = self.config.divergence_lr_cut
        assert snap is not None
        self.restore(snap)
        self.guard.after_rollback()
        self.emit(
            snap.step,
            "divergence",
            f"{decision.reason}: restored step {snap.step}, lr x{cut:g}",
            action="rollback",
            lr_factor=cut,
            to_step=snap.step,
            from_step=step,
            **extra,
        )
        return Rewind("rollback", step, snap.step, snap.progress, lr_factor=cut)

    # ------------------------------------------------------------------ the fused path
    def pending_reads(self) -> torch.Tensor | None:
        """What the decisions still waiting need from the device (fused path), as one flat
        float64 device tensor to read together with the caller's own figures: the scale now and
        the step records since the first waiting step; None when nothing waits. No host read."""
        if not self._pending:
            return None
        sc = self.scaler
        n = sc.num_updates - self._pending[0].update + 1
        rows = sc.recent_records(n)
        self._read_end = sc.num_updates  # the records end at this update
        scale = sc.get_scale_tensor()
        return torch.cat([scale.double().reshape(1), rows.double().reshape(-1)])

    def on_read(self, values: list[float]) -> Rewind | None:
        """Take the waiting decisions from the values of :meth:`pending_reads` (read by the
        caller). May restore a snapshot or switch precision (then returns the :class:`Rewind`:
        the steps run after the decision are discarded); may raise :class:`TrainAborted`."""
        pending, self._pending = self._pending, []
        if not pending:
            return None
        scale_now, flat = values[0], values[1:]
        width = len(rec.COLUMNS)
        rows = [flat[i : i + width] for i in range(0, len(flat), width)]
        first = self._read_end - len(rows) + 1  # the update number of rows[0]
        by_update = {first + i: r for i, r in enumerate(rows)}
        if len(rows) < len(pending):
            self.emit(
                pending[-1].step,
                "warning",
                f"the scaler's history holds {len(rows)} of the {len(pending)} steps since the "
                "last read: guard decisions for the older ones are lost (raise "
                "scaler.history_size above trainer.log_every)",
            )
        self._read_step = pending[-1].step
        for i, p in enumerate(pending):
            row = by_update.get(p.update)
            if row is None:
                continue
            nxt = by_update.get(p.update + 1)
            scale_after = nxt[rec.SCALE] if nxt is not None else scale_now
            rewind = self._observe(
                p.step,
                kind=rec.kind(row, check_loss=self.scaler.check_loss),
                record=row,
                scale_after=scale_after,
                names=None,
                batches=p.batches,
                late_by=pending[-1].step - p.step,
                ran_after=len(pending) - i - 1,
            )
            if rewind is not None:
                # the steps run after the decision are discarded: their skips are still written
                for q in pending[i + 1 :]:
                    self._discarded_event(q, by_update, scale_now)
                return rewind
        # a snapshot only where the state is known to be good: a read point after a clean step,
        # at least snapshot_every steps after the previous snapshot
        last = pending[-1].step
        since = last - self.snapshot.step if self.snapshot is not None else last
        if self.snapshots and self.guard.consecutive == 0 and since >= self.config.snapshot_every:
            self.take_snapshot(last)
        return None

    def sync(self) -> Rewind | None:
        """Read what :meth:`pending_reads` needs and take the waiting decisions (for loops that
        have no read point of their own); returns :meth:`on_read`'s :class:`Rewind`. **Syncs**
        once when decisions wait."""
        t = self.pending_reads()
        return self.on_read(t.tolist()) if t is not None else None

    def _attribute(self) -> tuple[list[str] | None, list[float], float]:
        """Names of the non-finite gradients (up to ``attribution_limit``; None when attribution
        is off), the last step's record and the scale after the step. **Syncs** once:
        everything in one transfer."""
        sc = self.scaler
        figures = [
            sc.recent_records(1).double().reshape(-1),
            sc.get_scale_tensor().double().reshape(1),
        ]
        names: list[str] = []
        if self.config.attribution:
            names, flags = nonfinite_flags(
                (n, p.grad) for n, p in self.precision.named_optimizer_params(self.model)
            )
            if flags is not None:
                figures.append(flags.double().to(figures[0].device))
        vals = torch.cat(figures).tolist()
        width = len(rec.COLUMNS)
        record, scale_after = vals[:width], float(vals[width])
        if not self.config.attribution:
            return None, record, scale_after
        limit = self.config.attribution_limit
        return names_flagged(names, vals[width + 1 :], limit), record, scale_after

    def _observe(
        self,
        step: int,
        *,
        kind: int,
        record: list[float] | None = None,
        scale_after: float = 0.0,
        names: list[str] | None = None,
        batches: list[dict[str, torch.Tensor]] | None = None,
        late_by: int | None = None,
        ran_after: int = 0,
    ) -> Rewind | None:
        skipped = kind != rec.CLEAN
        forward = kind == rec.FORWARD
        if skipped and kind in (rec.FORWARD, rec.SPIKE) and record is not None:
            scale_after = self._keep_scale(record[rec.SCALE], scale_after)
        at_floor = skipped and self.scaler.is_enabled() and scale_after <= self.scaler.min_scale
        if kind == rec.SPIKE:
            self._spike_event(step, record, scale_after, late_by)
        elif skipped:
            self._overflow_event(step, forward, scale_after, names, late_by)
            if forward and self.config.locate_forward and batches:
                self._locate_and_promote(step, batches, late_by)
            elif not forward and batches:
                self._replay_casts(step, batches, late_by)
        else:
            self._clean_since_snapshot += 1
        decision = self.guard.observe(
            step=step,
            skipped=skipped,
            forward_overflow=forward or kind == rec.SPIKE,
            at_floor=at_floor,
            precision=self.precision.name,
            bf16_ok=bf16_supported(self._device()),
        )
        return self._apply(decision, step, scale_after, ran_after)

    def _discarded_event(
        self, p: _Pending, by_update: dict[int, list[float]], scale: float
    ) -> None:
        """A skip on a step that a later rollback discarded (fused path): written, marked
        ``discarded``, with no decision of its own."""
        row = by_update.get(p.update)
        kind = rec.kind(row, check_loss=self.scaler.check_loss) if row is not None else rec.CLEAN
        if row is None or kind == rec.CLEAN:
            return
        late = self._read_step - p.step
        if kind == rec.SPIKE:
            self._spike_event(p.step, row, scale, late, discarded=True)
        else:
            self._overflow_event(p.step, kind == rec.FORWARD, scale, None, late, discarded=True)

    def _keep_scale(self, used: float, after: float) -> float:
        """A forward overflow or a spike backed the scale off (the scaler's rule cannot tell it
        from a gradient overflow), though a smaller scale cures neither: put the factor back on
        the scale as it is now. Returns the scale after the step as kept. No host read (the
        scale rides on the caller's read)."""
        if not self.scaler.is_enabled() or not (0 < after < used):
            return after
        self.scaler.restore_scale(used / after)
        return used

    def _spike_event(
        self,
        step: int,
        record: list[float] | None,
        scale: float,
        late_by: int | None,
        discarded: bool = False,
    ) -> None:
        """A step the spike rule vetoed: its loss (or gradient norm), the threshold and the
        z-scores against the window the threshold came from."""
        r = record or [float("nan")] * len(rec.COLUMNS)
        extra: dict[str, Any] = {
            "loss": r[rec.LOSS],
            "loss_threshold": r[rec.LOSS_THR],
            "grad_norm": r[rec.GNORM],
            "grad_norm_threshold": r[rec.GNORM_THR],
            "scale": scale,
            **self.spike.z_scores(r[rec.LOSS], r[rec.GNORM]),
        }
        what = (
            f"loss {r[rec.LOSS]:.4g} > {r[rec.LOSS_THR]:.4g}"
            if math.isfinite(r[rec.LOSS]) and r[rec.LOSS] > r[rec.LOSS_THR]
            else f"grad norm {r[rec.GNORM]:.4g} > {r[rec.GNORM_THR]:.4g}"
        )
        z = extra.get("loss_z") if "loss" in what else extra.get("grad_norm_z")
        zs = f" (z = {z:.1f})" if isinstance(z, float) and math.isfinite(z) else ""
        if late_by:
            extra["decided_at_step"] = step + late_by
        if discarded:
            extra["discarded"] = True
            zs += "; the step was discarded by a rollback decided later"
        self.emit(step, "spike", f"spike, step skipped: {what}{zs}", **extra)

    def _overflow_event(
        self,
        step: int,
        forward: bool,
        scale: float,
        names: list[str] | None,
        late_by: int | None,
        discarded: bool = False,
    ) -> None:
        kind = "forward" if forward else "gradient"
        msg = f"{kind} overflow, step skipped; scale now {scale:g}"
        if discarded:
            msg = f"{kind} overflow, step skipped, then discarded by a rollback decided later"
        extra: dict[str, Any] = {"overflow": kind, "scale": scale}
        if names:
            msg += f"; non-finite grads in {', '.join(names)}"
        if names is not None:
            extra["params"] = names
        elif late_by is not None and self.config.attribution:
            extra["params"] = None
            extra["attribution"] = (
                "unavailable: with a fused optimizer the skip is read at the next log step, "
                "when this step's gradients are gone"
            )
        if late_by:
            extra["decided_at_step"] = step + late_by
        if discarded:
            extra["discarded"] = True
        self.emit(step, "overflow", msg, **extra)

    # ------------------------------------------------------------------ acting
    def _apply(
        self, decision: Decision, step: int, scale_after: float, ran_after: int = 0
    ) -> Rewind | None:
        """Carry out a decision taken for ``step``; ``ran_after``: steps that already ran after it
        (fused path), which a rollback or fallback discards. Returns the :class:`Rewind` of a
        rollback or fallback."""
        if decision.action is Action.CONTINUE:
            return None
        if decision.action is Action.WARN:
            self.emit(step, "warning", decision.reason)
            return None
        if decision.action is Action.ABORT:
            self.emit(step, "abort", decision.reason)
            raise TrainAborted(decision.reason)
        if decision.action is Action.FALLBACK and not self._can_switch():
            why = self.fallback_unavailable or (
                f"this loop cannot rebuild its optimizer for {decision.precision} (pass "
                "rebuild_optimizer= to Protection)"
            )
            reason = f"{decision.reason}, but {why}"
            self.emit(step, "abort", reason)
            raise TrainAborted(reason)
        snap = self.snapshot
        # with no snapshot (guard.snapshot_every=0) the current state is the restart point:
        # skipped steps never touched it
        if snap is not None:
            self.restore(snap)  # the scaler keeps its counters: the skips happened
        to_step = snap.step if snap is not None else step
        progress = snap.progress if snap is not None else None
        late = {"discarded_steps": ran_after} if ran_after else {}
        snap_scale = float(snap.scale.item()) if snap is not None else scale_after
        if decision.action is Action.ROLLBACK:
            new_scale = max(
                min(scale_after, snap_scale) * self.config.rollback_backoff, self.scaler.min_scale
            )
            self.scaler.update(new_scale=new_scale)
            self.guard.after_rollback()
            self._step = to_step
            self.emit(
                to_step,
                "rollback",
                f"{decision.reason}: restored step {to_step}, scale {scale_after:g} -> "
                f"{new_scale:g}",
                to_step=to_step,
                from_step=step,
                **late,
            )
            return Rewind(
                "rollback",
                step,
                to_step,
                progress,
                ran_after,
                skip_batches=self.config.skip_batches,
            )
        old = self.precision.name
        self.switch_precision(decision.precision, scale=snap_scale)
        self.guard.after_fallback()
        self.snapshot = None
        self._step = to_step
        if self.snapshots:  # the restored state, with the position the loop is handed back
            self.take_snapshot(to_step, progress=progress)
        self.emit(
            to_step,
            "fallback",
            f"{decision.reason}; restored step {to_step}",
            from_precision=old,
            to_precision=decision.precision,
            to_step=to_step,
            from_step=step,
            **late,
        )
        return Rewind("fallback", step, to_step, progress, ran_after)

    def _can_switch(self) -> bool:
        if self.fallback_unavailable is not None:
            return False
        return self.precision.master is None or self.rebuild_optimizer is not None

    def take_snapshot(self, step: int, *, progress: Any = _ASK) -> None:
        """Keep the current (good) state in memory for rollback, with the loop's position
        (``progress``; by default what ``progress_state()`` returns now): one foreach copy per
        (device, dtype) group into buffers allocated once (:mod:`~ampctl.protect.snapshot`).
        No host read."""
        if progress is _ASK:
            progress = self.progress_state() if self.progress_state is not None else None
        scale = self.scaler.get_scale_tensor()
        if scale is None:  # before the first scale(): the scale the state will start from
            scale = torch.tensor(self.scaler.get_scale(), dtype=torch.float32)
        if self.snapshot is None:
            self.snapshot = Snapshot()
        master = self.precision.master
        self.snapshot.take(
            step,
            self.model,
            self.optimizer,
            masters=master.params if master is not None else None,
            scale=scale,
            progress=progress,
        )
        self._clean_since_snapshot = 0

    def _maybe_snapshot(self, step: int) -> None:
        if (
            self.snapshots
            and self._clean_since_snapshot >= self.config.snapshot_every
            and self.guard.consecutive == 0
        ):
            self.take_snapshot(step)

    def restore(self, snap: Snapshot) -> None:
        """Put the snapshot's weights, masters and optimizer state back (the scale is the
        caller's decision, the loop's position the loop's: see :class:`Rewind`). No host read."""
        master = self.precision.master
        snap.restore(self.model, self.optimizer, master.params if master is not None else None)

    def switch_precision(self, name: str, *, scale: float | None = None) -> None:
        """Move the run to precision ``name`` in place, keeping weights, optimizer state,
        fp32 modules and the scaler's counters (the scale restarts at ``scale`` when the new
        precision scales the loss)."""
        opt_state = self.optimizer.state_dict()
        new = switch_precision(self.precision, name, self.model, device=self._device(), scale=scale)
        params = new.optimizer_params(self.model)
        if self.rebuild_optimizer is not None:
            self.optimizer = self.rebuild_optimizer(params)
            self.optimizer.load_state_dict(opt_state)
        self.precision = new
        self.fp8_health = Fp8Health(self.config.fp8_rules)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The guard's host-side history and the spike rule's window statistics (the snapshot
        is not saved: a checkpoint is one)."""
        return {
            **self.guard.state_dict(),
            "spike": self.spike.state_dict(),
            "divergence": self.divergence.state_dict(),
            "promoted_at": dict(self.promoted_at),
            "not_the_cause": sorted(self.not_the_cause),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state)
        self.spike.load_state_dict(state.get("spike") or {}, self.scaler)
        self.divergence.load_state_dict(state.get("divergence") or {})
        self.promoted_at = {str(k): int(v) for k, v in (state.get("promoted_at") or {}).items()}
        self.not_the_cause = {str(n) for n in state.get("not_the_cause") or ()}
