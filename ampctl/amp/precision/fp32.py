"""fp32: no autocast, no loss scaling; non-finite steps are still detected and skipped."""

from __future__ import annotations

import torch

from .base import Precision

__all__ = ["FP32Precision"]


class FP32Precision(Precision):
    name = "fp32"
    compute_dtype = torch.float32
