"""Triton selective scan (seed mixers `S` Mamba-1 and `L` Longhorn): forward, backward and the decode step.
Written from the math in reference/scan.py:

    a_t = exp(delta_t A) ("exp") or 1 - delta_t B_t^2 ("longhorn"), 0 where a document starts
    h_t = a_t h_{t-1} + b_t,   b_t = delta_t x_t B_t,   y_t = (C_t . h_t + D x_t) * silu(z_t)

One program owns a batch row and a block of BD channels (all N states of each: a [BD, BN] fp32 state in
registers) and walks the sequence in chunks of T tokens. Per chunk it builds the [BD, BN, T] tile of (a, b)
pairs from the [BD, T] tiles of x / delta and the [BN, T] tiles of B / C, folds the incoming state into the
first pair and runs one associative scan along T (the combine (a1, b1) o (a2, b2) = (a1 a2, b1 a2 + b2)); the
last column is the state handed to the next chunk. The (B, L, D, N) states never touch memory.

Backward, per program (row, a few channel blocks, looped so that the B/C gradient partials stay few):
  phase 1: the forward again, keeping only each chunk's incoming state (program-private scratch);
  phase 2: chunks in reverse: rebuild the chunk's states (h_{t-1} by a gather along T), then one reverse
      associative scan of dh_t = dy_t C_t + a_{t+1} dh_{t+1}, whose carry between chunks is a_t dh_t (the
      gradient of the state entering the chunk; d initial_state after chunk 0; d final_state starts it).
  Every gradient is then elementwise or a sum inside the tile: dx, ddelta (through softplus and the bias),
  dz here; dB, dC as per-program partials summed in torch; dA, dD, d delta_bias per row, summed in torch.
No atomics: results are deterministic run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tsigmoid, tsoftplus, tsum

_DECAY = {"exp": 0, "longhorn": 1}


@triton.jit
def _combine(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _chunk(X, DT, Bp, SEQ, A_v, bias_v, b, g, t, d, md, n, mn, L,
           sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, ssb, ssl,
           DECAY: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr):
    """One chunk's inputs: x, raw delta, delta [BD, T], B [BN, T], the pairs (a, b) [BD, BN, T] (a = 0 where a
    document starts, 1 past the end) and `live` [T]: the token exists and continues its predecessor's document."""
    mt = t < L
    m2 = md[:, None] & mt[None, :]
    x = tl.load(X + b * sxb + t[None, :] * sxl + d[:, None] * sxd, mask=m2, other=0.0).to(tl.float32)
    raw = tl.load(DT + b * sdb + t[None, :] * sdl + d[:, None] * sdd, mask=m2, other=0.0).to(tl.float32)
    dt = raw
    if HAS_BIAS:
        dt = dt + bias_v[:, None]
    if SOFTPLUS:
        dt = tsoftplus(dt)
    dt = tl.where(m2, dt, 0.0)
    Bv = tl.load(Bp + b * sbb + g * sbg + t[None, :] * sbl + n[:, None] * sbn, mask=mn[:, None] & mt[None, :],
                 other=0.0).to(tl.float32)
    if DECAY == 0:
        a = tl.exp(dt[:, None, :] * A_v[:, :, None])
    else:
        a = 1.0 - dt[:, None, :] * (Bv * Bv)[None, :, :]
    live = mt
    if HAS_SEQ:
        s_t = tl.load(SEQ + b * ssb + t * ssl, mask=mt, other=0)
        s_p = tl.load(SEQ + b * ssb + (t - 1) * ssl, mask=mt & (t > 0), other=0)
        live = mt & ((t == 0) | (s_t == s_p))
    a = tl.where(live[None, None, :], a, tl.where(mt, 0.0, 1.0)[None, None, :])
    u = (dt * x)[:, None, :] * Bv[None, :, :]
    return x, raw, dt, Bv, a, u, live


@triton.jit
def _scan_chunk(a, u, h, tt, T: tl.constexpr):
    """States of the chunk [BD, BN, T] given the incoming state h [BD, BN]."""
    u = tl.where((tt == 0)[None, None, :], u + a * h[:, :, None], u)
    _, hs = tl.associative_scan((a, u), 2, _combine)
    return hs


@triton.jit
def _scan_fwd_kernel(X, DT, A, Bp, Cp, Dp, Z, DTB, INIT, SEQ, Y, FIN, L, Dm, cg, n_dblk,
                     sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, scb, scl, scg, scn, szb, szl, szd, ssb, ssl,
                     N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, T: tl.constexpr, DECAY: tl.constexpr,
                     SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, WANT_FIN: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    g = pid // n_dblk
    dl = (pid % n_dblk) * BD + tl.arange(0, BD)
    md = dl < cg
    d = g * cg + dl
    n = tl.arange(0, BN)
    mn = n < N
    tt = tl.arange(0, T)
    mdn = md[:, None] & mn[None, :]
    A_v = tl.load(A + d[:, None] * N + n[None, :], mask=mdn, other=0.0).to(tl.float32) if DECAY == 0 else None
    bias_v = tl.load(DTB + d, mask=md, other=0.0).to(tl.float32) if HAS_BIAS else None
    D_v = tl.load(Dp + d, mask=md, other=0.0).to(tl.float32) if HAS_D else None
    st = (b * Dm + d[:, None]) * N + n[None, :]
    if HAS_INIT:
        h = tl.load(INIT + st, mask=mdn, other=0.0).to(tl.float32)
    else:
        h = tl.full([BD, BN], 0.0, tl.float32)
    for c in range(0, (L + T - 1) // T):  # not tl.cdiv: the CPU interpreter can lose its patch of it
        t = c * T + tt
        x, raw, dt, Bv, a, u, live = _chunk(X, DT, Bp, SEQ, A_v, bias_v, b, g, t, d, md, n, mn, L,
                                            sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, ssb, ssl,
                                            DECAY, SOFTPLUS, HAS_BIAS, HAS_SEQ)
        hs = _scan_chunk(a, u, h, tt, T)
        mt = t < L
        m2 = md[:, None] & mt[None, :]
        Cv = tl.load(Cp + b * scb + g * scg + t[None, :] * scl + n[:, None] * scn, mask=mn[:, None] & mt[None, :],
                     other=0.0).to(tl.float32)
        y = tsum(hs * Cv[None, :, :], 1)
        if HAS_D:
            y += D_v[:, None] * x
        if HAS_Z:
            zv = tl.load(Z + b * szb + t[None, :] * szl + d[:, None] * szd, mask=m2, other=0.0).to(tl.float32)
            y = y * zv * tsigmoid(zv)
        tl.store(Y + (b * L + t[None, :]) * Dm + d[:, None], y.to(Y.dtype.element_ty), mask=m2)
        h = tsum(tl.where((tt == T - 1)[None, None, :], hs, 0.0), 2)
    if WANT_FIN:
        tl.store(FIN + st, h, mask=mdn)


@triton.jit
def _scan_bwd_kernel(X, DT, A, Bp, Cp, Dp, Z, DTB, INIT, SEQ, DY, DFIN, CK,
                     DX, DDT, DZ, DBP, DCP, DA, DD, DDTB, DINIT,
                     L, Dm, cg, n_dblk, n_sub, n_pg, nchunks,
                     sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, scb, scl, scg, scn, szb, szl, szd, ssb, ssl,
                     syb, syl, syd,
                     N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, T: tl.constexpr, DECAY: tl.constexpr,
                     SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFIN: tl.constexpr, ACCUM: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    n_prog = tl.num_programs(1)
    g = pid // n_pg
    pj = pid % n_pg
    n = tl.arange(0, BN)
    mn = n < N
    tt = tl.arange(0, T)
    prev_i = tl.broadcast_to(tl.maximum(tt - 1, 0)[None, None, :], (BD, BN, T))
    next_i = tl.broadcast_to(tl.minimum(tt + 1, T - 1)[None, None, :], (BD, BN, T))
    first = (tt == 0)[None, None, :]
    last = (tt == T - 1)[None, None, :]
    ck_base = (b * n_prog + pid) * nchunks
    part_base = (b * n_prog + pid) * L
    for jj in range(n_sub):
        if ACCUM:
            tl.debug_barrier()  # the previous channel block's B/C partial stores, before this block adds to them
        dl = (pj * n_sub + jj) * BD + tl.arange(0, BD)
        md = dl < cg
        d = g * cg + dl
        mdn = md[:, None] & mn[None, :]
        A_v = tl.load(A + d[:, None] * N + n[None, :], mask=mdn, other=0.0).to(tl.float32) if DECAY == 0 else None
        bias_v = tl.load(DTB + d, mask=md, other=0.0).to(tl.float32) if HAS_BIAS else None
        D_v = tl.load(Dp + d, mask=md, other=0.0).to(tl.float32) if HAS_D else None
        st = (b * Dm + d[:, None]) * N + n[None, :]
        ck_off = tl.arange(0, BD)[:, None] * BN + n[None, :]
        # phase 1: the incoming state of every chunk
        if HAS_INIT:
            h = tl.load(INIT + st, mask=mdn, other=0.0).to(tl.float32)
        else:
            h = tl.full([BD, BN], 0.0, tl.float32)
        for c in range(0, nchunks):
            tl.store(CK + (ck_base + c) * (BD * BN) + ck_off, h)
            t = c * T + tt
            x, raw, dt, Bv, a, u, live = _chunk(X, DT, Bp, SEQ, A_v, bias_v, b, g, t, d, md, n, mn, L,
                                                sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, ssb, ssl,
                                                DECAY, SOFTPLUS, HAS_BIAS, HAS_SEQ)
            hs = _scan_chunk(a, u, h, tt, T)
            h = tsum(tl.where(last, hs, 0.0), 2)
        # phase 2 reads the scratch states with another thread layout than phase 1 stored them in: without a
        # barrier a short sequence (one chunk: the load follows the store at once) read stale memory on an H100
        tl.debug_barrier()
        # phase 2: chunks in reverse
        if HAS_DFIN:
            carry = tl.load(DFIN + st, mask=mdn, other=0.0).to(tl.float32)
        else:
            carry = tl.full([BD, BN], 0.0, tl.float32)
        dA_acc = tl.full([BD, BN], 0.0, tl.float32)
        dD_acc = tl.full([BD], 0.0, tl.float32)
        dbias_acc = tl.full([BD], 0.0, tl.float32)
        for cc in range(0, nchunks):
            c = nchunks - 1 - cc
            t = c * T + tt
            mt = t < L
            m2 = md[:, None] & mt[None, :]
            mnt = mn[:, None] & mt[None, :]
            h_in = tl.load(CK + (ck_base + c) * (BD * BN) + ck_off)
            x, raw, dt, Bv, a, u, live = _chunk(X, DT, Bp, SEQ, A_v, bias_v, b, g, t, d, md, n, mn, L,
                                                sxb, sxl, sxd, sdb, sdl, sdd, sbb, sbl, sbg, sbn, ssb, ssl,
                                                DECAY, SOFTPLUS, HAS_BIAS, HAS_SEQ)
            hs = _scan_chunk(a, u, h_in, tt, T)
            h_prev = tl.where(first, h_in[:, :, None], tl.gather(hs, prev_i, 2))
            h_prev = tl.where(live[None, None, :], h_prev, 0.0)  # no gradient into a where it was cut
            Cv = tl.load(Cp + b * scb + g * scg + t[None, :] * scl + n[:, None] * scn, mask=mnt,
                         other=0.0).to(tl.float32)
            dout = tl.load(DY + b * syb + t[None, :] * syl + d[:, None] * syd, mask=m2, other=0.0).to(tl.float32)
            if HAS_Z:
                y = tsum(hs * Cv[None, :, :], 1)
                if HAS_D:
                    y += D_v[:, None] * x
                zv = tl.load(Z + b * szb + t[None, :] * szl + d[:, None] * szd, mask=m2, other=0.0).to(tl.float32)
                sz = tsigmoid(zv)
                dy = dout * zv * sz
                dz = dout * y * sz * (1.0 + zv * (1.0 - sz))
                tl.store(DZ + (b * L + t[None, :]) * Dm + d[:, None], dz.to(DZ.dtype.element_ty), mask=m2)
            else:
                dy = dout
            # dh_t = dy_t C_t + a_{t+1} dh_{t+1}; the chunk's last token takes the carry from the next chunk
            gsrc = dy[:, None, :] * Cv[None, :, :]
            gsrc = tl.where(last, gsrc + carry[:, :, None], gsrc)
            alpha = tl.where(last, 0.0, tl.gather(a, next_i, 2))
            _, dh = tl.associative_scan((alpha, gsrc), 2, _combine, reverse=True)
            carry = tsum(tl.where(first, a * dh, 0.0), 2)
            q = dh * h_prev  # gradient of a_t
            dhB = tsum(dh * Bv[None, :, :], 1)  # [BD, T]
            ddt = dhB * x
            dx = dhB * dt
            dBp = tsum(dh * (dt * x)[:, None, :], 0)  # [BN, T]
            if DECAY == 0:
                qa = q * a
                ddt += tsum(qa * A_v[:, :, None], 1)
                dA_acc += tsum(qa * dt[:, None, :], 2)
            else:
                ddt -= tsum(q * (Bv * Bv)[None, :, :], 1)
                dBp -= 2.0 * Bv * tsum(q * dt[:, None, :], 0)
            if HAS_D:
                dx += dy * D_v[:, None]
                dD_acc += tsum(tl.where(m2, dy * x, 0.0), 1)
            dCp = tsum(dy[:, None, :] * hs, 0)
            if SOFTPLUS:
                pre = raw
                if HAS_BIAS:
                    pre = pre + bias_v[:, None]
                ddt = ddt * tsigmoid(pre)
            ddt = tl.where(m2, ddt, 0.0)
            if HAS_BIAS:
                dbias_acc += tsum(ddt, 1)
            tl.store(DX + (b * L + t[None, :]) * Dm + d[:, None], dx.to(DX.dtype.element_ty), mask=m2)
            tl.store(DDT + (b * L + t[None, :]) * Dm + d[:, None], ddt.to(DDT.dtype.element_ty), mask=m2)
            poff = (part_base + t[None, :]) * BN + n[:, None]
            if ACCUM:
                dBp += tl.load(DBP + poff, mask=mnt, other=0.0)
                dCp += tl.load(DCP + poff, mask=mnt, other=0.0)
            tl.store(DBP + poff, dBp, mask=mnt)
            tl.store(DCP + poff, dCp, mask=mnt)
        if HAS_INIT:
            tl.store(DINIT + st, carry, mask=mdn)
        if DECAY == 0:
            tl.store(DA + st, dA_acc, mask=mdn)
        if HAS_D:
            tl.store(DD + b * Dm + d, dD_acc, mask=md)
        if HAS_BIAS:
            tl.store(DDTB + b * Dm + d, dbias_acc, mask=md)


@triton.jit
def _scan_step_kernel(STATE, X, DT, A, Bp, Cp, Dp, Z, DTB, Y, NEW, Dm, cg,
                      sxb, sxd, sdb, sdd, sbb, sbg, sbn, scb, scg, scn, szb, szd,
                      N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DECAY: tl.constexpr,
                      SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < Dm
    n = tl.arange(0, BN)
    mn = n < N
    mdn = md[:, None] & mn[None, :]
    g = d // cg
    x = tl.load(X + b * sxb + d * sxd, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(DT + b * sdb + d * sdd, mask=md, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(DTB + d, mask=md, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = tsoftplus(dt)
    Bv = tl.load(Bp + b * sbb + g[:, None] * sbg + n[None, :] * sbn, mask=mdn, other=0.0).to(tl.float32)
    Cv = tl.load(Cp + b * scb + g[:, None] * scg + n[None, :] * scn, mask=mdn, other=0.0).to(tl.float32)
    if DECAY == 0:
        a = tl.exp(dt[:, None] * tl.load(A + d[:, None] * N + n[None, :], mask=mdn, other=0.0).to(tl.float32))
    else:
        a = 1.0 - dt[:, None] * Bv * Bv
    off = (b * Dm + d[:, None]) * N + n[None, :]
    s = tl.load(STATE + off, mask=mdn, other=0.0).to(tl.float32)
    s = a * s + (dt * x)[:, None] * Bv
    tl.store(NEW + off, s, mask=mdn)
    y = tsum(s * Cv, 1)
    if HAS_D:
        y += x * tl.load(Dp + d, mask=md, other=0.0).to(tl.float32)
    if HAS_Z:
        zv = tl.load(Z + b * szb + d * szd, mask=md, other=0.0).to(tl.float32)
        y = y * zv * tsigmoid(zv)
    tl.store(Y + b * Dm + d, y.to(Y.dtype.element_ty), mask=md)


# --------------------------------------------------------------------------------------------------------
# launchers


def _tiles(N: int, bwd: bool):
    """(BD, T, num_warps): about 2048 elements per [BD, BN, T] tile, 32 tokens per chunk, 4 warps, for both
    passes. From `benchmarks/seed_scan.py --only tiles` on an H100 (B 8, L 2048, D 4096, N 16; docs/benchmarks.md):
    the backward at 8 warps (the earlier choice) took 2.1x as long, its reductions across the channel axis
    crossing more warps; 4 channels x 32 tokens beat 8 x 16 in both passes."""
    BN = triton.next_power_of_2(max(N, 1))
    T = 32
    BD = max(2, min(64, 2048 // (BN * T)))
    return BD, T, 4


def _groups_view(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 4 else t.unsqueeze(2)


def selective_scan_fwd(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx,
                       return_final_state, tiles=None):
    bsz, seqlen, dm = x.shape
    Bg, Cg = _groups_view(B), _groups_view(C)
    G, N = Bg.shape[2], Bg.shape[3]
    cg = dm // G
    y = torch.empty(bsz, seqlen, dm, dtype=x.dtype, device=x.device)
    fin = (torch.empty(bsz, dm, N, dtype=torch.float32, device=x.device) if return_final_state else None)
    if bsz == 0 or dm == 0:
        return y, fin
    BD, T, warps = tiles if tiles is not None else _tiles(N, False)
    n_dblk = triton.cdiv(cg, BD)
    init = initial_state.contiguous() if initial_state is not None else None
    Ac = A.contiguous() if A is not None else None
    if seqlen == 0:
        if fin is not None:
            fin.copy_(init if init is not None else torch.zeros_like(fin))
        return y, fin
    _scan_fwd_kernel[(bsz, G * n_dblk)](
        x, delta, Ac if Ac is not None else x, Bg, Cg, D if D is not None else x, z if z is not None else x,
        delta_bias if delta_bias is not None else x, init if init is not None else x,
        seq_idx if seq_idx is not None else x, y, fin if fin is not None else y, seqlen, dm, cg, n_dblk,
        *x.stride(), *delta.stride(), *Bg.stride(), *Cg.stride(), *(z.stride() if z is not None else (0, 0, 0)),
        *(seq_idx.stride() if seq_idx is not None else (0, 0)),
        N=N, BN=triton.next_power_of_2(N), BD=BD, T=T, DECAY=_DECAY[decay], SOFTPLUS=bool(delta_softplus),
        HAS_BIAS=delta_bias is not None, HAS_D=D is not None, HAS_Z=z is not None, HAS_INIT=init is not None,
        HAS_SEQ=seq_idx is not None, WANT_FIN=fin is not None, num_warps=warps,
    )
    return y, fin


def _n_sub(bsz, G, n_dblk):
    """Channel blocks per backward program: enough programs to fill the GPU (about 1024), as few B/C gradient
    partials as that allows."""
    return max(1, min(8, (bsz * G * n_dblk) // 1024))


def selective_scan_bwd(dy, dfinal, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state,
                       seq_idx, tiles=None):
    """Gradients (dx, ddelta, dA, dB, dC, dD, dz, d delta_bias, d initial_state) in the inputs' dtypes (None for
    absent inputs)."""
    bsz, seqlen, dm = x.shape
    Bg, Cg = _groups_view(B), _groups_view(C)
    G, N = Bg.shape[2], Bg.shape[3]
    BN = triton.next_power_of_2(N)
    cg = dm // G
    dev = x.device
    if tiles is not None:
        BD, T, warps, n_sub = tiles
    else:
        BD, T, warps = _tiles(N, True)
        n_sub = None
    n_dblk = triton.cdiv(cg, BD)
    if n_sub is None:
        n_sub = _n_sub(bsz, G, n_dblk)
    n_pg = triton.cdiv(n_dblk, n_sub)
    n_prog = G * n_pg
    nchunks = triton.cdiv(seqlen, T)
    f32 = dict(dtype=torch.float32, device=dev)
    dx = torch.empty(bsz, seqlen, dm, dtype=x.dtype, device=dev)  # dense: the kernel stores [B, L, D] rows
    ddt = torch.empty(bsz, seqlen, dm, dtype=delta.dtype, device=dev)
    dz = torch.empty(bsz, seqlen, dm, dtype=z.dtype, device=dev) if z is not None else None
    part = torch.zeros if n_sub > 1 else torch.empty  # several channel blocks add into one program's partial
    dbp = part(bsz, n_prog, seqlen, BN, **f32)
    dcp = part(bsz, n_prog, seqlen, BN, **f32)
    dA = torch.empty(bsz, dm, N, **f32) if A is not None else None
    dD = torch.empty(bsz, dm, **f32) if D is not None else None
    dbias = torch.empty(bsz, dm, **f32) if delta_bias is not None else None
    dinit = torch.empty(bsz, dm, N, **f32) if initial_state is not None else None
    if seqlen == 0 or bsz == 0 or dm == 0:
        dbp.zero_(), dcp.zero_()
        for t_ in (dA, dD, dbias):
            if t_ is not None:
                t_.zero_()
        if dinit is not None:
            dinit.copy_(dfinal if dfinal is not None else torch.zeros_like(dinit))
    else:
        ck = torch.empty(bsz * n_prog * nchunks * BD * BN, **f32)
        init = initial_state.contiguous() if initial_state is not None else None
        dfin = dfinal.contiguous() if dfinal is not None else None
        Ac = A.contiguous() if A is not None else None
        _scan_bwd_kernel[(bsz, n_prog)](
            x, delta, Ac if Ac is not None else x, Bg, Cg, D if D is not None else x, z if z is not None else x,
            delta_bias if delta_bias is not None else x, init if init is not None else x,
            seq_idx if seq_idx is not None else x, dy, dfin if dfin is not None else x, ck,
            dx, ddt, dz if dz is not None else dx, dbp, dcp, dA if dA is not None else ck,
            dD if dD is not None else ck, dbias if dbias is not None else ck, dinit if dinit is not None else ck,
            seqlen, dm, cg, n_dblk, n_sub, n_pg, nchunks,
            *x.stride(), *delta.stride(), *Bg.stride(), *Cg.stride(), *(z.stride() if z is not None else (0, 0, 0)),
            *(seq_idx.stride() if seq_idx is not None else (0, 0)), *dy.stride(),
            N=N, BN=BN, BD=BD, T=T, DECAY=_DECAY[decay], SOFTPLUS=bool(delta_softplus),
            HAS_BIAS=delta_bias is not None, HAS_D=D is not None, HAS_Z=z is not None, HAS_INIT=init is not None,
            HAS_SEQ=seq_idx is not None, HAS_DFIN=dfin is not None, ACCUM=n_sub > 1, num_warps=warps,
        )
    # partials -> gradients: B/C over the programs of each group, A / D / delta_bias over the batch rows
    dB = dbp.view(bsz, G, n_pg, seqlen, BN).sum(2)[..., :N].permute(0, 2, 1, 3)
    dC = dcp.view(bsz, G, n_pg, seqlen, BN).sum(2)[..., :N].permute(0, 2, 1, 3)
    if B.dim() == 3:
        dB, dC = dB[:, :, 0], dC[:, :, 0]
    out = (
        dx, ddt,
        dA.sum(0).to(A.dtype) if dA is not None else None,
        dB.to(B.dtype).contiguous(), dC.to(C.dtype).contiguous(),
        dD.sum(0).to(D.dtype) if dD is not None else None,
        dz,
        dbias.sum(0).to(delta_bias.dtype) if dbias is not None else None,
        dinit.to(initial_state.dtype) if dinit is not None else None,
    )
    return out


def selective_scan_step_fwd(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    bsz, dm = x.shape
    Bg = B if B.dim() == 3 else B.unsqueeze(1)
    Cg = C if C.dim() == 3 else C.unsqueeze(1)
    G, N = Bg.shape[1], Bg.shape[2]
    BN = triton.next_power_of_2(N)
    BD = max(2, min(256, 1024 // BN))
    state = state.contiguous()
    y = torch.empty(bsz, dm, dtype=x.dtype, device=x.device)
    new = torch.empty(bsz, dm, N, dtype=torch.float32, device=x.device)
    Ac = A.contiguous() if A is not None else None
    _scan_step_kernel[(bsz, triton.cdiv(dm, BD))](
        state, x, delta, Ac if Ac is not None else x, Bg, Cg, D if D is not None else x, z if z is not None else x,
        delta_bias if delta_bias is not None else x, y, new, dm, dm // G,
        *x.stride(), *delta.stride(), *Bg.stride(), *Cg.stride(), *(z.stride() if z is not None else (0, 0)),
        N=N, BN=BN, BD=BD, DECAY=_DECAY[decay], SOFTPLUS=bool(delta_softplus), HAS_BIAS=delta_bias is not None,
        HAS_D=D is not None, HAS_Z=z is not None, num_warps=4,
    )
    return y, new
