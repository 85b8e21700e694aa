"""Triton COFFEE recurrence with its read-out fused (seed mixer `C`, solver=sequential on the GPU). Written from
the math in reference/coffee.py:

    g_k = sigmoid(w * x_(k-1));   x_k = x_(k-1) + g_k * (lam * x_(k-1) + v_k)    x [B, D, n], 0 before a document
    y_k = C . x_k   (* sigmoid(w_out . x_k) with the output filter)               per channel, summed over n

The recurrence is nonlinear in the state, so there is no chunked form, but its D * n scalar recurrences are
independent: one program owns a batch row and a block of BD channels (a [BD, n] fp32 state in registers) and
walks the sequence one token at a time, the next token's input loaded while the current one is computed. The
[B, L, D, n] trajectory never touches memory: y is formed in the loop, and the forward keeps only the state
entering every K-token segment (checkpoints).

Backward, per program, segments in reverse: the forward again from the segment's checkpoint into a
program-private scratch of K + 1 states, then the tokens in reverse with the adjoint G_k = dL/dx_k:

    G_k  = dy_k dy_k/dx_k + J_(k+1) G_(k+1),   J_k = 1 + lam g_k + w g_k (1 - g_k) (lam x_(k-1) + v_k)
    dv_k = sum_j G_k g_k;   dlam += G g x_(k-1);   dw += G g (1 - g) x_(k-1) (lam x_(k-1) + v_k)
    dC += dy x_k (* the filter);  dw_out += dy (C . x_k) s (1 - s) x_k;   d x_(-1) = J_0 G_0

The parameter gradients are per-row partials summed in torch. No atomics: deterministic run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tsigmoid, tsum

SEGMENT = 64  # tokens between the forward's checkpoints (the backward's scratch holds SEGMENT + 1 states)


@triton.jit
def _load_token(V, SEQ, b, t, d, md, L, svb, svl, svd, ssb, ssl, HAS_SEQ: tl.constexpr):
    """v_t [BD] (fp32; 0 past the end) and whether t starts a new document (t > 0 and its id changes)."""
    ok = t < L
    v = tl.load(V + b * svb + t * svl + d * svd, mask=md & ok, other=0.0).to(tl.float32)
    start = ok & (t < 0)  # False (a tensor even when t is a constant: it is loop-carried)
    if HAS_SEQ:
        cur = tl.load(SEQ + b * ssb + t * ssl, mask=ok, other=0)
        prev = tl.load(SEQ + b * ssb + (t - 1) * ssl, mask=ok & (t > 0), other=0)
        start = ok & (t > 0) & (cur != prev)
    return v, start


@triton.jit
def _load_params(LAM, W, Cp, WO, dj, m2, HAS_OF: tl.constexpr):
    """lam, w, C and w_out (C again without the filter) of the program's [BD, NP] block, 0 in padded lanes."""
    lam = tl.load(LAM + dj, mask=m2, other=0.0)
    w = tl.load(W + dj, mask=m2, other=0.0)
    Cv = tl.load(Cp + dj, mask=m2, other=0.0)
    Wo = Cv
    if HAS_OF:
        Wo = tl.load(WO + dj, mask=m2, other=0.0)
    return lam, w, Cv, Wo


@triton.jit
def _step(x, v, start, lam, w, m2):
    """One token of the recurrence: x_k from x_(k-1) (0 where a document starts); padded lanes stay 0."""
    x = tl.where(start, 0.0, x)
    g = tsigmoid(w * x)
    return tl.where(m2, x + g * (lam * x + v[:, None]), 0.0)


@triton.jit
def _readout(x, Cv, Wo, HAS_OF: tl.constexpr):
    cx = tsum(Cv * x, axis=1)
    if HAS_OF:
        return cx * tsigmoid(tsum(Wo * x, axis=1))
    return cx


@triton.jit
def _coffee_fwd_kernel(V, LAM, W, Cp, WO, SEQ, X0, Y, CK, FIN, L, D, NSEG,
                       svb, svl, svd, ssb, ssl,
                       NP: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, K: tl.constexpr,
                       HAS_SEQ: tl.constexpr, HAS_X0: tl.constexpr, HAS_OF: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    j = tl.arange(0, NP)
    md = d < D
    m2 = md[:, None] & (j < N)[None, :]
    dj = d[:, None] * N + j[None, :]
    lam, w, Cv, Wo = _load_params(LAM, W, Cp, WO, dj, m2, HAS_OF)
    if HAS_X0:
        x = tl.load(X0 + b * D * N + dj, mask=m2, other=0.0)
    else:
        x = tl.full([BD, NP], 0.0, tl.float32)
    v, start = _load_token(V, SEQ, b, 0, d, md, L, svb, svl, svd, ssb, ssl, HAS_SEQ)
    for seg in range(NSEG):
        tl.store(CK + ((b * NSEG + seg) * D) * N + dj, x, mask=m2)
        for t in range(seg * K, tl.minimum(seg * K + K, L)):
            v_next, start_next = _load_token(V, SEQ, b, t + 1, d, md, L, svb, svl, svd, ssb, ssl, HAS_SEQ)
            x = _step(x, v, start, lam, w, m2)
            tl.store(Y + (b * L + t) * D + d, _readout(x, Cv, Wo, HAS_OF), mask=md)
            v, start = v_next, start_next
    tl.store(FIN + b * D * N + dj, x, mask=m2)


@triton.jit
def _coffee_bwd_kernel(V, LAM, W, Cp, WO, SEQ, CK, DY, DFIN, SX, DV, DX0, DLAM, DW, DC, DWO, L, D, NSEG,
                       svb, svl, svd, ssb, ssl,
                       NP: tl.constexpr, N: tl.constexpr, BD: tl.constexpr, K: tl.constexpr,
                       HAS_SEQ: tl.constexpr, HAS_DFIN: tl.constexpr, HAS_OF: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    d = db * BD + tl.arange(0, BD)
    j = tl.arange(0, NP)
    md = d < D
    m2 = md[:, None] & (j < N)[None, :]
    dj = d[:, None] * N + j[None, :]
    lam, w, Cv, Wo = _load_params(LAM, W, Cp, WO, dj, m2, HAS_OF)
    # program-private scratch: slot 0 = the state entering the segment, slot i + 1 = the state after token i
    sx = SX + (b * tl.num_programs(1) + db) * (K + 1) * BD * NP + tl.arange(0, BD)[:, None] * NP + j[None, :]
    if HAS_DFIN:
        G = tl.load(DFIN + b * D * N + dj, mask=m2, other=0.0)
    else:
        G = tl.full([BD, NP], 0.0, tl.float32)
    dlam = tl.full([BD, NP], 0.0, tl.float32)
    dw = tl.full([BD, NP], 0.0, tl.float32)
    dc = tl.full([BD, NP], 0.0, tl.float32)
    dwo = tl.full([BD, NP], 0.0, tl.float32)
    for si in range(NSEG):
        seg = NSEG - 1 - si
        t0 = seg * K
        nt = tl.minimum(t0 + K, L) - t0
        x = tl.load(CK + ((b * NSEG + seg) * D) * N + dj, mask=m2, other=0.0)
        tl.store(sx, x)
        for i in range(nt):  # the segment's forward again, every state kept
            v, start = _load_token(V, SEQ, b, t0 + i, d, md, L, svb, svl, svd, ssb, ssl, HAS_SEQ)
            x = _step(x, v, start, lam, w, m2)
            tl.store(sx + (i + 1) * BD * NP, x)
        tl.debug_barrier()  # the reverse walk reads the scratch in the same layout, but order it anyway
        for ri in range(nt):
            i = nt - 1 - ri
            t = t0 + i
            v, start = _load_token(V, SEQ, b, t, d, md, L, svb, svl, svd, ssb, ssl, HAS_SEQ)
            xt = tl.load(sx + (i + 1) * BD * NP)
            xp = tl.where(start, 0.0, tl.load(sx + i * BD * NP))
            dy = tl.load(DY + (b * L + t) * D + d, mask=md, other=0.0).to(tl.float32)[:, None]
            if HAS_OF:
                cx = tsum(Cv * xt, axis=1)[:, None]
                so = tsigmoid(tsum(Wo * xt, axis=1))[:, None]
                dso = dy * cx * so * (1.0 - so)
                G += dy * so * Cv + dso * Wo
                dc += dy * so * xt
                dwo += dso * xt
            else:
                G += dy * Cv
                dc += dy * xt
            g = tsigmoid(w * xp)
            s = lam * xp + v[:, None]
            gg = G * g
            tl.store(DV + (b * L + t) * D + d, tsum(gg, axis=1), mask=md)
            dlam += gg * xp
            dw += gg * (1.0 - g) * xp * s
            # padded lanes keep G = 0: their C, w_out, dy and d final state are all 0
            G = tl.where(start, 0.0, (1.0 + lam * g + w * g * (1.0 - g) * s) * G)
        tl.debug_barrier()  # the next segment's forward overwrites the scratch
    tl.store(DX0 + b * D * N + dj, G, mask=m2)
    tl.store(DLAM + b * D * N + dj, dlam, mask=m2)
    tl.store(DW + b * D * N + dj, dw, mask=m2)
    tl.store(DC + b * D * N + dj, dc, mask=m2)
    if HAS_OF:
        tl.store(DWO + b * D * N + dj, dwo, mask=m2)


def _blocks(v, n):
    """(BD, NP, num_warps): n padded to a power of two; channel blocks small enough that the rows x blocks
    programs fill the GPU (each program is a long sequential walk: latency-bound, so more programs help)."""
    bsz, _, dim = v.shape
    NP = max(2, triton.next_power_of_2(n))
    BD = max(1, min(32, 512 // NP))
    if v.is_cuda:
        sms = torch.cuda.get_device_properties(v.device).multi_processor_count
        while BD > 2 and bsz * triton.cdiv(dim, BD) < 4 * sms:
            BD //= 2
    BD = max(BD, 2)
    return BD, NP, 1 if BD * NP <= 256 else 2


def _seq_args(seq_idx, v):
    if seq_idx is None:
        return v, 0, 0
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


def _params(lam, w, C, w_out):
    f = lambda t: None if t is None else t.detach().float().contiguous()  # noqa: E731
    return f(lam), f(w), f(C), f(w_out)


def coffee_scan_fwd(v, lam, w, C, w_out, x0, seq_idx):
    """y [B, L, D] fp32, final state [B, D, n] fp32 and the segment checkpoints (for coffee_scan_bwd)."""
    bsz, seqlen, dim = v.shape
    n = lam.shape[-1]
    lam, w, C, w_out = _params(lam, w, C, w_out)
    K = SEGMENT
    nseg = triton.cdiv(seqlen, K)
    dev = v.device
    y = torch.empty(bsz, seqlen, dim, dtype=torch.float32, device=dev)
    ck = torch.empty(bsz, nseg, dim, n, dtype=torch.float32, device=dev)
    fin = torch.empty(bsz, dim, n, dtype=torch.float32, device=dev)
    x0c = x0.detach().float().contiguous() if x0 is not None else None
    BD, NP, warps = _blocks(v, n)
    seq, ssb, ssl = _seq_args(seq_idx, v)
    _coffee_fwd_kernel[(bsz, triton.cdiv(dim, BD))](
        v, lam, w, C, w_out if w_out is not None else C, seq, x0c if x0c is not None else fin, y, ck, fin,
        seqlen, dim, nseg, *v.stride(), ssb, ssl,
        NP=NP, N=n, BD=BD, K=K, HAS_SEQ=seq_idx is not None, HAS_X0=x0 is not None, HAS_OF=w_out is not None,
        num_warps=warps,
    )
    return y, fin, ck


def coffee_scan_bwd(dy, dfin, v, lam, w, C, w_out, seq_idx, ck):
    """Gradients (dv [v.dtype], dlam, dw, dC, dw_out, dx0) of coffee_scan_fwd, from its checkpoints."""
    bsz, seqlen, dim = v.shape
    n = lam.shape[-1]
    lam, w, C, w_out = _params(lam, w, C, w_out)
    K = SEGMENT
    nseg = ck.shape[1]
    dev = v.device
    BD, NP, warps = _blocks(v, n)
    nprog = triton.cdiv(dim, BD)
    scratch = torch.empty(bsz * nprog * (K + 1) * BD * NP, dtype=torch.float32, device=dev)
    dy = dy.float().contiguous()
    dv = torch.empty(bsz, seqlen, dim, dtype=torch.float32, device=dev)
    part = [torch.empty(bsz, dim, n, dtype=torch.float32, device=dev) for _ in range(4 if w_out is not None else 3)]
    dx0 = torch.empty(bsz, dim, n, dtype=torch.float32, device=dev)
    dfc = dfin.float().contiguous() if dfin is not None else None
    seq, ssb, ssl = _seq_args(seq_idx, v)
    _coffee_bwd_kernel[(bsz, nprog)](
        v, lam, w, C, w_out if w_out is not None else C, seq, ck, dy, dfc if dfc is not None else dx0, scratch,
        dv, dx0, part[0], part[1], part[2], part[3] if w_out is not None else part[2],
        seqlen, dim, nseg, *v.stride(), ssb, ssl,
        NP=NP, N=n, BD=BD, K=K, HAS_SEQ=seq_idx is not None, HAS_DFIN=dfin is not None, HAS_OF=w_out is not None,
        num_warps=warps,
    )
    sums = [p.sum(0) for p in part]
    return (dv.to(v.dtype), sums[0], sums[1], sums[2], sums[3] if w_out is not None else None, dx0)
