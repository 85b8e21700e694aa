"""Triton CP state read-out (parallel/cp.py): out = y + w * (C_t . h), each rank's SSD output corrected for the
state its slice inherits from the ranks before it, and the backward, one pass over y / dout each.

    y, out [B, L, H, P]   C [B, L, G, N] (head hh reads group hh // (H / G))   h [B, H, P, N] fp32
    w [B, L, H] fp32: exp(decay from the slice start) for the tokens of the slice's first document, else 0

In torch the read-out's product is an fp32 [B, L, H, P] tensor, scaled, cast and added (about ten passes of
activation size over the forward, its recomputation and the backward per layer: ~100 ms a step of
mamba2-1.3b at 16K tokens a rank on an H100, docs/benchmarks.md). Here the forward reads y and C and writes
out; the backward reads dout and C twice (dC and dw in one kernel, dh in another). The products run on the
tensor cores as the SSD's do (ssd_common: bf16 inputs as they are, the fp32 state as a bf16 hi + lo pair;
fp32 inputs in fp32); the sum y + w * (C . h) is formed in fp32 and rounded once. P and N: powers of two
>= 16 (supported()).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tsum
from .triton_ssd_common import _bf16, _mm_af

BL = 64  # tokens per program


def supported(y: torch.Tensor, C: torch.Tensor) -> bool:
    P, N = y.shape[-1], C.shape[-1]
    return all(v >= 16 and v & (v - 1) == 0 for v in (P, N)) and y.shape[2] % C.shape[2] == 0


def _prec(C: torch.Tensor) -> str:
    # bf16: h rounded to bf16 for the products, as the torch path does (one tensor-core product, not hi + lo)
    return "bf16fast" if C.dtype == torch.bfloat16 else "ieee"


@triton.jit
def _readout_fwd_kernel(Y, C, HS, W, OUT, L, H, HPG,
                        s_yb, s_yl, s_yh, s_cb, s_cl, s_cg, s_hb, s_hh, s_hp, s_wb, s_wl, s_wh,
                        P: tl.constexpr, N: tl.constexpr, BL: tl.constexpr, PREC: tl.constexpr):
    pid_l, bh = tl.program_id(0), tl.program_id(1)
    b, hh = bh // H, bh % H
    g = hh // HPG
    t = pid_l * BL + tl.arange(0, BL)
    mt = t < L
    p, n = tl.arange(0, P), tl.arange(0, N)
    b64 = b.to(tl.int64)
    c = tl.load(C + b64 * s_cb + t[:, None].to(tl.int64) * s_cl + g * s_cg + n[None, :], mask=mt[:, None], other=0.0)
    hs = tl.load(HS + b64 * s_hb + hh * s_hh + p[:, None] * s_hp + n[None, :])  # [P, N] fp32
    r = tl.trans(_mm_af(hs, tl.trans(c), PREC))  # [BL, P] = C . h
    w = tl.load(W + b64 * s_wb + t.to(tl.int64) * s_wl + hh * s_wh, mask=mt, other=0.0)
    yo = b64 * s_yb + t[:, None].to(tl.int64) * s_yl + hh * s_yh + p[None, :]
    y = tl.load(Y + yo, mask=mt[:, None], other=0.0).to(tl.float32)
    tl.store(OUT + yo, (y + r * w[:, None]).to(OUT.dtype.element_ty), mask=mt[:, None])


@triton.jit
def _readout_dc_kernel(DO, C, HS, W, DC, DW, L, H, G, HPG, HPS,
                       s_db, s_dl, s_dh, s_cb, s_cl, s_cg, s_hb, s_hh, s_hp, s_wb, s_wl, s_wh,
                       s_gs, s_gb, s_gl, s_gg,
                       P: tl.constexpr, N: tl.constexpr, BL: tl.constexpr, PREC: tl.constexpr):
    """One group's dC [BL, N] summed over HPS of its heads (partial sums: program_id(2) picks the heads) and,
    per head, dw = sum_p dout * (C . h)."""
    pid_l, bg, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, g = bg // G, bg % G
    t = pid_l * BL + tl.arange(0, BL)
    mt = t < L
    p, n = tl.arange(0, P), tl.arange(0, N)
    b64, t64 = b.to(tl.int64), t.to(tl.int64)
    c = tl.load(C + b64 * s_cb + t64[:, None] * s_cl + g * s_cg + n[None, :], mask=mt[:, None], other=0.0)
    dc = tl.full((BL, N), 0.0, tl.float32)
    for j in range(sp * HPS, tl.minimum(sp * HPS + HPS, HPG)):
        hh = g * HPG + j
        hs = tl.load(HS + b64 * s_hb + hh * s_hh + p[:, None] * s_hp + n[None, :])  # [P, N] fp32
        w = tl.load(W + b64 * s_wb + t64 * s_wl + hh * s_wh, mask=mt, other=0.0)
        do = tl.load(DO + b64 * s_db + t64[:, None] * s_dl + hh * s_dh + p[None, :], mask=mt[:, None],
                     other=0.0).to(tl.float32)  # [BL, P]
        r = tl.trans(_mm_af(hs, tl.trans(c), PREC))  # [BL, P]
        tl.store(DW + b64 * s_wb + t64 * s_wl + hh * s_wh, tsum(do * r, 1), mask=mt)
        dw = do * w[:, None]
        if PREC != "ieee":  # rounded as the torch path rounds it (the interpreter's own cast truncates)
            dw = _bf16(dw)
        # dC += (w dout) . h: h is the derived operand; as [N, P] x [P, BL] -> dC^T
        dc += tl.trans(_mm_af(tl.trans(hs), tl.trans(dw), PREC))
    tl.store(DC + sp * s_gs + b64 * s_gb + t64[:, None] * s_gl + g * s_gg + n[None, :], dc, mask=mt[:, None])


@triton.jit
def _readout_dh_kernel(DO, C, W, DH, L, H, HPG, BPS,
                       s_db, s_dl, s_dh, s_cb, s_cl, s_cg, s_wb, s_wl, s_wh, s_hs, s_hb, s_hh, s_hp,
                       P: tl.constexpr, N: tl.constexpr, BL: tl.constexpr, PREC: tl.constexpr):
    """One head's dh [P, N] over BPS token blocks (partial sums: program_id(1) picks the blocks): sum over the
    tokens of (w dout)^T C."""
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, hh = bh // H, bh % H
    g = hh // HPG
    p, n = tl.arange(0, P), tl.arange(0, N)
    b64 = b.to(tl.int64)
    acc = tl.full((P, N), 0.0, tl.float32)
    for l0 in range(sp * BPS * BL, tl.minimum(sp * BPS * BL + BPS * BL, L), BL):
        t = l0 + tl.arange(0, BL)
        mt = t < L
        t64 = t.to(tl.int64)
        w = tl.load(W + b64 * s_wb + t64 * s_wl + hh * s_wh, mask=mt, other=0.0)
        do = tl.load(DO + b64 * s_db + t64[:, None] * s_dl + hh * s_dh + p[None, :], mask=mt[:, None],
                     other=0.0).to(tl.float32)
        c = tl.load(C + b64 * s_cb + t64[:, None] * s_cl + g * s_cg + n[None, :], mask=mt[:, None], other=0.0)
        acc += _mm_af(tl.trans(do * w[:, None]), c, PREC)  # [P, BL] x [BL, N]
    tl.store(DH + sp * s_hs + b64 * s_hb + hh * s_hh + p[:, None] * s_hp + n[None, :], acc)


def _check(y, C, h, w):
    if y.stride(-1) != 1 or C.stride(-1) != 1 or not h.is_contiguous() or h.dtype != torch.float32 \
            or w.dtype != torch.float32:
        raise ValueError("state read-out: y and C need a unit last stride, h contiguous fp32, w fp32")


def readout_fwd(y: torch.Tensor, C: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y + w * (C . h) [B, L, H, P] in y's dtype."""
    _check(y, C, h, w)
    B, L, H, P = y.shape
    G, N = C.shape[2], C.shape[3]
    out = torch.empty_like(y, memory_format=torch.contiguous_format)
    if y.stride() != out.stride():
        y = y.contiguous()
    if B * L * H:
        _readout_fwd_kernel[(triton.cdiv(L, BL), B * H)](
            y, C, h, w, out, L, H, H // G, *y.stride()[:3], *C.stride()[:3], *h.stride()[:3], *w.stride(),
            P=P, N=N, BL=BL, PREC=_prec(C), num_warps=4)
    return out


HEADS_PER_PROGRAM = 8  # dC: a group's heads split over programs (partial sums), for a grid that fills the GPU
BLOCKS_PER_PROGRAM = 16  # dh: a head's token blocks split over programs (partial sums)


def readout_bwd(dout: torch.Tensor, C: torch.Tensor, h: torch.Tensor, w: torch.Tensor):
    """(dC [B, L, G, N] in C's dtype, dh [B, H, P, N] fp32, dw [B, L, H] fp32) of out = y + w * (C . h). The
    partial sums are summed in a fixed order (deterministic)."""
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    _check(dout, C, h, w)
    B, L, H, P = dout.shape
    G, N = C.shape[2], C.shape[3]
    hpg = H // G
    hs = triton.cdiv(hpg, HEADS_PER_PROGRAM)
    nb = triton.cdiv(L, BL)
    ls = triton.cdiv(nb, BLOCKS_PER_PROGRAM)
    dCp = torch.empty((hs, B, L, G, N), dtype=torch.float32, device=C.device)
    dhp = torch.empty((ls, *h.shape), dtype=torch.float32, device=h.device)
    dw = torch.empty((B, L, H), dtype=torch.float32, device=w.device)
    if w.stride() != dw.stride():
        w = w.contiguous()
    if B * L * H:
        _readout_dc_kernel[(nb, B * G, hs)](
            dout, C, h, w, dCp, dw, L, H, G, hpg, HEADS_PER_PROGRAM, *dout.stride()[:3], *C.stride()[:3],
            *h.stride()[:3], *w.stride(), *dCp.stride()[:4], P=P, N=N, BL=BL, PREC=_prec(C), num_warps=4)
        _readout_dh_kernel[(B * H, ls)](
            dout, C, w, dhp, L, H, hpg, BLOCKS_PER_PROGRAM, *dout.stride()[:3], *C.stride()[:3], *w.stride(),
            *dhp.stride()[:4], P=P, N=N, BL=BL, PREC=_prec(C), num_warps=8)
        dC, dh = dCp.sum(0).to(C.dtype), dhp.sum(0)
    else:
        dC, dh = torch.zeros((B, L, G, N), dtype=C.dtype, device=C.device), torch.zeros_like(h)
    return dC, dh, dw
