"""Counted collectives over a process group (the only place megassm.parallel talks to torch.distributed
for activations). `COUNTS` records how many of each collective ran, so tests can assert "one all-reduce
per Mamba-2 layer forward" without monkey-patching torch."""
from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist

__all__ = ["COUNTS", "reset_counts", "all_reduce", "all_reduce_start", "wait", "all_reduce_max", "all_gather_dim",
           "reduce_scatter_dim", "all_gather_tokens", "reduce_scatter_tokens",
           "reduce_scatter_tokens_start", "world", "rank", "gather_dim_autograd",
           "sum_fwd_identity_bwd"]

COUNTS: Counter = Counter()


def reset_counts() -> None:
    COUNTS.clear()


def world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group (in place on a contiguous copy; returns the result)."""
    return _all_reduce(x, group, async_op=False)[0]


def all_reduce_start(x: torch.Tensor, group):
    """all_reduce begun, not waited on (async_op): (x, work); `wait(x, work)` before x is read. Meanwhile the
    stream may run other work beside the collective (NCCL runs it on its own stream). all_reduce and the other
    collectives stay synchronous: only the paths that overlap (parallel.tp_overlap) begin collectives."""
    return _all_reduce(x, group, async_op=True)


def _all_reduce(x: torch.Tensor, group, async_op: bool):
    if world(group) == 1:
        return x, None
    x = x.contiguous()
    COUNTS["all_reduce"] += 1
    return x, dist.all_reduce(x, group=group, async_op=async_op)


def wait(x: torch.Tensor, work) -> torch.Tensor:
    """The result of a collective begun by *_start, once it is done (a no-op for a group of one)."""
    if work is not None:
        work.wait()
    return x


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if world(group) == 1:
        return x
    x = x.contiguous()
    COUNTS["all_reduce"] += 1
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def _flat_order(x: torch.Tensor, dim: int) -> bool:
    """Whether the ranks' blocks along `dim` are contiguous in memory (no dim before it larger than 1): then a
    collective over the flat buffer is one along `dim`, with no copy (micro-batch 1 under SP)."""
    return all(s == 1 for s in x.shape[:dim])


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate the ranks' `x` along `dim` (rank order). The result is contiguous: when dims before `dim`
    are larger than 1 the ranks' blocks are gathered stacked ([n, *x.shape]) and reordered by one copy."""
    n = world(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    COUNTS["all_gather"] += 1
    flat = _flat_order(x, dim)
    out = x.new_empty((*x.shape[:dim], x.shape[dim] * n, *x.shape[dim + 1:]) if flat else (n, *x.shape))
    # rank-major flat views: the backends check the sizes along dim 0
    dist.all_gather_into_tensor(out.view(n, -1), x.view(1, -1), group=group)
    return out if flat else out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the ranks, each rank keeps its 1/n slice along `dim` (a contiguous tensor; when dims before
    `dim` are larger than 1 the input is reordered rank-major by one copy first)."""
    n = world(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: size {x.shape[dim]} of dim {dim} not divisible by {n} ranks")
    COUNTS["reduce_scatter"] += 1
    if _flat_order(x, dim):
        xs = x.contiguous()
    else:
        xs = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = x.new_empty((*x.shape[:dim], x.shape[dim] // n, *x.shape[dim + 1:]))
    dist.reduce_scatter_tensor(out.view(1, -1), xs.view(n, -1), group=group)
    return out


# ----------------------------------------------------------------------------------------------------
# token-flat collectives (sequence parallelism, sp.py): a rank's piece of [B, L, ...] is the rank-th 1/n of its
# B * L tokens in memory order, shaped [B, L / n, ...], so neither collective reorders anything for any B
# ----------------------------------------------------------------------------------------------------
def all_gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """The ranks' x [B, l, ...] concatenated as one run of B * l * n tokens in rank order, shaped [B, l * n, ...]
    (the inverse of reduce_scatter_tokens' split; for B = 1 the sequence concatenated)."""
    n = world(group)
    if n == 1:
        return x
    x = x.contiguous()
    COUNTS["all_gather"] += 1
    out = x.new_empty((x.shape[0], x.shape[1] * n, *x.shape[2:]))
    dist.all_gather_into_tensor(out.view(n, -1), x.view(1, -1), group=group)
    return out


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the ranks of x [B, L, ...]; each rank keeps its 1/n of the B * L tokens in memory order, shaped
    [B, L / n, ...]."""
    return _reduce_scatter_tokens(x, group, async_op=False)[0]


def reduce_scatter_tokens_start(x: torch.Tensor, group):
    """reduce_scatter_tokens begun, not waited on: (out, work), as all_reduce_start."""
    return _reduce_scatter_tokens(x, group, async_op=True)


def _reduce_scatter_tokens(x: torch.Tensor, group, async_op: bool):
    n = world(group)
    if n == 1:
        return x, None
    if x.shape[1] % n:
        raise ValueError(f"reduce_scatter: sequence length {x.shape[1]} not divisible by {n} ranks")
    x = x.contiguous()
    COUNTS["reduce_scatter"] += 1
    out = x.new_empty((x.shape[0], x.shape[1] // n, *x.shape[2:]))
    return out, dist.reduce_scatter_tensor(out.view(1, -1), x.view(n, -1), group=group, async_op=async_op)


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
