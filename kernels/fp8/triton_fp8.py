"""Triton casts to FP8 for kernels/fp8/op.py: a tensor's per-tensor power-of-two scale and its FP8 copy in both
layouts, in two passes over the input (the eager path takes five or more: the amax, the scale's small kernels,
the multiply, the cast, and a transposing copy of each FP8 operand that torch._scaled_mm needs column-major).

    t8, t8t, inv = cast_transpose(t, dtype)   # t [M, K] (any strides), dtype float8_e4m3fn / float8_e5m2:
                                              # t8 [M, K], t8t = t8^T contiguous [K, M], inv = 1 / scale (fp32)

Pass 1 (`_amax_kernel`): up to PARTS programs, each the max |t| of a contiguous run of rows, into `partials`.
Pass 2 (`_cast_kernel`): every tile reduces the partials itself (no extra launch), forms the scale exactly as
kernels/fp8/op.py's `_scale` does (s = 2^(e - 1) with fmax / amax = m 2^e, m in [0.5, 1): the exponent read from
the bits, the division IEEE-rounded, so both paths pick the same power of two), and writes t * s rounded to FP8
(round to nearest even) in both layouts (the transposed copy from a second, transposed read of the tile);
program (0, 0) also writes 1 / s. The products t * s are exact (powers
of two), so the result is the eager path's bit for bit on the GPU (Triton's CPU interpreter rounds FP8 casts its
own way: its tests feed values that FP8 holds exactly).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tmax

PARTS = 512       # amax partials (a power of two: the cast kernel loads them as one block)
AMAX_BLOCK_K = 512  # columns per amax load (x 8 rows)
TILE_M, TILE_K, WARPS = 64, 128, 8
_TL = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _amax_kernel(T, P, M, K, stride_m, stride_k, rows_per_prog, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid * rows_per_prog
    acc = tl.full([BLOCK_M, BLOCK_K], 0.0, tl.float32)
    for m in range(r0, r0 + rows_per_prog, BLOCK_M):
        rows = m + tl.arange(0, BLOCK_M)
        rmask = rows < M  # rows_per_prog is a multiple of BLOCK_M: a program's steps never pass its run
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            ptr = T + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k
            x = tl.load(ptr, mask=rmask[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
    tl.store(P + pid, tmax(tmax(acc, 1), 0))


@triton.jit
def _cast_kernel(T, P, n_parts, Q, QT, INV, M, K, stride_m, stride_k, fmax, floor,
                 PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_Q: tl.constexpr,
                 WRITE_T: tl.constexpr):
    pm, pk = tl.program_id(0), tl.program_id(1)
    parts = tl.load(P + tl.arange(0, PARTS), mask=tl.arange(0, PARTS) < n_parts, other=0.0)
    amax = tl.maximum(tmax(parts, 0), floor)
    r = tl.math.div_rn(fmax, amax)  # IEEE division, as torch's
    e = ((r.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 r) for a normal r
    s = ((e + 127) << 23).to(tl.float32, bitcast=True)
    if (pm == 0) & (pk == 0):
        tl.store(INV, ((127 - e) << 23).to(tl.float32, bitcast=True))
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    if WRITE_Q:
        x = tl.load(T + rows[:, None].to(tl.int64) * stride_m + cols[None, :].to(tl.int64) * stride_k, mask=mask,
                    other=0.0).to(tl.float32)
        tl.store(Q + rows[:, None].to(tl.int64) * K + cols[None, :], (x * s).to(Q.dtype.element_ty), mask=mask)
    if WRITE_T:  # the tile read again (from L2) through transposed pointers and stored row by row: an FP8 tile
        # transposed in registers (tl.trans, or a store to transposed addresses) lost rows on an H200 (Triton 3.6)
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        xt = tl.load(T + rows[None, :].to(tl.int64) * stride_m + cols[:, None].to(tl.int64) * stride_k,
                     mask=mask_t, other=0.0).to(tl.float32)
        tl.store(QT + cols[:, None].to(tl.int64) * M + rows[None, :], (xt * s).to(QT.dtype.element_ty), mask=mask_t)


def cast_transpose(t: torch.Tensor, dtype: torch.dtype, amax_floor: float, transpose: bool = True,
                   out: tuple | None = None, rowmajor: bool = True) -> tuple:
    """(t8 [M, K] or None, t8t [K, M] or None, 1 / scale): module docstring; `rowmajor` / `transpose` say which
    layouts to write. `out`: (t8, t8t, inv) written in place."""
    assert t.dim() == 2 and dtype in _TL and (rowmajor or transpose), (t.shape, dtype)
    M, K = t.shape
    dev = t.device
    if out is None:
        q = torch.empty(M, K, dtype=dtype, device=dev) if rowmajor else None
        qt = torch.empty(K, M, dtype=dtype, device=dev) if transpose else None
        inv = torch.empty((), dtype=torch.float32, device=dev)
    else:
        q, qt, inv = out
    rows = triton.cdiv(M, PARTS)
    rows = triton.cdiv(rows, 8) * 8  # whole BLOCK_M steps per program
    n_parts = triton.cdiv(M, rows)
    partials = torch.empty(PARTS, dtype=torch.float32, device=dev)
    bk = min(triton.next_power_of_2(max(K, 16)), AMAX_BLOCK_K)
    _amax_kernel[(n_parts,)](t, partials, M, K, t.stride(0), t.stride(1), rows, BLOCK_M=8, BLOCK_K=bk,
                             num_warps=4)
    grid = (triton.cdiv(M, TILE_M), triton.cdiv(K, TILE_K))
    _cast_kernel[grid](t, partials, n_parts, q if q is not None else qt, qt if qt is not None else q, inv, M, K,
                       t.stride(0), t.stride(1), float(torch.finfo(dtype).max), amax_floor, PARTS=PARTS,
                       BLOCK_M=TILE_M, BLOCK_K=TILE_K, WRITE_Q=q is not None, WRITE_T=qt is not None,
                       num_warps=WARPS)
    return q, qt, inv
