"""Triton decode-step kernel: one token of the SSD recurrence, one launch (the conv's is in
kernels/conv1d/triton_conv.py).

Backward of this op (rarely needed: decoding runs under no_grad) goes through the reference (ssd/op.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tsigmoid, tsoftplus, tsum


@triton.jit
def _ssd_step_kernel(STATE, X, DT, A, Bp, Cp, Dp, Z, DT_BIAS, Y, NEW, H, G, dt_lo, dt_hi,
                     sxb, sxh, sxp, sdb, sdh, sbb, sbg, sbn, szb, szh, szp,
                     P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BP + tl.arange(0, BP)
    n = tl.arange(0, BN)
    mp = p < P
    mn = n < N
    g = h // (H // G)
    dt = tl.load(DT + b * sdb + h * sdh).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(DT_BIAS + h).to(tl.float32)
    if SOFTPLUS:
        dt = tsoftplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    decay = tl.exp(dt * tl.load(A + h).to(tl.float32))
    x = tl.load(X + b * sxb + h * sxh + p * sxp, mask=mp, other=0.0).to(tl.float32)
    bv = tl.load(Bp + b * sbb + g * sbg + n * sbn, mask=mn, other=0.0).to(tl.float32)
    cv = tl.load(Cp + b * sbb + g * sbg + n * sbn, mask=mn, other=0.0).to(tl.float32)
    off = ((b * H + h) * P + p[:, None]) * N + n[None, :]
    m = mp[:, None] & mn[None, :]
    s = tl.load(STATE + off, mask=m, other=0.0).to(tl.float32)
    s = s * decay + (dt * x)[:, None] * bv[None, :]
    tl.store(NEW + off, s, mask=m)
    y = tsum(s * cv[None, :], 1)
    if HAS_D:
        if D_PER_CHANNEL:
            y += x * tl.load(Dp + h * P + p, mask=mp, other=0.0).to(tl.float32)
        else:
            y += x * tl.load(Dp + h).to(tl.float32)
    if HAS_Z:
        zv = tl.load(Z + b * szb + h * szh + p * szp, mask=mp, other=0.0).to(tl.float32)
        y = y * zv * tsigmoid(zv)
    tl.store(Y + (b * H + h) * P + p, y.to(Y.dtype.element_ty), mask=mp)


def ssd_step_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    bsz, nheads, hdim = x.shape
    ngroups, dstate = B.shape[1:]
    state = state.contiguous()
    y = torch.empty(bsz, nheads, hdim, dtype=x.dtype, device=x.device)
    new = torch.empty(bsz, nheads, hdim, dstate, dtype=torch.float32, device=x.device)
    BN = triton.next_power_of_2(dstate)
    BP = max(1, min(triton.next_power_of_2(hdim), 4096 // BN))
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)
    if C.stride() != B.stride():
        C = C.contiguous()
        B = B.contiguous()
    Dc = D.contiguous() if D is not None else None
    _ssd_step_kernel[(bsz, nheads, triton.cdiv(hdim, BP))](
        state, x, dt, A, B, C, Dc if Dc is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else dt, y, new, nheads, ngroups, lo, hi,
        *x.stride(), *dt.stride(), *B.stride(), *(z.stride() if z is not None else (0, 0, 0)),
        P=hdim, N=dstate, BP=BP, BN=BN, HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2,
        HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_LIMIT=dt_limit is not None,
        num_warps=4,
    )
    return y, new
