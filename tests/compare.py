"""Comparison helpers of the equivalence tests. A non-finite value never passes: rel() and worst() give inf
for it, and the checks are written `not x <= tol`, which NaN fails too."""
from __future__ import annotations

import math
import zlib

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (Frobenius norms, fp64); inf when either side holds a NaN or inf."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def worst(values) -> float:
    """max of floats; inf when any is NaN or inf (a bare max() skips NaN depending on the order)."""
    values = [float(v) for v in values]
    return math.inf if any(not math.isfinite(v) for v in values) else max(values, default=0.0)


def close(x: float, ref: float, tol: float) -> bool:
    """Both finite and |x - ref| <= tol |ref|."""
    return math.isfinite(x) and math.isfinite(ref) and abs(x - ref) <= tol * abs(ref)


@torch.no_grad()
def randomize_(named_params, seed: int = 0, scale: float = 0.1) -> None:
    """Move every parameter off its initial value, deterministically by name (the same name gets the same
    values in any layout): zero biases become ~N(0, scale^2), unit norm weights 1 + N(0, scale^2), other
    tensors get noise of scale times their own spread. A dropped or misplaced bias then changes outputs."""
    for name, p in named_params:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
        spread = p.detach().double().std().item() if p.numel() > 1 else 0.0
        p.add_((noise * scale * (spread if spread > 0 else 1.0)).to(device=p.device, dtype=p.dtype))
