"""Count the device ops a training step spends on protection (tests and ``ampctl bench``).

:func:`count_ops` opens a ``TorchDispatchMode`` that counts every aten op dispatched inside the
block, except ops that launch no kernel on a GPU: views and aliases (``view``, ``select``,
``slice``, ``detach`` ...), allocations that write nothing (``empty``), and the device-to-host copy
behind ``.item()`` (a host read, counted by :mod:`ampctl.hostreads`). On a GPU each counted op is
a kernel launch (a few microseconds each, whatever the tensor size); the count is the same on the
CPU, which is where the tests take it.

What is not protection is left out with :meth:`OpCount.paused` (or the ``exclude_*`` helpers,
which patch the objects for the block): the model's forward and backward, gradient clipping, the
optimizer's own math and data loading. What remains is what the loss scaler, the overflow check,
the guard and the logging cost.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCount", "count_ops"]

_NO_KERNEL = {
    "detach",
    "alias",
    "empty",
    "empty_strided",
    "empty_like",
    "lift_fresh",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "_reshape_alias",
    "_record_function_enter_new",  # profiler markers (optimizer.zero_grad's), not kernels
    "_record_function_exit",
}


def _launches(func: Any) -> bool:
    """Whether an aten op launches a kernel (views and empty allocations do not)."""
    if getattr(func, "is_view", False):
        return False
    name = func._schema.name.split("::")[-1]
    return name not in _NO_KERNEL


class OpCount(TorchDispatchMode):
    """The running count (see the module docstring): :attr:`total`, and :attr:`by_op` by aten
    name."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and _launches(func):
            self.total += 1
            self.by_op[func._schema.name.split("::")[-1]] += 1
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.total = 0
        self.by_op.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops inside are not counted."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _pausing(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            # leave the mode for the call when this counter is the innermost one: the ops run
            # at full speed (foreach kernels included), not through Python
            with self.paused(), _outside(self):
                return fn(*a, **k)

        return inner

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **k: Any) -> Any:
            # counted even inside a left-out region (a tensor hook run by the backward pass):
            # the mode goes back on the stack for the call when it was taken off
            paused, self._paused = self._paused, 0
            try:
                if _current() is self:
                    return fn(*a, **k)
                with self:
                    return fn(*a, **k)
            finally:
                self._paused = paused

        return inner


def _current() -> Any:
    return getattr(torch.utils._python_dispatch, "_get_current_dispatch_mode", lambda: None)()


@contextlib.contextmanager
def _outside(mode: OpCount) -> Iterator[None]:
    pop = getattr(torch.utils._python_dispatch, "_pop_mode_temporarily", None)
    if pop is None or _current() is not mode:
        yield
        return
    with pop():
        yield


@contextlib.contextmanager
def count_ops(
    *,
    models: tuple[torch.nn.Module, ...] = (),
    optimizers: tuple[Any, ...] = (),
    exclude: tuple[tuple[Any, str], ...] = (),
    include: tuple[tuple[Any, str], ...] = (),
    backward: bool = True,
    clipping: bool = True,
) -> Iterator[OpCount]:
    """Count the protection's ops inside the block (not thread-safe).

    Left out: the forward of each of ``models`` (its ``forward``, patched), the backward pass
    (``torch.autograd.backward``; ``backward=False`` counts it), gradient clipping
    (``torch.nn.utils.clip_grad_norm_``; ``clipping=False`` counts it), the ``step`` of each of
    ``optimizers``, and each ``(object, method name)`` of ``exclude`` (e.g. a data source's
    ``next_batch``). Each ``(object, method name)`` of ``include`` is counted even when a
    left-out call runs it (a tensor hook the backward pass calls, e.g. ``ActGradCounter._add``).
    The patches are undone on exit."""
    counter = OpCount()
    undo: list[Callable[[], None]] = []

    def patch(obj: Any, name: str, wrap: Callable[..., Any] | None = None) -> None:
        had = name in vars(obj)
        original = vars(obj)[name] if had and isinstance(obj, type) else getattr(obj, name)
        setattr(obj, name, (wrap or counter._pausing)(original))
        undo.append(lambda: setattr(obj, name, original) if had else delattr(obj, name))

    for m in models:
        patch(m, "forward")
    for opt in optimizers:
        patch(opt, "step")
    for obj, name in exclude:
        patch(obj, name)
    for obj, name in include:
        patch(obj, name, counter._counting)
    if backward:
        patch(torch.autograd, "backward")
    if clipping:
        patch(torch.nn.utils, "clip_grad_norm_")
    try:
        with counter:
            yield counter
    finally:
        for fn in reversed(undo):
            fn()
