"""Llama causal language model in plain PyTorch, with Hugging Face's module names.

The module tree mirrors ``transformers.LlamaForCausalLM``, so a Hugging Face Llama state dict
loads with ``load_state_dict(strict=True)`` and this model's state dict loads into theirs::

    model.embed_tokens
    model.layers.{i}.input_layernorm                       (RMSNorm)
    model.layers.{i}.self_attn.{q_proj, k_proj, v_proj, o_proj}
    model.layers.{i}.post_attention_layernorm              (RMSNorm)
    model.layers.{i}.mlp.{gate_proj, up_proj, down_proj}   (SwiGLU)
    model.norm                                             (RMSNorm)
    model.rotary_emb                                       (no parameters)
    lm_head                                                (tied to embed_tokens if asked)

Architecture: pre-norm blocks with RMSNorm, grouped-query attention (``num_kv_heads`` key/value
heads shared by ``num_heads`` query heads), rotary position embeddings on q and k (rotate-half
form, as Hugging Face's checkpoints expect), SwiGLU MLP ``down(silu(gate(x)) * up(x))``, no
biases.

Precision, as Meta's reference code and Hugging Face do it:

* RMSNorm normalises in fp32 whatever the input dtype, then casts back before the weight.
* Rotary: the angles, cos and sin are computed in fp32 with autocast off, from ``rope_theta``
  at every call (no buffer, so ``model.half()`` cannot round the frequencies), and q and k are
  rotated in fp32, then cast back to their dtype.
* The attention softmax runs in fp32; the loss comes from ``logits.float()``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import require_float, require_int
from .causal import CausalLM, causal_attention

__all__ = ["LlamaForCausalLM", "LlamaRMSNorm", "rotary_cos_sin", "apply_rotary"]


class LlamaRMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in fp32."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden: Tensor) -> Tensor:
        dtype = hidden.dtype
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin [T, head_dim] of the rotary angles ``t * theta^(-2i/head_dim)``,
    each frequency repeated for both halves (Hugging Face's rotate-half layout)."""
    with torch.autocast(device.type, enabled=False):
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv_freq = 1.0 / (theta**exponent)
        angles = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, H, T, D] by the angles of ``cos``/``sin`` [T, D], in fp32; returns
    ``x``'s dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class LlamaRotaryEmbedding(nn.Module):
    """Rotary cos/sin for a sequence length (Hugging Face's ``model.rotary_emb``; it holds no
    state: the frequencies are recomputed in fp32 at each call)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        return rotary_cos_sin(seq_len, self.head_dim, self.theta, device)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary positions; no biases."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        dropout: float,
        attn_impl: str,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        self.attn_impl = attn_impl
        self.dropout = dropout
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], key_mask: Tensor | None):
        batch, seq_len, _ = hidden.shape

        def heads(t: Tensor, n: int) -> Tensor:
            return t.view(batch, seq_len, n, self.head_dim).transpose(1, 2)

        cos, sin = rotary
        q = apply_rotary(heads(self.q_proj(hidden), self.num_heads), cos, sin)
        k = apply_rotary(heads(self.k_proj(hidden), self.num_kv_heads), cos, sin)
        v = heads(self.v_proj(hidden), self.num_kv_heads)
        context = causal_attention(
            q,
            k,
            v,
            key_mask,
            scale=self.head_dim**-0.5,
            impl=self.attn_impl,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o_proj(context.transpose(1, 2).reshape(batch, seq_len, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, hidden_size: int, ffn_size: int, norm_eps: float, **attn: Any) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hidden_size=hidden_size, **attn)
        self.mlp = LlamaMLP(hidden_size, ffn_size)
        self.input_layernorm = LlamaRMSNorm(hidden_size, norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden_size, norm_eps)

    def forward(self, hidden: Tensor, rotary: tuple[Tensor, Tensor], key_mask: Tensor | None):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, key_mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Token embeddings, the decoder layers, the final RMSNorm."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        norm_eps: float,
        rope_theta: float,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hidden_size=hidden_size, norm_eps=norm_eps, **layer)
            for _ in range(num_layers)
        )
        self.norm = LlamaRMSNorm(hidden_size, norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(hidden_size // layer["num_heads"], rope_theta)

    def forward(self, input_ids: Tensor, key_mask: Tensor | None) -> Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary_emb(input_ids.shape[1], input_ids.device)
        for layer in self.layers:
            hidden = layer(hidden, rotary, key_mask)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    """Llama with a language-model head, trained with the shifted next-token loss.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width; divisible by ``num_heads``, giving an even head dim.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); divides ``num_heads``.
            ``None``: as many as query heads.
        ffn_size: SwiGLU inner width (``intermediate_size``).
        max_position: longest sequence accepted (rotary needs no table; this is a guard).
        rope_theta: rotary base (Llama 2: 10000; Llama 3: 500000).
        norm_eps: RMSNorm epsilon (``rms_norm_eps``; Llama 2/3: 1e-5).
        dropout: attention dropout (Llama: 0).
        tie_embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight`` (Llama 3.2 1B/3B:
            yes; Llama 2 and larger Llama 3: no).
        attn_impl: ``"sdpa"`` or ``"eager"`` (explicit fp32 softmax).
        initializer_range: std of the normal init of every linear and embedding weight.

    Raises:
        ValueError: an argument out of range; the message names it.
    """

    backbone_name = "model"

    def __init__(
        self,
        *,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        num_layers: int = 32,
        num_heads: int = 32,
        num_kv_heads: int | None = None,
        ffn_size: int = 11008,
        max_position: int = 4096,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        dropout: float = 0.0,
        tie_embeddings: bool = False,
        attn_impl: str = "sdpa",
        initializer_range: float = 0.02,
    ) -> None:
        for name, value in (
            ("vocab_size", vocab_size),
            ("hidden_size", hidden_size),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("ffn_size", ffn_size),
            ("max_position", max_position),
        ):
            require_int(name, value, 1)
        if num_kv_heads is None:
            num_kv_heads = num_heads
        require_int("num_kv_heads", num_kv_heads, 1)
        if hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) "
                "into an even head dim (rotary pairs dimensions)"
            )
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        rope_theta = require_float("rope_theta", rope_theta, low=1.0)
        norm_eps = require_float("norm_eps", norm_eps, low=1e-30)
        dropout = require_float("dropout", dropout, low=0.0, high=1.0)
        initializer_range = require_float("initializer_range", initializer_range, low=0.0)
        if not isinstance(tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be true or false, got {tie_embeddings!r}")
        super().__init__(vocab_size, hidden_size, num_layers, max_position, attn_impl)
        self.initializer_range = initializer_range
        self.model = LlamaModel(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            norm_eps=norm_eps,
            rope_theta=rope_theta,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            ffn_size=ffn_size,
            dropout=dropout,
            attn_impl=attn_impl,
        )
        self._add_head(self.model.embed_tokens, tie_embeddings)
