"""The log step's figures: gathered on the device, read on the host in one transfer.

:class:`LogWindow` accumulates a log interval's loss and tokens on the device (no host read per
step). :class:`DeviceFigures` collects every device value the log step needs -- the window, the
gradient statistics, the scaler's counters, the learning rate when it is a tensor, the guard's
pending decisions (fused path), probes -- and reads them with **one** ``tolist()`` (under
torchrun after one SUM and one MAX all-reduce of the values that need it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["LogWindow", "DeviceFigures", "Probe", "gather_log_figures", "sampling"]


@dataclass
class LogWindow:
    """A log interval: the loss scaler's update number where it began (its losses are the
    scaler's records since: no op per step), its tokens and its start time. Steps whose loss the
    scaler did not see (a loop that hands its losses over instead) are summed on the device in
    ``loss_sum`` / ``loss_n``; a window that has those uses them. Kept in checkpoints, so a
    resumed interval's row equals the uninterrupted one."""

    first_update: int = 0
    loss_sum: torch.Tensor | None = None
    loss_n: torch.Tensor | None = None
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, tokens: int = 0) -> None:
        """Add a step's loss the scaler did not record (non-finite losses are not averaged in).
        No host read."""
        finite = torch.isfinite(loss)
        value = torch.where(finite, loss, 0.0)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        n = finite.double()
        self.loss_n = n if self.loss_n is None else self.loss_n + n
        self.tokens += tokens

    def loss(self, scaler: Any) -> tuple[Any, Any]:
        """``(sum, count)`` of the interval's finite losses (0-dim device tensors): those handed
        over, else the scaler's records since :attr:`first_update` over the steps that were
        *applied* -- a skipped step (an overflow, a spike) is counted in the row's skip counters,
        not averaged into its loss; an interval whose every step was skipped keeps their losses
        (``LossScaler.loss_since(..., applied=True)``). No host read."""
        if self.loss_sum is not None:
            return self.loss_sum, self.loss_n
        if scaler.num_updates <= self.first_update:
            return 0.0, 0.0
        return scaler.loss_since(self.first_update, applied=True)

    def course_loss(self, scaler: Any) -> tuple[Any, Any] | None:
        """``(sum, count)`` of the interval's finite losses without the spikes the spike rule
        skipped (``LossScaler.loss_since(..., without_spikes=True)``): the course the divergence
        rule judges. None when the losses were handed over (no record of which step each
        belongs to) or no step was recorded. No host read."""
        if self.loss_sum is not None or scaler.num_updates <= self.first_update:
            return None
        return scaler.loss_since(self.first_update, without_spikes=True)

    def state_dict(self) -> dict[str, Any]:
        """CPU copies (a device-to-host copy: call it when checkpointing)."""
        return {
            "first_update": self.first_update,
            "loss_sum": self.loss_sum.detach().cpu() if self.loss_sum is not None else None,
            "loss_n": self.loss_n.detach().cpu() if self.loss_n is not None else None,
            "tokens": self.tokens,
        }

    @classmethod
    def from_state(cls, sd: dict[str, Any] | None, device: torch.device) -> LogWindow:
        sd = sd or {}
        w = cls(first_update=int(sd.get("first_update", 0)), tokens=int(sd.get("tokens", 0)))
        if sd.get("loss_sum") is not None:
            w.loss_sum = sd["loss_sum"].to(device)
            w.loss_n = sd["loss_n"].to(device)
        return w


class DeviceFigures:
    """Named device values read together. ``reduce`` is how ranks combine a value under
    torchrun: ``"sum"``, ``"max"`` or None (already identical on every rank, or rank-local)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._items: list[tuple[str, torch.Tensor, str | None]] = []
        self._vectors: set[str] = set()

    def add(
        self,
        name: str,
        value: torch.Tensor | float | None,
        reduce: str | None = None,
        *,
        vector: bool = False,
    ) -> None:
        """Add a value (a number, or a tensor of any shape, read back flat). ``vector``: read
        back as a list even when it has one element. No host read."""
        if value is None:
            value = float("nan")
        t = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        self._items.append((name, t.detach().to(self.device, torch.float64).reshape(-1), reduce))
        if vector or t.numel() != 1:
            self._vectors.add(name)

    def read(self, ctx: Any = None) -> dict[str, float | list[float]]:
        """Reduce across ranks where asked, then read everything: **syncs once**. Values that
        were added as one number come back as a float, others as a list."""
        if not self._items:
            return {}
        enabled = ctx is not None and getattr(ctx, "enabled", False)
        flat: list[torch.Tensor] = []
        for kind in ("sum", "max", None):
            part = [t for _, t, r in self._items if r == kind]
            if not part:
                continue
            cat = torch.cat(part)
            if enabled and kind == "sum":
                cat = ctx.reduce_sum(cat)
            elif enabled and kind == "max":
                cat = ctx.reduce_max(cat)
            flat.append(cat)
        values = torch.cat(flat).tolist()  # the one host read
        out: dict[str, float | list[float]] = {}
        pos = 0
        for kind in ("sum", "max", None):
            for name, t, r in self._items:
                if r != kind:
                    continue
                chunk = values[pos : pos + t.numel()]
                pos += t.numel()
                out[name] = chunk if name in self._vectors else chunk[0]
        return out


class Probe(Protocol):
    """A figure measured on log steps only (activation-gradient underflow, fp8 cast health ...):
    its hooks are installed for the forward and backward of a log step and removed after it, its
    device values ride on the log step's one read, and it adds keys to the metrics row.

    The trainer calls, on a log step: ``with probe.sampling(model, True): forward/backward``,
    then ``probe.figures(fig)`` before the read and ``probe.row(values)`` after it. On other steps
    ``sampling(model, False)`` must install nothing and cost nothing.
    """

    def sampling(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager: ...

    def figures(self, fig: DeviceFigures) -> None: ...

    def row(self, values: dict[str, Any]) -> dict[str, Any]: ...


@contextlib.contextmanager
def sampling(probes: list[Probe], model: nn.Module, enabled: bool):
    """Every probe's sampling context at once (nothing at all when not ``enabled``)."""
    if not enabled or not probes:
        yield
        return
    with contextlib.ExitStack() as stack:
        for p in probes:
            stack.enter_context(p.sampling(model, True))
        yield


def gather_log_figures(
    fig: DeviceFigures,
    *,
    window: LogWindow,
    stats: dict[str, torch.Tensor] | None,
    scaler: Any,
    overflow_window: int,
    lr: Any,
    probes: list[Probe] | tuple[()] = (),
    protection: Any = None,
    sharded: bool = False,
) -> None:
    """Add every figure of a log step to ``fig`` under the names
    :meth:`~ampctl.protect.shell.RunShell.row` reads: the interval's loss, the gradient
    statistics (when taken), the scaler's counters, the recent skips, the lr, the probes' figures
    and the protection's (:meth:`~ampctl.protect.protection.Protection.log_figures`: the waiting
    decisions of the fused path, the spike rule's window).
    ``sharded``: the gradients are sharded over ranks (FSDP), so their figures are summed (and
    their max taken) across ranks; the loss is always summed. No host read."""
    loss_sum, loss_n = window.loss(scaler)
    fig.add("loss_sum", loss_sum, "sum")
    fig.add("loss_n", loss_n, "sum")
    course = window.course_loss(scaler)  # the divergence rule's course (skipped spikes out)
    if course is not None:
        fig.add("course_loss_sum", course[0], "sum")
        fig.add("course_loss_n", course[1], "sum")
    if stats is not None:
        s, m = ("sum", "max") if sharded else (None, None)
        fig.add("grad_norm_sq", stats["grad_norm"] ** 2, s)
        fig.add("grad_underflow", stats["grad_underflow"], s)
        fig.add("grad_elems", stats["grad_elems"], s)
        fig.add("nonfinite_grads", stats["nonfinite_grads"], s)
        fig.add("grad_amax", stats["grad_amax"], m)
    for k, v in scaler.device_counters().items():
        fig.add(k, v)
    fig.add("recent_skips", scaler.recent_skips(overflow_window))
    fig.add("lr", lr)
    for probe in probes:
        probe.figures(fig)
    if protection is not None:
        protection.log_figures(fig)
