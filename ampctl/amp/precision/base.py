"""The precision plugin interface: one small base whose hooks pass through by default
(the shape of Lightning's ``plugins/precision/precision.py``).

A plugin owns, for one precision: its autocast context, its :class:`~ampctl.amp.LossScaler`
(scaling on for the fp16 family; for the others the scaler still detects non-finite steps and
skips them), the parameters the optimizer steps (fp32 masters in fp16-pure), the backward and
optimizer-step hooks, the modules it runs in fp32, and its state in a checkpoint.

``fp32_modules`` (fnmatch patterns over module names, e.g. ``*embeddings*``) run their forward
in fp32 even under autocast: inputs are cast up and autocast is off inside. Modules can be
moved to fp32 later (``to_fp32``), which is how the overflow guard moves a module that overflows out
of the low precision while the rest stays fast.

A plugin may also keep some layers in a precision *lower* than its autocast dtype (fp8: torchao
``Float8Linear``): :meth:`Precision.demotable` lists them, :meth:`Precision.demote` moves one to
the autocast dtype (the guard's layer demotion), :meth:`Precision.probes` gives the log-step
probes that watch them (see :class:`ampctl.protect.figures.Probe`), :meth:`Precision.restore` puts
the demotions of a checkpoint back and :meth:`Precision.summary` names them for the run summary.
The base has no such layers: the hooks pass through.

None of the hooks reads a device value on the host, except :meth:`Precision.optimizer_step`,
which makes the scaler's one read of the step (none with a fused optimizer).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ampctl.amp.scaler import LossScaler

__all__ = ["Precision", "match_modules", "bf16_supported", "saved_in_fp32"]


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


def saved_in_fp32(state: Mapping[str, Any]) -> list[str]:
    """The module names a saved precision state (:meth:`Precision.state_dict`) runs in fp32.
    Checkpoints of ampctl 0.2 and before keep them under ``"exempted"``, still read."""
    return [str(n) for n in state.get("in_fp32", state.get("exempted", []))]


class Precision:
    """A precision plugin (see the module docstring). Subclasses set the class attributes and
    override the hooks they need.

    Args:
        fp32_modules: fnmatch patterns of module names kept in fp32.
        device_type: ``cpu`` or ``cuda`` (for autocast).
        scaler: the plugin's LossScaler; by default one with ampctl's defaults, scaling enabled
            exactly when the precision needs it (``needs_scaler``).
    """

    name: ClassVar[str] = ""
    compute_dtype: ClassVar[torch.dtype] = torch.float32
    param_dtype: ClassVar[torch.dtype] = torch.float32
    needs_scaler: ClassVar[bool] = False
    # the plugin's own constructor arguments, taken from ``make_precision(options=...)``
    option_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        fp32_modules: Iterable[str] = (),
        device_type: str = "cpu",
        scaler: LossScaler | None = None,
    ) -> None:
        if isinstance(fp32_modules, str):
            raise ValueError(
                "precision.fp32_modules must be a list of patterns, e.g. ['*embeddings*']"
            )
        self.fp32_modules = list(fp32_modules)
        self.device_type = device_type
        self.scaler = scaler if scaler is not None else LossScaler(enabled=self.needs_scaler)
        self.in_fp32: list[str] = []  # module names currently running in fp32
        self._originals: dict[str, tuple[nn.Module, object]] = {}
        # every option this plugin was made with (also other plugins' keys): a precision
        # fallback hands them to the next plugin
        self.options: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(in_fp32={self.in_fp32})"

    # ------------------------------------------------------------------ properties
    @property
    def master(self) -> Any:
        """fp32 master weights (fp16-pure), else None."""
        return None

    @property
    def autocast_enabled(self) -> bool:
        return self.compute_dtype != torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context for the forward pass (a no-op context for fp32)."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    # ------------------------------------------------------------------ hooks
    def prepare(self, model: nn.Module) -> nn.Module:
        """Apply the precision to a model in place (base: the fp32 modules to fp32)."""
        for name in match_modules(model, self.fp32_modules):
            self.to_fp32(model, name)
        return model

    def release(self, model: nn.Module) -> list[str]:
        """Undo :meth:`prepare` (the model is left in fp32 with its current values, e.g. before
        switching to another precision). Returns the module names that were in fp32."""
        names = list(self.in_fp32)
        for n in names:
            self.undo_fp32(model, n)
        model.float()
        return names

    def optimizer_params(self, model: nn.Module) -> list[nn.Parameter]:
        """Parameters the optimizer should own."""
        return [p for _, p in self.named_optimizer_params(model)]

    def named_optimizer_params(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        """Extra gradients to clear besides the optimizer's (fp16-pure: the model's)."""

    def backward(self, loss: torch.Tensor) -> None:
        """``scaler.scale(loss).backward()``. No host read."""
        self.scaler.scale(loss).backward()

    def after_backward(self) -> None:
        """After the last backward of a step, before unscaling. Pass-through."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale and check the gradients (fused). No host read."""
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Step (or skip) and update the scale; returns whether the step was skipped as the
        scaler read it, or None when no read was made (fused optimizer). **Syncs once** on the
        standard path (the scaler's skip flag), never with a fused optimizer."""
        self.scaler.step(optimizer)
        self.scaler.update()
        self.after_step()
        return self.scaler.last_skip_read

    def after_step(self) -> None:
        """After the optimizer step. Pass-through."""

    def probes(self) -> list[Any]:
        """Log-step probes of this precision (:class:`ampctl.protect.figures.Probe`); none here."""
        return []

    # ------------------------------------------------------------------ low-precision layers
    def demotable(self, model: nn.Module, under: str = "") -> list[str]:
        """Names of the layers kept below the autocast dtype, at or inside module ``under``
        ("": the whole model), in module order. None here."""
        return []

    def demote(self, model: nn.Module, name: str, reason: str) -> bool:
        """Move layer ``name`` up to the autocast dtype, keeping its Parameters (and so the
        optimizer state); ``reason`` is kept for the checkpoint and the summary. Returns whether
        a layer was demoted (never here)."""
        return False

    def replay_casts(self, model: nn.Module, run: Any) -> tuple[list[str], torch.Tensor] | None:
        """Call ``run()`` (a forward and backward of ``model``) with the per-layer cast probe of
        the low-precision layers open: their names and a device tensor of rows (see
        :mod:`ampctl.amp.fp8`), or None without such layers (here). No host read."""
        return None

    def restore(self, model: nn.Module, state: dict[str, Any]) -> None:
        """After :meth:`prepare` on resume: redo what :meth:`state_dict` recorded beyond the
        fp32 modules (the caller moves those to fp32 again). Pass-through."""

    def summary(self, model: nn.Module) -> dict[str, Any]:
        """Keys for the run summary. None here."""
        return {}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the precision (the scaler is saved on its own)."""
        return {"name": self.name, "in_fp32": list(self.in_fp32)}

    def master_state(self) -> list[torch.Tensor] | None:
        """CPU copies of the fp32 masters (fp16-pure), else None. Copies to the host."""
        return None

    def load_master_state(self, masters: list[torch.Tensor] | None) -> None:
        """Restore :meth:`master_state`. Pass-through."""

    # ------------------------------------------------------------------ fp32 modules
    def to_fp32(self, model: nn.Module, name: str) -> bool:
        """Run module ``name`` in fp32 from now on (inputs cast up, autocast off inside).

        Returns False when it (or an ancestor) already runs in fp32.
        """
        if name in self.in_fp32 or any(name.startswith(e + ".") for e in self.in_fp32):
            return False
        module = model.get_submodule(name)
        self._fp32_params(module)
        orig = module.forward
        wrapped = functools.partial(_fp32_forward, orig, _module_device_type(module))
        functools.update_wrapper(wrapped, orig)
        had_instance_forward = "forward" in module.__dict__
        module.forward = wrapped  # instance attribute: nn.Module.__call__ picks it up
        self._originals[name] = (module, orig if had_instance_forward else None)
        self.in_fp32.append(name)
        return True

    def _fp32_params(self, module: nn.Module) -> None:
        """What :meth:`to_fp32` does to the module's parameters (base: nothing, they are fp32)."""

    def undo_fp32(self, model: nn.Module, name: str) -> None:
        """Undo :meth:`to_fp32` for ``name``."""
        module, orig = self._originals.pop(name)
        if orig is None:
            del module.forward
        else:
            module.forward = orig
        self.in_fp32.remove(name)
