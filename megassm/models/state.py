"""Recurrent state: one format for decoding, BPTT state carrying across training windows, and (later) the
hand-off between context-parallel ranks.

A model's state is a list with one entry per block of the pattern:
  `M`  MambaState(conv [B, conv_dim, d_conv-1], ssm [B, H, P, N]), both fp32;
  `*`  KVCache(k, v [B, n_kv_heads, T, head_dim], valid [B, T] bool, pos [B] int64): the keys (already
       rotated by RoPE) and values of the row's current document. Full attention keeps every key of the
       document (T grows); a sliding window of W keeps the last W. `valid` marks which cached columns still
       belong to the row's current document (a reset or a document boundary invalidates the older ones
       without reshaping the batch); `pos` is the in-document position of the next token (RoPE);
  `-`  None (the MLP has no state).

State objects are immutable in practice: every op returns new tensors, so a state can be kept (e.g. for
BPTT or for trying several continuations) and reused.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["MambaState", "KVCache", "reset_states", "detach_states", "states_to"]


@dataclass
class MambaState:
    conv: torch.Tensor  # [B, conv_dim, d_conv-1] fp32, oldest input first
    ssm: torch.Tensor  # [B, H, P, N] fp32

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[0]

    def reset(self, mask: torch.Tensor) -> "MambaState":
        """Zero the rows where mask [B] (bool) is True."""
        keep = ~mask.to(device=self.ssm.device, dtype=torch.bool)
        return MambaState(
            conv=self.conv * keep.view(-1, 1, 1).to(self.conv.dtype),
            ssm=self.ssm * keep.view(-1, 1, 1, 1).to(self.ssm.dtype),
        )


@dataclass
class KVCache:
    k: torch.Tensor  # [B, n_kv_heads, T, head_dim], rotated keys
    v: torch.Tensor  # [B, n_kv_heads, T, head_dim]
    valid: torch.Tensor  # [B, T] bool: column belongs to the row's current document
    pos: torch.Tensor  # [B] int64: in-document position of the next token

    @property
    def batch_size(self) -> int:
        return self.k.shape[0]

    @property
    def length(self) -> int:
        return self.k.shape[2]

    def reset(self, mask: torch.Tensor) -> "KVCache":
        """Forget the rows where mask [B] (bool) is True: their columns become invalid, position 0."""
        mask = mask.to(device=self.valid.device, dtype=torch.bool)
        return KVCache(
            k=self.k,
            v=self.v,
            valid=self.valid & ~mask[:, None],
            pos=torch.where(mask, torch.zeros_like(self.pos), self.pos),
        )


def _map(states, fn):
    out = []
    for s in states:
        if s is None:
            out.append(None)
        else:
            out.append(replace(s, **{f.name: fn(f.name, getattr(s, f.name)) for f in fields(s)}))
    return out


def reset_states(states: list, mask: torch.Tensor | None) -> list:
    """Zero/forget the rows where mask [B] is True in every layer (a new document starts in that row)."""
    if mask is None:
        return list(states)
    return [None if s is None else s.reset(mask) for s in states]


def detach_states(states: list) -> list:
    """Cut the autograd graph (BPTT: carry the values, not the history)."""
    return _map(states, lambda name, t: t.detach())


def states_to(states: list, device=None) -> list:
    return _map(states, lambda name, t: t.to(device))
