"""Shared pieces of the integration tests: a tiny regression model and a planted gradient
overflow that appears during backward (a parameter hook), as a real one would."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """Two linear layers; ``forward(x, y)`` returns ``{"loss": ...}`` (the HF convention).
    ``seen`` records the dtype of the first layer's output (what autocast ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.seen: list[torch.dtype] = []

    def forward(self, x, y):
        h = self.emb(x)
        self.seen.append(h.dtype)
        return {"loss": ((self.head(torch.relu(h)) - y) ** 2).mean()}


def batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(n)
    ]


def plant_inf(param: nn.Parameter, when) -> torch.utils.hooks.RemovableHandle:
    """Make ``param``'s gradient infinite in every backward for which ``when()`` is true."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if when() else grad

    return param.register_hook(hook)
