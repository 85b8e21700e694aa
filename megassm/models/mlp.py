"""MLP (`-`): SwiGLU, out = w2(silu(w1 u) * w3 u) (model.mlp.activation=swiglu, the default), or squared
ReLU, out = w2(relu(w1 u)^2) with no w3 (relu2: Nemotron-H's MLP, so such hybrids export exactly).

w1 (gate) and w3 (up) are column-parallel and w2 (down) row-parallel under tensor parallelism; they are
separate Linears so a TP plan shards each one directly. w2 gets the GPT-2 scaled init like out_proj.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megassm.config import ModelConfig, ffn_hidden

from .init import make_linear

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        hidden = ffn_hidden(cfg)
        std = cfg.init_std
        self.hidden = hidden
        self.activation = cfg.mlp.activation
        self.w1 = make_linear(cfg.d_model, hidden, cfg.mlp.bias, std)
        self.w3 = make_linear(cfg.d_model, hidden, cfg.mlp.bias, std) if self.activation == "swiglu" else None
        self.w2 = make_linear(hidden, cfg.d_model, cfg.mlp.bias, std / math.sqrt(2 * n_layer))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(torch.square(F.relu(self.w1(u))))
        return self.w2(F.silu(self.w1(u)) * self.w3(u))
