"""The numeric core: loss scaling, overflow detection, precision policy, guard rules.

Imports torch only -- no CLI, config or display code.
"""

from .overflow import check_and_unscale_, nonfinite_grad_names, nonfinite_tensor_names
from .precision import PRECISIONS, MasterWeights, PrecisionPolicy, bf16_supported, match_modules
from .scaler import LossScaler, OptState, next_scale

__all__ = [
    "LossScaler",
    "OptState",
    "next_scale",
    "PrecisionPolicy",
    "MasterWeights",
    "PRECISIONS",
    "bf16_supported",
    "match_modules",
    "check_and_unscale_",
    "nonfinite_grad_names",
    "nonfinite_tensor_names",
]
