"""Pure-PyTorch reference of the LM loss (the oracle of triton_ce.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["cross_entropy"]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-row losses [N] of logits [N, V] against labels [N], in fp32 (fp64 stays fp64); rows whose label is
    ignore_index have loss 0: F.cross_entropy(reduction="none") on the logits cast up, as the model computed its
    loss before the fused kernel."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(x, labels, ignore_index=ignore_index, reduction="none")
