"""Sequence-parallel regions (Megatron-style): activations between the TP regions are split over their
tokens across the tensor-parallel group. Rank r holds the r-th 1/tp of the B * L tokens of [B, L, d] in memory
order, shaped [B, L/tp, d]: for B = 1 the r-th piece of the sequence, for B > 1 a run of whole rows' pieces
(the layout Megatron gets from its sequence-first [L, B, d]). The collectives then move contiguous buffers for
any micro-batch: a split along dim 1 would reorder [tp, B, L/tp, d] <-> [B, L, d] around each of the four
collectives of a layer (28 ms of strided copies per mamba2-2.7b step at micro-batch 4 on an H100,
docs/benchmarks.md). Only per-token work (norms, residual adds) runs on the shards.

    gather_from_sp(x)         fwd all-gather of the tokens       bwd reduce-scatter
    reduce_scatter_to_sp(x)   fwd reduce-scatter of the tokens   bwd all-gather
    split_to_sp(x)            fwd keep this rank's tokens        bwd all-gather (used for inputs)

The norms' (replicated) weights get partial gradients that `megassm.parallel.tp.sync_tp_grads` sums over the
group.
"""
from __future__ import annotations

import torch

from . import comm

__all__ = ["gather_from_sp", "reduce_scatter_to_sp", "split_to_sp", "tokens_of_rank"]


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_tokens(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter_tokens(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter_tokens(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather_tokens(g, ctx.group), None


class _SplitToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return tokens_of_rank(x, comm.world(group), comm.rank(group))

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather_tokens(g, ctx.group), None


def tokens_of_rank(x: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's piece of x [B, L, ...] of n (the r-th 1/n of its tokens in memory order), [B, L/n, ...]."""
    if x.shape[1] % n:
        raise ValueError(f"sequence parallelism: sequence length {x.shape[1]} not divisible by {n} ranks")
    x = x.contiguous()
    return x.view(n, -1)[r].view(x.shape[0], x.shape[1] // n, *x.shape[2:])


def gather_from_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _ReduceScatterToSP.apply(x, group)


def split_to_sp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _SplitToSP.apply(x, group)
