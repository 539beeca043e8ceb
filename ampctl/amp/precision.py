"""PrecisionPolicy: one small interface for fp32 / bf16 / fp16 / fp16-pure.

* ``fp32``       no autocast, no scaler (non-finite steps are still skipped).
* ``bf16``       autocast to bfloat16; fp32 weights and optimizer state; no loss scaling.
* ``fp16``       autocast to float16; fp32 weights and optimizer state; dynamic loss scaling.
* ``fp16-pure``  fp16 model weights (half the weight memory, no per-step weight casts) with an
                 fp32 master copy that the optimizer owns, as Apex O2 did; autocast still runs
                 so that reductions and norms happen in fp32; dynamic loss scaling.

``fp32_modules`` (fnmatch patterns over module names, e.g. ``*embeddings*``) run their forward
in fp32 even under autocast: inputs are cast up and autocast is off inside. In ``fp16-pure``
their parameters stay fp32. Modules can be promoted later (``exempt``), which is how the
overflow guard moves a module that overflows out of fp16 while the rest stays fast.

The hooks (``prepare``, ``optimizer_params``, ``after_backward``, ``after_step``) pass through
by default and are cheap; none of them reads a device value on the host.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "PRECISIONS",
    "PrecisionPolicy",
    "MasterWeights",
    "FP16_MAX",
    "FP16_TINY",
    "FP16_SUBNORMAL",
    "dtype_max",
    "bf16_supported",
    "match_modules",
]

PRECISIONS = ("fp32", "bf16", "fp16", "fp16-pure")
FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # smallest normal
FP16_SUBNORMAL = 2.0**-24  # smallest subnormal

_COMPUTE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp16-pure": torch.float16,
}


def dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of a floating dtype."""
    return float(torch.finfo(dtype).max)


def bf16_supported(device: torch.device | str) -> bool:
    """Whether bf16 autocast is usable on ``device`` (CPU: yes; CUDA: Ampere or newer)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return dev.type == "cpu"


def match_modules(model: nn.Module, patterns: Iterable[str]) -> list[str]:
    """Names of the outermost modules whose qualified name matches any fnmatch pattern.

    A module inside an already-matched module is not listed again (its parent covers it).
    The root module ("") never matches.
    """
    pats = list(patterns)
    chosen: list[str] = []
    for name, _ in model.named_modules():
        if not name or not any(fnmatch.fnmatchcase(name, p) for p in pats):
            continue
        if any(name.startswith(c + ".") for c in chosen):
            continue
        chosen.append(name)
    return chosen


def _cast_floats(obj, dtype: torch.dtype):
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple | list):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _fp32_forward(orig, device_type: str, *args, **kwargs):
    args = _cast_floats(args, torch.float32)
    kwargs = _cast_floats(kwargs, torch.float32)
    with torch.autocast(device_type=device_type, enabled=False):
        return orig(*args, **kwargs)


def _module_device_type(module: nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    for b in module.buffers():
        return b.device.type
    return "cpu"


class MasterWeights:
    """fp32 master copies of a model's low-precision parameters (fp16-pure).

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

    def zero_grad(self) -> None:
        for p, m in self.pairs:
            p.grad = None
            m.grad = None


@dataclass(kw_only=True)
class PrecisionPolicy:
    """Precision of a run: autocast dtype, whether a loss scaler is needed, fp32 exemptions.

    Args:
        name: one of ``fp32``, ``bf16``, ``fp16``, ``fp16-pure``.
        fp32_modules: fnmatch patterns of module names kept in fp32.
        device_type: ``cpu`` or ``cuda`` (for autocast).
    """

    name: str = "fp16"
    fp32_modules: list[str] = field(default_factory=list)
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision: '{self.name}' is not one of {', '.join(PRECISIONS)}")
        if isinstance(self.fp32_modules, str):
            raise ValueError(
                "precision.fp32_modules must be a list of patterns, e.g. ['*embeddings*']"
            )
        self.fp32_modules = list(self.fp32_modules)
        self.exempted: list[str] = []  # module names currently running in fp32
        self.master: MasterWeights | None = None
        self._originals: dict[str, tuple[nn.Module, object]] = {}

    # ------------------------------------------------------------------ properties
    @property
    def compute_dtype(self) -> torch.dtype:
        return _COMPUTE[self.name]

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float16 if self.name == "fp16-pure" else torch.float32

    @property
    def needs_scaler(self) -> bool:
        """Whether the loss must be scaled (fp16 family)."""
        return self.name in ("fp16", "fp16-pure")

    @property
    def autocast_enabled(self) -> bool:
        return self.name != "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for the forward pass (a no-op context for fp32)."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------ hooks
    def prepare(self, model: nn.Module) -> nn.Module:
        """Apply the policy to a model in place: exemptions, then (fp16-pure) fp16 weights."""
        for name in match_modules(model, self.fp32_modules):
            self.exempt(model, name)
        if self.name == "fp16-pure":
            model.half()
            for name in self.exempted:
                model.get_submodule(name).float()
            self.master = MasterWeights(model)
        return model

    def optimizer_params(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters the optimizer should own: fp32 masters in fp16-pure, else the model's."""
        if self.master is not None:
            return self.master.params
        return [p for p in model.parameters() if p.requires_grad]

    def named_optimizer_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        if self.master is not None:
            return list(self.master.named_params())
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def after_backward(self) -> None:
        """fp16-pure: move gradients to the fp32 masters. Pass-through otherwise."""
        if self.master is not None:
            self.master.grads_to_master()

    def after_step(self) -> None:
        """fp16-pure: copy the updated masters back into the model. Pass-through otherwise."""
        if self.master is not None:
            self.master.master_to_model()

    # ------------------------------------------------------------------ exemptions
    def exempt(self, model: nn.Module, name: str) -> bool:
        """Run module ``name`` in fp32 from now on (inputs cast up, autocast off inside).

        Returns False when it (or an ancestor) is already exempt. In fp16-pure the module's
        parameters are turned to fp32 too.
        """
        if name in self.exempted or any(name.startswith(e + ".") for e in self.exempted):
            return False
        module = model.get_submodule(name)
        if self.master is not None:
            module.float()  # fp16-pure: same Parameter objects, now fp32; masters stay paired
        orig = module.forward
        wrapped = functools.partial(_fp32_forward, orig, _module_device_type(module))
        functools.update_wrapper(wrapped, orig)
        had_instance_forward = "forward" in module.__dict__
        module.forward = wrapped  # instance attribute: nn.Module.__call__ picks it up
        self._originals[name] = (module, orig if had_instance_forward else None)
        self.exempted.append(name)
        return True

    def unexempt(self, model: nn.Module, name: str) -> None:
        """Undo ``exempt`` for ``name``."""
        module, orig = self._originals.pop(name)
        if orig is None:
            del module.forward
        else:
            module.forward = orig
        self.exempted.remove(name)
