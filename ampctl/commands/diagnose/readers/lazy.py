"""Tensors read one at a time.

A reader describes the tensors of a checkpoint by :class:`TensorSource` (name, shape, dtype,
bytes, and a callable that reads that one tensor from its file) and hands them over as
:class:`LazyTensors`, a mapping whose values are read when asked for and never cached: a caller
that takes one, uses it and drops it holds one tensor at a time (the state health does, see
:mod:`..health`); the replay, which needs the whole model, asks for all of them.

Tensors that ``torch.load(..., weights_only=True, mmap=True)`` returns are lazy already (their
bytes stay in the file until touched): they are wrapped as sources as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSource", "LazyTensors", "tensor_sources", "shapes_of", "meta_of", "lazy_from"]


@dataclass(frozen=True)
class TensorSource:
    """One tensor of a checkpoint, not read yet. ``identity``: equal for two names that hold the
    same bytes (tied weights: counted once); ``load`` reads it (a new tensor on each call)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    identity: Any
    load: Callable[[], torch.Tensor]

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


class LazyTensors(Mapping[str, torch.Tensor]):
    """``name -> tensor``, each read from its source when asked for (not cached). Iterating
    the keys, :meth:`source` and :func:`shapes_of` read nothing."""

    def __init__(self, sources: Iterable[TensorSource] = ()) -> None:
        self._src: dict[str, TensorSource] = {}
        for s in sources:
            self._src.setdefault(s.name, s)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._src[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._src)

    def __len__(self) -> int:
        return len(self._src)

    def __contains__(self, name: object) -> bool:
        return name in self._src

    def __repr__(self) -> str:
        return f"LazyTensors({len(self)} tensors, {self.nbytes} bytes)"

    def source(self, name: str) -> TensorSource:
        return self._src[name]

    def sources(self) -> list[TensorSource]:
        return list(self._src.values())

    def update(self, other: Mapping[str, torch.Tensor]) -> None:  # type: ignore[override]
        for s in tensor_sources(other, floating_only=False):
            self._src[s.name] = s

    def reordered(self, key: Callable[[str], Any]) -> LazyTensors:
        """The same sources, sorted by ``key(name)`` (stable)."""
        return LazyTensors(sorted(self._src.values(), key=lambda s: key(s.name)))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._src.values())

    @property
    def largest(self) -> int:
        return max((s.nbytes for s in self._src.values()), default=0)


def _identity(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def tensor_sources(tensors: Mapping[str, Any], *, floating_only: bool = True) -> list[TensorSource]:
    """The sources of a mapping of tensors (its own for :class:`LazyTensors`, a wrapper of each
    tensor otherwise; values that are not tensors are left out). Reads nothing."""
    if isinstance(tensors, LazyTensors):
        srcs = tensors.sources()
    else:
        srcs = [
            TensorSource(str(k), tuple(v.shape), v.dtype, view_bytes(v), _identity(v), _const(v))
            for k, v in tensors.items()
            if isinstance(v, torch.Tensor)
        ]
    return [s for s in srcs if s.is_floating_point] if floating_only else srcs


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def lazy_from(tensors: Mapping[str, Any]) -> LazyTensors:
    """A :class:`LazyTensors` of the tensors of a mapping (a state dict of mmap-backed
    tensors, or one already lazy)."""
    return LazyTensors(tensor_sources(tensors, floating_only=False))


def shapes_of(tensors: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """``[(name, shape)]`` of the tensors of a mapping, reading none of them."""
    return [(s.name, s.shape) for s in tensor_sources(tensors, floating_only=False)]


def meta_of(tensors: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Meta tensors of the same names, shapes and dtypes (no memory, nothing read): for checks
    that look at shapes only."""
    return {
        s.name: torch.empty(s.shape, dtype=s.dtype, device="meta")
        for s in tensor_sources(tensors, floating_only=False)
    }


def view_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor takes once materialised (its shape, not its storage: an expanded or
    stride-0 view of one element counts every element it shows)."""
    return t.numel() * t.element_size()
