"""BERT for masked language modelling, in plain PyTorch.

The module tree mirrors Hugging Face's ``BertForMaskedLM`` so that name patterns
written for HF checkpoints (``*embeddings*``, ``*LayerNorm*``, ``*attention.self*``)
select the same parameters here::

    bert.embeddings.{word_embeddings, position_embeddings, token_type_embeddings,
                     LayerNorm, dropout}
    bert.encoder.layer.{i}.attention.self.{query, key, value}
    bert.encoder.layer.{i}.attention.output.{dense, LayerNorm}
    bert.encoder.layer.{i}.intermediate.dense
    bert.encoder.layer.{i}.output.{dense, LayerNorm}
    cls.predictions.transform.{dense, LayerNorm}
    cls.predictions.decoder            (weight tied to word_embeddings by default)

The model runs in fp32, under ``torch.autocast`` with fp16 or bf16, and with
fp16 weights (``model.half()``) under fp16 autocast. The masked-LM loss is always
computed from ``logits.float()``.

The eager attention path masks padding keys with a real ``-inf`` before the
softmax. Those ``-inf`` values are intentional; anything that scans activations
for non-finite values must not treat them as overflow. A row of scores is only
all ``-inf`` (and the softmax NaN) when a sequence is padding throughout; the data
pipeline never produces one (CLS, the first token, is never padding). The
softmax itself is computed in fp32 and cast back, so fp16 scores stay accurate.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (
    ATTN_IMPLS,
    IGNORE_INDEX,
    LanguageModel,
    MaskedLMOutput,
    check_inputs,
    require_int,
)

__all__ = ["ATTN_IMPLS", "MaskedLMOutput", "BertForMaskedLM"]

_TYPE_VOCAB_SIZE = 2


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        max_position: int,
        dropout: float,
        layer_norm_eps: float,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_position, hidden_size)
        self.token_type_embeddings = nn.Embedding(_TYPE_VOCAB_SIZE, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer(
            "position_ids", torch.arange(max_position).unsqueeze(0), persistent=False
        )

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        seq_len = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_len]
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention projections and the attention product."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, attn_impl: str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.attn_impl = attn_impl
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, seq_len, _ = x.shape
        return x.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        """Attend over ``hidden`` [B, T, H].

        ``key_mask`` is a bool tensor broadcastable to [B, heads, T, T] (in
        practice [B, 1, 1, T]) that is True where a key may be attended to, or
        ``None`` for no masking.
        """
        q = self._split_heads(self.query(hidden))
        k = self._split_heads(self.key(hidden))
        v = self._split_heads(self.value(hidden))

        if self.attn_impl == "sdpa":
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=key_mask,
                dropout_p=self.dropout.p if self.training else 0.0,
            )
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if key_mask is not None:
                # Intentional -inf: padding keys get exactly zero probability.
                scores = scores.masked_fill(~key_mask, float("-inf"))
            # Normalise in fp32 (scores may be fp16 under autocast or .half()).
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
            context = self.dropout(probs) @ v

        batch, _, seq_len, _ = context.shape
        return context.transpose(1, 2).reshape(batch, seq_len, self.num_heads * self.head_dim)


class BertAttention(nn.Module):
    """Self-attention block: ``self`` (projections) and ``output`` (post-LN)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dropout: float,
        layer_norm_eps: float,
        attn_impl: str,
    ) -> None:
        super().__init__()
        self.self = BertSelfAttention(hidden_size, num_heads, dropout, attn_impl)
        self.output = BertOutput(hidden_size, hidden_size, dropout, layer_norm_eps)

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        return self.output(self.self(hidden, key_mask), hidden)


class BertIntermediate(nn.Module):
    """Feed-forward expansion with GELU."""

    def __init__(self, hidden_size: int, ffn_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, ffn_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.gelu(self.dense(hidden))


class BertOutput(nn.Module):
    """Projection to the width, dropout, residual and LayerNorm: after the attention
    (``attention.output``) and after the feed-forward (``output``)."""

    def __init__(
        self, in_size: int, hidden_size: int, dropout: float, layer_norm_eps: float
    ) -> None:
        super().__init__()
        self.dense = nn.Linear(in_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertLayer(nn.Module):
    """One post-LN transformer encoder layer."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        ffn_size: int,
        dropout: float,
        layer_norm_eps: float,
        attn_impl: str,
    ) -> None:
        super().__init__()
        self.attention = BertAttention(hidden_size, num_heads, dropout, layer_norm_eps, attn_impl)
        self.intermediate = BertIntermediate(hidden_size, ffn_size)
        self.output = BertOutput(ffn_size, hidden_size, dropout, layer_norm_eps)

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        attended = self.attention(hidden, key_mask)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    """A stack of :class:`BertLayer` under the name ``layer``."""

    def __init__(self, num_layers: int, **layer_kwargs: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(**layer_kwargs) for _ in range(num_layers))

    def forward(self, hidden: Tensor, key_mask: Tensor | None) -> Tensor:
        for layer in self.layer:
            hidden = layer(hidden, key_mask)
        return hidden


class BertModel(nn.Module):
    """Embeddings followed by the encoder (no pooler: masked-LM does not use it)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        ffn_size: int,
        max_position: int,
        dropout: float,
        layer_norm_eps: float,
        attn_impl: str,
    ) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(
            vocab_size, hidden_size, max_position, dropout, layer_norm_eps
        )
        self.encoder = BertEncoder(
            num_layers,
            hidden_size=hidden_size,
            num_heads=num_heads,
            ffn_size=ffn_size,
            dropout=dropout,
            layer_norm_eps=layer_norm_eps,
            attn_impl=attn_impl,
        )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor
    ) -> Tensor:
        hidden = self.embeddings(input_ids, token_type_ids)
        key_mask = None if attention_mask is None else attention_mask[:, None, None, :]
        return self.encoder(hidden, key_mask)


class BertPredictionHeadTransform(nn.Module):
    """Dense + GELU + LayerNorm applied before the vocabulary projection."""

    def __init__(self, hidden_size: int, layer_norm_eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=layer_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    """Transform, then project to the vocabulary with ``decoder``."""

    def __init__(self, vocab_size: int, hidden_size: int, layer_norm_eps: float) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(hidden_size, layer_norm_eps)
        self.decoder = nn.Linear(hidden_size, vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden))


class BertOnlyMLMHead(nn.Module):
    """Holds the prediction head under the HF name ``predictions``."""

    def __init__(self, vocab_size: int, hidden_size: int, layer_norm_eps: float) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(vocab_size, hidden_size, layer_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.predictions(hidden)


class BertForMaskedLM(LanguageModel):
    """BERT encoder with a masked-LM head.

    Args:
        vocab_size: number of token ids.
        hidden_size: model width; must be divisible by ``num_heads``.
        num_layers: number of encoder layers.
        num_heads: attention heads per layer.
        ffn_size: feed-forward inner width.
        max_position: longest sequence accepted (size of the position table).
        dropout: dropout probability for embeddings, attention and residuals.
        layer_norm_eps: LayerNorm epsilon.
        tie_embeddings: share ``cls.predictions.decoder.weight`` with
            ``bert.embeddings.word_embeddings.weight``.
        attn_impl: ``"eager"`` (explicit softmax with a ``-inf`` padding mask)
            or ``"sdpa"`` (``F.scaled_dot_product_attention``).

    Raises:
        ValueError: if an argument is out of range; the message names it.
    """

    def __init__(
        self,
        *,
        vocab_size: int = 30522,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_heads: int = 12,
        ffn_size: int = 3072,
        max_position: int = 512,
        dropout: float = 0.1,
        layer_norm_eps: float = 1e-12,
        tie_embeddings: bool = True,
        attn_impl: str = "eager",
    ) -> None:
        require_int("vocab_size", vocab_size, 1)
        require_int("hidden_size", hidden_size, 1)
        require_int("num_layers", num_layers, 1)
        require_int("num_heads", num_heads, 1)
        require_int("ffn_size", ffn_size, 1)
        require_int("max_position", max_position, 1)
        if hidden_size % num_heads != 0:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})"
            )
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout ({dropout}) must be in [0, 1)")
        if isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, int | float):
            raise ValueError(f"layer_norm_eps must be a positive float, got {layer_norm_eps!r}")
        if not (math.isfinite(layer_norm_eps) and layer_norm_eps > 0.0):
            raise ValueError(f"layer_norm_eps ({layer_norm_eps}) must be a positive finite float")
        if not isinstance(tie_embeddings, bool):
            raise ValueError(f"tie_embeddings must be a bool, got {tie_embeddings!r}")
        super().__init__(vocab_size, hidden_size, num_layers, max_position, attn_impl)
        self.num_heads = num_heads
        self.ffn_size = ffn_size
        self.dropout_prob = float(dropout)
        self.layer_norm_eps = float(layer_norm_eps)
        self.tie_embeddings = tie_embeddings

        self.bert = BertModel(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            ffn_size=ffn_size,
            max_position=max_position,
            dropout=dropout,
            layer_norm_eps=layer_norm_eps,
            attn_impl=attn_impl,
        )
        self.cls = BertOnlyMLMHead(vocab_size, hidden_size, layer_norm_eps)
        decoder, embeddings = self.cls.predictions.decoder, self.bert.embeddings.word_embeddings
        self._init_and_tie(decoder, embeddings, tie_embeddings)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> MaskedLMOutput:
        """Compute masked-LM logits and, if ``labels`` is given, the loss.

        Args:
            input_ids: long [B, T], ``T <= max_position``.
            attention_mask: [B, T], True (or 1) for real tokens and False (0) for
                padding. Padding keys are excluded from attention. Every
                sequence needs at least one real token (CLS is never padding).
            token_type_ids: long [B, T] in {0, 1}; zeros if omitted.
            labels: long [B, T]; the original token at predicted positions and
                -100 elsewhere.

        Returns:
            :class:`MaskedLMOutput` with ``logits`` [B, T, vocab_size] (in the
            compute dtype) and ``loss``, the mean fp32 cross entropy over the
            positions whose label is not -100 (``None`` without labels).
        """
        attention_mask = check_inputs(
            input_ids,
            self.max_position,
            attention_mask,
            token_type_ids=token_type_ids,
            labels=labels,
        )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        hidden = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.cls(hidden)

        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits.float().reshape(-1, self.vocab_size),
                labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
            )
        return MaskedLMOutput(loss=loss, logits=logits)
