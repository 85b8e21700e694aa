"""Triton SSD (Mamba-2 chunked scan): the forward here, the backward in ssd_bwd.py. Written from the math
in reference/ssd.py.

Per batch row b, head h (group g = h // (H/G)), chunk c of T tokens, positions t, s inside the chunk:

    dt_t   = clamp(softplus(dt_raw_t + dt_bias)),  a_t = dt_t * A,  cs_t = a_0 + .. + a_t  (within the chunk)
    CB_ts  = C_t . B_s                                                   (per group)
    L_ts   = exp(cs_t - cs_s) if s <= t and doc(s) == doc(t) else 0
    S_0    = initial state;  S_{c+1} = exp(cs_last) keep_c S_c + sum_s exp(cs_last - cs_s) m'_s dt_s x_s (x) B_s
    y_t    = sum_s L_ts CB_ts dt_s x_s + exp(cs_t) m_t S_c C_t ;   out = (y + D x) * silu(z)

m'_s: s is of the chunk's last document; m_t: t is of the document of the state entering the chunk; keep_c:
the entering state's document is the chunk's last document. Pad positions (t >= L) carry dt = 0, x = 0.

Forward kernels:  _dt_kernel (dt processing + in-chunk cumsum), _cb_kernel (C B^T per chunk and group),
_states_kernel (chunk end states and the passing across chunks fused: one program walks the chunks of its
(b, h, P-block, N-block) in order, so the chunk states never round-trip through memory),
_scan_kernel (outputs: state read-out + masked intra-chunk quadratic form, D skip and z gate fused).
With MEGASSM_SSD_STATE_SEGMENTS=k the chunk walks run as k parallel segments (the later ones from zero), and
_states_fix_kernel adds each previous segment's true end state, decayed, to the later segments' chunks
(_dstates_kernel / _dstates_fix_kernel likewise in reverse): parallelism for a few long rows.

Backward (recomputes dt/cs, CB and the entering states; the SSM output only with the gate z, in _scan_kernel's
BWD mode, which writes dy = dout * silu(z) and dz; then):
  _dstates_kernel: reverse pass over chunks, dS_{c+1} (gradient of the state leaving chunk c) for every
      chunk, d initial_states, and <dS_{c+1}, S_{c+1}> (the gradient of cs_last through every term scaled by it);
  _dx_kernel (per head, block of s): dx, the direct dt gradient x_s . Q_s (the cs_s gradient) and dD partials;
  _dcb_kernel (per group): the gradient of C_t . B_s summed over the group's heads, and per head the
      intra-chunk part of dy_t . y_t (the cs_t gradient);
  _dbc_kernel (per group, block of positions, block of N; loops over the group's heads): dB and dC, and in
      the dC pass the state read-out part of dy_t . y_t;
  torch: the cs gradients -> reverse cumsum -> ddt, dA, then softplus/clamp/bias; sums of the partials.
No atomics anywhere: every reduction is a loop inside one program or a torch sum over partials, so results
are deterministic run to run.

The per-chunk states S and dS are stored as the dot operands their readers need (_st_store: fp32, or bf16
hi + lo arrays, or bf16 alone in MEGASSM_SSD_PRECISION=bf16 mode). Intra-chunk tiles wholly below the diagonal
factor the decay exp(cs_t - cs_s) = exp(cs_t - cs_r) exp(cs_r - cs_s) around a position r between them (both
factors <= 1 since A <= 0): two vectors per tile instead of an exp and a causal mask per element.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime.errors import OutOfResources

from ._lang import tcumsum, tsigmoid, tsum  # noqa: F401

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_AUTOTUNE = os.environ.get("MEGASSM_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "no", "off")


class _Tuned:
    """`kernel[grid](...)` with num_warps / num_stages picked per shape: on the first call for a key (the named
    arguments' values and the tensor dtypes, as triton.autotune keys) every config is timed once and the
    fastest kept; later calls launch the kernel directly. triton.autotune does the same but costs ~85 us of
    Python per launch on an H100 host (benchmarks/host_overhead.py): ~35 ms per mamba2-1.3b training step."""

    def __init__(self, fn, configs, key):
        self.fn, self.configs, self.key = fn, configs, key
        self.arg_names = fn.arg_names
        self.best: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._run(grid, args, kwargs)

    def _time(self, grid, cfg, args, kwargs):
        """Median ms of one config; inf when it needs more shared memory than the GPU has (large tiles fit
        only with fewer pipeline stages)."""
        try:
            return triton.testing.do_bench(lambda: self._launch(grid, cfg, args, kwargs), warmup=5, rep=20,
                                           return_mode="median")
        except OutOfResources:
            return float("inf")

    def _launch(self, grid, cfg, args, kwargs):
        return self.fn[grid](*args, **kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def _run(self, grid, args, kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        k = tuple(named[n] for n in self.key) + tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        cfg = self.best.get(k)
        if cfg is None:
            cfg = self.configs[0]
            if len(self.configs) > 1:
                times = [self._time(grid, c, args, kwargs) for c in self.configs]
                if min(times) == float("inf"):  # none fits: launch the first again to raise its error
                    return self._launch(grid, cfg, args, kwargs)
                cfg = self.configs[min(range(len(times)), key=times.__getitem__)]
            self.best[k] = cfg
        return self._launch(grid, cfg, args, kwargs)


def _autotune(configs, key):
    """Autotune num_warps / num_stages per shape (_Tuned); off (first config only) under the interpreter and
    with MEGASSM_TRITON_AUTOTUNE=0 (the GPU tests: compiling every config of every variant costs minutes)."""
    if _INTERPRET or not _AUTOTUNE:
        configs = configs[:1]
    return lambda fn: _Tuned(fn, configs, key)


# --------------------------------------------------------------------------------------------------------
# shared helpers

# Triton 3.6's CPU interpreter computes tl.dot on bf16/fp16 operands wrongly; there the operands are upcast
# first (bf16 x bf16 products are exact in fp32, so this matches the GPU's fp32-accumulating tensor cores).
_UPCAST_DOT = tl.constexpr(_INTERPRET)


@triton.jit
def _dot_lp(a, b):
    """Both operands bf16 (exact products, fp32 accumulation)."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _split(a):
    hi = a.to(tl.bfloat16)
    return hi, (a - hi.to(tl.float32)).to(tl.bfloat16)


# Matrix products. PREC "bf16": the inputs are bf16; a raw input operand goes to the tensor cores as is, a
# derived fp32 operand (decay-weighted, states, ...) as a bf16 hi + lo pair (about 16 mantissa bits: two bf16
# products instead of one rounding to 8 bits). PREC "ieee": fp32 / fp16 inputs, fp32 products.
@triton.jit
def _mm_raw(a, b, PREC: tl.constexpr):
    if PREC == "bf16" or PREC == "bf16fast":
        return _dot_lp(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _mm_af(a, b, PREC: tl.constexpr):
    """a fp32 (derived), b raw input."""
    if PREC == "bf16fast":
        return _dot_lp(a.to(tl.bfloat16), b)
    elif PREC == "bf16":
        hi, lo = _split(a)
        return _dot_lp(hi, b) + _dot_lp(lo, b)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")


@triton.jit
def _mm_ff(a, b, PREC: tl.constexpr):
    """Both fp32 (derived)."""
    if PREC == "bf16fast":
        return _dot_lp(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16":
        ahi, alo = _split(a)
        bhi, blo = _split(b)
        return _dot_lp(ahi, bhi) + (_dot_lp(ahi, blo) + _dot_lp(alo, bhi))
    else:
        return tl.dot(a, b, input_precision="ieee")


# Chunk states (entering states S and their gradients dS) are stored as they are used: as dot operands. PREC
# "ieee": one fp32 array. "bf16": a bf16 hi array and a bf16 lo array (hi + lo = the fp32 value to ~16 bits; the
# same bytes as fp32, and consumers load ready tensor-core operands instead of splitting in every program).
# "bf16fast": the hi array only (the products round the state to bf16 once anyway, as mamba_ssm stores them).
@triton.jit
def _st_store(HI, LO, off, v, mask, PREC: tl.constexpr):
    if PREC == "ieee":
        tl.store(HI + off, v, mask=mask)
    else:
        hi = v.to(tl.bfloat16)
        tl.store(HI + off, hi, mask=mask)
        if PREC == "bf16":
            tl.store(LO + off, (v - hi.to(tl.float32)).to(tl.bfloat16), mask=mask)


@triton.jit
def _st_load(HI, LO, off, mask, PREC: tl.constexpr):
    """A stored state tile as fp32 (for elementwise use)."""
    v = tl.load(HI + off, mask=mask, other=0.0).to(tl.float32)
    if PREC == "bf16":
        v += tl.load(LO + off, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _mm_a_st(a, HI, LO, off, mask, A_F32: tl.constexpr, PREC: tl.constexpr):
    """a @ (stored state tile at HI/LO + off). a: a raw input, or with A_F32 a derived fp32 operand."""
    if PREC == "ieee":
        return tl.dot(a.to(tl.float32), tl.load(HI + off, mask=mask, other=0.0), input_precision="ieee")
    else:
        hi = tl.load(HI + off, mask=mask, other=0.0)
        if A_F32:
            if PREC == "bf16":
                ahi, alo = _split(a)
                lo = tl.load(LO + off, mask=mask, other=0.0)
                return _dot_lp(ahi, hi) + (_dot_lp(ahi, lo) + _dot_lp(alo, hi))
            else:
                return _dot_lp(a.to(tl.bfloat16), hi)
        else:
            r = _dot_lp(a, hi)
            if PREC == "bf16":
                r += _dot_lp(a, tl.load(LO + off, mask=mask, other=0.0))
            return r


@triton.jit
def _softplus(x):
    # max(x, 0) + log1p(exp(-|x|)), log1p by Goldberg's trick (accurate for tiny arguments)
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    l1p = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    return tl.maximum(x, 0.0) + l1p


@triton.jit
def _seq_at(SEQ, b, pos, L, ssb, ssl):
    p = tl.minimum(tl.maximum(pos, 0), L - 1)
    return tl.load(SEQ + b * ssb + p * ssl)


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
    dt = tl.load(DT + b * sdb + pos[:, None] * sdl + h[None, :] * sdh, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(DT_BIAS + h, mask=mh, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        dt = _softplus(dt)
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


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
            triton.Config({}, num_warps=4, num_stages=3)], key=["T", "BP", "BN", "BS"])
@triton.jit
def _states_kernel(X, Bp, DTP, CS, SEQ, INIT, STH, STL, FINAL, L, H, G, NC, NSEG, CPS,
                   sxb, sxl, sxh, sxp, sbb, sbl, sbg, sbn, ssb, ssl, sib, sih, sip, sin,
                   P: tl.constexpr, N: tl.constexpr, T: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                   BS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, PREC: tl.constexpr):
    """Walks the chunks [seg * CPS, seg * CPS + CPS) of one (row, segment, head, P-block, N-block) in order:
    stores each chunk's entering state, then the segment's end state into FINAL[b, seg]. Segments after the
    first start from zero (their entering states are completed by _states_fix_kernel); with NSEG = 1 this is
    the whole sequence and FINAL the final state."""
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
    st_base = (b * NC * H + h) * P * N
    for c in range(seg * CPS, tl.minimum(seg * CPS + CPS, NC)):
        off = st_base + c * H * P * N + p[:, None] * N + n[None, :]
        _st_store(STH, STL, off, S, mp[:, None] & mn[None, :], PREC)
        dbase = ((b * H + h) * NC + c) * T
        cs_last = tl.load(CS + dbase + T - 1)
        last = tl.minimum(c * T + T, L) - 1
        if HAS_SEQ:
            seq_last = _seq_at(SEQ, b, last, L, ssb, ssl)
        acc = tl.full([BP, BN], 0.0, tl.float32)
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
            acc += _mm_af(tl.trans(xs), bv, PREC)
        decay = tl.exp(cs_last)
        if HAS_SEQ:
            sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)  # clamps to position 0 for c = 0
            decay = tl.where(sid_in == seq_last, decay, 0.0)
        S = S * decay + acc
    tl.store(FINAL + ((b * NSEG + seg) * H + h) * P * N + p[:, None] * N + n[None, :], S,
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _states_fix_kernel(STH, STL, ENDS, DPRE, NC, H, CPS, PN: tl.constexpr, BLK: tl.constexpr,
                       PREC: tl.constexpr):
    """Completes the entering states of the chunks of segments after the first: S_c += DPRE[b, h, c] *
    ENDS[b, seg - 1, h] (the true end state of the previous segment, decayed to chunk c)."""
    j = tl.program_id(2) * BLK + tl.arange(0, BLK)
    h = tl.program_id(1)
    nfix = NC - CPS
    b = (tl.program_id(0) // nfix).to(tl.int64)
    c = CPS + tl.program_id(0) % nfix
    seg = c // CPS
    nseg = (NC + CPS - 1) // CPS
    m = j < PN
    w = tl.load(DPRE + (b * H + h) * NC + c)
    prev = tl.load(ENDS + ((b * nseg + seg - 1) * H + h) * PN + j, mask=m, other=0.0)
    off = ((b * NC + c) * H + h) * PN + j
    _st_store(STH, STL, off, _st_load(STH, STL, off, m, PREC) + w * prev, m, PREC)


@_autotune([triton.Config({}, num_warps=8, num_stages=2), triton.Config({}, num_warps=4, num_stages=2),
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
    # read-out of the entering state: exp(cs_t) m_t C_t S^T
    acc = tl.full([BT, BP], 0.0, tl.float32)
    st_off = ((b * NC + c) * H + h) * P * N
    for k0 in range(0, N, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < N
        cv = tl.load(Cp + b * scb + pt[:, None] * scl + g * scg + k[None, :] * scn,
                     mask=mt[:, None] & mk[None, :], other=0.0)
        acc += _mm_a_st(cv, STH, STL, st_off + p[None, :] * N + k[:, None], mk[:, None] & mp[None, :], False, PREC)
    row = tl.exp(cs_t)
    if HAS_SEQ:
        sid_in = _seq_at(SEQ, b, c * T - 1, L, ssb, ssl)
        row = tl.where(seq_t == sid_in, row, 0.0)
    acc = acc * row[:, None]
    # intra-chunk: sum_s L_ts CB_ts dt_s x_s. Source blocks wholly before this target block (s < r <= t, r its
    # first position) factor the decay as exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1 (A <= 0): two vectors
    # instead of an exp and the causal mask per element; pad sources carry dt = 0 and CB = 0.
    cb_base = ((b * NC + c) * G + g) * T * T
    r = tb * BT
    cs_r = tl.load(CS + dbase + r)
    e_t = tl.exp(cs_t - cs_r)
    s_mid = (r // BS) * BS
    for s0 in range(0, s_mid, BS):
        s = s0 + tl.arange(0, BS)
        ps = c * T + s
        cb = tl.load(CB + cb_base + t[:, None] * T + s[None, :])
        f_s = tl.exp(cs_r - tl.load(CS + dbase + s)) * tl.load(DTP + dbase + s)
        w = cb * e_t[:, None] * f_s[None, :]
        if HAS_SEQ:
            w = tl.where(_seq_at(SEQ, b, ps, L, ssb, ssl)[None, :] == seq_t[:, None], w, 0.0)
        xv = tl.load(X + b * sxb + ps[:, None] * sxl + h * sxh + p[None, :] * sxp,
                     mask=(ps < L)[:, None] & mp[None, :], other=0.0)
        acc += _mm_af(w, xv, PREC)
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


def _pow2_block(n, cap):
    return max(16, min(cap, triton.next_power_of_2(n)))


# Tile sizes (powers of two; each is capped by the chunk length or the state size at the call). The defaults
# come from benchmarks/ssd_tiles.py on an H100 (docs/benchmarks.md); num_warps / num_stages are tuned per shape
# by _Tuned. The table is module state so that benchmark can sweep it; MEGASSM_SSD_TILES overrides entries.
TILES = {
    "cb_bt": 64,       # _cb_kernel: C B^T block
    "states_bs": 64,   # _states_kernel: positions per step of the chunk walk
    "states_bn": 128,  # _states_kernel: state columns per program (all N: x is read once)
    "scan_bt": 64,     # _scan_kernel: target positions per program
    "scan_bs": 32,     # _scan_kernel: source positions per step
    "scan_bk": 64,     # _scan_kernel: state columns per step of the read-out
    "dstates_bt": 64,  # _dstates_kernel: positions per step of the reverse walk
    "dstates_bn": 128, # _dstates_kernel: state columns per program (all N: dy is read once)
    "dx_bs": 64,       # _dx_kernel: source positions per program (and target positions per step)
    "dx_bk": 64,       # _dx_kernel: state columns per step
    "dcb_bs": 64,      # _dcb_kernel: square block of the chunk's dCB (and of the cs_t partials)
    "dbc_bs": 128,     # _dbc_kernel: positions per program and per step
    "dbc_bn": 128,     # _dbc_kernel: state columns per program
}


def _tiles_from_env(table, text):
    """MEGASSM_SSD_TILES="dx_bs=64,dbc_bs=64": override TILES entries (tuning on another GPU). Unknown names and
    values that are not powers of two >= 16 fail at import, naming the entry."""
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, val = (x.strip() for x in item.partition("="))
        if not sep or name not in table:
            raise ValueError(f"MEGASSM_SSD_TILES: {item!r} is not NAME=VALUE with NAME one of {sorted(table)}")
        v = int(val) if val.isdigit() else 0
        if v < 16 or v & (v - 1):
            raise ValueError(f"MEGASSM_SSD_TILES: {name}={val!r} must be a power of two >= 16")
        table[name] = v


_tiles_from_env(TILES, os.environ.get("MEGASSM_SSD_TILES", ""))


def _tile(name, limit):
    """TILES[name] capped by limit (the chunk length or the padded state size), at least 16."""
    return max(16, min(TILES[name], triton.next_power_of_2(limit)))


def supported(x, chunk_size):
    """Whether the Triton path takes this call (otherwise ops.py uses the reference)."""
    return (x.dtype in (torch.float32, torch.bfloat16, torch.float16) and chunk_size >= 16
            and chunk_size & (chunk_size - 1) == 0)


def _chunk_len(seqlen, chunk_size):
    # a chunk longer than the (power-of-two padded) sequence is only padding
    return max(16, min(chunk_size, triton.next_power_of_2(max(seqlen, 1))))


def _prec(x):
    """Product precision. bf16 inputs: "bf16" (default; derived fp32 operands as bf16 hi + lo pairs) or, with
    MEGASSM_SSD_PRECISION=bf16, "bf16fast" (derived operands rounded once to bf16, as mamba_ssm does: fewer
    tensor-core products, about 2-4x the reference's bf16 error on y, dx, dB, dC, but ~1e-2 relative on the
    cancelling sums dA and ddt_bias, 20-50x mamba_ssm's). Other dtypes: fp32 products."""
    if x.dtype != torch.bfloat16:
        return "ieee"
    mode = os.environ.get("MEGASSM_SSD_PRECISION", "split").strip().lower()
    if mode not in ("split", "bf16"):
        raise ValueError(f"MEGASSM_SSD_PRECISION={mode!r}: expected split or bf16")
    return "bf16fast" if mode == "bf16" else "bf16"


def _state_blocks(x, bsz, nheads, hdim, dstate, bn_tile):
    """P/N blocks of the sequential (chunk-walking) kernels: P 64 and N TILES[bn_tile], halving N down to 64
    while that leaves fewer than two programs per multiprocessor (e.g. micro-batch 4 x 64 heads); still too few
    (one 32K-token row): 32 and 32."""
    BP, BN = _pow2_block(hdim, 64), _tile(bn_tile, dstate)
    if x.is_cuda:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count

        def programs(bp, bn):
            return bsz * nheads * triton.cdiv(hdim, bp) * triton.cdiv(dstate, bn)

        while BN > 64 and programs(BP, BN) < 2 * sms:
            BN //= 2
        if programs(BP, BN) < 2 * sms:
            BP, BN = _pow2_block(hdim, 32), _pow2_block(dstate, 32)
    return BP, BN


def _states_step(BN, T):
    """Positions per step of _states_kernel: TILES["states_bs"] at the full TILES["states_bn"] columns; when
    _state_blocks narrows the N block, longer steps (at most 128), keeping the tile work per step (the H100
    sweep: 64 x 128 and 128 x 64 are the best pairs, 64 x 64 is ~25% slower)."""
    bs = TILES["states_bs"]
    if BN < TILES["states_bn"]:
        bs = max(bs, min(bs * (TILES["states_bn"] // BN), 128))
    return max(16, min(bs, triton.next_power_of_2(T)))


def _seq_args(seq_idx, x):
    if seq_idx is None:
        return x, 0, 0
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


def _prep(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, seq_idx, chunk_size):
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
    _cb_kernel[(bsz * nc, ngroups, (T // BT) ** 2)](
        C, B, cb, seqlen, ngroups, nc, *C.stride(), *B.stride(), N=dstate, T=T, BT=BT, BK=BK, PREC=_prec(x),
    )
    return T, nc, dtp, cs, cb


def _state_buffer(x, shape):
    """(hi, lo) arrays for chunk states or their gradients, stored as _st_store writes them: fp32 (both names
    one array) for fp32 inputs, bf16 hi + lo arrays by default for bf16 inputs, a bf16 hi array alone with
    MEGASSM_SSD_PRECISION=bf16."""
    prec = _prec(x)
    if prec == "ieee":
        t = torch.empty(shape, dtype=torch.float32, device=x.device)
        return t, t
    t = torch.empty((2 if prec == "bf16" else 1,) + tuple(shape), dtype=torch.bfloat16, device=x.device)
    return t[0], t[-1]


def _state_segments(x, bsz, nheads, hdim, dstate, nc):
    """(segments, chunks per segment) of the chunk walks in _states_kernel / _dstates_kernel.
    MEGASSM_SSD_STATE_SEGMENTS: "1" (default: one walk over the whole sequence), an integer k (k walks of
    ceil(nc / k) chunks in parallel, then a fix-up pass), or "auto" (double k, up to 16 and nc / 2, while the
    walks give fewer than two programs per multiprocessor at 64 x 64 blocks or a walk is longer than 16 chunks:
    a starting rule, not yet tuned on a GPU). Read per call."""
    text = os.environ.get("MEGASSM_SSD_STATE_SEGMENTS", "1").strip().lower()
    if text == "auto":
        k = 1
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            blocks = triton.cdiv(hdim, 64) * triton.cdiv(dstate, 64)
            while k < 16 and 2 * k <= nc // 2 and (bsz * k * nheads * blocks < 2 * sms or triton.cdiv(nc, k) > 16):
                k *= 2
    else:
        try:
            k = int(text)
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"MEGASSM_SSD_STATE_SEGMENTS={text!r}: expected a positive integer or auto")
    cps = triton.cdiv(nc, min(k, nc))
    return triton.cdiv(nc, cps), cps


def _chunk_decays(cs, seq_idx, T, seqlen):
    """exp(cs_last) per (row, head, chunk): the factor by which a chunk carries its entering state to its end;
    0 where the entering state's document is not the chunk's last (as _states_kernel's `decay`)."""
    dec = torch.exp(cs[..., T - 1])
    if seq_idx is not None:
        nc = cs.shape[2]
        starts = torch.arange(nc, device=cs.device) * T
        first = (starts - 1).clamp(0, seqlen - 1)
        last = (starts + T).clamp(max=seqlen) - 1
        keep = seq_idx[:, first] == seq_idx[:, last]
        dec = dec * keep[:, None, :]
    return dec


def _segment_decays(dec, nseg, cps):
    """For chunk decays [B, H, nc] grouped into segments of cps chunks: (before, after, whole), the products of
    the decays of the segment's chunks before chunk c, after chunk c, and of the whole segment [B, H, nseg]."""
    bsz, nheads, nc = dec.shape
    d = torch.nn.functional.pad(dec, (0, nseg * cps - nc), value=1.0).view(bsz, nheads, nseg, cps)
    one = torch.ones_like(d[..., :1])
    inc = d.cumprod(-1)
    before = torch.cat([one, inc[..., :-1]], -1)
    after = torch.cat([d.flip(-1).cumprod(-1).flip(-1)[..., 1:], one], -1)
    return (before.reshape(bsz, nheads, -1)[..., :nc].contiguous(),
            after.reshape(bsz, nheads, -1)[..., :nc].contiguous(), inc[..., -1])


def _states(x, B, dtp, cs, seq_idx, initial_states, T, nc):
    """Entering state of every chunk ((hi, lo) arrays, _state_buffer) and the final states (fp32). With
    segments (_state_segments), each segment's walk starts from zero; the true segment ends follow in order
    (end_k += decay of segment k * end_{k-1}) and _states_fix_kernel adds the decayed previous end to the
    entering states of every later segment's chunks."""
    bsz, seqlen, nheads, hdim = x.shape
    ngroups, dstate = B.shape[-2:]
    states = _state_buffer(x, (bsz, nc, nheads, hdim, dstate))
    nseg, cps = _state_segments(x, bsz, nheads, hdim, dstate, nc)
    ends = torch.empty(bsz, nseg, nheads, hdim, dstate, dtype=torch.float32, device=x.device)
    BP, BN = _state_blocks(x, bsz * nseg, nheads, hdim, dstate, "states_bn")
    seq, ssb, ssl = _seq_args(seq_idx, x)
    grid = (bsz * nseg, nheads, triton.cdiv(hdim, BP) * triton.cdiv(dstate, BN))
    _states_kernel[grid](
        x, B, dtp, cs, seq, initial_states if initial_states is not None else x, *states, ends,
        seqlen, nheads, ngroups, nc, nseg, cps, *x.stride(), *B.stride(), ssb, ssl,
        *(initial_states.stride() if initial_states is not None else (0, 0, 0, 0)),
        P=hdim, N=dstate, T=T, BP=BP, BN=BN, BS=_states_step(BN, T), HAS_INIT=initial_states is not None,
        HAS_SEQ=seq_idx is not None, PREC=_prec(x),
    )
    if nseg == 1:
        return states, ends[:, 0]
    before, _, whole = _segment_decays(_chunk_decays(cs, seq_idx, T, seqlen), nseg, cps)
    for k in range(1, nseg):
        ends[:, k] += whole[:, :, k, None, None] * ends[:, k - 1]
    BLK = _pow2_block(hdim * dstate, 1024)
    # rows x chunks on grid axis 0: CUDA caps axes 1 and 2 at 65535 programs
    _states_fix_kernel[(bsz * (nc - cps), nheads, triton.cdiv(hdim * dstate, BLK))](
        *states, ends, before, nc, nheads, cps, PN=hdim * dstate, BLK=BLK, PREC=_prec(x),
    )
    return states, ends[:, -1].contiguous()


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
        D_PER_CHANNEL=D is not None and D.dim() == 2, HAS_Z=z is not None, BWD=bwd, PREC=_prec(x),
    )
    if bwd:
        return dy, dz
    return y


def _contig_last(t):
    return None if t is None else (t if t.stride(-1) == 1 else t.contiguous())


def ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
            return_final_states):
    x, B, C, z = _contig_last(x), _contig_last(B), _contig_last(C), _contig_last(z)
    D = D.contiguous() if D is not None else None
    A = A.contiguous()
    if initial_states is not None:
        initial_states = initial_states.contiguous()
    T, nc, dtp, cs, cb = _prep(x, dt, A, B, C, dt_bias, dt_softplus, dt_limit, seq_idx, chunk_size)
    states, final = _states(x, B, dtp, cs, seq_idx, initial_states, T, nc)
    y = _scan(x, z, C, D, cb, dtp, cs, seq_idx, states, T, nc)
    return y, (final if return_final_states else None)
