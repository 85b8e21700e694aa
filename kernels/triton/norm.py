"""Triton RMS norms: grouped gated RMSNorm (rmsnorm is its G=1, no-gate case) and fused residual-add + RMSNorm.

Statistics in fp32. Forward: one program per (row, group). Backward: one program per (block of rows, group),
looping over its rows; the weight gradient is summed per program into a [programs, D] fp32 buffer and reduced
by torch afterwards, so there are no atomics and the result is deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._lang import tcumsum, tsigmoid, tsum  # noqa: F401


@triton.jit
def _silu_parts(z):
    s = tsigmoid(z)
    return z * s, s * (1.0 + z * (1.0 - s))  # silu(z), silu'(z)


# MODE (forward): 0 normalize with the row's own statistics; 1 only write each (row, group)'s sum of squares to SS;
# 2 normalize with the sums of squares read from SS. MODE (backward): 0 the gradients, statistics recomputed;
# 1 only write each (row, group)'s sum of dn * n to DOT (statistics from SS); 2 the gradients with SS and DOT
# given. Modes 1 and 2 are the stages of a norm whose group's channels are spread over devices (the caller
# sums SS and DOT over them between the stages); N is then the whole group's width, DG this device's part.
# X, Z, DOUT rows may be strided (the last dim contiguous): the Mamba-2 gate z is a slice of in_proj's output.
@triton.jit
def _gated_fwd_kernel(
    X, Z, W, OUT, SS, M, D, DG, N, eps, stride_x, stride_z, stride_ss,
    HAS_Z: tl.constexpr, HAS_W: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * DG + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < DG
    r64 = row.to(tl.int64)
    x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(Z + r64 * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        gate = z * tsigmoid(z)
        if not NORM_BEFORE_GATE:
            x = x * gate
    if MODE == 1:
        tl.store(SS + r64 * stride_ss + g, tsum(x * x, axis=0))
    else:
        if MODE == 0:
            ss = tsum(x * x, axis=0)
        else:
            ss = tl.load(SS + r64 * stride_ss + g)
        rstd = 1.0 / tl.sqrt(ss / N + eps)
        out = x * rstd
        if HAS_W:
            out = out * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            if NORM_BEFORE_GATE:
                out = out * gate
        tl.store(OUT + r64 * D + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    DOUT, X, Z, W, DX, DZ, DW_PART, SS, DOT, M, D, DG, N, eps, rows_per_prog, stride_do, stride_x, stride_z,
    stride_ss, stride_dot,
    HAS_Z: tl.constexpr, HAS_W: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    cols = g * DG + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < DG
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    r0 = pid * rows_per_prog
    r0_64 = r0.to(tl.int64)
    for r in range(r0, tl.minimum(r0 + rows_per_prog, M)):
        r64 = r0_64 + (r - r0)
        x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DOUT + r64 * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
        u = x
        if HAS_Z:
            z = tl.load(Z + r64 * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
            sz = tsigmoid(z)
            gate = z * sz
            dgate_dz = sz * (1.0 + z * (1.0 - sz))
            if not NORM_BEFORE_GATE:
                u = x * gate
        if MODE == 0:
            ss = tsum(u * u, axis=0)
        else:
            ss = tl.load(SS + r64 * stride_ss + g)
        rstd = 1.0 / tl.sqrt(ss / N + eps)
        n = u * rstd
        if HAS_Z and NORM_BEFORE_GATE:
            dn = do * w * gate
            dw += do * n * gate
        else:
            dn = do * w
            dw += do * n
        if MODE == 1:
            tl.store(DOT + r64 * stride_dot + g, tsum(dn * n, axis=0))
        else:
            if MODE == 0:
                dot = tsum(dn * n, axis=0)
            else:
                dot = tl.load(DOT + r64 * stride_dot + g)
            du = rstd * (dn - n * (dot / N))
            if HAS_Z:
                if NORM_BEFORE_GATE:
                    dx = du
                    dz = do * n * w * dgate_dz
                else:
                    dx = du * gate
                    dz = du * x * dgate_dz
                tl.store(DZ + r64 * D + cols, dz.to(DZ.dtype.element_ty), mask=mask)
            else:
                dx = du
            tl.store(DX + r64 * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        if MODE != 1:
            tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=mask)


def _rows(x):
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2


def _strided_rows(x):
    """x as [rows, d] with contiguous rows, a view when the leading dims collapse (a slice of the last dim
    does: the Mamba-2 z), else a copy."""
    d = x.shape[-1]
    if x.stride(-1) == 1:
        try:
            return x.view(-1, d)
        except RuntimeError:
            pass
    return x.reshape(-1, d).contiguous()


def _stats_rows(t, ngroups):
    """Per-(row, group) statistics [..., G] fp32 as [rows, G] with unit column stride (one column may be a
    slice of a wider buffer)."""
    t2 = t.reshape(-1, ngroups)
    if t2.dtype != torch.float32 or (ngroups > 1 and t2.stride(1) != 1):
        t2 = t2.float().contiguous()
    return t2


def _n_progs(m, x):
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        target = 4 * sms
    else:
        target = 4
    return max(1, min(m, target))


def _warps(block):
    return max(1, min(16, block // 256))


def _gated_fwd(x, z, weight, ngroups, eps, norm_before_gate, mode, ss=None, group_size=None):
    shape = x.shape
    d = shape[-1]
    x2 = _strided_rows(x)
    z2 = _strided_rows(z) if z is not None else None
    m = x2.shape[0]
    dg = d // ngroups
    out = torch.empty(m, d, dtype=x.dtype, device=x.device) if mode != 1 else None
    if mode == 1:
        ss = torch.empty(m, ngroups, dtype=torch.float32, device=x.device)
    elif mode == 2:
        ss = _stats_rows(ss, ngroups)
    if m > 0:
        block = triton.next_power_of_2(dg)
        _gated_fwd_kernel[(m, ngroups)](
            x2, z2 if z2 is not None else x2, weight if weight is not None else x2, out if out is not None else x2,
            ss if ss is not None else x2, m, d, dg, dg if group_size is None else group_size, float(eps),
            x2.stride(0), z2.stride(0) if z2 is not None else 0, ss.stride(0) if ss is not None else 0,
            HAS_Z=z is not None, HAS_W=weight is not None, NORM_BEFORE_GATE=bool(norm_before_gate), MODE=mode,
            BLOCK=block, num_warps=_warps(block),
        )
    if mode == 1:
        return ss.view(*shape[:-1], ngroups)
    return out.view(shape)


def gated_rmsnorm_fwd(x, z, weight, ngroups, eps, norm_before_gate):
    return _gated_fwd(x, z, weight, ngroups, eps, norm_before_gate, 0)


def gated_rmsnorm_sumsq(x, z, ngroups, norm_before_gate):
    """[..., ngroups] fp32: each row's per-group sum of squares of x * silu(z) (or x)."""
    return _gated_fwd(x, z, None, ngroups, 0.0, norm_before_gate, 1)


def gated_rmsnorm_apply(x, z, weight, sumsq, group_size, eps, norm_before_gate):
    return _gated_fwd(x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 2, sumsq, group_size)


def _gated_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate, mode, ss=None, dot=None, group_size=None):
    shape = x.shape
    d = shape[-1]
    x2 = _strided_rows(x)
    z2 = _strided_rows(z) if z is not None else None
    do2 = _strided_rows(dout)
    m = x2.shape[0]
    dg = d // ngroups
    if mode != 0:
        ss = _stats_rows(ss, ngroups)
    if mode == 1:
        dot = torch.empty(m, ngroups, dtype=torch.float32, device=x.device)
        dx = dz = None
    else:
        dx = torch.empty(m, d, dtype=x.dtype, device=x.device)
        dz = torch.empty(m, d, dtype=z.dtype, device=z.device) if z2 is not None else None
        if mode == 2:
            dot = _stats_rows(dot, ngroups)
    nprog = _n_progs(m, x2)
    rows_per = -(-m // nprog) if m else 1
    nprog = -(-m // rows_per) if m else 0
    want_dw = weight is not None and mode != 1
    dw_part = torch.empty(max(nprog, 1), d, dtype=torch.float32, device=x.device) if want_dw else None
    if m > 0:
        block = triton.next_power_of_2(dg)
        _gated_bwd_kernel[(nprog, ngroups)](
            do2, x2, z2 if z2 is not None else x2, weight if weight is not None else x2,
            dx if dx is not None else x2, dz if dz is not None else x2, dw_part if dw_part is not None else x2,
            ss if ss is not None else x2, dot if dot is not None else x2, m, d, dg,
            dg if group_size is None else group_size, float(eps), rows_per, do2.stride(0), x2.stride(0),
            z2.stride(0) if z2 is not None else 0, ss.stride(0) if ss is not None else 0,
            dot.stride(0) if dot is not None else 0,
            HAS_Z=z is not None, HAS_W=weight is not None, NORM_BEFORE_GATE=bool(norm_before_gate), MODE=mode,
            BLOCK=block, num_warps=_warps(block),
        )
    if mode == 1:
        return dot.view(*shape[:-1], ngroups)
    dw = None
    if want_dw:
        dw = (dw_part[:nprog].sum(0) if m > 0 else torch.zeros(d, device=x.device)).to(weight.dtype)
    return dx.view(shape), (dz.view(z.shape) if dz is not None else None), dw


def gated_rmsnorm_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate):
    return _gated_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate, 0)


def gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, group_size, eps, norm_before_gate):
    return _gated_bwd(dout, x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 1, sumsq, None, group_size)


def gated_rmsnorm_bwd_apply(dout, x, z, weight, sumsq, dot, group_size, eps, norm_before_gate):
    return _gated_bwd(dout, x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 2, sumsq, dot, group_size)


# --------------------------------------------------------------------------------------------------------
# fused residual add + RMSNorm


@triton.jit
def _add_fwd_kernel(X, RES, W, OUT, NEWRES, D, eps, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    base = row.to(tl.int64) * D
    h = tl.load(X + base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(RES + base + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(NEWRES + base + cols, h.to(NEWRES.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tsum(h * h, axis=0) / D + eps)
    out = h * rstd
    if HAS_W:
        out = out * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + base + cols, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _add_bwd_kernel(DOUT, DRES_IN, H, W, DX, DRES, DW_PART, M, D, eps, rows_per_prog,
                    HAS_DRES_IN: tl.constexpr, HAS_W: tl.constexpr, WRITE_DRES: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK], 1.0, tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    r0 = pid * rows_per_prog
    base0 = r0.to(tl.int64) * D
    for r in range(r0, tl.minimum(r0 + rows_per_prog, M)):
        base = base0 + (r - r0) * D
        h = tl.load(H + base + cols, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DOUT + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tsum(h * h, axis=0) / D + eps)
        n = h * rstd
        dn = do * w
        dw += do * n
        dh = rstd * (dn - n * (tsum(dn * n, axis=0) / D))
        if HAS_DRES_IN:
            dh += tl.load(DRES_IN + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + base + cols, dh.to(DX.dtype.element_ty), mask=mask)
        if WRITE_DRES:
            tl.store(DRES + base + cols, dh.to(DRES.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=mask)


def add_rmsnorm_fwd(x, residual, weight, eps):
    shape = x.shape
    d = shape[-1]
    cdt = torch.promote_types(x.dtype, torch.float32)
    if residual is not None:
        cdt = torch.promote_types(cdt, residual.dtype)
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    m = x2.shape[0]
    out = torch.empty_like(x2)
    newres = torch.empty(x2.shape, dtype=cdt, device=x.device)
    if m > 0:
        block = triton.next_power_of_2(d)
        _add_fwd_kernel[(m,)](x2, r2 if r2 is not None else x2, weight if weight is not None else x2, out, newres,
                              d, float(eps), HAS_RES=residual is not None, HAS_W=weight is not None, BLOCK=block,
                              num_warps=_warps(block))
    return out.view(shape), newres.view(shape)


def add_rmsnorm_bwd(dout, dres_in, new_res, weight, eps, x_dtype, res_dtype):
    """Gradients (dx, dresidual, dweight) given dout (grad of the normed output) and dres_in (grad of the new
    residual, may be None or zeros)."""
    shape = new_res.shape
    d = shape[-1]
    h2 = _rows(new_res)
    do2 = _rows(dout)
    dr2 = _rows(dres_in) if dres_in is not None else None
    m = h2.shape[0]
    dx = torch.empty(h2.shape, dtype=x_dtype, device=h2.device)
    write_dres = res_dtype is not None and res_dtype != x_dtype
    dres = torch.empty(h2.shape, dtype=res_dtype, device=h2.device) if write_dres else None
    nprog = _n_progs(m, h2)
    rows_per = -(-m // nprog) if m else 1
    nprog = -(-m // rows_per) if m else 0
    dw_part = torch.empty(max(nprog, 1), d, dtype=torch.float32, device=h2.device) if weight is not None else None
    if m > 0:
        block = triton.next_power_of_2(d)
        _add_bwd_kernel[(nprog,)](
            do2, dr2 if dr2 is not None else do2, h2, weight if weight is not None else h2, dx,
            dres if dres is not None else dx, dw_part if dw_part is not None else dx, m, d, float(eps), rows_per,
            HAS_DRES_IN=dr2 is not None, HAS_W=weight is not None, WRITE_DRES=write_dres, BLOCK=block,
            num_warps=_warps(block),
        )
    dw = None
    if weight is not None:
        dw = (dw_part[:nprog].sum(0) if m > 0 else torch.zeros(d, device=h2.device)).to(weight.dtype)
    dresidual = None
    if res_dtype is not None:
        dresidual = (dres if write_dres else dx.clone()).view(shape)
    return dx.view(shape), dresidual, dw
