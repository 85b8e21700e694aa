"""Recurrent state: one format for decoding, BPTT state carrying across training windows, and (later) the
hand-off between context-parallel ranks.

A model's state is a list with one entry per block of the pattern:
  `M`  MambaState(conv [B, conv_dim, d_conv-1], ssm [B, H, P, N]), both fp32;
  `*`  KVCache(k, v [B, n_kv_heads, T, head_dim], valid [B, T] bool, pos [B] int64): the keys (already
       rotated by RoPE) and values of the row's current document. Full attention keeps every key of the
       document (T grows); a sliding window of W keeps the last W. `valid` marks which cached columns still
       belong to the row's current document (a reset or a document boundary invalidates the older ones
       without reshaping the batch); `pos` is the in-document position of the next token (RoPE);
  `-`  None (the MLP has no state);
  `C`  CoffeeState(x [B, D, n] fp32): the COFFEE state of every channel;
  `B`  BMojoState: its Mamba-2 SSM (conv, ssm), the last W raw keys/values, the current chunk's memory
       tokens, the running top-m_e eidetic candidates with their scores, the last SSM outputs (fading tokens
       and the innovation predictor) and the in-document position (models/bmojo.py);
  `S`, `L` ScanState(conv [B, d_inner, d_conv-1], ssm [B, d_inner, N]), both fp32: the Mamba-1 / Longhorn
       conv tail and selective-scan state (Longhorn's S: [d_inner, m]).

State objects are immutable in practice: every op returns new tensors, so a state can be kept (e.g. for
BPTT or for trying several continuations) and reused.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

__all__ = ["MambaState", "KVCache", "CoffeeState", "BMojoState", "ScanState", "reset_states", "detach_states", "states_to",
           "cat_states", "select_states"]


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


@dataclass
class CoffeeState:
    x: torch.Tensor  # [B, D, n] fp32

    @property
    def batch_size(self) -> int:
        return self.x.shape[0]

    def reset(self, mask: torch.Tensor) -> "CoffeeState":
        """Zero the rows where mask [B] (bool) is True."""
        keep = ~mask.to(device=self.x.device, dtype=torch.bool)
        return CoffeeState(x=self.x * keep.view(-1, 1, 1).to(self.x.dtype))


@dataclass
class BMojoState:
    """Everything a B'MOJO layer carries (W = window, m = n_fading + n_eidetic, Hy = max(n_fading, k))."""

    conv: torch.Tensor  # [B, conv_dim, d_conv-1] fp32: the SSM's conv state
    ssm: torch.Tensor  # [B, H, P, N] fp32: the SSM state
    k: torch.Tensor  # [B, n_kv_heads, W, head_dim]: keys of the last W tokens (oldest first)
    v: torch.Tensor  # [B, n_kv_heads, W, head_dim]
    valid: torch.Tensor  # [B, W] bool: that token belongs to the row's current document
    mem_k: torch.Tensor  # [B, n_kv_heads, m, head_dim]: the current chunk's memory tokens [fading | eidetic]
    mem_v: torch.Tensor  # [B, n_kv_heads, m, head_dim]
    mem_valid: torch.Tensor  # [B, m] bool
    cand_k: torch.Tensor  # [B, n_kv_heads, m_e, head_dim]: top-m_e candidates of the document so far
    cand_v: torch.Tensor  # [B, n_kv_heads, m_e, head_dim]
    cand_score: torch.Tensor  # [B, m_e] fp32 innovation scores
    cand_pos: torch.Tensor  # [B, m_e] int64 in-document positions (ties go to the earlier token)
    cand_valid: torch.Tensor  # [B, m_e] bool
    y_hist: torch.Tensor  # [B, Hy, d_model] fp32: the last SSM outputs (0 before the document start)
    y_valid: torch.Tensor  # [B, Hy] bool
    pos: torch.Tensor  # [B] int64: in-document position of the next token

    @property
    def batch_size(self) -> int:
        return self.pos.shape[0]

    def reset(self, mask: torch.Tensor) -> "BMojoState":
        """Forget the rows where mask [B] (bool) is True: SSM zeroed, every memory invalid, position 0."""
        mask = mask.to(device=self.pos.device, dtype=torch.bool)
        keep = ~mask
        return BMojoState(
            conv=self.conv * keep.view(-1, 1, 1).to(self.conv.dtype),
            ssm=self.ssm * keep.view(-1, 1, 1, 1).to(self.ssm.dtype),
            k=self.k, v=self.v, valid=self.valid & keep[:, None],
            mem_k=self.mem_k, mem_v=self.mem_v, mem_valid=self.mem_valid & keep[:, None],
            cand_k=self.cand_k, cand_v=self.cand_v, cand_score=self.cand_score, cand_pos=self.cand_pos,
            cand_valid=self.cand_valid & keep[:, None],
            y_hist=self.y_hist * keep.view(-1, 1, 1).to(self.y_hist.dtype), y_valid=self.y_valid & keep[:, None],
            pos=torch.where(mask, torch.zeros_like(self.pos), self.pos),
        )


@dataclass
class ScanState:
    conv: torch.Tensor  # [B, d_inner, d_conv-1] fp32, oldest input first
    ssm: torch.Tensor  # [B, d_inner, N] fp32

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[0]

    def reset(self, mask: torch.Tensor) -> "ScanState":
        """Zero the rows where mask [B] (bool) is True."""
        keep = ~mask.to(device=self.ssm.device, dtype=torch.bool)
        return ScanState(conv=self.conv * keep.view(-1, 1, 1).to(self.conv.dtype),
                         ssm=self.ssm * keep.view(-1, 1, 1).to(self.ssm.dtype))


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


def _cat_one(parts: list):
    """One block's states of several batches, concatenated along the batch. Attention caches of different
    lengths are left-padded with invalid columns (masked out by `valid`, so every row decodes as it would
    alone); every other state has fixed shapes."""
    if parts[0] is None:
        return None
    if isinstance(parts[0], KVCache):
        T = max(p.length for p in parts)

        def pad(p: KVCache) -> KVCache:
            extra = T - p.length
            if not extra:
                return p
            z = p.k.new_zeros(p.k.shape[0], p.k.shape[1], extra, p.k.shape[3])
            return KVCache(k=torch.cat([z, p.k], 2), v=torch.cat([z.to(p.v.dtype), p.v], 2),
                           valid=torch.cat([p.valid.new_zeros(p.valid.shape[0], extra), p.valid], 1), pos=p.pos)

        parts = [pad(p) for p in parts]
    first = parts[0]
    return replace(first, **{f.name: torch.cat([getattr(p, f.name) for p in parts], 0) for f in fields(first)})


def cat_states(batches: list[list]) -> list:
    """The states of several batches (each a per-block list) as one batch, rows in order."""
    if not batches:
        raise ValueError("cat_states: no states")
    return [_cat_one([b[i] for b in batches]) for i in range(len(batches[0]))]


def select_states(states: list, rows: torch.Tensor) -> list:
    """The rows `rows` (index tensor) of every block's states, e.g. to drop finished rows while decoding."""
    return _map(states, lambda name, t: t.index_select(0, rows.to(t.device)))
