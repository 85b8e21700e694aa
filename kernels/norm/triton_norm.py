"""Triton RMS norms: grouped gated RMSNorm (rmsnorm is its G=1, no-gate case) and fused residual-add + RMSNorm.

Statistics in fp32. Forward: one program per (row, group). Backward: one program per (block of rows, group),
looping over its rows in [ROWS, BLOCK] tiles (tiles picked by _gated_bwd_tiles / _add_bwd_tiles, swept by
benchmarks/norm_tiles.py); the weight gradient is summed per program into a [programs, D] fp32 buffer and reduced
by torch afterwards, so there are no atomics and the result is deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tcumsum, tsigmoid, tsum  # noqa: F401
from ..common.out import out_or_empty


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
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _sum2(a, b, axis: tl.constexpr):
    """(sum(a), sum(b)) along axis in one reduction (one shared-memory round trip for both)."""
    return tl.reduce((a, b), axis, _add2)


@triton.jit
def _gated_bwd_load(DOUT, X, Z, rows, cols, mask, stride_do, stride_x, stride_z, HAS_Z: tl.constexpr,
                    EVICT: tl.constexpr):
    """One [ROWS, BLOCK] tile of dout, x, z in their own dtypes (z is x when HAS_Z is off)."""
    r64 = rows.to(tl.int64)[:, None]
    do = tl.load(DOUT + r64 * stride_do + cols, mask=mask, other=0.0, eviction_policy=EVICT)
    x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0, eviction_policy=EVICT)
    z = x
    if HAS_Z:
        z = tl.load(Z + r64 * stride_z + cols, mask=mask, other=0.0, eviction_policy=EVICT)
    return do, x, z


@triton.jit
def _gated_bwd_parts(do, x, z, w, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """fp32 (x, do, u, dn, gate, silu'(z)): u is what is normalized, dn the gradient of the normalized u (gate and
    silu'(z) are x without z)."""
    x = x.to(tl.float32)
    do = do.to(tl.float32)
    u = x
    gate = x
    dgate_dz = x
    dn = do * w
    if HAS_Z:
        z = z.to(tl.float32)
        sz = tsigmoid(z)
        gate = z * sz
        dgate_dz = sz * (1.0 + z * (1.0 - sz))
        if NORM_BEFORE_GATE:
            dn = dn * gate
        else:
            u = x * gate
    return x, do, u, dn, gate, dgate_dz


# Backward: each program walks its rows_per_prog rows (a multiple of ROWS) as [ROWS, BLOCK] tiles, statistics
# reduced per row (axis 1). sum(u * u) and sum(dn * u) are taken in one reduction (dot = rstd * sum(dn * u)), so a
# tile is load -> one reduction -> store. Rows past the program's end (the last tile) load zeros (n = dn = 0: they
# add nothing to dweight) and store nothing. Registers bound the rows an SM holds (~14 a thread per element live
# across the reduction, ~60 KB a 4096-column row), so the load latency is hidden by two options instead of a
# bigger tile: PREFETCH issues the next tile's loads before this tile's math (one more raw tile in registers),
# RELOAD reads the tile again (L1 / L2) after the reduction instead of keeping it live through it.
@triton.jit
def _gated_bwd_kernel(
    DOUT, X, Z, W, DX, DZ, DW_PART, SS, DOT, M, D, DG, N, eps, rows_per_prog, stride_do, stride_x, stride_z,
    stride_ss, stride_dot, stride_dz,
    HAS_Z: tl.constexpr, HAS_W: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, MODE: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr, RELOAD: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = (g * DG + offs)[None, :]
    cmask = (offs < DG)[None, :]
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.full([1, BLOCK], 1.0, tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    r0 = pid * rows_per_prog
    r_end = tl.minimum(r0 + rows_per_prog, M)
    # first reads: keep the lines for the second (RELOAD)
    EVICT1: tl.constexpr = "evict_last" if RELOAD and MODE != 1 else ""
    if PREFETCH:
        rows_n = r0 + tl.arange(0, ROWS)
        do_n, x_n, z_n = _gated_bwd_load(DOUT, X, Z, rows_n, cols, (rows_n < r_end)[:, None] & cmask, stride_do,
                                         stride_x, stride_z, HAS_Z, EVICT1)
    for rs in range(r0, r_end, ROWS):
        rows = rs + tl.arange(0, ROWS)
        rmask = rows < r_end
        mask = rmask[:, None] & cmask
        if PREFETCH:
            do, x, z = do_n, x_n, z_n
            rows_n = rows + ROWS
            do_n, x_n, z_n = _gated_bwd_load(DOUT, X, Z, rows_n, cols, (rows_n < r_end)[:, None] & cmask,
                                             stride_do, stride_x, stride_z, HAS_Z, EVICT1)
        else:
            do, x, z = _gated_bwd_load(DOUT, X, Z, rows, cols, mask, stride_do, stride_x, stride_z, HAS_Z, EVICT1)
        x, do, u, dn, gate, dgate_dz = _gated_bwd_parts(do, x, z, w, HAS_Z, NORM_BEFORE_GATE)
        r64 = rows.to(tl.int64)
        if MODE == 0:
            ss, dnu = _sum2(u * u, dn * u, 1)
        else:
            ss = tl.load(SS + r64 * stride_ss + g, mask=rmask, other=1.0)
            if MODE == 1:
                dnu = tsum(dn * u, axis=1)
        rstd = 1.0 / tl.sqrt(ss / N + eps)
        if MODE == 1:
            tl.store(DOT + r64 * stride_dot + g, rstd * dnu, mask=rmask)
        else:
            if MODE == 0:
                dot = rstd * dnu
            else:
                dot = tl.load(DOT + r64 * stride_dot + g, mask=rmask, other=0.0)
            if RELOAD:
                do, x, z = _gated_bwd_load(DOUT, X, Z, rows, cols, mask, stride_do, stride_x, stride_z, HAS_Z,
                                           "evict_first")
                x, do, u, dn, gate, dgate_dz = _gated_bwd_parts(do, x, z, w, HAS_Z, NORM_BEFORE_GATE)
            rstd2 = rstd[:, None]
            n = u * rstd2
            if HAS_Z and NORM_BEFORE_GATE:
                dw += tsum(do * n * gate, axis=0)
            else:
                dw += tsum(do * n, axis=0)
            du = rstd2 * (dn - n * (dot / N)[:, None])
            o64 = r64[:, None] * D + cols
            if HAS_Z:
                if NORM_BEFORE_GATE:
                    dx = du
                    dz = do * n * w * dgate_dz
                else:
                    dx = du * gate
                    dz = du * x * dgate_dz
                tl.store(DZ + r64[:, None] * stride_dz + cols, dz.to(DZ.dtype.element_ty), mask=mask)
            else:
                dx = du
            tl.store(DX + o64, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        if MODE != 1:
            tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw[None, :], mask=cmask)


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


def _sms(x):
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1


def _bwd_tiles_for(m, block, x, ngroups=1, narrow=True):
    """(ROWS, num_warps, programs, PREFETCH, RELOAD) of a backward norm kernel over rows of `block` (a power of 2)
    columns, ngroups programs a row block. From benchmarks/norm_tiles.py on an H100 (bf16, 4 x 2048 rows; gated
    4096 columns: 0.214 ms (the row-at-a-time kernel) -> 0.133, floor 0.112; add 2048: 0.146 -> 0.107, floor
    0.090): registers, not the tile, bound the rows an SM holds, so ROWS = 1 (ROWS 2 at these widths was slower
    or spilled), 4 columns a thread (32 warps at 4096), PREFETCH, and exactly one wave of programs (each
    persistent over its rows): ~64 registers a thread, so 32 // num_warps programs per SM. PREFETCH's raw tile
    only fits with 2-byte row inputs (narrow; fp32 x spills at 4096) and up to 4096 columns; at 8192 (8 columns
    a thread) RELOAD keeps it from spilling. Against the old kernel at 8192 rows on the H100, bf16: gated
    1536-4096 columns 30-39% faster (ngroups 8: 24-29%), 5120 / 8192 1-5%, fp32 4096 4%; add 1024-2560 15-35%,
    4096 8%, 768 even."""
    warps = max(1, min(32, block // 128))
    rows = max(1, min(16, 128 // block))
    per_sm = max(1, min(16, 32 // warps))
    nprog = max(1, min(m, per_sm * _sms(x) // ngroups))
    return rows, warps, nprog, narrow and block <= 4096, block > 4096


def _gated_bwd_tiles(m, dg, x, ngroups=1, narrow=True):
    """_gated_bwd_kernel's tile over rows of ngroups groups of dg columns (see _bwd_tiles_for)."""
    return _bwd_tiles_for(m, triton.next_power_of_2(dg), x, ngroups, narrow)


def _add_bwd_tiles(m, d, x):
    """_add_bwd_kernel's tile over rows of d columns (see _bwd_tiles_for; its fp32 rows fit PREFETCH)."""
    return _bwd_tiles_for(m, triton.next_power_of_2(d), x)


def _row_split(m, tiles):
    """(ROWS, num_warps, rows per program (a multiple of ROWS), programs, PREFETCH, RELOAD) from a tile (rows,
    warps, programs[, prefetch[, reload]]); programs shrinks so that none is empty."""
    rows, warps, nprog = (int(t) for t in tiles[:3])
    prefetch = bool(tiles[3]) if len(tiles) > 3 else False
    reload = bool(tiles[4]) if len(tiles) > 4 else False
    if rows < 1 or rows & (rows - 1) or warps < 1 or warps & (warps - 1) or nprog < 1:
        raise ValueError(f"norm backward tiles={tiles!r}: rows and warps must be powers of 2, programs >= 1")
    rows_per = -(-max(m, 1) // min(nprog, max(m, 1)))
    rows_per = -(-rows_per // rows) * rows
    return rows, warps, rows_per, -(-m // rows_per), prefetch, reload


def _warps(block):
    return max(1, min(16, block // 256))


def _gated_fwd(x, z, weight, ngroups, eps, norm_before_gate, mode, ss=None, group_size=None, out_dtype=None):
    shape = x.shape
    d = shape[-1]
    x2 = _strided_rows(x)
    z2 = _strided_rows(z) if z is not None else None
    m = x2.shape[0]
    dg = d // ngroups
    out = torch.empty(m, d, dtype=out_dtype or x.dtype, device=x.device) if mode != 1 else None
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


def gated_rmsnorm_fwd(x, z, weight, ngroups, eps, norm_before_gate, out_dtype=None):
    return _gated_fwd(x, z, weight, ngroups, eps, norm_before_gate, 0, out_dtype=out_dtype)


def gated_rmsnorm_sumsq(x, z, ngroups, norm_before_gate):
    """[..., ngroups] fp32: each row's per-group sum of squares of x * silu(z) (or x)."""
    return _gated_fwd(x, z, None, ngroups, 0.0, norm_before_gate, 1)


def gated_rmsnorm_apply(x, z, weight, sumsq, group_size, eps, norm_before_gate):
    return _gated_fwd(x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 2, sumsq, group_size)


def _gated_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate, mode, ss=None, dot=None, group_size=None,
               tiles=None, out_dz=None):
    """tiles: (ROWS, num_warps, programs[, PREFETCH[, RELOAD]]) for benchmarks/norm_tiles.py; None:
    _gated_bwd_tiles. out_dz: z-shaped, z's dtype, unit last stride, to write dz into (a column block of Mamba-2's
    in_proj gradient, grad_blocks.GradBlocks), else dz is allocated."""
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
        dz_out = out_or_empty(out_dz, z, "gated_rmsnorm_bwd out_dz") if z2 is not None else None
        dz = _strided_rows(dz_out) if dz_out is not None else None
        if dz is not None and dz.data_ptr() != dz_out.data_ptr():  # copied: the kernel takes a single row stride
            raise ValueError(f"gated_rmsnorm_bwd out_dz stride {dz_out.stride()}: its rows must collapse")
        if mode == 2:
            dot = _stats_rows(dot, ngroups)
    narrow = max(t.element_size() for t in (x2, do2, z2) if t is not None) <= 2
    rows, warps, rows_per, nprog, prefetch, reload = _row_split(m, tiles or _gated_bwd_tiles(m, dg, x2, ngroups,
                                                                                           narrow))
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
            dot.stride(0) if dot is not None else 0, dz.stride(0) if dz is not None else 0,
            HAS_Z=z is not None, HAS_W=weight is not None, NORM_BEFORE_GATE=bool(norm_before_gate), MODE=mode,
            BLOCK=block, ROWS=rows, PREFETCH=prefetch, RELOAD=reload, num_warps=warps,
        )
    if mode == 1:
        return dot.view(*shape[:-1], ngroups)
    dw = None
    if want_dw:
        dw = (dw_part[:nprog].sum(0) if m > 0 else torch.zeros(d, device=x.device)).to(weight.dtype)
    return dx.view(shape), dz_out, dw


def gated_rmsnorm_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate, out_dz=None):
    return _gated_bwd(dout, x, z, weight, ngroups, eps, norm_before_gate, 0, out_dz=out_dz)


def gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, group_size, eps, norm_before_gate):
    return _gated_bwd(dout, x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 1, sumsq, None, group_size)


def gated_rmsnorm_bwd_apply(dout, x, z, weight, sumsq, dot, group_size, eps, norm_before_gate, out_dz=None):
    return _gated_bwd(dout, x, z, weight, sumsq.shape[-1], eps, norm_before_gate, 2, sumsq, dot, group_size,
                      out_dz=out_dz)


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
def _add_bwd_load(DOUT, H, rows, cols, mask, D, EVICT: tl.constexpr):
    """One [ROWS, BLOCK] tile of h, dout in their own dtypes."""
    offs = rows.to(tl.int64)[:, None] * D + cols
    return (tl.load(H + offs, mask=mask, other=0.0, eviction_policy=EVICT),
            tl.load(DOUT + offs, mask=mask, other=0.0, eviction_policy=EVICT))


# As _gated_bwd_kernel: [ROWS, BLOCK] tiles, sum(h * h) and sum(dn * h) in one reduction, PREFETCH / RELOAD.
# dres_in is read with the first reads (with the second under RELOAD): it is only added after the reduction.
@triton.jit
def _add_bwd_kernel(DOUT, DRES_IN, H, W, DX, DRES, DW_PART, M, D, eps, rows_per_prog,
                    HAS_DRES_IN: tl.constexpr, HAS_W: tl.constexpr, WRITE_DRES: tl.constexpr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, PREFETCH: tl.constexpr, RELOAD: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    cmask = cols < D
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        w = tl.full([1, BLOCK], 1.0, tl.float32)
    dw = tl.full([BLOCK], 0.0, tl.float32)
    r0 = pid * rows_per_prog
    r_end = tl.minimum(r0 + rows_per_prog, M)
    EVICT1: tl.constexpr = "evict_last" if RELOAD else ""
    if PREFETCH:
        rows_n = r0 + tl.arange(0, ROWS)
        h_n, do_n = _add_bwd_load(DOUT, H, rows_n, cols, (rows_n < r_end)[:, None] & cmask, D, EVICT1)
    for rs in range(r0, r_end, ROWS):
        rows = rs + tl.arange(0, ROWS)
        mask = (rows < r_end)[:, None] & cmask
        offs = rows.to(tl.int64)[:, None] * D + cols
        if PREFETCH:
            h, do = h_n, do_n
            rows_n = rows + ROWS
            h_n, do_n = _add_bwd_load(DOUT, H, rows_n, cols, (rows_n < r_end)[:, None] & cmask, D, EVICT1)
        else:
            h, do = _add_bwd_load(DOUT, H, rows, cols, mask, D, EVICT1)
        if HAS_DRES_IN and not RELOAD:
            dr = tl.load(DRES_IN + offs, mask=mask, other=0.0)
        h = h.to(tl.float32)
        do = do.to(tl.float32)
        dn = do * w
        ss, dnh = _sum2(h * h, dn * h, 1)
        rstd = 1.0 / tl.sqrt(ss / D + eps)
        if RELOAD:
            h, do = _add_bwd_load(DOUT, H, rows, cols, mask, D, "evict_first")
            h = h.to(tl.float32)
            do = do.to(tl.float32)
            dn = do * w
            if HAS_DRES_IN:
                dr = tl.load(DRES_IN + offs, mask=mask, other=0.0)
        rstd2 = rstd[:, None]
        n = h * rstd2
        dw += tsum(do * n, axis=0)
        dh = rstd2 * (dn - n * (rstd * dnh / D)[:, None])
        if HAS_DRES_IN:
            dh += dr.to(tl.float32)
        tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=mask)
        if WRITE_DRES:
            tl.store(DRES + offs, dh.to(DRES.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw[None, :], mask=cmask)


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


def add_rmsnorm_bwd(dout, dres_in, new_res, weight, eps, x_dtype, res_dtype, tiles=None):
    """Gradients (dx, dresidual, dweight) given dout (grad of the normed output) and dres_in (grad of the new
    residual, may be None or zeros). tiles: (ROWS, num_warps, programs[, PREFETCH[, RELOAD]]) for
    benchmarks/norm_tiles.py; None: _add_bwd_tiles."""
    shape = new_res.shape
    d = shape[-1]
    h2 = _rows(new_res)
    do2 = _rows(dout)
    dr2 = _rows(dres_in) if dres_in is not None else None
    m = h2.shape[0]
    dx = torch.empty(h2.shape, dtype=x_dtype, device=h2.device)
    write_dres = res_dtype is not None and res_dtype != x_dtype
    dres = torch.empty(h2.shape, dtype=res_dtype, device=h2.device) if write_dres else None
    rows, warps, rows_per, nprog, prefetch, reload = _row_split(m, tiles or _add_bwd_tiles(m, d, h2))
    dw_part = torch.empty(max(nprog, 1), d, dtype=torch.float32, device=h2.device) if weight is not None else None
    if m > 0:
        block = triton.next_power_of_2(d)
        _add_bwd_kernel[(nprog,)](
            do2, dr2 if dr2 is not None else do2, h2, weight if weight is not None else h2, dx,
            dres if dres is not None else dx, dw_part if dw_part is not None else dx, m, d, float(eps), rows_per,
            HAS_DRES_IN=dr2 is not None, HAS_W=weight is not None, WRITE_DRES=write_dres, BLOCK=block, ROWS=rows,
            PREFETCH=prefetch, RELOAD=reload, num_warps=warps,
        )
    dw = None
    if weight is not None:
        dw = (dw_part[:nprog].sum(0) if m > 0 else torch.zeros(d, device=h2.device)).to(weight.dtype)
    dresidual = None
    if res_dtype is not None:
        dresidual = (dres if write_dres else dx.clone()).view(shape)
    return dx.view(shape), dresidual, dw
