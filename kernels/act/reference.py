"""Pure-PyTorch reference of the gated MLP activation (the oracle of triton_act.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu"]


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, elementwise (SwiGLU's gate a = w1 u, up b = w3 u), in the inputs' dtype as torch computes it
    (under bf16 autocast: silu rounded to bf16, then the product)."""
    return F.silu(a) * b
