"""The CP state read-out, out = y + w * (C_t . h) (parallel/cp.py: a rank's SSD output plus the state its slice
inherits, read by the tokens of the slice's first document), as one autograd op: Triton kernels
(triton_readout.py) on the Triton path, else the torch products below.

    y [B, L, H, P]   C [B, L, G, N]   h [B, H, P, N] fp32   w [B, L, H] fp32   ->   out like y

The backward returns dout itself for y, and dC, dh and dw (sum_p dout * (C . h)); the caller's w = exp(...)
takes dw through autograd ([B, L, H] only).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import pick, triton_module, use_triton

triton_readout = triton_module("megassm.kernels.mamba2_ssd.triton_readout")  # readout_fwd / _bwd, supported


def readout(C: Tensor, h: Tensor, mm: torch.dtype) -> Tensor:
    """C_t . h per head, [B, L, H, P] in fp32 at least: head hh reads B/C group hh // (H/G). The product runs
    in `mm`."""
    bsz, L, G, N = C.shape
    H, P = h.shape[1], h.shape[2]
    Cg = C.to(mm).permute(0, 2, 1, 3)  # [B, G, L, N]
    hg = h.to(mm).reshape(bsz, G, (H // G) * P, N).transpose(-1, -2)  # [B, G, N, rep*P]
    out = torch.matmul(Cg, hg).to(torch.promote_types(mm, torch.float32))  # [B, G, L, rep*P]
    return out.view(bsz, G, L, H // G, P).permute(0, 2, 1, 3, 4).reshape(bsz, L, H, P)


def _mm(C: Tensor) -> torch.dtype:
    return C.dtype if C.dtype in (torch.bfloat16, torch.float16) else torch.promote_types(C.dtype, torch.float32)


def _triton(y: Tensor, C: Tensor) -> bool:
    return use_triton(y) and triton_readout().supported(y, C)


class StateReadoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, C, h, w):
        ctx.save_for_backward(C, h, w)
        ctx.tri = _triton(y, C) and pick(y)
        if ctx.tri:
            return triton_readout().readout_fwd(y, C, h, w)
        # torch: the product in C's dtype, scaled in fp32, rounded, added (y's dtype)
        return y + (readout(C, h, _mm(C)) * w[..., None]).to(y.dtype)

    @staticmethod
    def backward(ctx, dout):
        C, h, w = ctx.saved_tensors
        if ctx.tri:
            dC, dh, dw = triton_readout().readout_bwd(dout, C, h, w)
            return dout, dC, dh, dw
        mm = _mm(C)
        bsz, L, G, N = C.shape
        H, P = h.shape[1], h.shape[2]
        cdt = w.dtype
        dw = (dout.to(cdt) * readout(C, h, mm)).sum(-1)
        dg = (dout.to(cdt) * w[..., None]).to(mm).view(bsz, L, G, (H // G) * P).permute(0, 2, 1, 3)
        dh = torch.matmul(dg.transpose(-1, -2), C.to(mm).permute(0, 2, 1, 3)).reshape(bsz, H, P, N).to(h.dtype)
        hg = h.to(mm).reshape(bsz, G, (H // G) * P, N)
        dC = torch.matmul(dg, hg).permute(0, 2, 1, 3).to(C.dtype)
        return dout, dC, dh, dw


def state_readout_add(y: Tensor, C: Tensor, h: Tensor, w: Tensor) -> Tensor:
    """y + w[..., None] * (C_t . h) (module docstring), differentiable in all four."""
    return StateReadoutAdd.apply(y, C, h, w)
