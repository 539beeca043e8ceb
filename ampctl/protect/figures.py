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
    """Loss sum and count of the finite losses of an interval, and its tokens (device tensors;
    kept in checkpoints so that a resumed interval's row equals the uninterrupted one)."""

    loss_sum: torch.Tensor | None = None
    loss_n: torch.Tensor | None = None
    tokens: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def add_step(self, loss: torch.Tensor | None, tokens: int) -> None:
        """Add one step: its loss (None: none known, only the tokens count) and tokens."""
        if loss is None:
            self.tokens += tokens
        else:
            self.add(loss, tokens)

    def add(self, loss: torch.Tensor, tokens: int) -> None:
        """Add one step's loss (non-finite losses are not averaged in). No host read."""
        finite = torch.isfinite(loss)
        value = torch.where(finite, loss, 0.0)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        n = finite.double()
        self.loss_n = n if self.loss_n is None else self.loss_n + n
        self.tokens += tokens

    def state_dict(self) -> dict[str, Any]:
        """CPU copies (a device-to-host copy: call it when checkpointing)."""
        return {
            "loss_sum": self.loss_sum.detach().cpu() if self.loss_sum is not None else None,
            "loss_n": self.loss_n.detach().cpu() if self.loss_n is not None else None,
            "tokens": self.tokens,
        }

    @classmethod
    def from_state(cls, sd: dict[str, Any] | None, device: torch.device) -> LogWindow:
        sd = sd or {}
        w = cls(tokens=int(sd.get("tokens", 0)))
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
    pending: torch.Tensor | None = None,
    sharded: bool = False,
) -> None:
    """Add every figure of a log step to ``fig`` under the names
    :func:`~ampctl.protect.records.metrics_row` reads: the interval's loss, the gradient
    statistics (when taken), the scaler's counters, the recent skips, the lr, the probes' figures
    and the guard's waiting decisions (``pending``, fused path; read back as ``"pending_decisions"``).
    ``sharded``: the gradients are sharded over ranks (FSDP), so their figures are summed (and
    their max taken) across ranks; the loss is always summed. No host read."""
    fig.add("loss_sum", window.loss_sum if window.loss_sum is not None else 0.0, "sum")
    fig.add("loss_n", window.loss_n if window.loss_n is not None else 0.0, "sum")
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
    if pending is not None:
        fig.add("pending_decisions", pending, vector=True)
