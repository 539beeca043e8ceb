"""What the models that ship with ampctl share (BERT, GPT-2, Llama).

* :class:`MaskedLMOutput`: ``.loss`` / ``.logits``, also readable as a mapping (HF style).
* :func:`require_int` (:mod:`ampctl.errors`'s), :func:`require_float`: a constructor argument
  checked, the message naming it; :func:`check_inputs`: the shapes of ``forward``'s tensors.
* :class:`LanguageModel`: the sizes every model keeps, its ``attn_impl`` checked, and Hugging
  Face's normal init with the output projection tied to the token embeddings if asked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from ampctl.errors import require_int

__all__ = [
    "ATTN_IMPLS",
    "IGNORE_INDEX",
    "MaskedLMOutput",
    "LanguageModel",
    "check_inputs",
    "require_int",
    "require_float",
]

#: Allowed values of a model's ``attn_impl``.
ATTN_IMPLS: tuple[str, ...] = ("eager", "sdpa")
IGNORE_INDEX = -100


@dataclass
class MaskedLMOutput:
    """Result of :meth:`BertForMaskedLM.forward`.

    Supports attribute access (``out.loss``) and, like Hugging Face's
    ``ModelOutput``, mapping access (``out["loss"]``). As in HF, fields that are
    ``None`` are not keys: ``out["loss"]`` raises ``KeyError`` when no labels
    were given.
    """

    loss: Tensor | None
    logits: Tensor

    def keys(self) -> list[str]:
        """Names of the fields that are not ``None``, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Tensor:
        if key not in self.keys():
            raise KeyError(f"{key!r} is not set in this output; set keys: {self.keys()}")
        value: Tensor = getattr(self, key)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def items(self) -> Iterator[tuple[str, Tensor]]:
        """``(name, tensor)`` pairs of the fields that are not ``None``."""
        return ((k, self[k]) for k in self.keys())


def require_float(name: str, value: Any, *, low: float, high: float | None = None) -> float:
    """A finite number ``>= low`` (and ``< high`` when given)."""
    allowed = f"in [{low}, {high})" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    if not math.isfinite(value) or value < low or (high is not None and value >= high):
        raise ValueError(f"{name} ({value}) must be a finite number {allowed}")
    return float(value)


def check_inputs(
    input_ids: Tensor,
    max_position: int,
    attention_mask: Tensor | None,
    **others: Tensor | None,
) -> Tensor | None:
    """Validate the shapes of a model's inputs (``others``: its other [B, T] tensors, ``None``
    where not given); returns the mask as bool (or ``None``)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] > max_position:
        raise ValueError(
            f"input_ids has seq_len {input_ids.shape[1]}, more than max_position ({max_position})"
        )
    for name, tensor in (("attention_mask", attention_mask), *others.items()):
        if tensor is not None and tensor.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, "
                f"expected the shape of input_ids {tuple(input_ids.shape)}"
            )
    if attention_mask is None:
        return None
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()


class LanguageModel(nn.Module):
    """A model's sizes, kept once its other arguments are checked (``attn_impl`` is checked
    here, last); :meth:`_init_weights` draws weights with std ``initializer_range``."""

    initializer_range: float = 0.02

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        max_position: int,
        attn_impl: str,
    ) -> None:
        if attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl ({attn_impl!r}) must be one of {', '.join(ATTN_IMPLS)}")
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.max_position = max_position
        self.attn_impl = attn_impl

    def _init_weights(self, module: nn.Module) -> None:
        """Hugging Face's init: N(0, initializer_range) linear and embedding weights, zero
        biases, LayerNorm ones/zeros."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def _init_and_tie(self, head: nn.Linear, embeddings: nn.Embedding, tie: bool) -> None:
        """Every module initialised, then ``head``'s weight tied to ``embeddings``' if ``tie``."""
        self.apply(self._init_weights)
        if tie:
            head.weight = embeddings.weight
