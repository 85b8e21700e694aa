"""Average gradients over the data-parallel group after the backward, one flat all-reduce per dtype. The
DDP engine's path where torch DDP cannot run (pipeline stages, BPTT with several windows per backward;
parallel/engines.py), and the reference for the PP tests."""
from __future__ import annotations

import torch

from . import comm

__all__ = ["allreduce_grads"]


@torch.no_grad()
def allreduce_grads(params, group) -> None:
    n = comm.world(group)
    if n == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in gs])
        comm.all_reduce(flat, group)
        flat.div_(n)
        off = 0
        for g in gs:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
