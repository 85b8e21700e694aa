"""megassm.models: Mamba-2 / attention / MLP blocks from a pattern string, single device, pure PyTorch.

The math of the mixers lives in megassm.kernels; parallel plans are applied from outside (megassm.parallel).
"""
from .attention import Attention
from .blocks import Block
from .init import canonical_init, canonical_parameter, param_seed
from .lm import LanguageModel, LMOutput, build_model, padded_vocab_size
from .mamba2 import Mamba2Mixer
from .mlp import GatedMLP
from .norm import GatedRMSNorm, RMSNorm
from .state import KVCache, MambaState, detach_states, reset_states, states_to

__all__ = [
    "build_model",
    "LanguageModel",
    "LMOutput",
    "padded_vocab_size",
    "Block",
    "Mamba2Mixer",
    "Attention",
    "GatedMLP",
    "RMSNorm",
    "GatedRMSNorm",
    "MambaState",
    "KVCache",
    "reset_states",
    "detach_states",
    "states_to",
    "canonical_init",
    "canonical_parameter",
    "param_seed",
]
