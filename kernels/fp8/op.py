"""FP8 matmuls for the projections (train.fp8): y = x W^T + b with x and W in float8, per-tensor dynamic scales.

    fp8_linear(x, weight, bias=None)          # x [..., K], weight [N, K]: [..., N]

Forward: x and W each scaled by a power of two s = 2^floor(log2(fmax / amax)) and cast to float8_e4m3fn
(fmax 448), multiplied by torch._scaled_mm (FP8 tensor cores on sm_89+; also a CPU implementation) with the
inverse scales, accumulated in fp32, written in the autocast dtype (else x's). Backward: the output gradient
is scaled and cast to float8_e5m2 (fmax 57344: gradients need range more than precision), then dx = g W and
dW = g^T x as two more FP8 matmuls from the saved FP8 x and W; dW is written in W's dtype (fp32 master weights:
no bf16 round trip). This is the "tensorwise" recipe of torchao's float8 training and Transformer Engine's
current scaling, written here on torch._scaled_mm so it runs under our CUDA graphs: every scale is computed
on the device (no host sync).

Why powers of two: multiplying by 2^k is exact in any float format, so the only rounding is the cast to FP8,
and since s <= fmax / amax no element exceeds fmax (no clamp, no saturation). A zero tensor gets amax 1e-12's
scale (every element stays 0).

torch._scaled_mm wants its first operand row-major and its second column-major, with the reduced dimension
and the output's columns multiples of 16. K and N are checked by `fp8_eligible` (the caller keeps a Linear that
fails it in bf16); the token count M is the reduced dimension of dW: when M % 16 != 0, dW is computed in x's
dtype from the dequantized FP8 x instead (the same values, one bf16 matmul).

The casts (`cast_fp8`) write each FP8 operand in the layouts its matmuls take: x and W row-major for the forward,
x^T (the weight gradient's column-major x) kept for the backward instead of x, W^T for dx, and the output
gradient both ways. On CUDA that is kernels/fp8/triton_fp8.py, two passes over the input (amax; scale, cast and
transpose), the same values as the eager casts used elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import triton_module, use_triton
from .reference import AMAX_FLOOR, E4M3, E5M2, to_fp8

__all__ = ["cast_fp8", "fp8_eligible", "fp8_linear", "fp8_weight"]

triton_fp8 = triton_module("megassm.kernels.fp8.triton_fp8")  # cast_transpose


def fp8_eligible(in_features: int, out_features: int) -> bool:
    """Can a Linear of these sizes run through torch._scaled_mm (both multiples of 16)?"""
    return in_features % 16 == 0 and out_features % 16 == 0


def cast_fp8(t: torch.Tensor, dtype: torch.dtype, transpose: bool = True, out: tuple | None = None,
             rowmajor: bool = True) -> tuple:
    """A 2-D t as (t8 or None, t8^T contiguous or None, 1 / s), the FP8 operands torch._scaled_mm takes in both
    roles (`rowmajor`, `transpose`: which to make). Triton (triton_fp8.py: two passes over t) on CUDA
    tensors, else the eager casts; the same values. `out`: (t8, t8t, inv) to write in place."""
    if use_triton(t):
        return triton_fp8().cast_transpose(t, dtype, AMAX_FLOOR, transpose, out, rowmajor)
    t8, inv = to_fp8(t, dtype)
    t8t = t8.t().contiguous() if transpose else None
    t8 = t8 if rowmajor else None
    if out is None:
        return t8, t8t, inv
    for dst, src in zip(out, (t8, t8t, inv)):
        if dst is not None:
            dst.copy_(src)
    return out


@torch.no_grad()
def fp8_weight(weight: torch.Tensor, out: tuple | None = None) -> tuple:
    """A weight's FP8 operands, (w8 [N, K], w8t [K, N] contiguous, 1 / scale): what fp8_linear would make of it
    at every call, made once (training/fp8.py casts them once per optimizer step, as Transformer Engine does
    at a step's first micro-batch). With `out` (a tuple of that layout), written into it in place: CUDA graphs
    read the same tensors."""
    return cast_fp8(weight, E4M3, transpose=True, out=out)


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, out_dtype: torch.dtype):
    """a8 [M, K] row-major times b8 [K, N] column-major, dequantized by sa * sb."""
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, wq):
        K = x.shape[-1]
        x2 = x.reshape(-1, K)
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # x^T is the column-major x the weight gradient's matmul takes: the only FP8 copy of x kept
        x8, x8t, sx = cast_fp8(x2, E4M3, transpose=want_dw)
        if wq is None:  # cast here (FSDP2: the gathered weight); dx's W^T is cast again in the backward from the
            # weight itself, which costs no memory (FSDP2 holds it to the backward at reshard=step, gathers it again
            # at reshard=block) where an FP8 copy kept from forward to backward would hold 1 byte a parameter of the
            # whole model (6.5 GiB at 7B); the same bits as a forward cast
            w8, _, sw = cast_fp8(weight, E4M3, transpose=False)
            ctx.save_for_backward(x8t, sx, weight if want_dx else None, sw)
        else:  # cast once per step (fp8_weight): the same values
            w8, w8t, sw = wq
            ctx.save_for_backward(x8t, sx, w8t, sw)
        ctx.recast = wq is None
        y = _mm(x8, w8.t(), sx, sw, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.n_out = x.shape, x.dtype, weight.dtype, weight.shape[0]
        ctx.has_bias = bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y  # [M, N]: fp8_linear views it as [..., N] outside (a view made in here could not be changed in
        # place afterwards, as TP's all-reduce of a row-parallel output does)

    @staticmethod
    def backward(ctx, gy):
        x8t, sx, w_kept, sw = ctx.saved_tensors  # w_kept: W^T in FP8, or (ctx.recast) the weight itself
        w8t = w_kept
        if ctx.recast and w_kept is not None:  # W^T's operand cast as the forward cast W
            _, w8t, sw = cast_fp8(w_kept.detach(), E4M3, rowmajor=False, transpose=True)
        g2 = gy.reshape(-1, ctx.n_out)
        M = g2.shape[0]
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g8, g8t, sg = cast_fp8(g2, E5M2, transpose=want_dw and M % 16 == 0)
        dx = dw = db = None
        if want_dx:  # g [M, N] @ W [N, K]: W as a column-major [N, K], i.e. W^T row-major
            dx = _mm(g8, w8t.t(), sg, sw, ctx.x_dtype).view(ctx.x_shape)
        if want_dw:  # g^T [N, M] @ x [M, K]
            if M % 16 == 0:
                dw = _mm(g8t, x8t.t(), sg, sx, ctx.w_dtype)
            else:  # the reduced dimension is not a multiple of 16: the same operands, one matmul in x's dtype
                dt = ctx.x_dtype if ctx.x_dtype in (torch.bfloat16, torch.float16) else torch.float32
                dw = ((g8.to(dt) * sg.to(dt)).t() @ (x8t.t().to(dt) * sx.to(dt))).to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               wq: tuple | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through FP8 (module docstring). The output is in the autocast dtype when
    autocast is on (as F.linear's would be), else in x's dtype. `wq`: the weight's operands from fp8_weight,
    to use instead of casting the weight at this call (they must be of its current values; dW still goes to
    `weight`)."""
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fp8_linear: output dtype {out_dtype} (bf16, fp16 or fp32)")
    if not fp8_eligible(x.shape[-1], weight.shape[0]):
        raise ValueError(f"fp8_linear: in_features {x.shape[-1]} and out_features {weight.shape[0]} must be "
                         "multiples of 16 (torch._scaled_mm); keep this Linear in bf16")
    if x.numel() == 0:  # no tokens (an amax has no value): the empty output, and zero gradients, of F.linear
        return F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
    with torch.autocast(dev, enabled=False):
        return _FP8Linear.apply(x, weight, bias, out_dtype, wq).view(*x.shape[:-1], weight.shape[0])
