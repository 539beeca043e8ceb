"""fp16-pure: fp16 model weights (half the weight memory, no per-step weight casts) with an
fp32 master copy that the optimizer owns, as Apex O2 did; autocast still runs so that reductions
and norms happen in fp32; dynamic loss scaling. Exempted modules keep fp32 parameters."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .base import Precision

__all__ = ["FP16PurePrecision", "MasterWeights"]


class MasterWeights:
    """fp32 master copies of a model's low-precision parameters.

    The optimizer is built over ``params``; ``grads_to_master`` copies the model's gradients
    into the masters (fused foreach copies, no host read) and ``master_to_model`` copies the
    updated masters back into the model after the optimizer step.
    """

    def __init__(self, model: nn.Module) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        self.names: list[str] = []
        seen: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            master = p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
            seen[id(p)] = master
            self.pairs.append((p, master))
            self.names.append(name)

    @property
    def params(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def named_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        return zip(self.names, self.params, strict=True)

    def _low(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        return [(p, m) for p, m in self.pairs if p is not m]

    def grads_to_master(self) -> None:
        """Copy model gradients (fp16) into fp32 master gradients. No host read."""
        low = [(p, m) for p, m in self._low() if p.grad is not None]
        if not low:
            return
        for _p, m in low:
            if m.grad is None:
                m.grad = torch.empty_like(m)
        torch._foreach_copy_([m.grad for _, m in low], [p.grad for p, _ in low])
        for p, _ in low:
            p.grad = None

    def master_to_model(self) -> None:
        """Copy fp32 masters into the fp16 model parameters. No host read."""
        low = self._low()
        if low:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in low], [m for _, m in low])

    def to_model(self) -> None:
        """Make the masters the model's weights (fp32), e.g. before a precision switch."""
        with torch.no_grad():
            for p, m in self._low():
                p.data = m.detach().clone()

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


class FP16PurePrecision(Precision):
    name = "fp16-pure"
    compute_dtype = torch.float16
    param_dtype = torch.float16
    needs_scaler = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._master: MasterWeights | None = None

    @property
    def master(self) -> MasterWeights | None:
        return self._master

    def prepare(self, model: nn.Module) -> nn.Module:
        super().prepare(model)
        model.half()
        for name in self.in_fp32:
            model.get_submodule(name).float()
        self._master = MasterWeights(model)
        return model

    def release(self, model: nn.Module) -> list[str]:
        if self._master is not None:
            self._master.to_model()  # the masters become the weights
        self._master = None
        return super().release(model)

    def _fp32_params(self, module: nn.Module) -> None:
        if self._master is not None:
            module.float()  # same Parameter objects, now fp32; masters stay paired

    def named_optimizer_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        if self._master is None:
            return super().named_optimizer_params(model)
        return list(self._master.named_params())

    def zero_grad(self) -> None:
        if self._master is not None:
            self._master.zero_grad()

    def after_backward(self) -> None:
        """Move gradients to the fp32 masters. No host read."""
        if self._master is not None:
            self._master.grads_to_master()

    def after_step(self) -> None:
        """Copy the updated masters back into the model. No host read."""
        if self._master is not None:
            self._master.master_to_model()

    def master_state(self) -> list[torch.Tensor] | None:
        if self._master is None:
            return None
        return [m.detach().cpu() for m in self._master.params]

    def load_master_state(self, masters: list[torch.Tensor] | None) -> None:
        if masters is None or self._master is None:
            return
        with torch.no_grad():
            for m, v in zip(self._master.params, masters, strict=True):
                m.copy_(v)
