"""The SSD's chunk walks: the entering state of every chunk (_states_kernel, forward) and the gradient of the
state leaving every chunk (_dstates_kernel, backward). One program walks the chunks of its (row, head, P-block,
N-block) in order, so the chunk states never round-trip through memory. With MEGASSM_SSD_STATE_SEGMENTS=k the
chunks are walked as k segments in parallel (the later ones from zero); _segment_ends_kernel makes the segment ends
true, and _states_fix_kernel / _dstates_fix_kernel complete the later segments' chunks: parallelism for a few long
rows. The math is in ssd.py's docstring."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import env
from . import triton_ssd_common
from ..common.lang import tsum
from .triton_ssd_common import (
    _autotune,
    _mma_af,
    _out_prec,
    _pow2_block,
    _prec,
    _seq_args,
    _seq_at,
    _st_load,
    _st_store,
    _state_buffer,
    _tile,
)


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=3)], key=["T", "BP", "BN", "BS"])
@triton.jit
def _states_kernel(X, Bp, DTP, CS, SEQ, INIT, SEGI, STH, STL, FINAL, L, H, G, NC, NSEG, CPS,
                   sxb, sxl, sxh, sxp, sbb, sbl, sbg, sbn, ssb, ssl, sib, sih, sip, sin,
                   P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   BS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEGI: tl.constexpr, HAS_SEQ: tl.constexpr,
                   HAS_FINAL: tl.constexpr, PREC: tl.constexpr, STORE: tl.constexpr, STORE0: tl.constexpr):
    """Walks the chunks [seg * CPS, seg * CPS + CPS) of one (row, segment, head, P-block, N-block) in order:
    stores each chunk's entering state, then (HAS_FINAL) the segment's end state into FINAL[b, seg]. Segments
    after the first start from zero (their entering states are completed by _states_fix_kernel), or with
    HAS_SEGI from their true entering states, SEGI[b, seg - 1] (the true segment ends of an earlier walk over
    the same inputs: the backward's recompute); with NSEG = 1 this is the whole sequence and FINAL the final
    state. PREC: the products' precision; STORE: the stored states' format (_st_store), PREC's or hi alone when
    only _scan reads them (_out_prec); STORE0: the first segment's (whose states are final as walked: hi alone
    where only _scan reads them, while the later segments keep STORE for their fix-up)."""
    b = (tl.program_id(0) // NSEG).to(tl.int64)
    seg = tl.program_id(0) % NSEG
    h = tl.program_id(1)
    npb: tl.constexpr = (P + BP - 1) // BP
    pb = tl.program_id(2) % npb
    nb = tl.program_id(2) // npb
    g = h // (H // G)
    p = pb * BP + tl.arange(0, BP)
    n = nb * BN + tl.arange(0, BN)
    mp = p < P
    mn = n < N
    if HAS_INIT:  # the initial state enters the first segment only
        S = tl.load(INIT + b * sib + h * sih + p[:, None] * sip + n[None, :] * sin,
                    mask=mp[:, None] & mn[None, :] & (seg == 0), other=0.0).to(tl.float32)
    else:
        S = tl.full([BP, BN], 0.0, tl.float32)
    if HAS_SEGI:  # the masks are disjoint: S is exactly one of the two
        S += tl.load(SEGI + ((b * NSEG + seg - 1) * H + h) * P * N + p[:, None] * N + n[None, :],
                     mask=mp[:, None] & mn[None, :] & (seg > 0), other=0.0)
    st_base = (b * NC * H + h) * P * N
    for c in range(seg * CPS, tl.minimum(seg * CPS + CPS, NC)):
        off = st_base + c * H * P * N + p[:, None] * N + n[None, :]
        if seg == 0:
            _st_store(STH, STL, off, S, mp[:, None] & mn[None, :], STORE0)
        else:
            _st_store(STH, STL, off, S, mp[:, None] & mn[None, :], STORE)
        dbase = ((b * H + h) * NC + c) * T
        cs_last = tl.load(CS + dbase + T - 1)
        last = tl.minimum(c * T + T, L) - 1
        if HAS_SEQ:
            seq_last = _seq_at(SEQ, b, last, L, ssb, ssl)
        decay = tl.exp(cs_last)
        if HAS_SEQ:
            sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)  # clamps to position 0 for c = 0
            decay = tl.where(sid_in == seq_last, decay, 0.0)
        # S_{c+1} = decay S_c + the chunk's own contribution, accumulated into S in place (no second [BP, BN]
        # fp32 accumulator: fewer registers per program)
        S = S * decay
        for s0 in range(0, T, BS):
            s = s0 + tl.arange(0, BS)
            pos = c * T + s
            ms = pos < L
            xv = tl.load(X + b * sxb + pos[:, None] * sxl + h * sxh + p[None, :] * sxp,
                         mask=ms[:, None] & mp[None, :], other=0.0)
            bv = tl.load(Bp + b * sbb + pos[:, None] * sbl + g * sbg + n[None, :] * sbn,
                         mask=ms[:, None] & mn[None, :], other=0.0)
            dts = tl.load(DTP + dbase + s)
            css = tl.load(CS + dbase + s)
            scale = dts * tl.exp(tl.minimum(cs_last - css, 0.0))
            ok = ms
            if HAS_SEQ:
                ok = ok & (_seq_at(SEQ, b, pos, L, ssb, ssl) == seq_last)
            scale = tl.where(ok, scale, 0.0)
            xs = xv.to(tl.float32) * scale[:, None]
            S = _mma_af(S, tl.trans(xs), bv, PREC)
    if HAS_FINAL:
        tl.store(FINAL + ((b * NSEG + seg) * H + h) * P * N + p[:, None] * N + n[None, :], S,
                 mask=mp[:, None] & mn[None, :])


@triton.jit
def _decay_product(CS, SEQ, b, h, c0, c1, L, H, NC, ssb, ssl, T: tl.constexpr, CPB: tl.constexpr,
                   HAS_SEQ: tl.constexpr):
    """The product of the chunk decays of chunks [c0, c1) (c1 - c0 <= CPB; 1 when empty): exp of the sum of
    their cs_last, 0 when a document starts inside one of them after its first position (the entering state
    does not cross it; as _states_kernel's `decay`)."""
    cc = c0 + tl.arange(0, CPB)
    mc = cc < c1
    w = tl.exp(tsum(tl.load(CS + ((b * H + h) * NC + cc) * T + T - 1, mask=mc, other=0.0), axis=0))
    if HAS_SEQ:
        first = _seq_at(SEQ, b, cc * T - 1, L, ssb, ssl)
        last = _seq_at(SEQ, b, tl.minimum(cc * T + T, L) - 1, L, ssb, ssl)
        w = tl.where(tsum(tl.where(mc & (first != last), 1, 0), axis=0) > 0, 0.0, w)
    return w


@triton.jit
def _segment_ends_kernel(ENDS, CS, SEQ, L, H, NC, NSEG, CPS, ssb, ssl, PN: tl.constexpr, BLK: tl.constexpr,
                         T: tl.constexpr, CPB: tl.constexpr, HAS_SEQ: tl.constexpr, REVERSE: tl.constexpr):
    """In place, in segment order: ENDS[b, k] += (the decay across segment k) * ENDS[b, k -+ 1]. Forward
    (REVERSE False): the segments' end states, from zero-started walks to true ones; backward: the gradients
    of their entering states, last segment first. One program per (row, head, block of P x N)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLK + tl.arange(0, BLK)
    m = j < PN
    k0 = 0
    if REVERSE:
        k0 = NSEG - 1
    prev = tl.load(ENDS + ((b * NSEG + k0) * H + h) * PN + j, mask=m, other=0.0)
    for i in range(1, NSEG):
        k = i
        if REVERSE:
            k = NSEG - 1 - i
        w = _decay_product(CS, SEQ, b, h, k * CPS, tl.minimum(k * CPS + CPS, NC), L, H, NC, ssb, ssl, T, CPB,
                           HAS_SEQ)
        off = ((b * NSEG + k) * H + h) * PN + j
        prev = tl.load(ENDS + off, mask=m, other=0.0) + w * prev
        tl.store(ENDS + off, prev, mask=m)


@triton.jit
def _states_fix_kernel(STH, STL, ENDS, CS, SEQ, L, NC, H, CPS, ssb, ssl, PN: tl.constexpr, BLK: tl.constexpr,
                       T: tl.constexpr, CPB: tl.constexpr, HAS_SEQ: tl.constexpr, PREC: tl.constexpr,
                       OUT: tl.constexpr):
    """Completes the entering states of the chunks of segments after the first: S_c += (the decays of the
    segment's chunks before c) * ENDS[b, seg - 1, h] (the true end state of the previous segment). Reads the
    walk's format (PREC), writes OUT (hi alone where only _scan reads the states)."""
    j = tl.program_id(2) * BLK + tl.arange(0, BLK)
    h = tl.program_id(1)
    nfix = NC - CPS
    b = (tl.program_id(0) // nfix).to(tl.int64)
    c = CPS + tl.program_id(0) % nfix
    seg = c // CPS
    nseg = (NC + CPS - 1) // CPS
    m = j < PN
    w = _decay_product(CS, SEQ, b, h, seg * CPS, c, L, H, NC, ssb, ssl, T, CPB, HAS_SEQ)
    prev = tl.load(ENDS + ((b * nseg + seg - 1) * H + h) * PN + j, mask=m, other=0.0)
    off = ((b * NC + c) * H + h) * PN + j
    _st_store(STH, STL, off, _st_load(STH, STL, off, m, PREC) + w * prev, m, OUT)


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=3)], key=["T", "BP", "BN", "BT"])
@triton.jit
def _dstates_kernel(DY, Cp, CS, SEQ, STH, STL, DFIN, DSH, DSL, DCSL, DINIT, L, H, G, NC, NSEG, CPS,
                    sdyb, sdyl, sdyh, sdyp, scb, scl, scg, scn, ssb, ssl,
                    P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    BT: tl.constexpr, HAS_DFIN: tl.constexpr, HAS_SEQ: tl.constexpr, WANT_DINIT: tl.constexpr,
                    PREC: tl.constexpr):
    """Reverse pass over the chunks [seg * CPS, seg * CPS + CPS): dS_{c+1} for every chunk (into DSN[b, c, h]),
    partials of decay_c <dS_{c+1}, S_c> (the cs_last gradient through the entering state carried across the
    chunk), and the gradient of the segment's entering state into DINIT[b, seg]. The last segment starts
    from d final_states, the others from zero (_dstates_fix_kernel completes them)."""
    b = (tl.program_id(0) // NSEG).to(tl.int64)
    seg = tl.program_id(0) % NSEG
    h = tl.program_id(1)
    blk = tl.program_id(2)
    nblk = tl.num_programs(2)
    npb: tl.constexpr = (P + BP - 1) // BP
    pb = blk % npb
    nb = blk // npb
    g = h // (H // G)
    p = pb * BP + tl.arange(0, BP)
    n = nb * BN + tl.arange(0, BN)
    mp = p < P
    mn = n < N
    mpn = mp[:, None] & mn[None, :]
    pn = p[:, None] * N + n[None, :]
    c0 = seg * CPS
    c1 = tl.minimum(c0 + CPS, NC)
    if HAS_DFIN:
        dS = tl.load(DFIN + (b * H + h) * P * N + pn, mask=mpn & (seg == NSEG - 1), other=0.0).to(tl.float32)
    else:
        dS = tl.full([BP, BN], 0.0, tl.float32)
    for ci in range(c0, c1):
        c = c0 + c1 - 1 - ci
        st_off = ((b * NC + c) * H + h) * P * N
        _st_store(DSH, DSL, st_off + pn, dS, mpn, PREC)
        dbase = ((b * H + h) * NC + c) * T
        decay = tl.exp(tl.load(CS + dbase + T - 1))
        if HAS_SEQ:
            sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)
            last = tl.minimum(c * T + T, L) - 1
            decay = tl.where(sid_in == _seq_at(SEQ, b, last, L, ssb, ssl), decay, 0.0)
        S_in = _st_load(STH, STL, st_off + pn, mpn, PREC)
        tl.store(DCSL + ((b * H + h) * NC + c) * nblk + blk, decay * tsum(tsum(dS * S_in, axis=1), axis=0))
        dS = dS * decay  # then the chunk's own term, accumulated in place (as in _states_kernel)
        for t0 in range(0, T, BT):
            t = t0 + tl.arange(0, BT)
            pt = c * T + t
            mt = pt < L
            dyv = tl.load(DY + b * sdyb + pt[:, None] * sdyl + h * sdyh + p[None, :] * sdyp,
                          mask=mt[:, None] & mp[None, :], other=0.0)
            cv = tl.load(Cp + b * scb + pt[:, None] * scl + g * scg + n[None, :] * scn,
                         mask=mt[:, None] & mn[None, :], other=0.0)
            row = tl.exp(tl.load(CS + dbase + t))
            ok = mt
            if HAS_SEQ:
                ok = ok & (_seq_at(SEQ, b, pt, L, ssb, ssl) == sid_in)
            row = tl.where(ok, row, 0.0)
            dys = dyv.to(tl.float32) * row[:, None]
            dS = _mma_af(dS, tl.trans(dys), cv, PREC)
    if WANT_DINIT:
        tl.store(DINIT + ((b * NSEG + seg) * H + h) * P * N + pn, dS, mask=mpn)


@triton.jit
def _dstates_fix_kernel(DSH, DSL, STH, STL, GST, CS, SEQ, DCSF, L, NC, H, CPS, NFIX, ssb, ssl, PN: tl.constexpr,
                        BLK: tl.constexpr, T: tl.constexpr, CPB: tl.constexpr, HAS_SEQ: tl.constexpr,
                        PREC: tl.constexpr):
    """Completes dS_{c+1} for the chunks of every segment but the last: += (the decays of the segment's chunks
    after c) * GST[b, seg + 1, h] (the true gradient of the next segment's entering state), and writes this
    term's share of decay_c <dS_{c+1}, S_c> (the cs_last gradient) as partials DCSF[b, h, c, block]."""
    blk = tl.program_id(2)
    j = blk * BLK + tl.arange(0, BLK)
    h = tl.program_id(1)
    b = (tl.program_id(0) // NFIX).to(tl.int64)
    c = tl.program_id(0) % NFIX
    seg = c // CPS
    nseg = (NC + CPS - 1) // CPS
    m = j < PN
    w = _decay_product(CS, SEQ, b, h, c + 1, seg * CPS + CPS, L, H, NC, ssb, ssl, T, CPB, HAS_SEQ)
    gnext = w * tl.load(GST + ((b * nseg + seg + 1) * H + h) * PN + j, mask=m, other=0.0)
    off = ((b * NC + c) * H + h) * PN + j
    _st_store(DSH, DSL, off, _st_load(DSH, DSL, off, m, PREC) + gnext, m, PREC)
    s_in = _st_load(STH, STL, off, m, PREC)  # S_c, the state entering chunk c
    dec = _decay_product(CS, SEQ, b, h, c, c + 1, L, H, NC, ssb, ssl, T, 1, HAS_SEQ)
    tl.store(DCSF + ((b * H + h) * NFIX + c) * tl.num_programs(2) + blk, dec * tsum(gnext * s_in, axis=0))


# --------------------------------------------------------------------------------------------------------
# host side

def _state_blocks(x, bsz, nheads, hdim, dstate, bn_tile):
    """P/N blocks of the sequential (chunk-walking) kernels: P 64 and N TILES[bn_tile] (all of N: x, or dy, is
    read once). The segments (_state_segments) supply the parallelism; only where even they leave fewer programs
    than multiprocessors (few heads or few chunks) is N halved down to 64, then 32 x 32. Narrowing where
    segments do the job costs: 4 x 8K at 64 x 64 blocks 3.92 ms fwd+bwd against 3.59 at 64 x 128 (bf16 mode,
    H100: x read twice, half the tile per step)."""
    BP, BN = _pow2_block(hdim, 64), _tile(bn_tile, dstate)
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count

        def programs(bp, bn):
            return bsz * nheads * triton.cdiv(hdim, bp) * triton.cdiv(dstate, bn)

        while BN > 64 and programs(BP, BN) < sms:
            BN //= 2
        if programs(BP, BN) < sms:
            BP, BN = _pow2_block(hdim, 32), _pow2_block(dstate, 32)
    return BP, BN


def _states_step(BN, T):
    """Positions per step of _states_kernel: TILES["states_bs"] at the full TILES["states_bn"] columns; when
    _state_blocks narrows the N block, longer steps (at most 128), keeping the tile work per step (the H100
    sweep: 64 x 128 and 128 x 64 are the best pairs, 64 x 64 is ~25% slower)."""
    tiles = triton_ssd_common.TILES  # read at the call: benchmarks and tests swap the table
    bs = tiles["states_bs"]
    if BN < tiles["states_bn"]:
        bs = max(bs, min(bs * (tiles["states_bn"] // BN), 128))
    return max(16, min(bs, triton.next_power_of_2(T)))


def _auto_segments(walks, nc, sms):
    """The segment count of MEGASSM_SSD_STATE_SEGMENTS=auto, for `walks` = rows x heads x P-blocks x N-blocks at
    the walks' full blocks (64 x 128): double k (up to 16 and nc / 2) while the doubled count stays within two
    programs per multiprocessor. One walk when the rows alone give that (no fix-up passes). The H100 sweep
    (docs/history/kernels.md, chunk walks; fwd+bwd ms, bf16 mode / split): 4 x 8K (256 walks) k 1 3.59 / 4.31,
    k 2 3.84 / 4.72; 2 x 16K (128) k 1 3.89 / 4.86, k 2 3.80 / 4.69, k 4 3.93 / 4.89; 1 x 32K (64) k 2
    4.10 / 5.24, k 4 3.88 / 4.85, k 8 3.96 / 4.97."""
    k = 1
    while k < 16 and 2 * k <= nc // 2 and walks * 2 * k <= 2 * sms:
        k *= 2
    return k


def _state_segments(x, bsz, nheads, hdim, dstate, nc):
    """(segments, chunks per segment) of the chunk walks in _states_kernel / _dstates_kernel.
    MEGASSM_SSD_STATE_SEGMENTS: "auto" (default: _auto_segments on a GPU, one walk elsewhere), or an integer k
    (k walks of ceil(nc / k) chunks in parallel, then a fix-up pass; 1: one walk over the whole sequence).
    Read per call."""
    k = env.ssd_state_segments()
    if k == "auto":
        k = 1
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            bn = _tile("states_bn", dstate)
            k = _auto_segments(bsz * nheads * triton.cdiv(hdim, 64) * triton.cdiv(dstate, bn), nc, sms)
    cps = triton.cdiv(nc, min(k, nc))
    return triton.cdiv(nc, cps), cps


def _segment_passes(cps, hdim, dstate):
    """Launch parameters of the segment passes: (BLK, number of P x N blocks, CPB: the decay vectors' length)."""
    BLK = _pow2_block(hdim * dstate, 1024)
    return BLK, triton.cdiv(hdim * dstate, BLK), max(2, triton.next_power_of_2(cps))


def _states(x, B, dtp, cs, seq_idx, initial_states, T, nc, want_final=True, readout_only=False, seg_starts=None,
            final_returned=None):
    """(entering state of every chunk as (hi, lo) arrays (_state_buffer), the final states (fp32; None when not
    `want_final`: one fp32 state per row and head not written, 134 MB per call at 64 rows x 64 heads), the true
    segment ends flattened (fp32; None for one walk)). `readout_only`: the states feed _scan alone (the forward,
    states not kept), which rounds them once (_out_prec): they end as the hi array only (the lo array would be
    written and never read). A segmented walk stores the first segment's states so too, but the later segments'
    partial states in the mode's format, so that the fix-up adds to unrounded values before it writes hi alone.
    With segments (_state_segments), each segment's walk starts from zero; the true segment ends follow in order
    (end_k += decay of segment k * end_{k-1}) and _states_fix_kernel adds the decayed previous end to the
    entering states of every later segment's chunks. `seg_starts`: the segment ends an
    earlier call on the same inputs returned (the forward's, in the backward): each segment starts from its
    true entering state, and neither pass runs. `final_returned`: whether the op returns the final states
    (default `want_final`; the backward's recompute passes the forward's, so both walks take the same products).
    """
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = B.shape[-2:]
    nseg, cps = _state_segments(x, bsz, nheads, hdim, dstate, nc)
    if seg_starts is not None and (nseg == 1 or seg_starts.numel() != bsz * nseg * nheads * hdim * dstate):
        # another segmentation (MEGASSM_SSD_STATE_SEGMENTS changed in between): fix up. The segment count alone
        # identifies a segmentation: for a given nc, _state_segments never gives one count two chunk lengths
        seg_starts = None
    # the format of the final states: hi alone where only _scan reads them; a segmented walk stores its later
    # segments' partial states in the mode's format, which the fix-up reads and completes into that one
    final_fmt = _out_prec(x) if readout_only else _prec(x)
    store = final_fmt if nseg == 1 else _prec(x)
    states = _state_buffer(x, (bsz, nc, nheads, hdim, dstate), store)
    # the segment ends feed the segment passes (not needed from true starts)
    has_final = want_final or (nseg > 1 and seg_starts is None)
    ends = torch.empty(bsz, nseg, nheads, hdim, dstate, dtype=torch.float32, device=x.device) if has_final else None
    BP, BN = _state_blocks(x, bsz * nseg, nheads, hdim, dstate, "states_bn")
    seq, ssb, ssl = _seq_args(seq_idx, x)
    grid = (bsz * nseg, nheads, triton.cdiv(hdim, BP) * triton.cdiv(dstate, BN))
    # the bf16 mode's products round x dt exp once, which leaves a returned final state (fp32) at bf16's error,
    # beyond 2x the reference's own: when it is returned the walk takes the split products (its stored states
    # keep the mode's format)
    final_returned = want_final if final_returned is None else final_returned
    walk_prec = "bf16" if final_returned and _prec(x) == "bf16fast" else _prec(x)
    _states_kernel[grid](
        x, B, dtp, cs, seq, initial_states if initial_states is not None else x,
        seg_starts if seg_starts is not None else cs, *states, ends if has_final else cs,
        seqlen, nheads, ngroups, nc, nseg, cps, *x.stride(), *B.stride(), ssb, ssl,
        *(initial_states.stride() if initial_states is not None else (0, 0, 0, 0)),
        P=hdim, N=dstate, T=T, BP=BP, BN=BN, BS=_states_step(BN, T), HAS_INIT=initial_states is not None,
        HAS_SEGI=seg_starts is not None, HAS_SEQ=seq_idx is not None, HAS_FINAL=has_final, PREC=walk_prec,
        STORE=store, STORE0=final_fmt,
    )
    if nseg == 1:
        return states, (ends[:, 0] if has_final else None), None
    if seg_starts is not None:  # every segment started true: so are its states and the last segment's end
        return states, (ends[:, -1].contiguous() if want_final else None), seg_starts
    # the true segment ends, then the later segments' chunks; the decays come from cs inside the kernels
    # (the torch glue they replace was ~20 launches, which one 32K row's forward waited for)
    BLK, npn, CPB = _segment_passes(cps, hdim, dstate)
    common = dict(PN=hdim * dstate, BLK=BLK, T=T, CPB=CPB, HAS_SEQ=seq_idx is not None)
    _segment_ends_kernel[(bsz, nheads, npn)](ends, cs, seq, seqlen, nheads, nc, nseg, cps, ssb, ssl,
                                             REVERSE=False, **common)
    # rows x chunks on grid axis 0: CUDA caps axes 1 and 2 at 65535 programs
    _states_fix_kernel[(bsz * (nc - cps), nheads, npn)](
        *states, ends, cs, seq, seqlen, nc, nheads, cps, ssb, ssl, PREC=_prec(x), OUT=final_fmt, **common,
    )
    return states, (ends[:, -1].contiguous() if want_final else None), ends.view(-1)


def _dstates(x, C, dy, cs, seq_idx, states, dfinal, initial_states, T, nc):
    """The reverse walk: (dS, the gradient of the state leaving every chunk, as _state_buffer arrays; the
    gradient of each chunk's cs_last through the entering state it carries, decay_c <dS_{c+1}, S_c>, [B, H, nc]
    fp32; d initial_states in fp32 or
    None). In segments as _states: the true gradient entering each segment follows last to first, and
    _dstates_fix_kernel completes dS and the cs_last terms of every segment but the last."""
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = C.shape[-2:]
    dev = x.device
    prec = _prec(x)
    seq, ssb, ssl = _seq_args(seq_idx, x)
    nseg, cps = _state_segments(x, bsz, nheads, hdim, dstate, nc)
    BP, BN = _state_blocks(x, bsz * nseg, nheads, hdim, dstate, "dstates_bn")
    nblk = triton.cdiv(hdim, BP) * triton.cdiv(dstate, BN)
    dsn = _state_buffer(x, (bsz, nc, nheads, hdim, dstate))
    dcsl = torch.empty(bsz, nheads, nc, nblk, dtype=torch.float32, device=dev)
    # the gradient of each segment's entering state; segment 0's is d initial_states
    gst = torch.empty(bsz, nseg, nheads, hdim, dstate, dtype=torch.float32, device=dev) \
        if initial_states is not None or nseg > 1 else None
    if dfinal is not None:
        dfinal = dfinal.contiguous()
    _dstates_kernel[(bsz * nseg, nheads, nblk)](
        dy, C, cs, seq, *states, dfinal if dfinal is not None else cs, *dsn, dcsl,
        gst if gst is not None else cs, seqlen, nheads, ngroups, nc, nseg, cps, *dy.stride(), *C.stride(),
        ssb, ssl, P=hdim, N=dstate, T=T, BP=BP, BN=BN, BT=_tile("dstates_bt", T), HAS_DFIN=dfinal is not None,
        HAS_SEQ=seq_idx is not None, WANT_DINIT=gst is not None, PREC=prec,
    )
    dcs_last = dcsl.sum(-1)
    if nseg > 1:
        BLK, npn, CPB = _segment_passes(cps, hdim, dstate)
        common = dict(PN=hdim * dstate, BLK=BLK, T=T, CPB=CPB, HAS_SEQ=seq_idx is not None)
        _segment_ends_kernel[(bsz, nheads, npn)](gst, cs, seq, seqlen, nheads, nc, nseg, cps, ssb, ssl,
                                                 REVERSE=True, **common)
        nfix = (nseg - 1) * cps
        dcsf = torch.empty(bsz, nheads, nfix, npn, dtype=torch.float32, device=dev)
        _dstates_fix_kernel[(bsz * nfix, nheads, npn)](
            *dsn, *states, gst, cs, seq, dcsf, seqlen, nc, nheads, cps, nfix, ssb, ssl, PREC=prec, **common,
        )
        dcs_last[:, :, :nfix] += dcsf.sum(-1)
    dinit = gst[:, 0].contiguous() if initial_states is not None else None
    return dsn, dcs_last, dinit
