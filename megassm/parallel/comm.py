"""Counted collectives over a process group (the only place megassm.parallel talks to torch.distributed
for activations). `COUNTS` records how many of each collective ran, so tests can assert "one all-reduce
per Mamba-2 layer forward" without monkey-patching torch."""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

__all__ = ["COUNTS", "reset_counts", "all_reduce", "all_reduce_max", "all_gather_dim", "reduce_scatter_dim",
           "world", "rank", "gather_dim_autograd", "sum_fwd_identity_bwd"]

COUNTS: Counter = Counter()


def reset_counts() -> None:
    COUNTS.clear()


def world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group (in place on a contiguous copy; returns the result)."""
    if world(group) == 1:
        return x
    x = x.contiguous()
    COUNTS["all_reduce"] += 1
    dist.all_reduce(x, group=group)
    return x


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if world(group) == 1:
        return x
    x = x.contiguous()
    COUNTS["all_reduce"] += 1
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _move(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if dim == 0 else x.movedim(dim, 0)


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the ranks' `x` along `dim` (rank order)."""
    n = world(group)
    if n == 1:
        return x
    xs = _move(x, dim).contiguous()
    out = xs.new_empty((xs.shape[0] * n, *xs.shape[1:]))
    COUNTS["all_gather"] += 1
    dist.all_gather_into_tensor(out, xs, group=group)
    return out if dim == 0 else out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the ranks, each rank keeps its 1/n slice along `dim`."""
    n = world(group)
    if n == 1:
        return x
    xs = _move(x, dim).contiguous()
    if xs.shape[0] % n:
        raise ValueError(f"reduce_scatter: size {xs.shape[0]} of dim {dim} not divisible by {n} ranks")
    out = xs.new_empty((xs.shape[0] // n, *xs.shape[1:]))
    COUNTS["reduce_scatter"] += 1
    dist.reduce_scatter_tensor(out, xs, group=group)
    return out if dim == 0 else out.movedim(0, dim)


# ----------------------------------------------------------------------------------------------------
# autograd-aware collectives (context parallelism)
# ----------------------------------------------------------------------------------------------------
class _GatherDim(torch.autograd.Function):
    """fwd all-gather along `dim`; bwd reduce-scatter: each rank gets the sum over the ranks of the
    gradients of its own slice (every rank's loss may read every slice)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_dim(g, ctx.dim, ctx.group), None, None


class _SumFwdIdentityBwd(torch.autograd.Function):
    """fwd all-reduce (sum); bwd identity: every rank holds the global value, and each rank's backward
    differentiates only its own term (the ranks' gradients are summed afterwards)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def gather_dim_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """all_gather_dim with a reduce-scatter backward. Every rank must use the result in its graph (or
    none may): the backward is a collective."""
    return x if world(group) == 1 else _GatherDim.apply(x, dim, group)


def sum_fwd_identity_bwd(x: torch.Tensor, group) -> torch.Tensor:
    return x if world(group) == 1 else _SumFwdIdentityBwd.apply(x, group)
