"""Triton cross-entropy of the LM head's logits: per-row losses in fp32 and their gradient, without an fp32 copy.

The eager path (`F.cross_entropy(logits.float(), ...)`) casts the bf16 logits to fp32, runs log_softmax, keeps
its fp32 output for the backward, and backward scatters the labels, runs log_softmax's backward and casts the
gradient back to bf16: about 15 bytes an element moved forward and backward, plus an fp32 copy of the logits
held between them (1.65 GB per 8192 x 50304 micro-batch). Here the forward reads the logits once (an online max
and sum of exponentials per row, fp32) and writes two floats a row (loss, log-sum-exp); the backward reads
them once more and writes the gradient in the logits' dtype: 6 bytes an element for bf16, and only the logits
themselves are kept.

    loss_r = lse_r - logit[r, label_r]      (0 where label_r == ignore_index)
    dlogit[r, v] = g_r * (exp(logit[r, v] - lse_r) - [v == label_r])      (0 on ignored rows)

A label outside [0, V) that is not ignore_index gives a NaN loss for its row (F.cross_entropy raises a device
assert there; a NaN is what the trainer's checks then see).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.lang import tmax, tsum

BLOCK_V = 4096  # vocabulary tile: 8 KB of bf16 per load, 16 elements a thread at 8 warps


@triton.jit
def _cross_entropy_fwd_kernel(LOGITS, LABELS, LOSS, LSE, V, stride_row, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # online log-sum-exp per lane, combined across lanes at the end (no reduction inside the loop)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.full([BLOCK_V], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + cols < V
        x = tl.load(base + v0 + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen only -inf keep s = 0 (exp(-inf - -inf) would be NaN)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    mx = tmax(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tsum(s * tl.exp(m - mx_safe), 0)
    lse = mx_safe + tl.log(total)
    label = tl.load(LABELS + row).to(tl.int64)
    in_range = (label >= 0) & (label < V)
    picked = tl.load(base + tl.where(in_range, label, 0)).to(tl.float32)
    loss = tl.where(in_range, lse - picked, float("nan"))
    loss = tl.where(label == ignore_index, 0.0, loss)
    tl.store(LOSS + row, loss)
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(LOGITS, LABELS, LSE, DLOSS, DLOGITS, V, stride_row, stride_drow, stride_dloss,
                              ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    label = tl.load(LABELS + row).to(tl.int64)
    g = tl.load(DLOSS + row * stride_dloss).to(tl.float32)
    g = tl.where(label == ignore_index, 0.0, g)
    lse = tl.load(LSE + row)
    x = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    d = g * (tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0))
    tl.store(DLOGITS + row * stride_drow + cols, d.to(DLOGITS.dtype.element_ty), mask=mask)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] with unit column stride (a view when it already has one)."""
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def cross_entropy_fwd(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(losses [N] fp32, lse [N] fp32) of logits [N, V], labels [N] int."""
    x = _rows(logits)
    n, v = x.shape
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        _cross_entropy_fwd_kernel[(n,)](x, labels, loss, lse, v, x.stride(0), int(ignore_index),
                                        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(max(v, 1))), num_warps=8)
    return loss, lse


def cross_entropy_bwd(dloss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                      ignore_index: int) -> torch.Tensor:
    """dlogits [N, V] in the logits' dtype, given dloss [N] (the gradient of each row's loss)."""
    x = _rows(logits)
    n, v = x.shape
    d = torch.empty(n, v, dtype=logits.dtype, device=x.device)
    if n and v:
        block = min(BLOCK_V, triton.next_power_of_2(v))
        _cross_entropy_bwd_kernel[(n, triton.cdiv(v, block))](
            x, labels, lse, dloss, d, v, x.stride(0), d.stride(0), dloss.stride(0), int(ignore_index),
            BLOCK_V=block, num_warps=8)
    return d
