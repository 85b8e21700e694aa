"""RMS norm modules: thin wrappers over megassm.kernels (fp32 weights, fp32 statistics)."""
from __future__ import annotations

import torch
from torch import nn

from megassm import kernels

from .init import InitRule


class RMSNorm(nn.Module):
    """weight [dim] fp32, initialized to 1, no weight decay."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.init_rules = {"weight": InitRule("ones", no_wd=True)}

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return kernels.rmsnorm(x, self.weight, self.eps, out_dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Fused residual add + norm: (normed in x.dtype, new fp32 residual = residual + x)."""
        return kernels.add_rmsnorm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Grouped RMS norm with a SiLU gate (end of the Mamba-2 mixer): norm_g(y * silu(z)) * weight,
    or norm_g(y) * weight * silu(z) when norm_before_gate. Groups are contiguous slices of the last dim,
    so each tensor-parallel rank owns whole groups."""

    def __init__(self, dim: int, ngroups: int = 1, eps: float = 1e-5, norm_before_gate: bool = False):
        super().__init__()
        self.eps = eps
        self.ngroups = ngroups
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.init_rules = {"weight": InitRule("ones", no_wd=True)}

    def forward(self, y: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        return kernels.gated_rmsnorm(
            y, z, self.weight, ngroups=self.ngroups, eps=self.eps, norm_before_gate=self.norm_before_gate
        )

    def extra_repr(self) -> str:
        n = self.weight.shape[0]
        return f"{n}, ngroups={self.ngroups}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
