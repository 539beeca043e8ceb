"""The protection's replays: running a step's batches again, with hooks, to find out more.

* Forward locate: a forward overflow is replayed with forward hooks; the first module whose
  output is not finite is promoted to fp32 -- unless it computes in fp32 already (then no precision
  change can cure it and none is made). A promoted module that overflows again in fp32 was not
  the cause: its promotion is undone (``promotion_undone``).
* fp8 cast replay: a gradient overflow of a run with fp8 layers is replayed with the cast probe and
  the layer whose cast went non-finite first is demoted to bf16; at each log read the demotion
  rules run on the plugin's sampled cast figures.
* Rerun attribution (``guard.rerun``): a skipped step (non-finite or spike) is run once more from
  the same state, batch and RNG. A clean rerun is a transient fault (a flipped bit, a bad device):
  the step is retried with the rerun's gradients, not skipped; a rerun that fails the same way is
  reproducible (the data or the numerics). Under torchrun the event names the ranks whose first
  pass failed and whose rerun did not. Cost: one extra forward and backward per flagged step.

A mixin of :class:`~ampctl.protect.protection.Protection`: it uses the protection's model,
optimizer, precision, forward, config, events and distributed context. Every replay **syncs**
once (its figures); none runs on a clean step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampctl.amp import records as rec
from ampctl.amp.fp8 import DemoteRules, LayerSample, decide_demotions
from ampctl.amp.locate import first_bad, trace_modules
from ampctl.amp.overflow import nonfinite_flags

__all__ = ["Replays"]


class Replays:
    """Forward locate and promotion, fp8 cast replay and demotion, rerun attribution."""

    def _locate_and_promote(
        self, step: int, batches: list[dict[str, torch.Tensor]], late_by: int | None
    ) -> None:
        """Replay the step's batches with forward hooks and promote the first module whose
        output is non-finite. Every batch is replayed (ranks stay in step under FSDP) and the
        ranks agree on one module (the first found, in rank order). **Syncs** (the replay)."""
        found = None
        for batch in batches:
            losses: list[torch.Tensor] = []

            def run(b: Any = batch, out: list[torch.Tensor] = losses) -> torch.Tensor:
                out.append(self.forward(self.model, b))
                return out[-1]

            with torch.no_grad(), self.precision.autocast():
                traces, _ = trace_modules(self.model, run)
            bad = first_bad(traces)
            if bad is not None and found is None:
                found = (bad.name, bad.dtype)
            elif found is None and losses and not torch.isfinite(losses[-1]).all():
                found = ("<model>", str(losses[-1].dtype).replace("torch.", ""))  # the loss itself
        if self.dist is not None and getattr(self.dist, "enabled", False):
            found = next((f for f in self.dist.all_gather_object(found) if f is not None), None)
        late = f" (replayed on the weights of step {step + late_by})" if late_by else ""
        if found is None:
            self.emit(
                step,
                "locate",
                "forward overflow did not reproduce on replay (non-deterministic or "
                f"data-dependent){late}",
            )
            return
        name, dtype = found
        if name in self.promoted_at:
            # it was moved to fp32 for an earlier overflow and overflows in fp32 too: the
            # promotion did not cure it, so it was not the cause
            self.precision.undo_fp32(self.model, name)
            since = self.promoted_at.pop(name)
            self.not_the_cause.add(name)
            self.emit(
                step,
                "promotion_undone",
                f"{name} overflows in fp32 too (promoted at step {since}): not the cause, moved "
                f"back to {self.precision.name}{late}",
                module=name,
                promoted_at=since,
            )
            return
        if name == "<model>":
            self.emit(
                step,
                "locate",
                "forward overflow: the loss itself is not finite while every module's output is "
                f"(look at the loss function, the labels and the learning rate){late}",
                module=name,
                dtype=dtype,
            )
            return
        if dtype == "float32" or name in self.not_the_cause:
            # it computes in fp32 already (autocast keeps e.g. LayerNorm and softmax there), or
            # it overflowed in fp32 before: no precision change can cure it
            why = (
                f"which computes in {dtype} already"
                if dtype == "float32"
                else "which overflowed in fp32 too when it was moved there"
            )
            self.emit(
                step,
                "locate",
                f"forward overflow first appears in {name}, {why}: not a precision problem "
                f"(look at the learning rate and the data){late}",
                module=name,
                dtype=dtype,
            )
            return
        if not self.config.promote or self.precision.name == "fp32":
            self.emit(
                step,
                "locate",
                f"forward overflow first appears in {name} ({dtype}){late}",
                module=name,
                dtype=dtype,
            )
            return
        for layer in self.precision.demotable(self.model, name):
            self.demote_layer(step, layer, f"inside '{name}', promoted to fp32")
        if self.precision.to_fp32(self.model, name):
            self.promoted_at[name] = step
            self.emit(
                step,
                "promotion",
                f"forward overflow first appears in {name} (non-finite, {dtype}): now runs in "
                f"fp32{late}",
                module=name,
                dtype=dtype,
            )
        else:
            self.emit(
                step, "locate", f"forward overflow in {name}, already fp32{late}", module=name
            )

    # ------------------------------------------------------------------ rerun
    def mark_step_start(self) -> None:
        """The loop is about to run a step's forward: keep the RNG state it starts from, for a
        rerun of the step (``guard.rerun``; nothing is kept otherwise). No host read (the CPU
        generator's state, and on CUDA the generators' seeds and offsets)."""
        if not (self.enabled and self.config.rerun):
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._rng_at_step = (torch.get_rng_state(), cuda)

    def _rerun(
        self, step: int, batches: list[Any] | None, record: list[float], kind: int
    ) -> str | None:
        """Run the skipped step once more from the same state, batches and RNG (see the module
        docstring); returns the verdict ``transient`` or ``reproducible`` (None when no rerun
        was possible: no batches). A transient fault's step is retried with the rerun's
        gradients (clipped to ``rerun_clip``), the scale it used kept. **Syncs** once."""
        if not batches:
            return None
        used = record[rec.SCALE] if self.scaler.is_enabled() else 1.0
        params = [p for _, p in self.precision.named_optimizer_params(self.model)]
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.zero_grad()
        devices = [d.index for d in {p.device for p in params} if d.type == "cuda"]
        with torch.random.fork_rng(devices=devices):
            state = getattr(self, "_rng_at_step", None)
            if state is not None:
                torch.set_rng_state(state[0])
                if state[1] is not None:
                    torch.cuda.set_rng_state_all(state[1])
            loss_sum = None
            for batch in batches:
                with self.precision.autocast():
                    loss = self.forward(self.model, batch) / len(batches)
                (loss * used).backward()
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        names, flags = nonfinite_flags(
            (n, p.grad) for n, p in self.precision.named_optimizer_params(self.model)
        )
        lt, gt = record[rec.LOSS_THR], record[rec.GNORM_THR]
        figures = [loss_sum.double().reshape(1)]
        if flags is not None:
            figures.append(flags.double().to(figures[0].device))
        vals = torch.cat(figures).tolist()
        rerun_loss, bad = vals[0], any(v > 0 for v in vals[1:])
        again = bad or not math.isfinite(rerun_loss) or rerun_loss > lt
        mine = (True, again)
        ranks: list[int] | None = None
        if self.dist is not None and getattr(self.dist, "enabled", False):
            seen = self.dist.all_gather_object(mine)
            ranks = [r for r, (_, a) in enumerate(seen) if not a]
            again = any(a for _, a in seen)
        verdict = "reproducible" if again else "transient"
        cause = "spike" if kind == rec.SPIKE else "overflow"
        if verdict == "transient":
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(1.0 / used)
            if self.rerun_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, self.rerun_clip, foreach=True)
            self.optimizer.step()
            self.retried = True
            what = f"clean (loss {rerun_loss:.4g}): a transient fault, the step was retried"
        else:
            what = f"fails again (loss {rerun_loss:.4g}): the data or the numerics"
        if gt < math.inf and math.isfinite(record[rec.GNORM]):
            what += f"; its grad norm was {record[rec.GNORM]:.4g} against {gt:.4g}"
        on = f" (rank {', '.join(map(str, ranks))})" if ranks and verdict == "transient" else ""
        self.emit(
            step,
            "rerun",
            f"rerun of step {step} ({cause}){on}: {what}",
            verdict=verdict,
            cause=cause,
            rank=ranks[0] if ranks and verdict == "transient" else None,
            rerun_loss=rerun_loss,
        )
        return verdict

    # ------------------------------------------------------------------ fp8 layers
    def after_log(self, step: int) -> None:
        """After the loop's log read: apply the fp8 demotion rules to the per-layer cast health
        the precision's probe sampled on this log step (if any), and demote the layers they
        name. No host read (the figures came with the log read)."""
        for probe in self.precision.probes():
            take = getattr(probe, "take_sample", None)
            sample = take() if take is not None else None
            if sample is None or not self.enabled or not self.config.fp8_demote:
                continue
            names, rows = sample
            for name, reason in self.fp8_health.observe(names, rows).items():
                self.demote_layer(step, name, reason)

    def _replay_casts(
        self, step: int, batches: list[dict[str, torch.Tensor]], late_by: int | None
    ) -> None:
        """A gradient overflow in a run with fp8 layers: replay the step's forward and backward
        with the cast probe (gradients discarded, RNG state kept) and demote the layer whose
        cast went non-finite first. Under torchrun the ranks demote the union of what each
        found. **Syncs** once (the replayed figures); nothing happens without fp8 layers."""
        if not (self.enabled and self.config.fp8_demote and self.precision.demotable(self.model)):
            return
        params = [p for p in self.model.parameters() if p.requires_grad]

        def run() -> None:
            for batch in batches:
                with self.precision.autocast():
                    loss = self.forward(self.model, batch)
                torch.autograd.grad(loss, params, allow_unused=True)

        dev = self._device()
        cuda = []
        if dev.type == "cuda":
            cuda = [dev.index if dev.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=cuda):
            got = self.precision.replay_casts(self.model, run)
        found: dict[str, str] = {}
        if got is not None:
            names, rows = got
            history = {
                n: [LayerSample.from_row(r)] for n, r in zip(names, rows.tolist(), strict=True)
            }
            # one replayed sample: with patience 2 only the non-finite rules (1, 2) can fire
            found = decide_demotions(history, DemoteRules(patience=2))
        if self.dist is not None and getattr(self.dist, "enabled", False):
            merged: dict[str, str] = {}
            for part in self.dist.all_gather_object(found):
                for n, why in (part or {}).items():
                    merged.setdefault(n, why)
            found = merged
        late = f" (replayed on the weights of step {step + late_by})" if late_by else ""
        for name, reason in found.items():
            self.demote_layer(step, name, f"{reason} on the replay of the skipped step{late}")

    def demote_layer(self, step: int, name: str, reason: str) -> bool:
        """Demote the low-precision layer ``name`` (fp8 -> bf16, same Parameters and optimizer
        state) and record a ``demotion`` event. Returns False when it is not such a layer."""
        if not self.precision.demote(self.model, name, reason):
            return False
        self.fp8_health.forget(name)
        self.emit(
            step,
            "demotion",
            f"{name}: fp8 -> bf16 ({reason})",
            module=name,
            reason=reason,
            to_precision="bf16",
        )
        return True

    # ------------------------------------------------------------------ deciding
