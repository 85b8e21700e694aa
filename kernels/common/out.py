"""Output buffers of the Triton wrappers: a caller's block to write into, or a fresh tensor."""
from __future__ import annotations

import torch


def out_or_empty(out: torch.Tensor | None, like: torch.Tensor, what: str) -> torch.Tensor:
    """`out` when given (a block of the caller's buffer, e.g. of Mamba-2's in_proj gradient, grad_blocks.GradBlocks: like's
    shape, dtype and device, unit last stride, any row strides), else a fresh contiguous tensor shaped like
    `like`. The kernel writing it must take its row strides."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(f"{what} {tuple(out.shape)} {out.dtype} stride {out.stride()}: expected {tuple(like.shape)} "
                         f"{like.dtype} on {like.device}, unit last stride")
    return out
