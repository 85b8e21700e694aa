"""Triton causal depthwise conv1d (+SiLU), channels-last x [B, L, C] (any strides), width W <= 4 (any W works).

    pre_t = bias + sum_k weight[:, k] * x_{t-(W-1)+k}     (taps of another document read as 0)
    y_t   = silu(pre_t)

Positions -(W-1)..-1 read initial_state[:, :, pos + W-1] and belong to the row's first document.
Forward: one program per (row, block of positions, block of channels). Backward, three modes
(MEGASSM_CONV_BWD, or causal_conv1d_bwd's mode):
- two_pass_defer (the default since 2026-12-06): two_pass whose pass 1 adds the dweight / dbias products
  element-wise over its blocks and reduces them over the rows once per program, not once per block and tap.
  dx and d initial_state are two_pass's; dweight / dbias the same terms summed in another order. On an H100
  (4 x 2048 x 4352, bf16) the backward takes 0.27 ms a call against two_pass's 0.45, and a mamba2-1.3b trainer
  step under CUDA graphs spends 63 ms in conv instead of 99 (+3.9% tokens/s).
- two_pass (the default from 2026-11-28 to 2026-12-06, kept as a baseline): pass 1 (_conv_dpre_kernel) computes
  pre and dpre = dy * silu'(pre) once per output position, writes dpre to an fp32 scratch [B, L, C] (without
  SiLU dpre is dy: no scratch) and per-program partial sums of dweight/dbias, reduced across the tile's rows per
  block and tap; pass 2 (_conv_dx_kernel), a forward-like conv over dpre, writes dx (s >= 0) or
  d initial_state (s < 0). At the same tiles its outputs are the fused kernel's bit for bit (in the
  interpreter).
- fused (_conv_bwd_kernel, the previous default, kept as the A/B baseline): one program per (row, block of input
  positions s in [-(W-1), L), block of channels); it recomputes pre at the W output positions each input feeds
  (from the 2W-1 shifted x tiles s-(W-1) .. s+W-1, each loaded once per block): W times the pre work and a
  register-bound tile.
The dweight/dbias partials are reduced by torch afterwards (no atomics: deterministic). The final state (last
W-1 inputs, earlier documents zeroed) is a small gather done in torch.
The decode step (causal_conv1d_step_fwd, at the end): one token, one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from ..common.lang import tcumsum, tsigmoid, tsum  # noqa: F401
from ..common.out import out_or_empty


@triton.jit
def _load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W: tl.constexpr,
             HAS_INIT: tl.constexpr):
    in_x = (pos >= 0) & (pos < L)
    pos_x = tl.where(in_x, pos, 0)
    v = tl.load(X + b * sxb + pos_x[:, None] * sxl + c[None, :] * sxc, mask=in_x[:, None] & mask_c[None, :],
                other=0.0).to(tl.float32)
    if HAS_INIT:
        j = pos + (W - 1)
        in_i = (pos < 0) & (j >= 0)
        j = tl.where(in_i, j, 0)
        v += tl.load(INIT + b * sib + c[None, :] * sic + j[:, None] * sil, mask=in_i[:, None] & mask_c[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _load_seq(SEQ, b, pos, L, ssb, ssl):
    p = tl.minimum(tl.maximum(pos, 0), L - 1)
    return tl.load(SEQ + b * ssb + p * ssl)


@triton.jit
def _pre(X, INIT, SEQ, WT, BIAS, b, t, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww,
         W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr,
         BL: tl.constexpr, BC: tl.constexpr):
    acc = tl.full([BL, BC], 0.0, tl.float32)
    if HAS_SEQ:
        st = _load_seq(SEQ, b, t, L, ssb, ssl)
    for k in tl.static_range(W):
        pos = t - (W - 1) + k
        v = _load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT)
        if HAS_SEQ:
            v = tl.where((_load_seq(SEQ, b, pos, L, ssb, ssl) == st)[:, None], v, 0.0)
        wk = tl.load(WT + c * swc + k * sww, mask=mask_c, other=0.0).to(tl.float32)
        acc += v * wk[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_fwd_kernel(X, INIT, SEQ, WT, BIAS, Y, L, C, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww,
                     syb, syl, syc,
                     W: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr,
                     SILU: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BL + tl.arange(0, BL)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    mask_c = c < C
    acc = _pre(X, INIT, SEQ, WT, BIAS, b, t, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww,
               W, HAS_INIT, HAS_SEQ, HAS_BIAS, BL, BC)
    if SILU:
        acc = acc * tsigmoid(acc)
    mask = (t < L)[:, None] & mask_c[None, :]
    tl.store(Y + b * syb + t[:, None] * syl + c[None, :] * syc, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _load_taps(WT, c, mask_c, swc, sww, W: tl.constexpr):
    """The W weight columns of channels c, fp32, as a tuple (loaded once per program)."""
    wts = ()
    for k in tl.static_range(W):
        wts = wts + (tl.load(WT + c * swc + k * sww, mask=mask_c, other=0.0).to(tl.float32),)
    return wts


@triton.jit
def _finish_dx(dx, s, seq_s, b, c, mask_c, L, C, SEQ, ssb, ssl, DFIN, sfb, sfc, sfl, DX, sdxb, sdxl, DINIT,
               W: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFIN: tl.constexpr, WANT_DINIT: tl.constexpr):
    """The backward's last step for input positions s (seq_s: their document ids, with HAS_SEQ): add d final_state,
    then store dx (s >= 0; rows of stride sdxl, unit channel stride) or d initial_state (s < 0)."""
    if HAS_DFIN:
        # final_state[:, :, j] is input position L-(W-1)+j (zeroed if of an earlier document than the last)
        j = s - (L - (W - 1))
        in_f = (j >= 0) & (j < W - 1)
        jc = tl.where(in_f, j, 0)
        df = tl.load(DFIN + b * sfb + c[None, :] * sfc + jc[:, None] * sfl,
                     mask=in_f[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if HAS_SEQ:
            same_last = seq_s == _load_seq(SEQ, b, s * 0 + (L - 1), L, ssb, ssl)
            df = tl.where(same_last[:, None], df, 0.0)
        dx += df
    in_x = (s >= 0) & (s < L)
    s_x = tl.where(in_x, s, 0)
    tl.store(DX + b * sdxb + s_x.to(tl.int64)[:, None] * sdxl + c[None, :], dx.to(DX.dtype.element_ty),
             mask=in_x[:, None] & mask_c[None, :])
    if WANT_DINIT:
        jj = s + (W - 1)
        in_i = (s < 0) & (jj >= 0)
        jj = tl.where(in_i, jj, 0)
        tl.store(DINIT + b * C * (W - 1) + c[None, :] * (W - 1) + jj[:, None], dx,
                 mask=in_i[:, None] & mask_c[None, :])


@triton.jit
def _store_partials(DW_PART, DB_PART, part, c, mask_c, kk, C, dw_acc, db_acc, W: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """One program's dweight / dbias partial sums (torch reduces them over the programs)."""
    if HAS_BIAS:
        tl.store(DB_PART + part * C + c, db_acc, mask=mask_c)
    tl.store(DW_PART + (part * W + kk[:, None]) * C + c[None, :], dw_acc, mask=(kk < W)[:, None] & mask_c[None, :])


@triton.jit
def _conv_bwd_kernel(X, INIT, SEQ, WT, BIAS, DY, DFIN, DX, DINIT, DW_PART, DB_PART, L, C, n_sblocks, sb_per_prog,
                     n_prog_l, sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww, sdyb, sdyl, sdyc, sfb, sfc, sfl,
                     sdxb, sdxl, W: tl.constexpr, WP: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_DFIN: tl.constexpr, WANT_DINIT: tl.constexpr,
                     BL: tl.constexpr, BC: tl.constexpr):
    """Per block of input positions s, every distinct shifted tile is loaded once: x (and seq_idx) at s + j for
    j = -(W-1) .. W-1 (x only for j <= 0 without SiLU: then pre is not needed), dy at s + m for m = 0 .. W-1.
    pre(s + m) reads x at s + j, j = m - (W-1) + k, i.e. tile index m + k of `xs`; it is summed in _pre's order
    (k = 0 .. W-1, then the bias): the same operations in the same order as the kernel's earlier form, which
    called _pre for each m (its outputs are bit for bit those, test_conv_bwd_bitwise_equals_old_kernel). The
    weight columns and the bias are loaded once per program. The tiles are tuples of tensors indexed by
    constexprs (the loops are unrolled)."""
    b = tl.program_id(0).to(tl.int64)
    pl = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    mask_c = c < C
    kk = tl.arange(0, WP)
    wts = _load_taps(WT, c, mask_c, swc, sww, W)
    if HAS_BIAS:
        bias = tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)
    dw_acc = tl.full([WP, BC], 0.0, tl.float32)
    db_acc = tl.full([BC], 0.0, tl.float32)
    for i in range(sb_per_prog):
        sblk = pl * sb_per_prog + i
        s = sblk * BL - (W - 1) + tl.arange(0, BL)  # input positions handled here (none past the end)
        # xs[j + W-1] = x(s + j) (initial_state below 0), sq[j + W-1] = seq_idx(s + j); j < 0 here, j = m below
        xs = ()
        sq = ()
        for q in tl.static_range(W - 1):
            pos = s + (q - (W - 1))
            xs = xs + (_load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT),)
            if HAS_SEQ:
                sq = sq + (_load_seq(SEQ, b, pos, L, ssb, ssl),)
        dx = tl.full([BL, BC], 0.0, tl.float32)
        for m in tl.static_range(W):
            t = s + m  # output position fed by input s through tap k = W-1-m
            if SILU or m == 0:
                xs = xs + (_load_in(X, INIT, b, t, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT),)
            if HAS_SEQ:
                sq = sq + (_load_seq(SEQ, b, t, L, ssb, ssl),)
            valid_t = (t >= 0) & (t < L)
            t_c = tl.where(valid_t, t, 0)
            dy = tl.load(DY + b * sdyb + t_c[:, None] * sdyl + c[None, :] * sdyc,
                         mask=valid_t[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            if SILU:
                # pre(t) = bias + sum_k w_k x(t-(W-1)+k), taps of another document than t's read as 0 (as _pre)
                pre = tl.full([BL, BC], 0.0, tl.float32)
                for k in tl.static_range(W):
                    v = xs[m + k]
                    if HAS_SEQ:
                        v = tl.where((sq[m + k] == sq[m + W - 1])[:, None], v, 0.0)
                    pre += v * wts[k][None, :]
                if HAS_BIAS:
                    pre += bias[None, :]
                sg = tsigmoid(pre)
                dpre = dy * sg * (1.0 + pre * (1.0 - sg))
            else:
                dpre = dy
            contrib = dpre * wts[W - 1 - m][None, :]
            if HAS_SEQ:
                contrib = tl.where((sq[m + W - 1] == sq[W - 1])[:, None], contrib, 0.0)
            dx += contrib
            if m == 0:
                # weight / bias gradients over the output positions t = s of this block: the taps are the
                # tiles x(s-(W-1)+k) = xs[k] that pre(s) read
                db_acc += tsum(dpre, 0)
                for k in tl.static_range(W):
                    v = xs[k]
                    if HAS_SEQ:
                        v = tl.where((sq[k] == sq[W - 1])[:, None], v, 0.0)
                    dwk = tsum(dpre * v, 0)
                    dw_acc += tl.where(kk[:, None] == k, dwk[None, :], 0.0)
        seq_s = s  # unused without seq_idx
        if HAS_SEQ:
            seq_s = sq[W - 1]
        _finish_dx(dx, s, seq_s, b, c, mask_c, L, C, SEQ, ssb, ssl, DFIN, sfb, sfc, sfl, DX, sdxb, sdxl,
                   DINIT, W, HAS_SEQ, HAS_DFIN, WANT_DINIT)
    _store_partials(DW_PART, DB_PART, b * n_prog_l + pl, c, mask_c, kk, C, dw_acc, db_acc, W, HAS_BIAS)


@triton.jit
def _conv_dpre_kernel(X, INIT, SEQ, WT, BIAS, DY, DPRE, DW_PART, DB_PART, L, C, sb_per_prog, n_prog_l,
                      sxb, sxl, sxc, sib, sic, sil, ssb, ssl, swc, sww, sdyb, sdyl, sdyc,
                      W: tl.constexpr, WP: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DEFER: tl.constexpr, BL: tl.constexpr,
                      BC: tl.constexpr):
    """Two-pass backward, pass 1: per block of output positions t, dpre(t) = dy(t) * silu'(pre(t)) into DPRE
    (fp32 [B, L, C], only with SiLU: without it dpre is dy, which pass 2 reads in place) and the dweight /
    dbias partials. The blocks, programs and every operation are those of _conv_bwd_kernel's m == 0 step (t is
    its s), so DW_PART / DB_PART and dpre are bit for bit the fused kernel's at the same tiles.
    DEFER (W <= 4; mode two_pass_defer, the default): the products dpre * x are summed element-wise over the program's blocks
    in [BL, BC] accumulators and reduced over the rows once, at the end, instead of a reduction across the
    block's rows (threads and warps) per block and tap: the same terms, another summation order."""
    b = tl.program_id(0).to(tl.int64)
    pl = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    mask_c = c < C
    kk = tl.arange(0, WP)
    wts = _load_taps(WT, c, mask_c, swc, sww, W)
    if HAS_BIAS:
        bias = tl.load(BIAS + c, mask=mask_c, other=0.0).to(tl.float32)
    dw_acc = tl.full([WP, BC], 0.0, tl.float32)
    db_acc = tl.full([BC], 0.0, tl.float32)
    # DEFER's accumulators, one per tap (named: W <= 4) and the bias; unused ones are compiled away
    a0 = tl.full([BL, BC], 0.0, tl.float32)
    a1 = tl.full([BL, BC], 0.0, tl.float32)
    a2 = tl.full([BL, BC], 0.0, tl.float32)
    a3 = tl.full([BL, BC], 0.0, tl.float32)
    ab = tl.full([BL, BC], 0.0, tl.float32)
    for i in range(sb_per_prog):
        sblk = pl * sb_per_prog + i
        t = sblk * BL - (W - 1) + tl.arange(0, BL)
        if HAS_SEQ:
            st = _load_seq(SEQ, b, t, L, ssb, ssl)
        # xm[k] = x(t-(W-1)+k), zeroed where of another document than t: pre's taps and dweight's factors
        xm = ()
        for k in tl.static_range(W):
            pos = t - (W - 1) + k
            v = _load_in(X, INIT, b, pos, c, mask_c, L, sxb, sxl, sxc, sib, sic, sil, W, HAS_INIT)
            if HAS_SEQ:
                v = tl.where((_load_seq(SEQ, b, pos, L, ssb, ssl) == st)[:, None], v, 0.0)
            xm = xm + (v,)
        valid_t = (t >= 0) & (t < L)
        t_c = tl.where(valid_t, t, 0)
        dy = tl.load(DY + b * sdyb + t_c[:, None] * sdyl + c[None, :] * sdyc,
                     mask=valid_t[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if SILU:
            pre = tl.full([BL, BC], 0.0, tl.float32)
            for k in tl.static_range(W):
                pre += xm[k] * wts[k][None, :]
            if HAS_BIAS:
                pre += bias[None, :]
            sg = tsigmoid(pre)
            dpre = dy * sg * (1.0 + pre * (1.0 - sg))
            tl.store(DPRE + b * L * C + t_c.to(tl.int64)[:, None] * C + c[None, :], dpre,
                     mask=valid_t[:, None] & mask_c[None, :])
        else:
            dpre = dy
        if DEFER:
            if HAS_BIAS:
                ab += dpre
            a0 += dpre * xm[0]
            if W > 1:
                a1 += dpre * xm[1]
            if W > 2:
                a2 += dpre * xm[2]
            if W > 3:
                a3 += dpre * xm[3]
        else:
            if HAS_BIAS:
                db_acc += tsum(dpre, 0)
            for k in tl.static_range(W):
                dwk = tsum(dpre * xm[k], 0)
                dw_acc += tl.where(kk[:, None] == k, dwk[None, :], 0.0)
    if DEFER:
        if HAS_BIAS:
            db_acc = tsum(ab, 0)
        dw_acc += tl.where(kk[:, None] == 0, tsum(a0, 0)[None, :], 0.0)
        if W > 1:
            dw_acc += tl.where(kk[:, None] == 1, tsum(a1, 0)[None, :], 0.0)
        if W > 2:
            dw_acc += tl.where(kk[:, None] == 2, tsum(a2, 0)[None, :], 0.0)
        if W > 3:
            dw_acc += tl.where(kk[:, None] == 3, tsum(a3, 0)[None, :], 0.0)
    _store_partials(DW_PART, DB_PART, b * n_prog_l + pl, c, mask_c, kk, C, dw_acc, db_acc, W, HAS_BIAS)


@triton.jit
def _conv_dx_kernel(SEQ, WT, DP, DFIN, DX, DINIT, L, C, ssb, ssl, swc, sww, sdpb, sdpl, sdpc, sfb, sfc, sfl,
                    sdxb, sdxl, W: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_DFIN: tl.constexpr,
                    WANT_DINIT: tl.constexpr, BL: tl.constexpr, BC: tl.constexpr):
    """Two-pass backward, pass 2: one program per (row, block of input positions s in [-(W-1), L), block of
    channels), dx(s) = sum_m dpre(s+m) w[W-1-m] over m = 0 .. W-1 (terms of another document than s's read as 0;
    dpre outside [0, L) as 0), plus d final_state: _conv_bwd_kernel's sums in its order, so dx and
    d initial_state are its bits (in the interpreter; a GPU may contract the products into FMAs differently)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BL - (W - 1) + tl.arange(0, BL)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    mask_c = c < C
    seq_s = s  # unused without seq_idx
    if HAS_SEQ:
        seq_s = _load_seq(SEQ, b, s, L, ssb, ssl)
    dx = tl.full([BL, BC], 0.0, tl.float32)
    for m in tl.static_range(W):
        t = s + m  # output position fed by input s through tap k = W-1-m
        valid_t = (t >= 0) & (t < L)
        t_c = tl.where(valid_t, t, 0)
        dp = tl.load(DP + b * sdpb + t_c.to(tl.int64)[:, None] * sdpl + c[None, :] * sdpc,
                     mask=valid_t[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        wk = tl.load(WT + c * swc + (W - 1 - m) * sww, mask=mask_c, other=0.0).to(tl.float32)
        contrib = dp * wk[None, :]
        if HAS_SEQ and m > 0:  # m == 0 is s's own position
            contrib = tl.where((_load_seq(SEQ, b, t, L, ssb, ssl) == seq_s)[:, None], contrib, 0.0)
        dx += contrib
    _finish_dx(dx, s, seq_s, b, c, mask_c, L, C, SEQ, ssb, ssl, DFIN, sfb, sfc, sfl, DX, sdxb, sdxl, DINIT, W,
               HAS_SEQ, HAS_DFIN, WANT_DINIT)


def _blocks(L, C, bwd=False):
    """Tiles from the H100 sweep of benchmarks/conv_tiles.py (bf16, 16 x 2048 x 4352, docs/benchmarks.md):
    forward 16 x 256, 8 warps (0.25 ms; 16 x 128 took 1.19), backward 64 x 32, 4 warps (2.16 ms; 16 x 64 took
    4.43, 64 x 64 2.68). The backward timings are of the kernel before it loaded each shifted x / seq_idx tile
    once per block (2W-1 x tiles instead of W*W + W): its best tile may have moved, and the backward sweep must
    be re-run on the device before this default is trusted (ptxas, sm_90: 64 x 32 / 4 warps still takes 255
    registers a thread, 16 x 64 / 8 warps ~120)."""
    BC = min(32 if bwd else 256, triton.next_power_of_2(max(C, 1)))
    BL = min(64 if bwd else 16, triton.next_power_of_2(max(L, 1)))
    return BL, BC


def _two_pass_tiles(npos, C):
    """(BL, BC, warps) of pass 1 and of pass 2 for npos = L + W-1 input positions. From the H200 sweep of
    benchmarks/conv_tiles.py (bf16, 4 x 2048 x 4352, 2026-11-28, docs/benchmarks.md): pass 1 16 x 32 / 4 warps
    with pass 2 16 x 256 / 8 warps took 0.44 ms, against 0.63 for 16 x 64 / 4, 0.66 for 32 x 32 / 8 and 1.01
    for the first guess 16 x 64 / 8 (the fused kernel at its default: 0.54). Pass 2's tile barely mattered
    (1.00-1.02 ms over five tiles). Registers (ptxas sm_90 via benchmarks/kernels_compile_check.py, W = 4,
    bf16): pass 1 costs ~20 per element a thread holds, so 16 x 32 / 4 warps (4 elements a thread) stays near
    78; pass 2, a forward-like conv over dpre, at the forward's 16 x 256 / 8 warps takes 78 (88 fp32).
    two_pass_defer's pass 1 (H100 sweep, 2026-12-06, same shape): 16 x 32 / 4 warps, 8 blocks a program is
    still the best, 0.27 ms for both passes, against 0.29-0.38 for 16 x 64, 32 x 32, 32 x 64, 64 x 32, 64 x 64,
    16 x 128, 32 x 128 and 2, 4 or 16 blocks a program."""
    BL1, BC1 = min(16, triton.next_power_of_2(max(npos, 1))), min(32, triton.next_power_of_2(max(C, 1)))
    BL2, BC2 = min(16, triton.next_power_of_2(max(npos, 1))), min(256, triton.next_power_of_2(max(C, 1)))
    return (BL1, BC1, 4), (BL2, BC2, 8 if BL2 * BC2 >= 2048 else 4)


def _final_state(x, initial_state, seq_idx, width):
    bsz, seqlen, channels = x.shape
    cdt = torch.promote_types(x.dtype, torch.float32)
    if initial_state is None:
        prev = x.new_zeros(bsz, width - 1, channels, dtype=cdt)
    else:
        prev = initial_state.to(cdt).transpose(1, 2)
    k = min(seqlen, width - 1)
    last = torch.cat([prev, x[:, seqlen - k:].to(cdt)], dim=1)[:, -(width - 1):] if width > 1 else prev
    if seq_idx is not None and width > 1:
        sp = torch.cat([seq_idx[:, :1].expand(bsz, width - 1), seq_idx], dim=1)[:, -(width - 1):]
        last = torch.where((sp == seq_idx[:, -1:])[..., None], last, torch.zeros_like(last))
    return last.transpose(1, 2).contiguous()


def causal_conv1d_fwd(x, weight, bias, initial_state, seq_idx, silu, return_final_state, tiles=None):
    bsz, seqlen, channels = x.shape
    width = weight.shape[-1]
    y = torch.empty(bsz, seqlen, channels, dtype=x.dtype, device=x.device)
    if seqlen > 0 and bsz > 0 and channels > 0:
        BL, BC = _blocks(seqlen, channels)
        warps = 8 if BL * BC >= 2048 else 4
        if tiles is not None:  # (BL, BC, num_warps): benchmarks/conv_tiles.py sweeps these
            BL, BC, warps = tiles
        init = initial_state if initial_state is not None else x
        seq = seq_idx if seq_idx is not None else x
        grid = (bsz, triton.cdiv(seqlen, BL), triton.cdiv(channels, BC))
        _conv_fwd_kernel[grid](
            x, init, seq, weight, bias if bias is not None else weight, y, seqlen, channels,
            x.stride(0), x.stride(1), x.stride(2),
            *(initial_state.stride() if initial_state is not None else (0, 0, 0)),
            *(seq_idx.stride() if seq_idx is not None else (0, 0)),
            weight.stride(0), weight.stride(1), y.stride(0), y.stride(1), y.stride(2),
            W=width, HAS_INIT=initial_state is not None, HAS_SEQ=seq_idx is not None, HAS_BIAS=bias is not None,
            SILU=bool(silu), BL=BL, BC=BC, num_warps=warps,
        )
    fin = _final_state(x, initial_state, seq_idx, width) if return_final_state else None
    return y, fin


def causal_conv1d_bwd(x, weight, bias, initial_state, seq_idx, silu, dy, dfinal, tiles=None, mode=None,
                      out_dx=None):
    """mode: "two_pass" (_conv_dpre_kernel, then _conv_dx_kernel), "two_pass_defer" (the same, pass 1 summing
    the dweight / dbias products over its blocks before one reduction; widths above 4 sum per block as two_pass)
    or "fused" (_conv_bwd_kernel); None reads MEGASSM_CONV_BWD (default two_pass_defer). tiles=(BL, BC, num_warps)
    is used by every kernel launched; the two_pass modes also take a pair ((pass 1's), (pass 2's))
    (benchmarks/conv_tiles.py sweeps each pass's). The fused kernel's or pass 1's tile may add a fourth entry,
    its position blocks per program (default 8). `out_dx`: a [B, L, C] tensor with unit channel stride to write dx
    into (a column block of Mamba-2's in_proj gradient, grad_blocks.GradBlocks), else dx is allocated."""
    mode = env.conv_bwd() if mode is None else mode
    if mode not in env.CONV_BWD_MODES:
        raise ValueError(f"causal_conv1d_bwd mode={mode!r}: expected one of {', '.join(env.CONV_BWD_MODES)}")
    pair = tiles is not None and isinstance(tiles[0], (tuple, list))
    if pair and mode == "fused":
        raise ValueError(f"causal_conv1d_bwd tiles={tiles!r}: a pair of tiles is for the two_pass modes only")
    bsz, seqlen, channels = x.shape
    width = weight.shape[-1]
    dx = out_or_empty(out_dx, x, "causal_conv1d_bwd out_dx")
    dinit = (torch.zeros(bsz, channels, width - 1, dtype=torch.float32, device=x.device)
             if initial_state is not None else None)
    npos = seqlen + width - 1  # input positions -(W-1) .. L-1
    if pair:
        tiles_main, tiles_dx = tiles
    elif tiles is not None:
        tiles_main = tiles_dx = tiles
    elif mode == "fused":
        tiles_main, tiles_dx = (*_blocks(npos, channels, bwd=True), 4), None
    else:
        tiles_main, tiles_dx = _two_pass_tiles(npos, channels)
    BL, BC, warps = tiles_main[:3]  # the fused kernel's or pass 1's
    n_sblocks = triton.cdiv(npos, BL)
    # 8 blocks per program by default: small dweight partials, enough programs
    sb_per_prog = min(tiles_main[3] if len(tiles_main) > 3 else 8, n_sblocks)
    n_prog_l = triton.cdiv(n_sblocks, sb_per_prog)
    # positions past the end (the last program's extra blocks) load nothing and store nothing
    dw_part = torch.empty(bsz * n_prog_l, width, channels, dtype=torch.float32, device=x.device)
    db_part = torch.empty(bsz * n_prog_l, channels, dtype=torch.float32, device=x.device)
    if bsz > 0 and channels > 0:
        init = initial_state if initial_state is not None else x
        seq = seq_idx if seq_idx is not None else x
        grid = (bsz, n_prog_l, triton.cdiv(channels, BC))
        in_strides = (x.stride(0), x.stride(1), x.stride(2),
                      *(initial_state.stride() if initial_state is not None else (0, 0, 0)),
                      *(seq_idx.stride() if seq_idx is not None else (0, 0)),
                      weight.stride(0), weight.stride(1), dy.stride(0), dy.stride(1), dy.stride(2))
        flags = dict(W=width, HAS_SEQ=seq_idx is not None)
        if mode == "fused":
            _conv_bwd_kernel[grid](
                x, init, seq, weight, bias if bias is not None else weight, dy,
                dfinal if dfinal is not None else dy, dx, dinit if dinit is not None else dx, dw_part, db_part,
                seqlen, channels, n_sblocks, sb_per_prog, n_prog_l, *in_strides,
                *(dfinal.stride() if dfinal is not None else (0, 0, 0)), dx.stride(0), dx.stride(1),
                WP=triton.next_power_of_2(width), HAS_INIT=initial_state is not None, HAS_BIAS=bias is not None,
                SILU=bool(silu), HAS_DFIN=dfinal is not None, WANT_DINIT=initial_state is not None,
                BL=BL, BC=BC, num_warps=warps, **flags,
            )
        else:
            # dpre round-trips through fp32 scratch (4 bytes an element each way) only with SiLU
            dpre = torch.empty(bsz, seqlen, channels, dtype=torch.float32, device=x.device) if silu else dy
            _conv_dpre_kernel[grid](
                x, init, seq, weight, bias if bias is not None else weight, dy, dpre, dw_part, db_part,
                seqlen, channels, sb_per_prog, n_prog_l, *in_strides,
                WP=triton.next_power_of_2(width), HAS_INIT=initial_state is not None, HAS_BIAS=bias is not None,
                SILU=bool(silu), DEFER=mode == "two_pass_defer" and width <= 4, BL=BL, BC=BC, num_warps=warps,
                **flags,
            )
            BL2, BC2, warps2 = tiles_dx[:3]
            _conv_dx_kernel[(bsz, triton.cdiv(npos, BL2), triton.cdiv(channels, BC2))](
                seq, weight, dpre, dfinal if dfinal is not None else dy, dx, dinit if dinit is not None else dx,
                seqlen, channels, *(seq_idx.stride() if seq_idx is not None else (0, 0)),
                weight.stride(0), weight.stride(1), dpre.stride(0), dpre.stride(1), dpre.stride(2),
                *(dfinal.stride() if dfinal is not None else (0, 0, 0)), dx.stride(0), dx.stride(1),
                HAS_DFIN=dfinal is not None, WANT_DINIT=initial_state is not None,
                BL=BL2, BC=BC2, num_warps=warps2, **flags,
            )
    dw = dw_part.sum(0).t().to(weight.dtype)
    db = db_part.sum(0).to(bias.dtype) if bias is not None else None
    if dinit is not None:
        dinit = dinit.to(initial_state.dtype)
    return dx, dw, db, dinit


# decode step: one token of the causal conv (+SiLU), one launch; its backward (rarely needed: decoding runs under
# no_grad) goes through the reference (conv1d/op.py)


@triton.jit
def _conv_step_kernel(STATE, X, WT, BIAS, Y, NEW, C, ssb, ssc, ssw, sxb, sxc, swc, sww,
                      W: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    x = tl.load(X + b * sxb + c * sxc, mask=mc, other=0.0).to(tl.float32)
    acc = x * tl.load(WT + c * swc + (W - 1) * sww, mask=mc, other=0.0).to(tl.float32)
    for k in tl.static_range(W - 1):
        v = tl.load(STATE + b * ssb + c * ssc + k * ssw, mask=mc, other=0.0).to(tl.float32)
        acc += v * tl.load(WT + c * swc + k * sww, mask=mc, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(NEW + (b * C + c) * (W - 1) + (k - 1), v, mask=mc)
    if W > 1:
        tl.store(NEW + (b * C + c) * (W - 1) + (W - 2), x, mask=mc)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tsigmoid(acc)
    tl.store(Y + b * C + c, acc.to(Y.dtype.element_ty), mask=mc)


def causal_conv1d_step_fwd(state, x, weight, bias, silu):
    bsz, ch = x.shape
    width = weight.shape[-1]
    y = torch.empty(bsz, ch, dtype=x.dtype, device=x.device)
    new = torch.empty(bsz, ch, width - 1, dtype=torch.float32, device=x.device)
    BC = min(1024, triton.next_power_of_2(ch))
    _conv_step_kernel[(bsz, triton.cdiv(ch, BC))](
        state, x, weight, bias if bias is not None else weight, y, new, ch, *state.stride(), *x.stride(),
        *weight.stride(), W=width, BC=BC, HAS_BIAS=bias is not None, SILU=bool(silu), num_warps=4,
    )
    return y, new
