"""fp16: autocast to float16, fp32 weights and optimizer state, dynamic loss scaling."""

from __future__ import annotations

import torch

from .base import Precision

__all__ = ["FP16Precision"]


class FP16Precision(Precision):
    name = "fp16"
    compute_dtype = torch.float16
    needs_scaler = True
