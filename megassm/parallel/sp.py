"""Sequence-parallel regions (Megatron-style): activations between the TP regions are split along the
sequence dim (dim 1 of [B, L, d]) across the tensor-parallel group.

    gather_from_sp(x)         fwd all-gather along L       bwd reduce-scatter along L
    reduce_scatter_to_sp(x)   fwd reduce-scatter along L   bwd all-gather along L
    split_to_sp(x)            fwd keep this rank's slice   bwd all-gather (used for inputs)

Norms and residual adds then run on [B, L/tp, d] shards; their (replicated) weights get partial gradients
that `megassm.parallel.tp.sync_tp_grads` sums over the group.
"""
from __future__ import annotations

import torch

from . import comm

__all__ = ["gather_from_sp", "reduce_scatter_to_sp", "split_to_sp", "SEQ_DIM"]

SEQ_DIM = 1


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter_dim(g, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter_dim(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather_dim(g, SEQ_DIM, ctx.group), None


class _SplitToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n, r = comm.world(group), comm.rank(group)
        return x.chunk(n, dim=SEQ_DIM)[r].contiguous()

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather_dim(g, SEQ_DIM, ctx.group), None


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _ReduceScatterToSP.apply(x, group)


def split_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _SplitToSP.apply(x, group)
