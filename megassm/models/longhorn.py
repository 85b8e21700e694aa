"""Longhorn mixer (`L`): Liu et al., "Longhorn: State Space Models are Amortized Online Learners", eq. 7.

The Mamba-1 block (models/mamba1.py: in_proj -> x, z; conv + SiLU; x_proj; D skip; silu(z) gate; out_proj)
with the SSM replaced by one step of implicit online regression per token. With x_proj(x) = [dt_low | k | q]
(R + 2m), per channel i and key index j (state S [d_inner, m], fp32):

    beta_t = sigmoid(beta_proj(dt_low_t))                      [d_inner], beta_proj: R -> d_inner with bias
    eps_t  = beta_t / (1 + beta_t * |k_t|^2)                   |k|^2 over all m entries
    S_t[i, j] = (1 - eps_t[i] k_t[j]^2) S_{t-1}[i, j] + eps_t[i] x_t[i] k_t[j]
    y_t    = S_t q_t + D x_t

No A parameter: forgetting comes from k (the gate 1 - eps k_j^2 lies in [1 / (1 + beta |k|^2), 1], so the
recurrence is stable). This is exactly the selective scan with delta = eps, B = k, C = q and decay
1 - delta B^2 (megassm.kernels.selective_scan, decay="longhorn"); eps is computed here in fp32 and its
dependence on k through |k|^2 is differentiated by autograd (the paper's extra dK term). The paper's exact
update (Thm 3.1) has the full k k^T; eq. 7, the model the paper trains, is its diagonal.

Init (`init: paper`, the official code's): every Linear bias zero (beta = 1/2 at init), beta_proj.weight
~ U(+-R^-1/2), D = 1; in_proj / x_proj ~ U(+-1/sqrt(fan_in)), out_proj the same / sqrt(blocks).
Tensor parallelism as Mamba-1 (`scan_tp_layout` in models/mamba1.py): two all-reduces per layer, since k, q and
dt_low come from x_proj over all channels (and |k|^2 needs all of k).
"""
from __future__ import annotations

import torch

from megassm import kernels
from megassm.config import ModelConfig

from .mamba1 import SelectiveScanMixer, ruled_linear, check_scan_section, scan_activation_bytes, scan_flops, scan_tp_layout
from .registry import BlockKind, register
from .state import ScanState

__all__ = ["LonghornMixer", "longhorn_eps"]


def longhorn_eps(beta_logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """eps = beta / (1 + beta |k|^2), beta = sigmoid(logits) [..., d_inner], k [..., m]; fp32 (fp64 stays)."""
    cdt = torch.promote_types(beta_logits.dtype, torch.float32)
    beta = torch.sigmoid(beta_logits.to(cdt))
    k2 = k.to(cdt).pow(2).sum(dim=-1, keepdim=True)
    return beta / (1.0 + beta * k2)


class LonghornMixer(SelectiveScanMixer):
    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__(cfg, n_layer, cfg.longhorn, "L")
        self.beta_proj = ruled_linear(self.dt_rank, self.d_inner, True, self._low_rank_rule())

    def _eps(self, dt_low, k):
        return longhorn_eps(self.beta_proj(dt_low), k)

    def scan(self, x, dt_low, Bm, Cm, z, seq_idx, ssm_state, return_state):
        """y [B, L, d_inner] (x.dtype) with the D skip and the z gate, and the final state if asked."""
        return kernels.selective_scan(x, self._eps(dt_low, Bm), None, Bm, Cm, D=self.D, z=z, decay="longhorn",
                                      initial_state=ssm_state, seq_idx=seq_idx, return_final_state=return_state)

    def scan_step(self, ssm_state, x, dt_low, Bm, Cm, z):
        return kernels.selective_scan_step(ssm_state, x, self._eps(dt_low, Bm), None, Bm, Cm, D=self.D, z=z,
                                           decay="longhorn")


BLOCK_KIND = register(BlockKind(
    letter="L", name="Longhorn", mixer=LonghornMixer, sections=("longhorn",), state=ScanState,
    check=lambda cfg, need: check_scan_section(cfg, need, "L", "longhorn"),
    flop_keys=("longhorn_proj", "longhorn_conv", "longhorn_scan"), flops=lambda m, L: scan_flops(m, L, "L"),
    activation_bytes=lambda mixer, a, ctx: (scan_activation_bytes(mixer, a, "L"), 0),
    tp_layout=scan_tp_layout, cp=None, bptt=None, cuda_graph="yes",
))
