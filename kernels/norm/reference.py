"""Pure-PyTorch reference RMS norms.

All statistics are taken in fp32 (fp64 for fp64 inputs): a bf16 sum of squares over thousands of channels
loses most of its mantissa. Outputs come back in x.dtype; the residual stream of add_rmsnorm stays fp32 so
that small per-layer updates are not rounded away across many layers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rmsnorm", "gated_rmsnorm", "add_rmsnorm", "gated_rmsnorm_sumsq", "gated_rmsnorm_apply",
           "gated_rmsnorm_bwd_dot", "gated_rmsnorm_bwd_apply"]


def _compute_dtype(*ts) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    return dt


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def rmsnorm(x, weight, eps=1e-5, out_dtype=None):
    """x / rms(x) * weight over the last dim. weight may be None (no affine). out_dtype: the output's dtype
    (default x.dtype), rounded once from the compute dtype."""
    cdt = _compute_dtype(x)
    out = _rms(x.to(cdt), eps)
    if weight is not None:
        out = out * weight.to(cdt)
    return out.to(x.dtype if out_dtype is None else out_dtype)


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


# --------------------------------------------------------------------------------------------------------
# gated_rmsnorm in stages, for groups whose channels are spread over several devices (tensor parallelism with
# fewer norm groups than ranks): each device holds a slice of every row's group, the caller sums the
# per-group statistics over the devices between the stages (parallel/tp.py). On one device,
# apply(sumsq(x, z)) with group_size = the group's width is gated_rmsnorm, and bwd_apply(bwd_dot(...)) its
# gradients. sumsq, dot: [..., G] in the compute dtype; group_size: the whole group's width (all devices).
def _gate_parts(x, z, norm_before_gate):
    """(u, gate, silu'(z)): u is what is normalized (x * silu(z), or x), all in the compute dtype."""
    cdt = _compute_dtype(x)
    u = x.to(cdt)
    if z is None:
        return u, None, None
    zf = z.to(cdt)
    s = torch.sigmoid(zf)
    gate = zf * s
    if not norm_before_gate:
        u = u * gate
    return u, gate, s * (1.0 + zf * (1.0 - s))


def _groups(t, ngroups):
    return t.unflatten(-1, (ngroups, t.shape[-1] // ngroups))


def gated_rmsnorm_sumsq(x, z, ngroups=1, norm_before_gate=False):
    """Per-group sums of squares of x * silu(z) (of x when norm_before_gate or z is None): [..., ngroups]."""
    u, _, _ = _gate_parts(x, z, norm_before_gate)
    return _groups(u, ngroups).pow(2).sum(-1)


def _normed(x, z, sumsq, group_size, eps, norm_before_gate):
    u, gate, dgate = _gate_parts(x, z, norm_before_gate)
    rstd = torch.rsqrt(sumsq.to(u.dtype) / group_size + eps)[..., None]
    return (_groups(u, sumsq.shape[-1]) * rstd).flatten(-2), rstd, u, gate, dgate


def gated_rmsnorm_apply(x, z, weight, sumsq, group_size, eps=1e-5, norm_before_gate=False):
    """gated_rmsnorm with the groups' sums of squares given (their mean: sumsq / group_size), in x.dtype."""
    n, _, _, gate, _ = _normed(x, z, sumsq, group_size, eps, norm_before_gate)
    out = n if weight is None else n * weight.to(n.dtype)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


def _dn(dout, n, weight, gate, norm_before_gate):
    dn = dout.to(n.dtype)
    if weight is not None:
        dn = dn * weight.to(n.dtype)
    if gate is not None and norm_before_gate:
        dn = dn * gate
    return dn


def gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, group_size, eps=1e-5, norm_before_gate=False):
    """The backward's per-group sums of dn * n (dn: the gradient reaching the normalized value n): [..., G]."""
    n, *_, gate, _ = _normed(x, z, sumsq, group_size, eps, norm_before_gate)
    dn = _dn(dout, n, weight, gate, norm_before_gate)
    return _groups(dn * n, sumsq.shape[-1]).sum(-1)


def gated_rmsnorm_bwd_apply(dout, x, z, weight, sumsq, dot, group_size, eps=1e-5, norm_before_gate=False):
    """(dx, dz, dweight) of gated_rmsnorm_apply given the groups' summed `dot` (gated_rmsnorm_bwd_dot summed
    like sumsq); dz None when z is None, dweight None when weight is None (this device's rows only)."""
    G = sumsq.shape[-1]
    n, rstd, u, gate, dgate = _normed(x, z, sumsq, group_size, eps, norm_before_gate)
    dn = _dn(dout, n, weight, gate, norm_before_gate)
    du = (rstd * (_groups(dn, G) - _groups(n, G) * (dot.to(n.dtype) / group_size)[..., None])).flatten(-2)
    dw = None
    if weight is not None:
        g = dout.to(n.dtype) * n
        if gate is not None and norm_before_gate:
            g = g * gate
        dw = g.reshape(-1, g.shape[-1]).sum(0).to(weight.dtype)
    if z is None:
        return du.to(x.dtype), None, dw
    if norm_before_gate:
        dx = du
        dz = dout.to(n.dtype) * n * dgate
        if weight is not None:
            dz = dz * weight.to(n.dtype)
    else:
        dx = du * gate
        dz = du * x.to(n.dtype) * dgate
    return dx.to(x.dtype), dz.to(z.dtype), dw


def add_rmsnorm(x, residual, weight, eps=1e-5):
    """Pre-norm block entry: new_residual = residual + x (fp32; residual None means 0),
    normed = rmsnorm(new_residual) * weight in x.dtype. Returns (normed, new_residual)."""
    cdt = _compute_dtype(x, residual)
    new_residual = x.to(cdt) if residual is None else residual.to(cdt) + x.to(cdt)
    out = _rms(new_residual, eps)
    if weight is not None:
        out = out * weight.to(cdt)
    return out.to(x.dtype), new_residual
