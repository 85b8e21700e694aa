"""Pure-PyTorch reference for the causal depthwise conv1d (+ SiLU) of the Mamba-2 mixer.

Convention (same as the usual causal-conv1d kernels): with width W, weight[:, W-1] multiplies the current
input and weight[:, k] the input W-1-k steps back:

    y_t = act(bias + sum_k weight[:, k] * x_{t-(W-1)+k})

The conv state is the W-1 inputs preceding the next token, oldest first, [B, C, W-1]. Channels-last x
[B, L, C] is the layout the in_proj produces, so no transpose is needed around the op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_step"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _activate(y, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"causal_conv1d: unknown activation {activation!r} (expected 'silu' or None)")


def causal_conv1d(
    x, weight, bias=None, initial_state=None, seq_idx=None, activation="silu", return_final_state=False
):
    """x [B,L,C], weight [C,W], bias [C], initial_state [B,C,W-1], seq_idx [B,L] (nondecreasing ids).

    Taps never cross a document boundary: an input of an earlier document reads as 0, and initial_state
    counts as part of the row's first document. Returns y [B,L,C] (x.dtype) or (y, final_state [B,C,W-1]
    fp32), where final_state is what the next token of the last document would see (inputs of earlier
    documents zeroed).
    """
    bsz, seqlen, channels = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width) or width < 1:
        raise ValueError(f"causal_conv1d: weight must be [C={channels}, W], got {tuple(weight.shape)}")
    cdt = _compute_dtype(x)
    _activate(x.new_zeros(()), activation)  # validate the activation name early

    if initial_state is None:
        prev = x.new_zeros(bsz, width - 1, channels, dtype=cdt)
    else:
        prev = initial_state.to(cdt).transpose(1, 2)
    xp = torch.cat([prev, x.to(cdt)], dim=1)  # row j + W-1 holds input j; rows < W-1 the carried state
    if seq_idx is not None:
        # carried rows belong to the row's first document
        sp = torch.cat([seq_idx[:, :1].expand(bsz, width - 1), seq_idx], dim=1)

    w = weight.to(cdt)
    y = None
    for k in range(width):  # W <= 4: a few fused multiply-adds beat building a [B,L,C,W] window tensor
        tap = xp[:, k : k + seqlen]
        if seq_idx is not None:
            same = (sp[:, k : k + seqlen] == seq_idx)[..., None]
            tap = torch.where(same, tap, torch.zeros_like(tap))
        term = tap * w[:, k]
        y = term if y is None else y + term
    if bias is not None:
        y = y + bias.to(cdt)
    y = _activate(y, activation).to(x.dtype)
    if not return_final_state:
        return y

    last = xp[:, seqlen:]  # the W-1 most recent rows (may reach into the carried state when L < W-1)
    if seq_idx is not None:
        same = (sp[:, seqlen:] == seq_idx[:, -1:])[..., None]
        last = torch.where(same, last, torch.zeros_like(last))
    return y, last.transpose(1, 2).contiguous()


def causal_conv1d_step(state, x, weight, bias=None, activation="silu"):
    """One decode token: state [B,C,W-1] (fp32), x [B,C] -> (y [B,C] in x.dtype, new_state fp32).

    Resets are the caller's job (zero the state). The input state is not modified.
    """
    cdt = _compute_dtype(x)
    window = torch.cat([state.to(cdt), x.to(cdt)[:, :, None]], dim=-1)  # [B, C, W]
    y = (window * weight.to(cdt)).sum(dim=-1)
    if bias is not None:
        y = y + bias.to(cdt)
    return _activate(y, activation).to(x.dtype), window[:, :, 1:]
