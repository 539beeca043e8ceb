"""bf16: autocast to bfloat16, fp32 weights and optimizer state, no loss scaling (bf16 has
fp32's range); non-finite steps are still detected and skipped."""

from __future__ import annotations

import torch

from .base import Precision

__all__ = ["BF16Precision"]


class BF16Precision(Precision):
    name = "bf16"
    compute_dtype = torch.bfloat16
