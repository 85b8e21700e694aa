"""The FP8 quantization in plain PyTorch: the power-of-two scales, the casts, and fp8_linear_reference (the test
oracle of fp8_linear, kernels/fp8/op.py: the same rounding in fp32 autograd)."""
from __future__ import annotations

import torch

__all__ = ["AMAX_FLOOR", "E4M3", "E5M2", "fp8_linear_reference", "to_fp8"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12  # a zero tensor's amax: its scale leaves every element 0


def _scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two scale that maps amax(|t|) to at most the format's largest finite value (fp32, 0-dim):
    2^floor(log2(fmax / amax)), the exponent read exactly (frexp) rather than through a rounded log2."""
    amax = torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32).clamp(min=AMAX_FLOOR)
    _, e = torch.frexp(torch.finfo(dtype).max / amax)  # fmax / amax = m 2^e, m in [0.5, 1)
    return torch.ldexp(torch.ones((), dtype=torch.float32, device=t.device), e - 1)


def to_fp8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t * s cast to `dtype`, 1 / s): the FP8 tensor and the scale that multiplies it back."""
    s = _scale(t, dtype)
    if t.dtype == torch.float16:  # a power of two above 2^15 is inf in fp16 (bf16 and fp32 hold any of them)
        t = t.float()
    return (t * s.to(t.dtype)).to(dtype), s.reciprocal()


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same quantization in plain fp32 autograd (the test oracle): x and W rounded to E4M3 at their scales in
    the forward, the output gradient rounded to E5M2 in the backward; the products in fp32."""
    def q(t, dtype):
        t8, inv = to_fp8(t.detach(), dtype)
        return t8.float() * inv

    class _RoundGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y

        @staticmethod
        def backward(ctx, g):
            return q(g, E5M2)

    xq = x.float() + (q(x, E4M3) - x.float()).detach()  # straight-through: the gradient flows to x unchanged
    wq = weight.float() + (q(weight, E4M3) - weight.float()).detach()
    y = _RoundGrad.apply(xq @ wq.t())
    if bias is not None:
        y = y + bias.float()
    return y
