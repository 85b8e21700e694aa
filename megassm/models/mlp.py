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

from megassm import kernels
from megassm.config import MLP_ACTIVATIONS, ModelConfig, ffn_hidden

from .init import make_linear
from .registry import BlockKind, Cut, Replicate, Split, TPLayout, register

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
        gate, up = self.project_in(u)
        if up is None:
            return self.w2(torch.square(F.relu(gate)))
        return self.w2(kernels.swiglu(gate, up))  # one Triton pass each way on the GPU

    def project_in(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(w1 u, w3 u or None): one method, the only reader of u, so that a tensor-parallel plan can compute both
        projections in one node (parallel.tp_overlap, parallel/tp.py)."""
        return self.w1(u), (None if self.w3 is None else self.w3(u))


# ----------------------------------------------------------------------------------------------------
# the block kind `-`
# ----------------------------------------------------------------------------------------------------
def _check(cfg, need) -> None:
    m, p = cfg.model, cfg.parallel
    need(ffn_hidden(m) > 0, "model.mlp.ffn_hidden must be positive")
    need(m.mlp.activation in MLP_ACTIVATIONS,
         f"model.mlp.activation must be {' or '.join(MLP_ACTIVATIONS)}, got '{m.mlp.activation}'")
    need(ffn_hidden(m) % p.tp == 0, f"parallel.tp={p.tp} must divide model.mlp.ffn_hidden ({ffn_hidden(m)})")


def mlp_flops(m: ModelConfig, L: int) -> dict:
    mats = 3 if m.mlp.activation == "swiglu" else 2  # w1 (gate), w3 (up), w2 (down); relu2 has no w3
    return {"mlp": 2 * L * mats * m.d_model * ffn_hidden(m)}


def mlp_activation_bytes(m, a: int, ctx=None) -> tuple[int, int]:
    # swiglu: w1 out, w3 out (kept by kernels.swiglu's Triton path, which recomputes silu in its backward), their
    # product (w2's input); relu2: w1 out, relu(w1 out)^2. (The CPU reference path keeps silu(w1 out) as well.)
    return a * (3 if m.w3 is not None else 2) * m.hidden, 0


def mlp_tp_layout(mlp, ranks: int, sp: bool) -> TPLayout:
    """w1 / w3 column-parallel, w2 row-parallel (relu2 has no w3)."""
    if mlp.hidden % ranks:
        raise ValueError(f"tensor parallelism: tp={ranks} must divide the MLP hidden size ({mlp.hidden})")
    h = Split(mlp.hidden)
    lay = TPLayout()
    for n in ("w1", "w3") if mlp.w3 is not None else ("w1",):
        lay.params[n + ".weight"] = Cut(0, (h,))
        lay.params[n + ".bias"] = Cut(0, (h,))
    lay.params["w2.weight"] = Cut(1, (h,))
    lay.params["w2.bias"] = Cut(0, (Replicate(mlp.w2.weight.shape[0], 1, partial=sp),))
    lay.sizes = {"hidden": mlp.hidden // ranks}
    lay.row_parallel = {"w2": sp}
    lay.fan_out = ("mlp_fan_out", {})  # forward() reads u only through project_in
    return lay


BLOCK_KIND = register(BlockKind(
    letter="-", name="gated MLP", mixer=GatedMLP, sections=("mlp",), state=None, check=_check,
    flop_keys=("mlp",), flops=mlp_flops, activation_bytes=mlp_activation_bytes, tp_layout=mlp_tp_layout,
    cp="local", bptt=lambda mixer: None, cuda_graph="yes", fsdp_bf16_gather=True,
))
