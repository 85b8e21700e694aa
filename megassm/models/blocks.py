"""Residual blocks: pre-norm, with the residual stream kept in fp32.

A block takes (hidden, residual) -- the previous block's mixer output and the fp32 residual stream before
that output is added -- and returns its own (hidden, residual):

    normed, residual = add_rmsnorm(hidden, residual)      residual <- residual + hidden, in fp32
    hidden = mixer(normed)

so the add and the norm are one fused kernel and the stream never goes through bf16, even under autocast.
The first block gets (embedding, None); the model closes the stack with the same fused add + final norm.
The pair is also what crosses a pipeline-stage boundary.
"""
from __future__ import annotations

import torch
from torch import nn

from megassm.config import ModelConfig

from .norm import RMSNorm
from .registry import block_kind, block_kinds

__all__ = ["Block", "MIXERS"]

# Pattern letter -> mixer class, as the registry (models/registry.py) declares them. A mixer takes (cfg,
# n_layer) and, when its class sets `stateful = True`, implements forward(u, seq_idx=None, state=None,
# return_state=False) -> (out, state or None) (a kind with single_doc_hint also takes single_doc=),
# step(u, state) -> (out, state) and allocate_state(batch_size, device=None). Stateless mixers are forward(u) -> out.
MIXERS = {k.letter: k.mixer for k in block_kinds()}


class Block(nn.Module):
    def __init__(self, kind: str, cfg: ModelConfig, n_layer: int):
        super().__init__()
        spec = block_kind(kind)  # ValueError naming the known letters
        self.kind = kind
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = spec.mixer(cfg, n_layer)

    @property
    def has_state(self) -> bool:
        return bool(getattr(self.mixer, "stateful", False))

    def allocate_state(self, batch_size: int, device=None):
        return self.mixer.allocate_state(batch_size, device=device) if self.has_state else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        seq_idx: torch.Tensor | None = None,
        state=None,
        return_state: bool = False,
        single_doc: bool | None = None,
    ):
        """Returns (hidden, residual fp32, new state or None)."""
        normed, residual = self.norm.add_forward(hidden, residual)
        out, new_state = self._mix(normed, seq_idx, state, return_state, single_doc)
        return out, residual, new_state

    def forward_summed(self, summed: torch.Tensor, out_dtype: torch.dtype, seq_idx: torch.Tensor | None = None,
                       state=None, return_state: bool = False, single_doc: bool | None = None):
        """The block from the residual already summed (residual + hidden, fp32), its norm's output in `out_dtype`
        (the hidden's dtype): what forward computes after its add. Returns (hidden, new state or None).
        Activation checkpointing's one-tensor boundary (parallel/checkpointing.py)."""
        return self._mix(self.norm(summed, out_dtype), seq_idx, state, return_state, single_doc)

    def _mix(self, normed, seq_idx, state, return_state, single_doc):
        if block_kind(self.kind).single_doc_hint:  # attention: the batch's single-document hint skips the doc mask
            return self.mixer(normed, seq_idx=seq_idx, state=state, return_state=return_state, single_doc=single_doc)
        if self.has_state:
            return self.mixer(normed, seq_idx=seq_idx, state=state, return_state=return_state)
        return self.mixer(normed), None

    def step(self, hidden: torch.Tensor, residual: torch.Tensor | None, state=None):
        """One token: hidden [B, d_model]. Returns (hidden, residual fp32, new state or None)."""
        normed, residual = self.norm.add_forward(hidden, residual)
        if self.has_state:
            out, new_state = self.mixer.step(normed, state)
        else:
            out, new_state = self.mixer(normed), None
        return out, residual, new_state
