"""Gated MLP (`-`): SwiGLU. out = w2(silu(w1 u) * w3 u).

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
from .registry import BlockKind, Cut, Replicate, Split, TPLayout, register

__all__ = ["GatedMLP"]


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        hidden = ffn_hidden(cfg)
        std = cfg.init_std
        self.hidden = hidden
        self.w1 = make_linear(cfg.d_model, hidden, cfg.mlp.bias, std)
        self.w3 = make_linear(cfg.d_model, hidden, cfg.mlp.bias, std)
        self.w2 = make_linear(hidden, cfg.d_model, cfg.mlp.bias, std / math.sqrt(2 * n_layer))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(u)) * self.w3(u))


# ----------------------------------------------------------------------------------------------------
# the block kind `-`
# ----------------------------------------------------------------------------------------------------
def _check(cfg, need) -> None:
    m, p = cfg.model, cfg.parallel
    need(ffn_hidden(m) > 0, "model.mlp.ffn_hidden must be positive")
    need(ffn_hidden(m) % p.tp == 0, f"parallel.tp={p.tp} must divide model.mlp.ffn_hidden ({ffn_hidden(m)})")


def mlp_flops(m: ModelConfig, L: int) -> dict:
    return {"mlp": 2 * L * 3 * m.d_model * ffn_hidden(m)}  # w1 (gate), w3 (up), w2 (down)


def mlp_activation_bytes(m, a: int, ctx=None) -> tuple[int, int]:
    return a * 4 * m.hidden, 0  # w1 out, silu(w1 out), w3 out, their product (w2's input)


def mlp_tp_layout(mlp, tp: int, sp: bool) -> TPLayout:
    """w1 / w3 column-parallel, w2 row-parallel."""
    if mlp.hidden % tp:
        raise ValueError(f"tensor parallelism: tp={tp} must divide the MLP hidden size ({mlp.hidden})")
    h = Split(mlp.hidden)
    lay = TPLayout()
    for n in ("w1", "w3"):
        lay.params[n + ".weight"] = Cut(0, (h,))
        lay.params[n + ".bias"] = Cut(0, (h,))
    lay.params["w2.weight"] = Cut(1, (h,))
    lay.params["w2.bias"] = Cut(0, (Replicate(mlp.w2.weight.shape[0], 1, partial=sp),))
    lay.sizes = {"hidden": mlp.hidden // tp}
    lay.row_parallel = {"w2": sp}
    return lay


BLOCK_KIND = register(BlockKind(
    letter="-", name="gated MLP", mixer=GatedMLP, sections=("mlp",), state=None, check=_check,
    flop_keys=("mlp",), flops=mlp_flops, activation_bytes=mlp_activation_bytes, tp_layout=mlp_tp_layout,
    cp="local", bptt=lambda mixer: None, cuda_graph="yes", fsdp_bf16_gather=True,
))
