"""Gradient-norm clipping of the gradients this process holds (the single-device case); the TP and PP
variants (tp.clip_grad_norm_tp, pp.clip_grad_norm_pp) reduce the norm across their shards first."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["clip_grad_norm"]


def clip_grad_norm(params: Iterable[torch.nn.Parameter] | torch.Tensor, max_norm: float) -> float:
    """Total L2 norm of the gradients (float); scales them to `max_norm` when above it.

    max_norm == 0 only computes the norm. A non-finite norm (inf/nan) is returned as is and the gradients
    are left untouched (the caller decides what to do: the trainer stops). One host sync per call.
    The norm is over the gradients this process holds: under sharded layouts (FSDP/TP) the caller must
    reduce across shards.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    else:
        dev = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(dev) for g in grads]))
    value = float(total.item())
    if max_norm > 0 and math.isfinite(value):
        if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        else:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
    return value
