"""The loss of a model call, for every loop: a tensor, ``.loss`` or ``["loss"]`` (the Hugging
Face convention), and the default forward ``model(**batch)`` that the guard's replays run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampctl.errors import BuildError

__all__ = ["ForwardLoss", "default_forward", "extract_loss"]

#: ``forward(model, batch) -> loss``: how a loop computes a batch's loss (replays use it).
ForwardLoss = Callable[[nn.Module, Any], torch.Tensor]


def extract_loss(out: Any) -> torch.Tensor:
    """The loss from a model output: a tensor, ``.loss`` or ``["loss"]`` (Hugging Face style)."""
    loss = out
    if not isinstance(loss, torch.Tensor):
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise BuildError(
            f"the model returned {type(out).__name__} with no scalar loss: model(**batch) must return a loss "
            "tensor, an object with .loss, or a dict with 'loss' (pass labels= through to the loss)"
        )
    return loss.reshape(())


def default_forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``model(**batch)``'s loss as fp32."""
    return extract_loss(model(**batch)).float()
