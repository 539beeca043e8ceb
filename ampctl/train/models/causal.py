"""Pieces shared by the decoder models (:mod:`ampctl.train.models.gpt2`, :mod:`ampctl.train.models.llama`).

* :class:`CausalLM`: the frame of both: the backbone, ``lm_head`` and the forward.
* :class:`CausalLMOutput`: ``.loss`` / ``.logits``, also readable as a mapping (HF style).
* :func:`causal_lm_loss`: the Hugging Face causal-LM loss. ``labels`` are the input ids (or -100
  where no prediction is wanted); the shift happens here: position ``t`` predicts label
  ``t + 1``. Cross entropy in fp32 over the positions whose shifted label is not -100.
* :func:`causal_attention`: scaled dot-product attention with a causal mask and an optional
  key-padding mask, through ``F.scaled_dot_product_attention`` ("sdpa") or an explicit
  softmax ("eager"). Both normalise in fp32.

Masking: a query attends to the keys at or before it that are not padding, and always to
itself, so a padding query (whose label must be -100) still gets a finite output and no row of
scores is all ``-inf``. The eager path fills masked scores with a real ``-inf``; those values
are intentional, not overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import IGNORE_INDEX, LanguageModel, MaskedLMOutput, check_inputs

__all__ = ["CausalLM", "CausalLMOutput", "causal_lm_loss", "causal_attention"]


@dataclass
class CausalLMOutput(MaskedLMOutput):
    """Result of a decoder's ``forward``: ``loss`` (``None`` without labels) and ``logits``
    [B, T, vocab] in the compute dtype. Attribute and mapping access, as HF's ``ModelOutput``."""


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean fp32 cross entropy of ``logits[:, t]`` against ``labels[:, t + 1]``, -100 ignored.

    Same as Hugging Face's ``ForCausalLMLoss`` without ``num_items_in_batch``.
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, vocab),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


def _allowed(seq_len: int, key_mask: Tensor, device: torch.device) -> Tensor:
    """Bool [B, 1, T, T]: causal and not padding, plus the diagonal."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_()
    allowed = causal & key_mask[:, None, None, :]
    return allowed | torch.eye(seq_len, dtype=torch.bool, device=device)


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D], each kv head shared by ``groups`` queries."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor | None,
    *,
    scale: float,
    impl: str,
    dropout_p: float = 0.0,
    upcast: bool = False,
) -> Tensor:
    """Causal attention of ``q`` [B, H, T, D] over ``k``, ``v`` [B, Hkv, T, D] (``H`` a
    multiple of ``Hkv``: grouped-query attention); returns [B, H, T, D] in ``v``'s dtype.

    ``key_mask`` is bool [B, T], True for real tokens, or ``None``. ``scale`` multiplies the
    scores (1/sqrt(D) usually). ``upcast`` computes the scores and the softmax in fp32 with
    autocast off (GPT-2's ``reorder_and_upcast_attn``), always on the eager path.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    seq_len = q.shape[2]
    if impl == "sdpa" and not upcast:
        mask = None if key_mask is None else _allowed(seq_len, key_mask, q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=scale
        )
    if upcast:
        with torch.autocast(q.device.type, enabled=False):
            scores = (q.float() * scale) @ k.float().transpose(-2, -1)
    else:
        scores = (q * scale) @ k.transpose(-2, -1)
    if key_mask is None:
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril_()
    else:
        allowed = _allowed(seq_len, key_mask, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))  # intentional -inf
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ v


class CausalLM(LanguageModel):
    """A causal LM: its backbone (under Hugging Face's name, :attr:`backbone_name`) and
    ``lm_head``, trained with the shifted next-token loss."""

    #: The attribute that holds the backbone: ``transformer`` (GPT-2), ``model`` (Llama).
    backbone_name: str

    def _add_head(self, embeddings: nn.Embedding, tie: bool) -> None:
        """``lm_head`` after the backbone; every module initialised, ``lm_head`` tied to the
        token ``embeddings`` if ``tie``."""
        self.lm_head = nn.Linear(self.hidden_size, self.vocab_size, bias=False)
        self._init_and_tie(self.lm_head, embeddings, tie)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> CausalLMOutput:
        """Next-token logits ``lm_head(backbone(input_ids, key_mask))`` and, with ``labels``,
        the loss.

        Args:
            input_ids: long [B, T], ``T <= max_position``.
            attention_mask: [B, T], True (1) for real tokens, False (0) for padding; padding
                keys are not attended to. ``None``: no padding.
            labels: long [B, T]: the input ids, with -100 where no loss is wanted; shifted
                inside (position t predicts labels[t + 1]), as in Hugging Face.

        Returns:
            :class:`CausalLMOutput`: ``logits`` [B, T, vocab_size] in the compute dtype,
            ``loss`` the mean fp32 cross entropy (``None`` without labels).
        """
        key_mask = check_inputs(input_ids, self.max_position, attention_mask, labels=labels)
        logits = self.lm_head(getattr(self, self.backbone_name)(input_ids, key_mask))
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return CausalLMOutput(loss=loss, logits=logits)
