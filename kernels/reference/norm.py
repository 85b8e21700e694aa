"""Pure-PyTorch reference RMS norms.

All statistics are taken in fp32 (fp64 for fp64 inputs): a bf16 sum of squares over thousands of channels
loses most of its mantissa. Outputs come back in x.dtype; the residual stream of add_rmsnorm stays fp32 so
that small per-layer updates are not rounded away across many layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rmsnorm", "gated_rmsnorm", "add_rmsnorm"]


def _compute_dtype(*ts) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(x, weight, eps=1e-5):
    """x / rms(x) * weight over the last dim. weight may be None (no affine)."""
    cdt = _compute_dtype(x)
    out = _rms(x.to(cdt), eps)
    if weight is not None:
        out = out * weight.to(cdt)
    return out.to(x.dtype)


def gated_rmsnorm(x, z, weight, ngroups=1, eps=1e-5, norm_before_gate=False):
    """Grouped RMS norm with a SiLU gate, as at the end of the Mamba-2 mixer. x, z: [..., D].

    The last dim is split into `ngroups` contiguous groups of D/ngroups, each normalized on its own. Per-group
    statistics are what make the norm tensor-parallel without communication (each TP rank owns whole
    groups), and match a model trained with the same G at any TP degree.
    norm_before_gate=False: rmsnorm_g(x * silu(z)) * weight ; True: rmsnorm_g(x) * weight * silu(z).
    z may be None (plain grouped rmsnorm).
    """
    d = x.shape[-1]
    if d % ngroups != 0:
        raise ValueError(f"gated_rmsnorm: dim {d} not divisible by ngroups {ngroups}")
    cdt = _compute_dtype(x)
    xf = x.to(cdt)
    gate = F.silu(z.to(cdt)) if z is not None else None
    if gate is not None and not norm_before_gate:
        xf = xf * gate
    out = _rms(xf.unflatten(-1, (ngroups, d // ngroups)), eps).flatten(-2)
    if weight is not None:
        out = out * weight.to(cdt)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def add_rmsnorm(x, residual, weight, eps=1e-5):
    """Pre-norm block entry: new_residual = residual + x (fp32; residual None means 0),
    normed = rmsnorm(new_residual) * weight in x.dtype. Returns (normed, new_residual)."""
    cdt = _compute_dtype(x, residual)
    new_residual = x.to(cdt) if residual is None else residual.to(cdt) + x.to(cdt)
    out = _rms(new_residual, eps)
    if weight is not None:
        out = out * weight.to(cdt)
    return out.to(x.dtype), new_residual
