"""Average gradients over the data-parallel group after the backward: all-reduces over buckets of at most
BUCKET_BYTES per dtype. The DDP engine's path where torch DDP cannot run (pipeline stages, BPTT with several
windows per backward, CUDA-graph replays; parallel/engines.py), FSDP2's replicated parameters, and the
reference for the PP tests.

Bucketed rather than one flat buffer of every gradient: a stage of a 7B pipeline holds ~14 GB of fp32
gradients, and concatenating them all needed as much again for a moment (memory no estimate counted). A
gradient larger than a bucket is reduced in place, without a copy."""
from __future__ import annotations

import torch

from . import comm

__all__ = ["allreduce_grads", "BUCKET_BYTES"]

BUCKET_BYTES = 256 * 2 ** 20


@torch.no_grad()
def allreduce_grads(params, group, bucket_bytes: int = BUCKET_BYTES, average: bool = True) -> None:
    """Every gradient of `params` all-reduced over `group`: the mean (average) or the sum (CP's gradients)."""
    n = comm.world(group)
    if n == 1:
        return
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for gs in by_dtype.values():
        bucket, size = [], 0
        for g in gs:
            nbytes = g.numel() * g.element_size()
            if nbytes >= bucket_bytes and g.is_contiguous():
                comm.all_reduce(g, group)  # alone and in place
                if average:
                    g.div_(n)
                continue
            if bucket and size + nbytes > bucket_bytes:
                _reduce_bucket(bucket, group, n if average else 1)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            _reduce_bucket(bucket, group, n if average else 1)


def _reduce_bucket(gs: list[torch.Tensor], group, divide: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in gs])
    comm.all_reduce(flat, group)
    if divide > 1:
        flat.div_(divide)
    off = 0
    for g in gs:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
