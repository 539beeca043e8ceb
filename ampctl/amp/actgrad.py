"""Activation-gradient underflow: how much of the fp16 backward pass flushes to zero.

The parameter-gradient figure (``grad_underflow_frac``, :func:`ampctl.amp.stats.grad_stats`)
looks at the gradients the optimizer receives. fp16 training loses information earlier, in the
*activation* gradients flowing back through the network in half precision: an element whose
scaled value falls below fp16's smallest normal number (2**-14 = 6.1e-5) keeps only a few bits
(a subnormal) and one below half the smallest subnormal (2**-25 = 3.0e-8) becomes zero. Loss
scaling exists to lift these values into range (Micikevicius et al. 2018, figure 3).

:class:`ActGradProbe` measures that on sampled steps only. While its :meth:`~ActGradProbe.
sampling` context is open, a forward hook on every leaf module registers a tensor hook on each
float16 output that requires a gradient; when the backward pass reaches it, the hook adds three
counts on the device: elements that are exactly zero, elements below fp16's normal range
(zero or subnormal), and all elements. The gradient seen is the one stored in fp16, i.e. times
the loss scale, which is the point: the scale is what keeps it out of the subnormal range.

Cost: on a sampled step, one ``abs``, two comparisons and two reductions per fp16 activation
gradient of the hooked modules (on the device, no host read; element counts are known on the
host). The trainer's probe hooks ``sample`` leaf modules per log step, in turn, so the cost is
bounded whatever the model's depth. Nothing is installed on other steps.
By default only float16 tensors are counted (bf16 has fp32's range; fp32 cannot underflow
here), so a run with no fp16 activations reports ``None``.

Exact zeros include structural ones (masked positions, a ReLU's dead units), so
``act_grad_zero_frac`` is an upper bound on what was flushed; ``act_grad_underflow_frac``
(zero or subnormal) is the figure to watch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .formats import FP16_TINY

__all__ = ["ActGradCounter", "ActGradProbe", "ROW_KEYS", "leaf_modules"]

ROW_KEYS = ("act_grad_underflow_frac", "act_grad_zero_frac")


class ActGradCounter:
    """Device-side counts of activation-gradient elements (zero, below fp16's normal range, all)
    over the backward passes run while :meth:`hooks` is open. ``dtypes``: the tensors counted
    (fp16 by default; ``diagnose`` also counts an fp32 pass's zeros, the ones no scale cures)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...] = (torch.float16,)) -> None:
        self.dtypes = dtypes
        self._zero: torch.Tensor | None = None  # device int64 scalars
        self._below: torch.Tensor | None = None
        self._total = 0  # element counts are known on the host: no device op

    @property
    def counts(self) -> torch.Tensor | None:
        """int64 ``[zero, below_normal, total]`` on the device (None before any gradient).
        No host read."""
        if self._zero is None or self._below is None:
            return None
        total = torch.tensor(self._total, dtype=torch.int64, device=self._zero.device)
        return torch.stack([self._zero, self._below, total])

    def _add(self, grad: torch.Tensor) -> None:
        if grad is None or grad.dtype not in self.dtypes or grad.numel() == 0:
            return
        a = grad.detach().abs()
        zero, below = (a == 0).sum(), (a < FP16_TINY).sum()
        if self._zero is None or self._below is None:
            self._zero, self._below = zero, below
        else:
            self._zero = self._zero + zero.to(self._zero.device)
            self._below = self._below + below.to(self._below.device)
        self._total += a.numel()

    @contextlib.contextmanager
    def hooks(
        self, model: nn.Module, modules: list[nn.Module] | None = None
    ) -> Iterator[ActGradCounter]:
        """Count the activation gradients of ``model``'s leaf modules (or of ``modules``, some
        of them) while open."""

        def on_forward(_mod: nn.Module, _inp: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.dtype in self.dtypes and t.requires_grad:
                    t.register_hook(self._add)

        handles = [m.register_forward_hook(on_forward) for m in modules or leaf_modules(model)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    @staticmethod
    def fractions(counts: list[float] | None) -> dict[str, float | None]:
        """The row figures from host ``counts`` ([zero, below_normal, total])."""
        if not counts or counts[2] <= 0:
            return dict.fromkeys(ROW_KEYS)
        return {
            "act_grad_underflow_frac": counts[1] / counts[2],
            "act_grad_zero_frac": counts[0] / counts[2],
        }


def leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` without children, in module order."""
    return [m for m in model.modules() if next(m.children(), None) is None]


class ActGradProbe:
    """The trainer's log-step probe (:class:`ampctl.protect.figures.Probe`) for
    :class:`ActGradCounter`: hooks open for the log step's forward and backward passes, the
    three counts summed over ranks on the log read, two row keys (:data:`ROW_KEYS`).

    ``sample``: leaf modules hooked per log step, taken in turn (round-robin over the model), so
    a log step costs a bounded number of ops whatever the depth of the model; a row's fractions
    are those of the sampled layers, and successive rows cover the whole model. None: every leaf
    module on every log step."""

    def __init__(self, sample: int | None = 8) -> None:
        self._counter: ActGradCounter | None = None
        self.sample = sample
        self._next = 0  # where the round-robin goes on

    def _sampled(self, model: nn.Module) -> list[nn.Module]:
        leaves = leaf_modules(model)
        if self.sample is None or self.sample >= len(leaves):
            return leaves
        start = self._next % len(leaves)
        self._next = start + self.sample
        return [leaves[(start + i) % len(leaves)] for i in range(self.sample)]

    @contextlib.contextmanager
    def sampling(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        self._counter = None
        if not enabled:
            yield
            return
        counter = ActGradCounter()
        with counter.hooks(model, self._sampled(model)):
            self._counter = counter
            yield

    def figures(self, fig: Any) -> None:
        """Add the counts to the log read (no host read here)."""
        c = self._counter
        if c is None:
            return
        counts = c.counts
        if counts is None:  # no fp16 activation on this rank: zeros keep the ranks' reads alike
            counts = torch.zeros(3, dtype=torch.int64)
        fig.add("act_grad_counts", counts, "sum", vector=True)

    def row(self, values: dict[str, Any]) -> dict[str, Any]:
        """The row keys from the read ``values`` (host numbers)."""
        c, self._counter = self._counter, None
        if c is None:
            return {}
        return c.fractions(values.get("act_grad_counts"))
