"""The models that ship with ampctl, in plain PyTorch with Hugging Face's module names (so a
Hugging Face state dict loads with ``strict=True``): BERT masked-LM, GPT-2 and Llama causal LMs.

What this package exports is what a config's ``model._target_`` may name without the user's
consent when it comes from a checkpoint (see :mod:`ampctl.trust`).
"""

from .bert import BertForMaskedLM, MaskedLMOutput
from .causal import CausalLMOutput
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM

__all__ = [
    "BertForMaskedLM",
    "GPT2LMHeadModel",
    "LlamaForCausalLM",
    "MaskedLMOutput",
    "CausalLMOutput",
]
