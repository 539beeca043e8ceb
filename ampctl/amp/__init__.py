"""The numeric core: loss scaling, overflow detection, precision plugins, guard rules.

Imports torch only -- no CLI, config or display code.
"""

from .formats import FP16_MAX, recommended_init_scale
from .overflow import check_and_unscale_, nonfinite_grad_names, nonfinite_tensor_names
from .precision import (
    PRECISIONS,
    MasterWeights,
    Precision,
    PrecisionPolicy,
    bf16_supported,
    make_precision,
    match_modules,
)
from .scaler import LossScaler, OptState, next_scale

__all__ = [
    "LossScaler",
    "OptState",
    "next_scale",
    "Precision",
    "make_precision",
    "PrecisionPolicy",
    "MasterWeights",
    "PRECISIONS",
    "FP16_MAX",
    "recommended_init_scale",
    "bf16_supported",
    "match_modules",
    "check_and_unscale_",
    "nonfinite_grad_names",
    "nonfinite_tensor_names",
]
