"""Triton SwiGLU activation: h = silu(a) * b and its backward, each one pass over the elements.

Eager PyTorch runs silu, then the product (two kernels, and autograd keeps silu(a) for the backward) and three
kernels backward; here the forward reads a, b and writes h, the backward reads dh, a, b and writes da, db. Math
in fp32, one rounding to the output dtype (the PyTorch path rounds silu(a) too). a and b: the same shape; any
leading strides, contiguous along the flattened elements (non-contiguous inputs are copied first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tsigmoid

BLOCK = 2048


@triton.jit
def _swiglu_fwd_kernel(A, B, H, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(H + offs, (a * tsigmoid(a) * b).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(A, B, DH, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    s = tsigmoid(a)
    tl.store(DA + offs, (dh * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dh * a * s).to(DB.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _flat(a), _flat(b)
    h = torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    n = a.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, h, n, BLOCK=BLOCK, num_warps=8)
    return h


def swiglu_bwd(dh: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, dh = _flat(a), _flat(b), _flat(dh)
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    n = a.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](a, b, dh, da, db, n, BLOCK=BLOCK, num_warps=8)
    return da, db
