"""GPT-2 causal language model in plain PyTorch, with Hugging Face's module names.

The module tree mirrors ``transformers.GPT2LMHeadModel``, so a Hugging Face GPT-2 state dict
loads with ``load_state_dict(strict=True)`` and this model's state dict loads into theirs::

    transformer.wte, transformer.wpe, transformer.drop
    transformer.h.{i}.ln_1
    transformer.h.{i}.attn.{c_attn, c_proj}          (c_attn: q, k, v stacked)
    transformer.h.{i}.ln_2
    transformer.h.{i}.mlp.{c_fc, c_proj}
    transformer.ln_f
    lm_head                                          (weight tied to transformer.wte)

Hugging Face's GPT-2 keeps ``c_attn``, ``c_proj`` and ``c_fc`` as ``Conv1D`` modules whose
weight is stored [in, out], the transpose of ``nn.Linear``'s [out, in]. Here they are plain
``nn.Linear`` (so anything that handles linear layers -- autocast's fast path, torchao's
float8 conversion, tensor parallel plans -- sees them), and the *state dict* uses Hugging
Face's [in, out] layout: a hook on this model transposes those four weights on
``state_dict()`` and back on ``load_state_dict()``, by name, so it keeps working when a
submodule is swapped (e.g. for a float8 linear). Checkpoints of this model are therefore
Hugging Face GPT-2 checkpoints; optimizer state is in memory layout ([out, in]), as for any
``nn.Linear``.

Numerics match Hugging Face: pre-LN blocks, GELU with the tanh approximation ("gelu_new"),
LayerNorm eps 1e-5, attention scaled by 1/sqrt(head_dim) (and by 1/(layer+1) with
``scale_attn_by_inverse_layer_idx``), GPT-2's init (N(0, 0.02), residual projections
``c_proj`` N(0, 0.02/sqrt(2 * num_layers))). The attention softmax is computed in fp32 and the
loss from ``logits.float()``; positions are 0..T-1 (no cache, training only).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import require_float, require_int
from .causal import CausalLM, causal_attention

__all__ = ["GPT2LMHeadModel", "HF_CONV1D_WEIGHTS"]

#: State-dict keys (relative to the model) stored [in, out] as Hugging Face's Conv1D does.
HF_CONV1D_WEIGHTS = re.compile(
    r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight"
)


class GPT2Attention(nn.Module):
    """Causal self-attention: ``c_attn`` projects to q, k, v; ``c_proj`` back to the width."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dropout: float,
        attn_impl: str,
        layer_idx: int,
        scale_attn_by_inverse_layer_idx: bool,
        reorder_and_upcast_attn: bool,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attn_impl = attn_impl
        self.upcast = reorder_and_upcast_attn
        self.scale = self.head_dim**-0.5
        if scale_attn_by_inverse_layer_idx:
            self.scale /= float(layer_idx + 1)
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        batch, seq_len, width = hidden.shape
        q, k, v = (
            t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.c_attn(hidden).split(width, dim=2)
        )
        context = causal_attention(
            q,
            k,
            v,
            key_mask,
            scale=self.scale,
            impl=self.attn_impl,
            dropout_p=self.attn_dropout.p if self.training else 0.0,
            upcast=self.upcast,
        )
        context = context.transpose(1, 2).reshape(batch, seq_len, width)
        return self.resid_dropout(self.c_proj(context))


class GPT2MLP(nn.Module):
    """``c_fc`` (expand), GELU (tanh approximation), ``c_proj`` (contract), dropout."""

    def __init__(self, hidden_size: int, ffn_size: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(hidden_size, ffn_size)
        self.c_proj = nn.Linear(ffn_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(hidden), approximate="tanh")))


class GPT2Block(nn.Module):
    """Pre-LN block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, hidden_size: int, ffn_size: int, layer_norm_eps: float, **attn: Any) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.attn = GPT2Attention(hidden_size=hidden_size, **attn)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = GPT2MLP(hidden_size, ffn_size, attn["dropout"])

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), key_mask)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    """Token and position embeddings, the blocks ``h``, the final LayerNorm ``ln_f``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        max_position: int,
        num_layers: int,
        dropout: float,
        **block: Any,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, hidden_size)
        self.wpe = nn.Embedding(max_position, hidden_size)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(
            GPT2Block(hidden_size=hidden_size, dropout=dropout, layer_idx=i, **block)
            for i in range(num_layers)
        )
        self.ln_f = nn.LayerNorm(hidden_size, eps=block["layer_norm_eps"])

    def forward(self, input_ids: Tensor, key_mask: Tensor | None) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            hidden = block(hidden, key_mask)
        return self.ln_f(hidden)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with a language-model head, trained with the shifted next-token loss.

    Args:
        vocab_size: number of token ids (GPT-2: 50257).
        hidden_size: model width ``n_embd``; divisible by ``num_heads``.
        num_layers: blocks ``n_layer``.
        num_heads: attention heads ``n_head``.
        ffn_size: MLP inner width ``n_inner`` (GPT-2: 4 * hidden_size).
        max_position: longest sequence, size of ``wpe`` (``n_positions``).
        dropout: embedding, attention and residual dropout (GPT-2: 0.1).
        layer_norm_eps: LayerNorm epsilon (GPT-2: 1e-5).
        tie_embeddings: ``lm_head.weight`` is ``transformer.wte.weight`` (GPT-2: yes).
        attn_impl: ``"sdpa"`` (``F.scaled_dot_product_attention``: flash / memory-efficient
            kernels on a GPU) or ``"eager"`` (explicit fp32 softmax).
        scale_attn_by_inverse_layer_idx: also divide layer ``i``'s scores by ``i + 1``.
        reorder_and_upcast_attn: compute the scores q.k and the softmax in fp32 (eager path),
            as in Hugging Face's option of that name (Mistral's fp16 stability fix).
        initializer_range: std of the normal init (GPT-2: 0.02).

    Raises:
        ValueError: an argument out of range; the message names it.
    """

    backbone_name = "transformer"

    def __init__(
        self,
        *,
        vocab_size: int = 50257,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_heads: int = 12,
        ffn_size: int | None = None,
        max_position: int = 1024,
        dropout: float = 0.1,
        layer_norm_eps: float = 1e-5,
        tie_embeddings: bool = True,
        attn_impl: str = "sdpa",
        scale_attn_by_inverse_layer_idx: bool = False,
        reorder_and_upcast_attn: bool = False,
        initializer_range: float = 0.02,
    ) -> None:
        for name, value in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("max_position", max_position),
        ):
            require_int(name, value, 1)
        if ffn_size is None:
            ffn_size = 4 * hidden_size
        require_int("ffn_size", ffn_size, 1)
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
            )
        dropout = require_float("dropout", dropout, low=0.0, high=1.0)
        layer_norm_eps = require_float("layer_norm_eps", layer_norm_eps, low=1e-30)
        initializer_range = require_float("initializer_range", initializer_range, low=0.0)
        for name, flag in (
            ("tie_embeddings", tie_embeddings),
            ("scale_attn_by_inverse_layer_idx", scale_attn_by_inverse_layer_idx),
            ("reorder_and_upcast_attn", reorder_and_upcast_attn),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        super().__init__(vocab_size, hidden_size, num_layers, max_position, attn_impl)
        self.initializer_range = initializer_range
        self.transformer = GPT2Model(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            max_position=max_position,
            num_layers=num_layers,
            dropout=dropout,
            ffn_size=ffn_size,
            layer_norm_eps=layer_norm_eps,
            num_heads=num_heads,
            attn_impl=attn_impl,
            scale_attn_by_inverse_layer_idx=scale_attn_by_inverse_layer_idx,
            reorder_and_upcast_attn=reorder_and_upcast_attn,
        )
        self._add_head(self.transformer.wte, tie_embeddings)
        self.register_state_dict_post_hook(_to_hf_layout)
        self.register_load_state_dict_pre_hook(_from_hf_layout)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's init: the base's N(0, std), and the residual projections (``c_proj``) at
        std / sqrt(2 * num_layers)."""
        super()._init_weights(module)
        if isinstance(module, GPT2Attention | GPT2MLP):
            std = self.initializer_range / math.sqrt(2 * self.num_layers)
            nn.init.normal_(module.c_proj.weight, mean=0.0, std=std)


def _conv1d_keys(state_dict: dict[str, Any], prefix: str) -> list[str]:
    n = len(prefix)
    return [k for k in state_dict if k.startswith(prefix) and HF_CONV1D_WEIGHTS.fullmatch(k[n:])]


def _to_hf_layout(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """state_dict() hook: Conv1D weights as [in, out] (a transposed view, no copy)."""
    for key in _conv1d_keys(state_dict, prefix):
        state_dict[key] = state_dict[key].t()


def _from_hf_layout(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict() pre-hook: Hugging Face's [in, out] Conv1D weights to [out, in]."""
    for key in _conv1d_keys(state_dict, prefix):
        value = state_dict[key]
        if hasattr(value, "dim") and value.dim() == 2:
            state_dict[key] = value.t()
