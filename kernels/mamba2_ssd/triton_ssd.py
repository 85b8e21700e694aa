"""Triton SSD (Mamba-2 chunked scan). Written from the math in reference/ssd.py. Modules: this one has the
forward's own kernels and ssd_fwd; ssd_states.py the chunk walks (forward and backward); ssd_bwd.py the rest of
the backward; ssd_common.py the autotuner, the precision-aware products, the stored-state format and the tiles.

Per batch row b, head h (group g = h // (H/G)), chunk c of T tokens, positions t, s inside the chunk:

    dt_t   = clamp(softplus(dt_raw_t + dt_bias)),  a_t = dt_t * A,  cs_t = a_0 + .. + a_t  (within the chunk)
    CB_ts  = C_t . B_s                                                   (per group)
    L_ts   = exp(cs_t - cs_s) if s <= t and doc(s) == doc(t) else 0
    S_0    = initial state;  S_{c+1} = exp(cs_last) keep_c S_c + sum_s exp(cs_last - cs_s) m'_s dt_s x_s (x) B_s
    y_t    = sum_s L_ts CB_ts dt_s x_s + exp(cs_t) m_t S_c C_t ;   out = (y + D x) * silu(z)

m'_s: s is of the chunk's last document; m_t: t is of the document of the state entering the chunk; keep_c:
the entering state's document is the chunk's last document. Pad positions (t >= L) carry dt = 0, x = 0.

Forward kernels:  _dt_kernel (dt processing + in-chunk cumsum), _cb_kernel (C B^T per chunk and group),
_states_kernel (ssd_states.py: chunk end states and the passing across chunks fused: one program walks the
chunks of its (b, h, P-block, N-block) in order, so the chunk states never round-trip through memory),
_scan_kernel (outputs: state read-out + masked intra-chunk quadratic form, D skip and z gate fused).
With MEGASSM_SSD_STATE_SEGMENTS=k the chunk walks run as k parallel segments (the later ones from zero), and
_states_fix_kernel adds each previous segment's true end state, decayed, to the later segments' chunks
(_dstates_kernel / _dstates_fix_kernel likewise in reverse): parallelism for a few long rows.

Backward (recomputes dt/cs, CB and the entering states; the SSM output only with the gate z, in _scan_kernel's
BWD mode, which writes dy = dout * silu(z) and dz; then):
  _dstates_kernel (ssd_states.py): reverse pass over chunks, dS_{c+1} (gradient of the state leaving chunk c) for every
      chunk, d initial_states, and exp(cs_last) <dS_{c+1}, S_c> (the cs_last gradient through the entering state);
  _dx_kernel (per head, block of s): dx, the direct dt gradient x_s . Q_s, its state part dt_s x_s . Q_s(state)
      (the source-side cs_s gradient through the state leaving the chunk) and dD partials;
  _dcb_kernel (per group): the gradient of C_t . B_s summed over the group's heads, and per head the
      intra-chunk part of dy_t . y_t (the cs_t gradient; in the bf16 mode minus the source-side cs_s part);
  _dbc_kernel (per group, block of positions, block of N; loops over the group's heads): dB and dC, and in
      the dC pass the state read-out part of dy_t . y_t;
  _dt_grad_kernel (ssd_bwd.py): the cs gradients -> the a = dt A gradients (from terms that do not cancel
      across kernels, docs/kernels.md) -> ddt through softplus/clamp/bias; partials for dA, ddt_bias.
No atomics anywhere: every reduction is a loop inside one program or a torch sum over partials, so results
are deterministic run to run.

Streams: the kernels that do not depend on the chunk walks (_cb_kernel; in the backward also _dcb_kernel) are
queued on a second CUDA stream beside them (ssd_common._Side, MEGASSM_SSD_STREAMS=1, the default), joined with
events before their readers; the same kernels in the same per-stream order, so the same bits as one stream.

The per-chunk states S and dS are stored as the dot operands their readers need (_st_store: fp32, or bf16
hi + lo arrays, or bf16 alone in MEGASSM_SSD_PRECISION=bf16 mode). Intra-chunk tiles wholly below the diagonal
factor the decay exp(cs_t - cs_s) = exp(cs_t - cs_r) exp(cs_r - cs_s) around a position r between them (both
factors <= 1 since A <= 0): two vectors per tile instead of an exp and a causal mask per element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tcumsum, tsigmoid, tsoftplus
from .triton_ssd_common import (
    _autotune,
    _contig_last,
    _dt_biased,
    _mm_a_st,
    _mm_af,
    _mm_raw,
    _out_prec,
    _pow2_block,
    _prec,
    _seq_args,
    _Side,
    _seq_at,
    _state_base,
    _state_buffer_dtype,
    _state_buffer_shape,
    _tile,
)
from .triton_ssd_states import _state_segments, _states

@triton.jit
def _dt_kernel(DT, DT_BIAS, A, DTP, CS, L, H, NC, sdb, sdl, sdh, dt_lo, dt_hi,
               T: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
               HAS_LIMIT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2) * BH + tl.arange(0, BH)
    t = tl.arange(0, T)
    pos = c * T + t
    mt = pos < L
    mh = h < H
    m = mt[:, None] & mh[None, :]
    dt = _dt_biased(DT, DT_BIAS, b, pos, h, m, mh, sdb, sdl, sdh, HAS_BIAS)
    if SOFTPLUS:
        dt = tsoftplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where(m, dt, 0.0)
    a = dt * tl.load(A + h, mask=mh, other=0.0).to(tl.float32)[None, :]
    cs = tcumsum(a, axis=0)
    off = ((b * H + h[None, :]) * NC + c) * T + t[:, None]
    tl.store(DTP + off, dt, mask=mh[None, :])
    tl.store(CS + off, cs, mask=mh[None, :])


@triton.jit
def _cb_kernel(Cp, Bp, CB, L, G, NC, scb, scl, scg, scn, sbb, sbl, sbg, sbn,
               N: tl.constexpr, T: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    bc = tl.program_id(0)
    b = (bc // NC).to(tl.int64)
    c = bc % NC
    g = tl.program_id(1)
    nsb: tl.constexpr = T // BT
    tb = tl.program_id(2) // nsb
    sb = tl.program_id(2) % nsb
    if sb <= tb:  # blocks above the diagonal are never read
        t = tb * BT + tl.arange(0, BT)
        s = sb * BT + tl.arange(0, BT)
        pt = c * T + t
        ps = c * T + s
        acc = tl.full([BT, BT], 0.0, tl.float32)
        for k0 in range(0, N, BK):
            k = k0 + tl.arange(0, BK)
            mk = k < N
            cv = tl.load(Cp + b * scb + pt[:, None] * scl + g * scg + k[None, :] * scn,
                         mask=(pt < L)[:, None] & mk[None, :], other=0.0)
            bv = tl.load(Bp + b * sbb + ps[None, :] * sbl + g * sbg + k[:, None] * sbn,
                         mask=(ps < L)[None, :] & mk[:, None], other=0.0)
            acc += _mm_raw(cv, bv, PREC)
        off = (((b * NC + c) * G + g) * T + t[:, None]) * T + s[None, :]
        tl.store(CB + off, acc)


# the capped configs (maxnreg=128: four programs per multiprocessor at 4 warps) first: 0.655 -> 0.58 ms at 16 x 2K
@_autotune([triton.Config({}, num_warps=4, num_stages=3, maxnreg=128),
            triton.Config({}, num_warps=4, num_stages=2, maxnreg=128), triton.Config({}, num_warps=8, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=3), triton.Config({}, num_warps=8, num_stages=1)],
           key=["T", "P", "N", "BT", "BS", "BK"])
@triton.jit
def _scan_kernel(X, Z, Cp, CB, DTP, CS, SEQ, STH, STL, Dp, Y, DOUT, DY, DZ, L, H, G, NC,
                 sxb, sxl, sxh, sxp, szb, szl, szh, szp, scb, scl, scg, scn, ssb, ssl,
                 syb, syl, syh, syp, sdob, sdol, sdoh, sdop,
                 P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BP: tl.constexpr,
                 BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                 HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr,
                 BWD: tl.constexpr, PREC: tl.constexpr):
    """Forward: Y = (y + D x) * silu(z). BWD (with z only): y stays in registers and the epilogue takes the
    output gradient: DY = dout * silu(z) and DZ."""
    # axis 0 runs over (head, T-block, P-block) of one chunk, so the programs sharing a chunk's CB and C
    # tiles run together (L2 reuse across heads)
    bc = tl.program_id(1)
    b = (bc // NC).to(tl.int64)
    c = bc % NC
    npb: tl.constexpr = (P + BP - 1) // BP
    ntp: tl.constexpr = (T // BT) * npb
    h = tl.program_id(0) // ntp
    tp = tl.program_id(0) % ntp
    g = h // (H // G)
    tb = tp // npb
    pb = tp % npb
    t = tb * BT + tl.arange(0, BT)
    p = pb * BP + tl.arange(0, BP)
    mp = p < P
    pt = c * T + t
    mt = pt < L
    dbase = ((b * H + h) * NC + c) * T
    cs_t = tl.load(CS + dbase + t)
    if HAS_SEQ:
        seq_t = _seq_at(SEQ, b, pt, L, ssb, ssl)
    # intra-chunk: sum_s L_ts CB_ts dt_s x_s. Source blocks wholly before this target block (s < r <= t, r its
    # first position) factor the decay as exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1 (A <= 0): the tiles take
    # the second, a vector over s, and the first, over t, scales their sum once (no exp and causal mask per
    # element); pad sources carry dt = 0 and CB = 0.
    cb_base = ((b * NC + c) * G + g) * T * T
    r = tb * BT
    cs_r = tl.load(CS + dbase + r)
    acc = tl.full([BT, BP], 0.0, tl.float32)
    s_mid = (r // BS) * BS
    for s0 in range(0, s_mid, BS):
        s = s0 + tl.arange(0, BS)
        ps = c * T + s
        cb = tl.load(CB + cb_base + t[:, None] * T + s[None, :])
        f_s = tl.exp(cs_r - tl.load(CS + dbase + s)) * tl.load(DTP + dbase + s)
        w = cb * f_s[None, :]
        if HAS_SEQ:
            w = tl.where(_seq_at(SEQ, b, ps, L, ssb, ssl)[None, :] == seq_t[:, None], w, 0.0)
        xv = tl.load(X + b * sxb + ps[:, None] * sxl + h * sxh + p[None, :] * sxp,
                     mask=(ps < L)[:, None] & mp[None, :], other=0.0)
        acc += _mm_af(w, xv, PREC)
    acc = acc * tl.exp(cs_t - cs_r)[:, None]
    # read-out of the entering state: exp(cs_t) m_t C_t S^T (its own accumulator, scaled per row)
    acc_s = tl.full([BT, BP], 0.0, tl.float32)
    st_off = ((b * NC + c) * H + h) * P * N
    for k0 in range(0, N, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < N
        cv = tl.load(Cp + b * scb + pt[:, None] * scl + g * scg + k[None, :] * scn,
                     mask=mt[:, None] & mk[None, :], other=0.0)
        acc_s += _mm_a_st(cv, STH, STL, st_off + p[None, :] * N + k[:, None], mk[:, None] & mp[None, :], False,
                          PREC)
    row = tl.exp(cs_t)
    if HAS_SEQ:
        sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)
        row = tl.where(seq_t == sid_in, row, 0.0)
    acc += acc_s * row[:, None]
    for s0 in range(s_mid, r + BT, BS):
        s = s0 + tl.arange(0, BS)
        ps = c * T + s
        ms = ps < L
        cb = tl.load(CB + cb_base + t[:, None] * T + s[None, :])
        cs_s = tl.load(CS + dbase + s)
        dt_s = tl.load(DTP + dbase + s)
        ok = (s[None, :] <= t[:, None]) & ms[None, :]
        if HAS_SEQ:
            seq_s = _seq_at(SEQ, b, ps, L, ssb, ssl)
            ok = ok & (seq_s[None, :] == seq_t[:, None])
        w = tl.where(ok, cb * tl.exp(tl.where(ok, cs_t[:, None] - cs_s[None, :], 0.0)) * dt_s[None, :], 0.0)
        xv = tl.load(X + b * sxb + ps[:, None] * sxl + h * sxh + p[None, :] * sxp,
                     mask=ms[:, None] & mp[None, :], other=0.0)
        acc += _mm_af(w, xv, PREC)
    m = mt[:, None] & mp[None, :]
    if BWD:
        do = tl.load(DOUT + b * sdob + pt[:, None] * sdol + h * sdoh + p[None, :] * sdop, mask=m,
                     other=0.0).to(tl.float32)
        zv = tl.load(Z + b * szb + pt[:, None] * szl + h * szh + p[None, :] * szp, mask=m,
                     other=0.0).to(tl.float32)
        sz = tsigmoid(zv)
        pre = acc
        if HAS_D:
            xt = tl.load(X + b * sxb + pt[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=m,
                         other=0.0).to(tl.float32)
            if D_PER_CHANNEL:
                dv = tl.load(Dp + h * P + p, mask=mp, other=0.0).to(tl.float32)[None, :]
            else:
                dv = tl.load(Dp + h).to(tl.float32)
            pre = acc + xt * dv
        dz = do * pre * (sz * (1.0 + zv * (1.0 - sz)))
        tl.store(DZ + ((b * L + pt[:, None]) * H + h) * P + p[None, :], dz.to(DZ.dtype.element_ty), mask=m)
        tl.store(DY + ((b * L + pt[:, None]) * H + h) * P + p[None, :], do * (zv * sz), mask=m)
    else:
        if HAS_D:
            xt = tl.load(X + b * sxb + pt[:, None] * sxl + h * sxh + p[None, :] * sxp, mask=m,
                         other=0.0).to(tl.float32)
            if D_PER_CHANNEL:
                dv = tl.load(Dp + h * P + p, mask=mp, other=0.0).to(tl.float32)[None, :]
            else:
                dv = tl.load(Dp + h).to(tl.float32)
            acc += xt * dv
        if HAS_Z:
            zv = tl.load(Z + b * szb + pt[:, None] * szl + h * szh + p[None, :] * szp, mask=m,
                         other=0.0).to(tl.float32)
            acc = acc * (zv * tsigmoid(zv))
        tl.store(Y + b * syb + pt[:, None] * syl + h * syh + p[None, :] * syp, acc.to(Y.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------------------
# host side: forward

def supported(x, chunk_size):
    """Whether the Triton path takes this call (otherwise op.py uses the reference)."""
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and chunk_size >= 16
            and chunk_size & (chunk_size - 1) == 0)


def _chunk_len(seqlen, chunk_size):
    # a chunk longer than the (power-of-two padded) sequence is only padding
    return max(16, min(chunk_size, triton.next_power_of_2(max(seqlen, 1))))


def _prep(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, seq_idx, chunk_size, side):
    """dt / cs per chunk (on the current stream), then C B^T per chunk and group queued on `side` (_Side):
    (T, nc, dtp, cs, cb, cb_ready); wait for cb_ready before reading cb."""
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = B.shape[-2:]
    T = _chunk_len(seqlen, chunk_size)
    nc = triton.cdiv(seqlen, T)
    dev = x.device
    dtp = torch.empty(bsz, nheads, nc, T, dtype=torch.float32, device=dev)
    cs = torch.empty_like(dtp)
    BH = min(16, triton.next_power_of_2(nheads))
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)
    _dt_kernel[(bsz, nc, triton.cdiv(nheads, BH))](
        dt, dt_bias if dt_bias is not None else dt, A, dtp, cs, seqlen, nheads, nc,
        dt.stride(0), dt.stride(1), dt.stride(2), lo, hi,
        T=T, BH=BH, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_LIMIT=dt_limit is not None,
    )
    cb = torch.empty(bsz, nc, ngroups, T, T, dtype=torch.float32, device=dev)
    BT = _tile("cb_bt", T)
    BK = _pow2_block(dstate, 64)
    cb_ready = side.run(lambda: _cb_kernel[(bsz * nc, ngroups, (T // BT) ** 2)](
        C, B, cb, seqlen, ngroups, nc, *C.stride(), *B.stride(), N=dstate, T=T, BT=BT, BK=BK, PREC=_prec(x),
    ))
    return T, nc, dtp, cs, cb, cb_ready


def _scan(x, z, C, D, cb, dtp, cs, seq_idx, states, T, nc, dout=None):
    """Forward output y, or with dout and z (backward): (dy = dout * silu(z) in fp32, dz)."""
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = C.shape[-2:]
    bwd = dout is not None
    assert not bwd or z is not None, "the backward recomputes the output only for the gate"
    BP = _pow2_block(hdim, 64)
    BT = _tile("scan_bt", T)
    dev = x.device
    if bwd:
        y = x  # unused
        dy = torch.empty(bsz, seqlen, nheads, hdim, dtype=torch.float32, device=dev)
        dz = torch.empty(z.shape, dtype=z.dtype, device=dev)
    else:
        y = torch.empty(bsz, seqlen, nheads, hdim, dtype=x.dtype, device=dev)
        dy = dz = None
        dout = y
    seq, ssb, ssl = _seq_args(seq_idx, x)

    grid = (nheads * triton.cdiv(T, BT) * triton.cdiv(hdim, BP), bsz * nc)
    _scan_kernel[grid](
        x, z if z is not None else x, C, cb, dtp, cs, seq, *states, D if D is not None else x, y,
        dout, dy if dy is not None else y, dz if dz is not None else y,
        seqlen, nheads, ngroups, nc, *x.stride(), *(z.stride() if z is not None else (0, 0, 0, 0)),
        *C.stride(), ssb, ssl, *y.stride(), *dout.stride(),
        P=hdim, N=dstate, T=T, BP=BP, BT=BT, BS=_tile("scan_bs", T),
        BK=_tile("scan_bk", dstate), HAS_SEQ=seq_idx is not None,
        HAS_D=D is not None,
        D_PER_CHANNEL=D is not None and D.dim() == 2, HAS_Z=z is not None, BWD=bwd, PREC=_out_prec(x),
    )
    if bwd:
        return dy, dz
    return y


def ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
            return_final_states, keep_states=False):
    """(y, final states or None, what the backward keeps or None). With keep_states, the entering states of every
    chunk as one buffer (_state_base): what ssd_bwd would otherwise recompute (MEGASSM_SSD_SAVE_STATES).
    Otherwise, when the chunk walk ran in segments, their true end states (fp32, flattened; one state per row,
    segment and head): ssd_bwd's recompute starts each segment from them instead of fixing up its states."""
    x, B, C, z = _contig_last(x), _contig_last(B), _contig_last(C), _contig_last(z)
    D = D.contiguous() if D is not None else None
    A = A.contiguous()
    if initial_states is not None:
        initial_states = initial_states.contiguous()
    side = _Side(x)  # C B^T beside the chunk walk
    T, nc, dtp, cs, cb, cb_ready = _prep(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, seq_idx, chunk_size, side)
    states, final, ends = _states(x, B, dtp, cs, seq_idx, initial_states, T, nc, want_final=return_final_states,
                                  readout_only=not keep_states)
    side.wait(cb_ready)
    y = _scan(x, z, C, D, cb, dtp, cs, seq_idx, states, T, nc)
    return y, final, (_state_base(states) if keep_states else ends)  # final: None unless return_final_states


def kept_state_shape(x, B, chunk_size, keep_states):
    """(shape, dtype) of what ssd_fwd returns for the backward (its third output), or None: what the custom op's
    fake implementation returns."""
    bsz, seqlen, nheads, hdim = x.shape
    dstate = B.shape[-1]
    nc = triton.cdiv(seqlen, _chunk_len(seqlen, chunk_size))
    if keep_states:
        return _state_buffer_shape(x, (bsz, nc, nheads, hdim, dstate)), _state_buffer_dtype(x)
    nseg, _ = _state_segments(x, bsz, nheads, hdim, dstate, nc)
    return ((bsz * nseg * nheads * hdim * dstate,), torch.float32) if nseg > 1 else None
