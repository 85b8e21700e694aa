"""Triton SSD backward: the reverse pass of ssd.py (see its docstring for the math and the kernel map).

Recomputes dt/cs, CB and the entering states with the forward's kernels (the SSM output only with the gate
z), then: _dstates (ssd_states.py: the reverse walk over chunks: dS per chunk, d initial_states, the cs_last
gradient terms), _dx_kernel (dx, the direct dt gradient = the cs_s gradient, dD partials), _dcb_kernel (the gradient of
each chunk's C.B, summed over a group's heads once, and the intra-chunk cs_t partials) and _dbc_kernel (dB and
dC: state terms + dCB products; the read-out cs_t partials) and _dt_grad_kernel (the cs gradients -> ddt, and
partial sums for dA / ddt_bias).
No atomics: deterministic run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tcumsum, trevcumsum, tsigmoid, tsoftplus, tsum
from ..common.out import out_or_empty
from .. import env
from .triton_ssd import _prep, _scan
from .triton_ssd_common import (
    _autotune,
    _contig_last,
    _dot_lp_acc,
    _dt_biased,
    _mm_a_st,
    _mm_af,
    _mma_a_st,
    _mma_af,
    _mm_ff,
    _mm_raw,
    _out_prec,
    _pow2_block,
    _prec,
    _seq_args,
    _seq_at,
    _Side,
    _split,
    _split3,
    _state_buffer_dtype,
    _state_buffer_shape,
    _state_views,
    _tile,
)
from .triton_ssd_states import _dstates, _states


@triton.jit
def _mma_w_dy(acc, w, DYP, mask, DY_F32: tl.constexpr, PREC: tl.constexpr, FULL: tl.constexpr = False):
    """acc + w (a derived fp32 decay-weighted tile) @ the dy tile at DYP (a raw input, or fp32 after the gate).
    FULL (PREC "bf16" only): w as bf16 hi + mid + lo, fp32's accuracy, and an fp32 dy as the same hi + lo pair
    _dcb_kernel's products use, so x_s . the sum matches _dcb's row sums term by term (docs/kernels.md, "the a
    gradient")."""
    dyv = tl.load(DYP, mask=mask, other=0.0)
    if FULL and PREC == "bf16":
        wh, wm, wl = _split3(w)
        if DY_F32:
            dh, dl = _split(dyv)
            acc = _dot_lp_acc(wh, dh, acc)
            acc = _dot_lp_acc(wh, dl, acc)
            acc = _dot_lp_acc(wm, dh, acc)
            acc = _dot_lp_acc(wm, dl, acc)
            return _dot_lp_acc(wl, dh, acc)
        else:
            return _dot_lp_acc(wl, dyv, _dot_lp_acc(wm, dyv, _dot_lp_acc(wh, dyv, acc)))
    elif DY_F32:
        return acc + _mm_ff(w, dyv, PREC)
    else:
        return _mma_af(acc, w, dyv, PREC)


# 4 warps capped at 168 registers (three programs per multiprocessor; uncapped ptxas takes 255) first: 1.24 ->
# 1.07 ms at 16 x 2K; 8 warps (one program, 64-row tiles split over two warp groups) ran 2.2x slower there
@_autotune([triton.Config({}, num_warps=4, num_stages=2, maxnreg=168),
            triton.Config({}, num_warps=4, num_stages=1, maxnreg=168),
            triton.Config({}, num_warps=4, num_stages=2), triton.Config({}, num_warps=8, num_stages=2)],
           key=["T", "P", "N", "BS", "BK"])
@triton.jit
def _dx_kernel(X, DY, Bp, CB, DTP, CS, SEQ, DSH, DSL, Dp, DX, DDT, DDTS, DDP, L, H, G, NC,
               sxb, sxl, sxh, sxp, sdyb, sdyl, sdyh, sdyp, sbb, sbl, sbg, sbn, ssb, ssl, sdxb, sdxl,
               P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BPF: tl.constexpr, BS: tl.constexpr,
               BK: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
               DY_F32: tl.constexpr, PREC: tl.constexpr, IPREC: tl.constexpr):
    """Per head and block of source positions s: Q_s = sum_t L_ts CB_ts dy_t + exp(cs_last - cs_s) m'_s dS B_s;
    dx_s = dt_s Q_s + D dy_s; DDT_s = x_s . Q_s (the direct dt gradient) and DDTS_s = dt_s x_s . (the state
    part of Q_s) (the source-side cs_s gradient through the state leaving the chunk); with D, DDP = this
    program's partial sum of dy_s * x_s over its positions (for dD)."""
    bc = tl.program_id(1)
    b = (bc // NC).to(tl.int64)
    c = bc % NC
    nsb: tl.constexpr = T // BS
    h = tl.program_id(0) // nsb
    g = h // (H // G)
    sb = tl.program_id(0) % nsb
    s = sb * BS + tl.arange(0, BS)
    p = tl.arange(0, BPF)
    mp = p < P
    ps = c * T + s
    ms = ps < L
    dbase = ((b * H + h) * NC + c) * T
    cs_s = tl.load(CS + dbase + s)
    dt_s = tl.load(DTP + dbase + s)
    cs_last = tl.load(CS + dbase + T - 1)
    if HAS_SEQ:
        seq_s = _seq_at(SEQ, b, ps, L, ssb, ssl)
    xv = tl.load(X + b * sxb + ps[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=ms[:, None] & mp[None, :],
                 other=0.0)
    # intra-chunk: sum over t >= s of L_ts CB_ts dy_t. The blocks after the diagonal one (s <= r < t, r this
    # block's last source) factor the decay as exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1: the tiles take
    # the first, a vector over t, and the second, over s, scales their sum once
    cb_base = ((b * NC + c) * G + g) * T * T
    r = sb * BS + BS - 1
    cs_r = tl.load(CS + dbase + r)
    Q = tl.full([BS, BPF], 0.0, tl.float32)
    for t0 in range(sb * BS + BS, T, BS):
        t = t0 + tl.arange(0, BS)
        pt = c * T + t
        mt = pt < L
        cbT = tl.load(CB + cb_base + t[None, :] * T + s[:, None])  # [s, t]; 0 at pad s and pad t
        wT = cbT * tl.exp(tl.load(CS + dbase + t) - cs_r)[None, :]
        if HAS_SEQ:
            wT = tl.where(seq_s[:, None] == _seq_at(SEQ, b, pt, L, ssb, ssl)[None, :], wT, 0.0)
        Q = _mma_w_dy(Q, wT, DY + b * sdyb + pt[:, None] * sdyl + h * sdyh + p[None, :] * sdyp,
                      mt[:, None] & mp[None, :], DY_F32, IPREC)
    Q = Q * tl.exp(cs_r - cs_s)[:, None]
    # the diagonal block (one iteration): its weights are the largest, so its products are fp32-accurate
    # (three-way split, _intra_prec); the off-diagonal ones above stay two-way
    for t0 in range(sb * BS, sb * BS + BS, BS):
        t = t0 + tl.arange(0, BS)
        pt = c * T + t
        mt = pt < L
        cbT = tl.load(CB + cb_base + t[None, :] * T + s[:, None])  # [s, t]
        cs_t = tl.load(CS + dbase + t)
        ok = (s[:, None] <= t[None, :]) & mt[None, :] & ms[:, None]
        if HAS_SEQ:
            ok = ok & (seq_s[:, None] == _seq_at(SEQ, b, pt, L, ssb, ssl)[None, :])
        wT = tl.where(ok, cbT * tl.exp(tl.where(ok, cs_t[None, :] - cs_s[:, None], 0.0)), 0.0)
        Q = _mma_w_dy(Q, wT, DY + b * sdyb + pt[:, None] * sdyl + h * sdyh + p[None, :] * sdyp,
                      mt[:, None] & mp[None, :], DY_F32, IPREC, True)
    # state path: B_s dS^T, scaled; its own accumulator, for its share of x_s . Q_s
    Qs = tl.full([BS, BPF], 0.0, tl.float32)
    st_off = ((b * NC + c) * H + h) * P * N
    for k0 in range(0, N, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < N
        bv = tl.load(Bp + b * sbb + ps[:, None] * sbl + g * sbg + k[None, :] * sbn, mask=ms[:, None] & mk[None, :],
                     other=0.0)
        Qs = _mma_a_st(Qs, bv, DSH, DSL, st_off + p[None, :] * N + k[:, None], mk[:, None] & mp[None, :], PREC)
    rs = tl.exp(tl.minimum(cs_last - cs_s, 0.0))
    ok_s = ms
    if HAS_SEQ:
        last = tl.minimum(c * T + T, L) - 1
        ok_s = ok_s & (seq_s == _seq_at(SEQ, b, last, L, ssb, ssl))
    rs = tl.where(ok_s, rs, 0.0)
    Qs = Qs * rs[:, None]
    xf = xv.to(tl.float32)
    tl.store(DDTS + dbase + s, dt_s * tsum(xf * Qs, axis=1))
    Q += Qs
    ddt = tsum(xf * Q, axis=1)
    dx = Q * dt_s[:, None]
    m = ms[:, None] & mp[None, :]
    if HAS_D:
        dys = tl.load(DY + b * sdyb + ps[:, None] * sdyl + h * sdyh + p[None, :] * sdyp, mask=m,
                      other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            dv = tl.load(Dp + h * P + p, mask=mp, other=0.0).to(tl.float32)[None, :]
        else:
            dv = tl.load(Dp + h).to(tl.float32)
        dx += dys * dv
        # [H, P, programs] layout: the host's sum over programs is then over the contiguous last dimension
        tl.store(DDP + (h * P + p) * (tl.num_programs(1) * nsb) + bc * nsb + sb, tsum(dys * xf, axis=0), mask=mp)
    # rows of DX may be wider than H * P (a slice of the [x | B | C] gradient: op.py packs it); int64 offsets
    tl.store(DX + b * sdxb + ps[:, None].to(tl.int64) * sdxl + h * P + p[None, :], dx.to(DX.dtype.element_ty),
             mask=m)
    tl.store(DDT + dbase + s, ddt)


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=3), triton.Config({}, num_warps=8, num_stages=1)],
           key=["T", "P", "BS"])
@triton.jit
def _dcb_kernel(X, DY, CB, DTP, CS, SEQ, DCB, DCSI, L, H, G, NC,
                sxb, sxl, sxh, sxp, sdyb, sdyl, sdyh, sdyp, ssb, ssl,
                P: tl.constexpr, T: tl.constexpr, BPF: tl.constexpr, BS: tl.constexpr, ZB: tl.constexpr,
                HAS_SEQ: tl.constexpr, DY_F32: tl.constexpr, PREC: tl.constexpr):
    """dCB[t, s] = sum over the group's heads of exp(cs_t - cs_s) dt_s (dy_t . x_s), t >= s in one document:
    the gradient of the chunk's C_t . B_s, shared by dB and dC so the per-head work is done once. One program
    per (group, t block, s block <= t block); the upper blocks are zeros where _dbc's larger diagonal blocks (ZB
    positions) read them, and otherwise never read and not written.
    Per head it also stores, of M_ts = CB_ts dt_s exp(cs_t - cs_s) (dy_t . x_s), t >= s, the row sums (the
    target-side cs_t gradient: the intra-chunk part of dy_t . y_t; the forward output is never recomputed for
    it) into DCSI[b, h, c, i, position]: block (tb, sb <= tb) at [sb, t], and zeros at [tb, s] for sb < tb, so
    every entry is written once (no zero fill). The source-side cs_s gradient, the column sums, is x_s . the
    intra-chunk part of _dx_kernel's Q_s, whose products are split in both precision modes for it;
    _dt_grad_kernel subtracts it."""
    bc = tl.program_id(1)
    b = (bc // NC).to(tl.int64)
    c = bc % NC
    nrb: tl.constexpr = T // BS
    g = tl.program_id(0) // (nrb * nrb)
    tb = (tl.program_id(0) % (nrb * nrb)) // nrb
    sb = tl.program_id(0) % nrb
    if sb <= tb:
        t = tb * BS + tl.arange(0, BS)
        s = sb * BS + tl.arange(0, BS)
        p = tl.arange(0, BPF)
        mp = p < P
        pt = c * T + t
        ps = c * T + s
        ok = (t[:, None] >= s[None, :]) & (pt < L)[:, None] & (ps < L)[None, :]
        if HAS_SEQ:
            ok = ok & (_seq_at(SEQ, b, pt, L, ssb, ssl)[:, None] == _seq_at(SEQ, b, ps, L, ssb, ssl)[None, :])
        acc = tl.full([BS, BS], 0.0, tl.float32)
        cbv = tl.load(CB + ((b * NC + c) * G + g) * T * T + t[:, None] * T + s[None, :])
        rep = H // G
        for hi in range(rep):
            h = g * rep + hi
            dbase = ((b * H + h) * NC + c) * T
            dyv = tl.load(DY + b * sdyb + pt[:, None] * sdyl + h * sdyh + p[None, :] * sdyp,
                          mask=(pt < L)[:, None] & mp[None, :], other=0.0)
            xT = tl.load(X + b * sxb + ps[None, :] * sxl + h * sxh + p[:, None] * sxp,
                         mask=(ps < L)[None, :] & mp[:, None], other=0.0)  # x_s^T [P, BS]
            if DY_F32:
                prod = _mm_af(dyv, xT, PREC)
            else:
                prod = _mm_raw(dyv, xT, PREC)
            cs_t = tl.load(CS + dbase + t)
            cs_s = tl.load(CS + dbase + s)
            dt_s = tl.load(DTP + dbase + s)
            if sb < tb:  # s < r <= t (r = this t block's first position): two vectors, both factors <= 1
                cs_r = tl.load(CS + dbase + tb * BS)
                w = tl.exp(cs_t - cs_r)[:, None] * (tl.exp(cs_r - cs_s) * dt_s)[None, :]
            else:
                w = tl.exp(tl.where(ok, cs_t[:, None] - cs_s[None, :], 0.0)) * dt_s[None, :]
            wp = tl.where(ok, w * prod, 0.0)
            acc += wp
            # where, not a product with the mask: with blocks larger than _cb_kernel's, CB's upper blocks are
            # unwritten memory (possibly inf / NaN)
            mts = tl.where(ok, wp * cbv, 0.0)
            hbase = ((b * H + h) * NC + c) * T * nrb
            if sb < tb:
                tl.store(DCSI + hbase + sb * T + t, tsum(mts, axis=1))
                tl.store(DCSI + hbase + tb * T + s, tl.full([BS], 0.0, tl.float32))
            else:  # (this layout of the stores measured 0.05 ms faster than one shared row store, H100 / H200)
                tl.store(DCSI + hbase + sb * T + t, tsum(mts, axis=1))
        tl.store(DCB + ((b * NC + c) * G + g) * T * T + t[:, None] * T + s[None, :], acc)
    elif (sb * BS) // ZB == (tb * BS) // ZB:  # above the diagonal but inside one of _dbc's diagonal blocks of ZB
        t = tb * BS + tl.arange(0, BS)      # positions, which it reads whole: zeros (no separate fill)
        s = sb * BS + tl.arange(0, BS)
        tl.store(DCB + ((b * NC + c) * G + g) * T * T + t[:, None] * T + s[None, :],
                 tl.full([BS, BS], 0.0, tl.float32))


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=8, num_stages=3)], key=["T", "P", "N", "BS", "BN", "IS_DC", "SPLIT"])
@triton.jit
def _dbc_kernel(X, DY, OTHER, CR, DCB, DTP, CS, SEQ, SVH, SVL, OUT, DCSR, PART, L, H, G, NC,
                sxb, sxl, sxh, sxp, sdyb, sdyl, sdyh, sdyp, sob, sol, sog, son, scrb, scrl, scrg, scrn, ssb, ssl,
                soutb, soutl,
                P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BPF: tl.constexpr, BS: tl.constexpr,
                BN: tl.constexpr, IS_DC: tl.constexpr, HAS_SEQ: tl.constexpr, DY_F32: tl.constexpr,
                PREC: tl.constexpr, SPLIT: tl.constexpr = 1):
    """dB (IS_DC False; rows are source positions s, OTHER = C, SV = dS leaving the chunk) or
    dC (IS_DC True; rows are target positions t, OTHER = B, SV = S entering the chunk): the state term summed
    over the heads of the group in this program, then the intra-chunk term dCB @ B (dC) or dCB^T @ C (dB)
    from _dcb_kernel (no atomics). The dC pass also stores DCSR[b, h, c, t, N block] = exp(cs_t) m_t
    sum over the block's n of (dy_t S^T)_n C_tn: the state read-out part of dy_t . y_t (the cs_t gradient).
    SPLIT > 1 (MEGASSM_SSD_DBC_SPLIT): program_id(2) = sp takes the sp-th share of the group's heads, sp 0 adds
    the intra-chunk term, and each stores its fp32 sum to PART[sp, b, l, g, n], which the caller sums into OUT."""
    bc = tl.program_id(1)
    b = (bc // NC).to(tl.int64)
    c = bc % NC
    nnb: tl.constexpr = (N + BN - 1) // BN
    nrn: tl.constexpr = (T // BS) * nnb
    g = tl.program_id(0) // nrn
    rb = (tl.program_id(0) % nrn) // nnb
    nb = tl.program_id(0) % nnb
    r = rb * BS + tl.arange(0, BS)
    n = nb * BN + tl.arange(0, BN)
    mn = n < N
    p = tl.arange(0, BPF)
    mp = p < P
    pr = c * T + r
    mr = pr < L
    if HAS_SEQ:
        seq_r = _seq_at(SEQ, b, pr, L, ssb, ssl)
        sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)
        seq_last = _seq_at(SEQ, b, tl.minimum(c * T + T, L) - 1, L, ssb, ssl)
    acc = tl.full([BS, BN], 0.0, tl.float32)
    if IS_DC:
        crv = tl.load(CR + b * scrb + pr[:, None] * scrl + g * scrg + n[None, :] * scrn,
                      mask=mr[:, None] & mn[None, :], other=0.0).to(tl.float32)
    rep = H // G
    sp = tl.program_id(2)
    per = (rep + SPLIT - 1) // SPLIT  # heads of this program's share: sp * per .. min(rep, (sp + 1) * per) - 1
    for hi in range(sp * per, tl.minimum(rep, sp * per + per)):
        h = g * rep + hi
        dbase = ((b * H + h) * NC + c) * T
        cs_r = tl.load(CS + dbase + r)
        if IS_DC:
            rowv = tl.load(DY + b * sdyb + pr[:, None] * sdyl + h * sdyh + p[None, :] * sdyp,
                           mask=mr[:, None] & mp[None, :], other=0.0)
        else:
            rowv = tl.load(X + b * sxb + pr[:, None] * sxl + h * sxh + p[None, :] * sxp,
                           mask=mr[:, None] & mp[None, :], other=0.0)
            dt_r = tl.load(DTP + dbase + r)
        st_off = ((b * NC + c) * H + h) * P * N
        st = _mm_a_st(rowv, SVH, SVL, st_off + p[:, None] * N + n[None, :], mp[:, None] & mn[None, :],
                      DY_F32 and IS_DC, PREC)
        if IS_DC:
            sc = tl.exp(cs_r)
            ok_r = mr
            if HAS_SEQ:
                ok_r = ok_r & (seq_r == sid_in)
        else:
            sc = dt_r * tl.exp(tl.minimum(tl.load(CS + dbase + T - 1) - cs_r, 0.0))
            ok_r = mr
            if HAS_SEQ:
                ok_r = ok_r & (seq_r == seq_last)
        scm = tl.where(ok_r, sc, 0.0)
        acc += st * scm[:, None]
        if IS_DC:
            tl.store(DCSR + (dbase + r) * nnb + nb, tsum(st * crv, axis=1) * scm)
    # intra-chunk term, once per group: dC_t = sum_s dCB[t, s] B_s; dB_s = sum_t dCB[t, s] C_t
    dcb_base = ((b * NC + c) * G + g) * T * T
    if IS_DC:
        lo = 0
        hi_ = rb * BS + BS
    else:
        lo = rb * BS
        hi_ = T
    hi_ = tl.where(sp > 0, lo, hi_)  # the first share's program adds it
    for o0 in range(lo, hi_, BS):
        o = o0 + tl.arange(0, BS)
        po = c * T + o
        if IS_DC:
            w = tl.load(DCB + dcb_base + r[:, None] * T + o[None, :])  # [t = r, s = o]
        else:
            w = tl.load(DCB + dcb_base + o[None, :] * T + r[:, None])  # [s = r, t = o]
        ov = tl.load(OTHER + b * sob + po[:, None] * sol + g * sog + n[None, :] * son,
                     mask=(po < L)[:, None] & mn[None, :], other=0.0)
        acc += _mm_af(w, ov, PREC)
    if SPLIT == 1:
        tl.store(OUT + b * soutb + pr[:, None].to(tl.int64) * soutl + g * N + n[None, :],
                 acc.to(OUT.dtype.element_ty), mask=mr[:, None] & mn[None, :])
    else:
        nbat = tl.num_programs(1) // NC
        row0 = (sp.to(tl.int64) * nbat + b) * L  # PART [SPLIT, batch, L, G, N], fp32, contiguous
        tl.store(PART + ((row0 + pr[:, None]) * G + g) * N + n[None, :], acc, mask=mr[:, None] & mn[None, :])


@triton.jit
def _dt_grad_kernel(DCSI, DCSR, DDTS, DCSL, DDTD, DTP, A, DT, DT_BIAS, DDT, DAP, DBP, L, H, NC,
                    sdb, sdl, sdh, sgb, sgl, dt_lo, dt_hi, T: tl.constexpr, BH: tl.constexpr, NSB: tl.constexpr,
                    NNB: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """Per (row, chunk, block of heads): the gradient of a_j = dt_j A from its terms (docs/kernels.md, "the a
    gradient"):
     - suffix sums over j of the intra-chunk cs gradient (DCSI, _dcb's row sums, minus the intra-chunk part of
       _dx's dt_s x_s . Q_s: both from accurate products in either precision mode) and of the state
       read-out's (DCSR, _dbc's dC pass);
     - the source-side terms of the positions before j only (DDTS, _dx: dt_s x_s . the state part of Q_s):
       the state leaving the chunk carries exp(cs_last - cs_s), in which a_j enters only for s < j;
     - exp(cs_last) <dS_out, S_in> (DCSL, _dstates), for every j.
    Then ddt = the direct part (DDTD) + A da, through the clamp, softplus and bias, stored as [B, L, H] with
    strides (sgb, sgl, 1); partial sums over the chunk of dt da (DAP, for dA) and of ddt (DBP, for ddt_bias),
    [B, NC, H]."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    t = tl.arange(0, T)
    pos = c * T + t
    mh = h < H
    m = (pos < L)[:, None] & mh[None, :]
    row = (b * H + h[None, :]) * NC + c  # [1, BH]: the (b, h, c) row of the [B, H, NC, ...] buffers
    off = row * T + t[:, None]
    target = tl.full([T, BH], 0.0, tl.float32)
    for i in range(NSB):
        target += tl.load(DCSI + (row * NSB + i) * T + t[:, None], mask=mh[None, :], other=0.0)
    for j in range(NNB):
        target += tl.load(DCSR + off * NNB + j, mask=mh[None, :], other=0.0)
    target = tl.where(m, target, 0.0)
    src = tl.where(m, tl.load(DDTS + off, mask=mh[None, :], other=0.0), 0.0)
    dtp = tl.load(DTP + off, mask=m, other=0.0)
    ddtd = tl.load(DDTD + off, mask=m, other=0.0)
    # the intra-chunk source side: dt_s x_s . Q_s less its state part
    target -= tl.where(m, dtp * ddtd - src, 0.0)
    da = trevcumsum(target, 0) + (tcumsum(src, 0) - src) + tl.load(DCSL + row, mask=mh[None, :], other=0.0)
    Av = tl.load(A + h, mask=mh, other=0.0).to(tl.float32)
    tl.store(DAP + (b * NC + c) * H + h, tsum(tl.where(m, dtp * da, 0.0), axis=0), mask=mh)
    g = ddtd + Av[None, :] * da
    # through clamp, softplus and bias (the forward's _dt_kernel)
    dtb = _dt_biased(DT, DT_BIAS, b, pos, h, m, mh, sdb, sdl, sdh, HAS_BIAS)
    if HAS_LIMIT:
        if SOFTPLUS:
            sp = tsoftplus(dtb)
        else:
            sp = dtb
        g = tl.where((sp >= dt_lo) & (sp <= dt_hi), g, 0.0)
    if SOFTPLUS:
        g = tl.where(dtb > 20.0, g, g * tsigmoid(dtb))
    g = tl.where(m, g, 0.0)
    tl.store(DDT + b * sgb + pos.to(tl.int64)[:, None] * sgl + h[None, :], g.to(DDT.dtype.element_ty), mask=m)
    tl.store(DBP + (b * NC + c) * H + h, tsum(g, axis=0), mask=mh)


def _intra_prec(prec):
    """The precision of the intra-chunk products of _dx_kernel and _dcb_kernel: split (bf16 hi + lo of the
    derived operand: the decay-weighted CB in _dx, dy after the gate in _dcb) in the bf16 mode too, and on _dx's
    diagonal tile (where the weights are largest) three ways (hi + mid + lo; with the gate, times _dcb's hi + lo
    of dy). x_s . the sum of _dx's is the source side of the intra-chunk cs gradient and _dcb's row sums its
    target side; they cancel, and dA / ddt_bias weight the difference by dt sums of up to a chunk, so a
    rounding on either side leaves them with ~1e-2 .. 1 errors (measured without and with the gate), and the
    two-way split on the diagonal tile with 1e-4 .. 2.6e-3 where the decays inside a chunk are large (three
    ways: the fp32-product error, at no measured cost; docs/history/kernels.md). Without the gate _dcb's operands
    are raw inputs and its products exact in either mode. The state products stay rounded once in the bf16
    mode."""
    return "bf16" if prec == "bf16fast" else prec


def ssd_bwd(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx,
            chunk_size, kept=None, out_xbc=None, out_ddt=None):
    """Gradients (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states) of ssd_fwd. `kept`: (ssd_fwd's third
    output, final states or None). A states buffer is used instead of recomputing the entering states when its
    layout matches this call's precision mode (a switch of MEGASSM_SSD_PRECISION between forward and backward
    recomputes); the true segment ends of a segmented walk let the recompute start every segment true (no
    fix-up pass), when the segments are this call's. The final states themselves are not needed: the reverse
    walk starts from `dfinal` (or zero). `out_xbc`: (dx, dB, dC) to write into, shaped like x, B, C with
    unit strides inside a row (slices of one [x | B | C] gradient buffer, op.py), else they are allocated;
    `out_ddt` likewise for ddt (a column block of Mamba-2's in_proj gradient, grad_blocks.GradBlocks)."""
    x, B, C, z = _contig_last(x), _contig_last(B), _contig_last(C), _contig_last(z)
    D_in = D
    D = D.contiguous() if D is not None else None
    A = A.contiguous()
    init_in = initial_states
    if initial_states is not None:
        initial_states = initial_states.contiguous()
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = B.shape[-2:]
    dev = x.device
    # C B^T and dCB (_dcb_kernel: reads C B^T, dy, x, cs and dt only) run on a side stream beside the chunk walks
    side = _Side(x)
    T, nc, dtp, cs, cb, cb_ready = _prep(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, seq_idx, chunk_size, side)
    seq, ssb, ssl = _seq_args(seq_idx, x)
    prec = _prec(x)
    iprec = _intra_prec(prec)  # _dx's and _dcb's intra-chunk products
    BPF = _pow2_block(hdim, 256)
    BSC, BSR = _tile("dcb_bs", T), _tile("dbc_bs", T)
    nsb = T // BSC
    # _dcb writes the blocks on and below the diagonal, and zeros above it inside _dbc's diagonal blocks (read
    # whole when they are larger than _dcb's)
    dcb = torch.empty(bsz, nc, ngroups, T, T, dtype=torch.float32, device=dev)
    dcsi = torch.empty(bsz, nheads, nc, nsb, T, dtype=torch.float32, device=dev)  # every entry written once

    def launch_dcb():  # run at once by side.run, with the dy of the branch below
        _dcb_kernel[(ngroups * nsb ** 2, bsz * nc)](
            x, dy, cb, dtp, cs, seq, dcb, dcsi, seqlen, nheads, ngroups, nc, *x.stride(), *dy.stride(), ssb, ssl,
            P=hdim, T=T, BPF=BPF, BS=BSC, ZB=max(BSR, BSC), HAS_SEQ=seq_idx is not None,
            DY_F32=dy.dtype == torch.float32,
            PREC=iprec,
        )

    if z is None:  # without a gate dy = dout, and the output is never recomputed (cs_t gradient: _dcb / _dbc)
        dy, dz = dout, None
        dcb_ready = side.run(launch_dcb)
    shape = _state_buffer_shape(x, (bsz, nc, nheads, hdim, dstate))
    if kept is not None and tuple(kept[0].shape) == shape and kept[0].dtype == _state_buffer_dtype(x):
        states = _state_views(kept[0])
    else:  # the reverse walk needs the entering states only, not the final ones; a segmented walk starts each
        # segment from the true end the forward kept (1-D fp32: never a states buffer), when it did
        ends = kept[0] if kept is not None and kept[0].dim() == 1 and kept[0].dtype == torch.float32 else None
        # dfinal is given exactly when the forward returned the final states (ops passes it only then): the same
        # walk products as the forward's, so kept and recomputed states agree
        states, _, _ = _states(x, B, dtp, cs, seq_idx, initial_states, T, nc, want_final=False, seg_starts=ends,
                               final_returned=dfinal is not None)
    if z is not None:  # the gate needs the forward output: recompute it, fused with dy = dout * silu(z) and dz
        side.wait(cb_ready)
        dy, dz = _scan(x, z, C, D, cb, dtp, cs, seq_idx, states, T, nc, dout=dout)
        dcb_ready = side.run(launch_dcb)
    dy_f32 = dy.dtype == torch.float32
    dsn, dcs_last, dinit = _dstates(x, C, dy, cs, seq_idx, states, dfinal, initial_states, T, nc)
    # dx, the direct dt gradient, dD
    BS = _tile("dx_bs", T)
    dx, dB, dC = out_xbc if out_xbc is not None else (
        torch.empty(bsz, seqlen, nheads, hdim, dtype=x.dtype, device=dev),
        torch.empty(bsz, seqlen, ngroups, dstate, dtype=B.dtype, device=dev),
        torch.empty(bsz, seqlen, ngroups, dstate, dtype=C.dtype, device=dev))
    ddt_direct = torch.empty(bsz, nheads, nc, T, dtype=torch.float32, device=dev)
    ddt_state = torch.empty_like(ddt_direct)
    ddp = torch.empty(nheads, hdim, bsz * nc * (T // BS), dtype=torch.float32, device=dev) if D is not None else None
    side.wait(cb_ready)
    _dx_kernel[(nheads * (T // BS), bsz * nc)](
        x, dy, B, cb, dtp, cs, seq, *dsn, D if D is not None else x, dx, ddt_direct, ddt_state,
        ddp if ddp is not None else dx,
        seqlen, nheads, ngroups, nc, *x.stride(), *dy.stride(), *B.stride(), ssb, ssl, dx.stride(0), dx.stride(1),
        P=hdim, N=dstate, T=T, BPF=BPF, BS=BS, BK=_tile("dx_bk", dstate), HAS_SEQ=seq_idx is not None,
        HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.dim() == 2, DY_F32=dy_f32, PREC=prec, IPREC=iprec,
    )
    dD = None
    if D is not None:
        # sums over the contiguous last dimension (torch's sum over a leading one ran ~0.03 ms at 16 x 2K)
        dD = (ddp.view(nheads, -1).sum(-1) if D.dim() == 1 else ddp.sum(-1)).to(D_in.dtype)
    # dB, dC and the cs_t gradient (dy_t . y_t: intra-chunk part from _dcb, state read-out part from the dC pass)
    side.wait(dcb_ready)
    BNc = _tile("dbc_bn", dstate)
    nnb = triton.cdiv(dstate, BNc)
    dcsr = torch.empty(bsz, nheads, nc, T, nnb, dtype=torch.float32, device=dev)
    # MEGASSM_SSD_DBC_SPLIT: programs sharing each tile's head loop (never more than the group's heads)
    split = max(1, min(env.ssd_dbc_split(), nheads // ngroups))
    grid = (ngroups * (T // BSR) * nnb, bsz * nc, split)
    part = (torch.empty(split, bsz, seqlen, ngroups, dstate, dtype=torch.float32, device=dev) if split > 1
            else dcsr)
    _dbc_kernel[grid](
        x, dy, C, C, dcb, dtp, cs, seq, *dsn, dB, dcsr, part, seqlen, nheads, ngroups, nc, *x.stride(),
        *dy.stride(), *C.stride(), *C.stride(), ssb, ssl, dB.stride(0), dB.stride(1), P=hdim, N=dstate, T=T,
        BPF=BPF, BS=BSR, BN=BNc, IS_DC=False,
        HAS_SEQ=seq_idx is not None, DY_F32=dy_f32, PREC=_out_prec(x), SPLIT=split,
    )
    if split > 1:
        dB.copy_(part.sum(0))
    _dbc_kernel[grid](
        x, dy, B, C, dcb, dtp, cs, seq, *states, dC, dcsr, part, seqlen, nheads, ngroups, nc, *x.stride(),
        *dy.stride(), *B.stride(), *C.stride(), ssb, ssl, dC.stride(0), dC.stride(1), P=hdim, N=dstate, T=T,
        BPF=BPF, BS=BSR, BN=BNc, IS_DC=True,
        HAS_SEQ=seq_idx is not None, DY_F32=dy_f32, PREC=prec, SPLIT=split,
    )
    if split > 1:
        dC.copy_(part.sum(0))
    # the cs gradients -> the a = dt * A gradients -> ddt, dA, ddt_bias, fused (_dt_grad_kernel)
    BH = min(16, triton.next_power_of_2(nheads))
    ddt = out_or_empty(out_ddt, dt, "ssd_bwd out_ddt")
    dap = torch.empty(bsz, nc, nheads, dtype=torch.float32, device=dev)
    dbp = torch.empty_like(dap)
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)
    _dt_grad_kernel[(bsz, nc, triton.cdiv(nheads, BH))](
        dcsi, dcsr, ddt_state, dcs_last, ddt_direct, dtp, A, dt,
        dt_bias if dt_bias is not None else dt, ddt, dap, dbp, seqlen, nheads, nc, *dt.stride(), ddt.stride(0),
        ddt.stride(1), lo, hi,
        T=T, BH=BH, NSB=nsb, NNB=nnb, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        HAS_LIMIT=dt_limit is not None, num_warps=8,
    )
    dA = dap.sum(dim=(0, 1)).to(A.dtype)
    ddt_bias = dbp.sum(dim=(0, 1)).to(dt_bias.dtype) if dt_bias is not None else None
    if dinit is not None:
        dinit = dinit.to(init_in.dtype)
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit
