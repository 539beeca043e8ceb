"""Find the module where values first leave the representable range (forward and backward).

Hooks are installed for one replay only and removed afterwards, so normal steps pay nothing.
Per-module figures are accumulated on the device and read on the host **once** at the end of
the replay (a sync; this runs on overflow steps and in ``ampctl diagnose`` only).

Intentional ``-inf`` (attention masks) is not a fault: ``-inf`` is reported only when it comes
out of a module that has parameters of its own (a Linear, a LayerNorm ... never emits ``-inf``
on purpose); NaN and ``+inf`` are always faults.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModuleTrace", "trace_modules", "first_bad"]


@dataclass
class ModuleTrace:
    name: str
    order: int  # execution order of the hook (inner modules finish first)
    amax: float  # max |x| over finite output elements
    nan: bool
    posinf: bool
    neginf: bool
    own_params: bool
    dtype: str

    @property
    def bad(self) -> bool:
        return self.nan or self.posinf or (self.neginf and self.own_params)

    def headroom_log2(self, limit: float) -> float:
        """log2(limit / amax): how many doublings before the output reaches ``limit``."""
        if self.amax <= 0 or not math.isfinite(self.amax):
            return math.inf
        return math.log2(limit / self.amax)


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, tuple | list):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    for attr in ("logits", "last_hidden_state", "loss"):  # model outputs (dataclass-like)
        if hasattr(obj, attr):
            return _tensors(getattr(obj, attr))
    return []


def trace_modules(
    model: nn.Module, run: Callable[[], torch.Tensor | None], *, backward: bool = False
) -> tuple[list[ModuleTrace], list[ModuleTrace]]:
    """Run ``run()`` (a forward, returning the loss when ``backward``) with hooks on every module.

    Returns ``(forward traces, backward traces)``, each in execution order. Backward traces look
    at the gradient flowing out of each module towards its inputs. **Syncs once.**
    """
    names = {m: n for n, m in model.named_modules()}
    own = {m: any(True for _ in m.parameters(recurse=False)) for m in names}
    fwd_raw: list[tuple[str, torch.Tensor, str]] = []
    bwd_raw: list[tuple[str, torch.Tensor, str]] = []

    def summarize(ts: list[torch.Tensor]) -> tuple[torch.Tensor, str] | None:
        if not ts:
            return None
        dev = ts[0].device
        amax = torch.zeros((), device=dev)
        nan = torch.zeros((), device=dev)
        pos = torch.zeros((), device=dev)
        neg = torch.zeros((), device=dev)
        for t in ts:
            t = t.detach()
            finite = torch.isfinite(t)
            amax = torch.maximum(
                amax,
                torch.where(finite, t, torch.zeros((), dtype=t.dtype, device=dev))
                .abs()
                .max()
                .float(),
            )
            nan = nan + torch.isnan(t).any().float()
            pos = pos + torch.isposinf(t).any().float()
            neg = neg + torch.isneginf(t).any().float()
        return torch.stack([amax, nan, pos, neg]), str(ts[0].dtype).replace("torch.", "")

    def fhook(mod, _inp, out):
        s = summarize(_tensors(out))
        if s is not None:
            fwd_raw.append((names[mod], *s))

    def bhook(mod, grad_input, _grad_output):
        s = summarize([g for g in grad_input if g is not None and g.is_floating_point()])
        if s is not None:
            bwd_raw.append((names[mod], *s))

    handles = [m.register_forward_hook(fhook) for m in names]
    if backward:
        handles += [m.register_full_backward_hook(bhook) for m in names if m is not model]
    try:
        with warnings.catch_warnings():
            # modules whose inputs need no grad (embeddings) fire on outputs instead; that is fine
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss = run()
            if backward and loss is not None and loss.requires_grad:
                loss.backward()
    finally:
        for h in handles:
            h.remove()

    def collect(raw) -> list[ModuleTrace]:
        if not raw:
            return []
        vals = torch.stack([v.cpu() for _, v, _ in raw]).tolist()  # the one host read
        mods = {n: m for m, n in names.items()}
        return [
            ModuleTrace(
                name=n or "<model>",
                order=i,
                amax=float(v[0]),
                nan=v[1] > 0,
                posinf=v[2] > 0,
                neginf=v[3] > 0,
                own_params=own[mods[n]],
                dtype=dt,
            )
            for i, ((n, _, dt), v) in enumerate(zip(raw, vals, strict=True))
        ]

    return collect(fwd_raw), collect(bwd_raw)


def first_bad(traces: list[ModuleTrace], limit: float | None = None) -> ModuleTrace | None:
    """The first module (execution order) whose output is non-finite, or above ``limit``."""
    for t in traces:
        if t.bad or (limit is not None and t.amax > limit):
            return t
    return None
