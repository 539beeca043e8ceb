"""The snapshot a rollback restores: device copies of the weights, fp32 masters, optimizer state
and scale, taken into buffers allocated once and refreshed with one ``_foreach_copy_`` per
(device, dtype) group -- a few ops per snapshot whatever the number of tensors.

The buffers are laid out from the tensors they copy (names, shapes, dtypes, devices): when that
layout changes (the optimizer created its state at its first step, a fallback rebuilt it, an fp8
layer was demoted) they are allocated again, once. Restoring copies back into the live tensors
in place, the same way; optimizer state whose layout changed since the snapshot is put back with
``load_state_dict`` instead. No host read anywhere here.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Snapshot", "clone_state"]


def _tensors(obj: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor of a nested state (dicts, lists, tuples) with its path, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, dict):
        return [kv for k in obj for kv in _tensors(obj[k], (*path, k))]
    if isinstance(obj, list | tuple):
        return [kv for i, v in enumerate(obj) for kv in _tensors(v, (*path, i))]
    return []


def _layout(items: list[tuple[tuple, torch.Tensor]]) -> tuple:
    return tuple((p, t.shape, t.dtype, t.device) for p, t in items)


def _copy_groups(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i, one foreach copy per (device, dtype) group."""
    groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
    for d, s in zip(dst, src, strict=True):
        g = groups[(d.device, d.dtype)]
        g[0].append(d)
        g[1].append(s)
    with torch.no_grad():
        for d, s in groups.values():
            if any(hasattr(t, "to_local") for t in d):  # DTensors (FSDP2): one copy each
                for x, y in zip(d, s, strict=True):
                    x.copy_(y)
            else:
                torch._foreach_copy_(d, s)


def _map_state(obj: Any, leaf: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of a nested state (dicts, lists, tuples) with ``leaf(tensor)`` for each tensor
    and a deep copy of everything else."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj)
    if isinstance(obj, dict):
        return {k: _map_state(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_state(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map_state(v, leaf) for v in obj)
    return copy.deepcopy(obj)


def clone_state(obj: Any) -> Any:
    """A copy of a (nested) state dict whose tensors are cloned on their device: what
    ``copy.deepcopy`` gives, without its per-object bookkeeping. No host read."""
    return _map_state(obj, lambda t: t.detach().clone())


class Snapshot:
    """The last good state (see the module docstring). ``step`` and ``progress`` (the loop's
    position, as its ``progress_state()`` gave it) describe it; :meth:`take` refreshes it."""

    def __init__(self) -> None:
        self.step = -1
        self.progress: Any = None
        self._layout: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._optim_host: Any = None  # the optimizer state without its tensors
        self._n_model = self._n_optim = 0

    @staticmethod
    def _sources(model: nn.Module, optimizer: Any, masters: list[torch.Tensor], scale: Any):
        model_items = [((k,), v) for k, v in model.state_dict(keep_vars=True).items()]
        opt_state = optimizer.state_dict()
        opt_items = _tensors(opt_state)
        extra = [(("master", i), m) for i, m in enumerate(masters)]
        if scale is not None:
            extra.append((("scale",), scale))
        return model_items, opt_state, opt_items, extra

    def take(
        self,
        step: int,
        model: nn.Module,
        optimizer: Any,
        *,
        masters: list[torch.Tensor] | None = None,
        scale: torch.Tensor | None = None,
        progress: Any = None,
    ) -> None:
        """Copy the current state into the buffers (allocating them when the layout changed).
        No host read."""
        model_items, opt_state, opt_items, extra = self._sources(
            model, optimizer, list(masters or []), scale
        )
        items = [*model_items, *opt_items, *extra]
        layout = _layout(items)
        src = [t.detach() for _, t in items]
        if layout != self._layout:
            self._buffers = [t.clone() for t in src]
            self._layout = layout
        else:
            _copy_groups(self._buffers, src)
        self._n_model, self._n_optim = len(model_items), len(opt_items)
        self._optim_host = _without_tensors(opt_state)
        self._opt_paths = [p for p, _ in opt_items]
        self.step, self.progress = step, progress

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights and buffers kept, by name (the buffers themselves: do not modify)."""
        layout = self._layout or ()
        return {p[0]: b for (p, *_), b in zip(layout[: self._n_model], self._buffers, strict=False)}

    def optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state kept, as ``state_dict()`` shaped it (tensors cloned)."""
        if self._optim_host is None:
            return None
        start = self._n_model
        return _with_tensors(
            self._optim_host, self._opt_paths, self._buffers[start : start + self._n_optim]
        )

    def masters(self) -> list[torch.Tensor] | None:
        """The fp32 masters kept (fp16-pure), else None."""
        layout = self._layout or ()
        kept = [b for (p, *_), b in zip(layout, self._buffers, strict=False) if p[0] == "master"]
        return kept or None

    @property
    def scale(self) -> torch.Tensor | None:
        """The scale at the snapshot (a device tensor), or None when none was kept."""
        if self._layout is None or self._layout[-1][0] != ("scale",):
            return None
        return self._buffers[-1]

    def restore(self, model: nn.Module, optimizer: Any, masters: list[torch.Tensor] | None = None):
        """Put the weights, masters and optimizer state back (the scale is the caller's
        decision). No host read."""
        model_items, opt_state, opt_items, extra = self._sources(
            model, optimizer, list(masters or []), None
        )
        live = [t for _, t in model_items]
        keep = self._buffers[: self._n_model]
        ours = self._layout[: self._n_model] if self._layout else ()
        if _layout(model_items) == ours:
            _copy_groups(live, keep)
        else:  # the model's layout changed (a module swapped): by name
            model.load_state_dict({p[0]: b for (p, *_), b in zip(ours, keep, strict=True)})
        opt_buf = self._buffers[self._n_model : self._n_model + self._n_optim]
        if [p for p, _ in opt_items] == self._opt_paths and _layout(opt_items) == tuple(
            self._layout[self._n_model : self._n_model + self._n_optim]
        ):
            _copy_groups([t for _, t in opt_items], opt_buf)
            _restore_host(optimizer, self._optim_host)
        else:  # the optimizer's state was created (or rebuilt) since: load it whole
            optimizer.load_state_dict(_with_tensors(self._optim_host, self._opt_paths, opt_buf))
        n_masters = len(extra)
        if n_masters:
            start = self._n_model + self._n_optim
            _copy_groups([t for _, t in extra], self._buffers[start : start + n_masters])


def _without_tensors(obj: Any) -> Any:
    """The nested state with every tensor replaced by None (the host part: lr, betas ...)."""
    return _map_state(obj, lambda t: None)


def _with_tensors(host: Any, paths: list[tuple], tensors: list[torch.Tensor]) -> Any:
    """The host part with clones of ``tensors`` put back at ``paths``."""
    out = copy.deepcopy(host)
    for path, t in zip(paths, tensors, strict=True):
        node = out
        for k in path[:-1]:
            node = node[k]
        if isinstance(node, tuple):  # tuples hold no tensors in optimizer states in practice
            raise TypeError("a tensor inside a tuple of an optimizer state cannot be restored")
        node[path[-1]] = t.clone()
    return out


def _restore_host(optimizer: Any, host: Any) -> None:
    """The host values of the optimizer's param groups (lr, betas, weight decay ...), as the
    snapshot had them; tensors in them were copied back with the state."""
    for group, saved in zip(optimizer.param_groups, host["param_groups"], strict=True):
        for k, v in saved.items():
            if k != "params" and v is not None and not isinstance(group.get(k), torch.Tensor):
                group[k] = copy.deepcopy(v)
