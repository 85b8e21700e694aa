"""Attention (`*`): causal, grouped-query, optional RoPE and sliding window, torch SDPA.

Document masking (attn.doc_mask, default on): with `seq_idx`, a token attends only to earlier tokens of its
own document (block-diagonal causal mask) and RoPE positions restart at each document, so a document's
outputs are the same wherever it sits in a packed row, and equal to what token-by-token decoding with a
reset gives. When every row holds one document the SDPA `is_causal` fast path is used (no mask tensor);
finding that out reads seq_idx on the host (`single_document`, once per model call). A caller that must not
sync (a CUDA graph capture: LanguageModel.capture_safe) passes single_doc=False: the mask and the positions
are then built on the device for every batch, single-document or not. Nothing else in the training forward
and backward (no cache, tp = cp = 1) reads a value on the host, sliding window included.
With doc_mask off, seq_idx is ignored here (packed documents see each other, positions run over the row).

Sliding window W: a token attends to itself and the W-1 tokens before it.

Carried state (KVCache, see state.py): keys are cached after RoPE. A forward with a cache prepends the
cached columns; they are visible to the row's first document only (and only where still `valid`).

Projections are separate q/k/v/o Linears (q: n_heads*head_dim rows, head-major; k/v: n_kv_heads*head_dim),
so tensor parallelism splits heads by slicing rows of q/k/v and columns of o.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megassm.config import ModelConfig, attn_dims

from .init import make_linear
from .registry import BlockKind, Cut, Replicate, Split, TPLayout, causal_pairs, register
from .state import KVCache

__all__ = ["Attention", "doc_positions", "masked_sdpa", "rope_rotate", "sdpa_without_cudnn", "single_document"]

# cuDNN's SDPA backend (the default for fp16 / bf16 on H100 and H200 since torch 2.11) has two known backward
# bugs, both when a query row's logsumexp is below -88.7 (every logit of the row very negative), measured on
# H200 with torch 2.11 / cuDNN 9.19 (docs/benchmarks.md):
#  - with an explicit mask and a key length of 64 mod 128, the query gradient is NaN (pytorch/pytorch#196678:
#    the unused half of the last 128-wide key tile is scored 0, not -inf). B'MOJO training with 576 keys per
#    query block hit it after ~1,500 steps (docs/seeds.md). Keys padded to a multiple of 128, the padding
#    masked out, give the right gradients on the same kernel, at the cost of the padding;
#  - with a single query, the key and value gradients are NaN (NVIDIA/cudnn-frontend#1072), padded or not:
#    such calls leave cuDNN out.
# Only calls that will be differentiated are touched: the forward is right, so inference (decoding) keeps
# cuDNN as it is, and so does the mask-free causal call, which the first bug spares.
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _cudnn_backward_possible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """SDPA may run this call's backward on cuDNN: a GPU, fp16 / bf16 (cuDNN takes nothing else), grad enabled
    and something to differentiate."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad))


def _pad_keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, extra: int):
    """`extra` zero keys / values appended, and masked out (False, or -inf for an additive mask)."""
    fill = False if mask.dtype == torch.bool else float("-inf")
    mask = mask.expand(*mask.shape[:-1], k.shape[-2])
    return F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra)), F.pad(mask, (0, extra), value=fill)


def sdpa_without_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       enable_gqa: bool = False) -> torch.Tensor:
    """Masked SDPA on any backend but cuDNN. Grouped K / V heads are shared out first: of those backends only
    flash (which takes no mask) and math accept grouped heads, and the memory-efficient kernel should run."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]  # query head i reads K / V head i // rep, as SDPA's enable_gqa
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    with sdpa_kernel(_NO_CUDNN):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                enable_gqa: bool = False) -> torch.Tensor:
    """SDPA with an explicit mask (q [..., Hq, Lq, D], k / v [..., Hkv, Lk, D]), steered around cuDNN's known
    backward bugs (above) when it will be differentiated in fp16 / bf16 on the GPU: a key length of 64 mod
    128 is padded to the next multiple of 128; a single query leaves cuDNN out (sdpa_without_cudnn)."""
    if not _cudnn_backward_possible(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    if q.shape[-2] == 1:
        return sdpa_without_cudnn(q, k, v, mask, enable_gqa)
    if k.shape[-2] % 128 == 64:
        k, v, mask = _pad_keys(k, v, mask, 64)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def single_document(seq_idx: torch.Tensor | None) -> bool:
    """True when every row holds one document (ids are nondecreasing per row). One host sync."""
    if seq_idx is None:
        return True
    return bool((seq_idx[:, 0] == seq_idx[:, -1]).all())


def doc_positions(seq_idx: torch.Tensor | None, offset: torch.Tensor | None, bsz: int, seqlen: int, device):
    """In-document position of every token [B, L] (int64). `offset` [B]: position of the first token of
    the row's first document (tokens already seen through a carried state)."""
    t = torch.arange(seqlen, device=device)
    if seq_idx is None:
        pos = t.expand(bsz, seqlen)
        return pos if offset is None else pos + offset.to(device)[:, None]
    start = torch.ones(bsz, seqlen, dtype=torch.bool, device=device)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    start_at = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    pos = t - start_at
    if offset is not None:
        first = seq_idx == seq_idx[:, :1]
        pos = pos + torch.where(first, offset.to(device)[:, None], torch.zeros_like(pos))
    return pos


def rope_rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split convention. x [B, L, heads, D], pos [B, L] -> x.dtype.
    Angles are taken in fp64 (exact for long positions), the rotation in fp32."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    ang = pos.to(torch.float64)[..., None] * inv_freq  # [B, L, half]
    cos = torch.cos(ang).to(torch.float32)[:, :, None, :]
    sin = torch.sin(ang).to(torch.float32)[:, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    stateful = True  # carries a recurrent state (models/state.py)

    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        a = cfg.attn
        dims = attn_dims(cfg)
        self.n_heads, self.n_kv_heads, self.head_dim = dims["n_heads"], dims["n_kv_heads"], dims["head_dim"]
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"attention: n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}")
        if a.rope and self.head_dim % 2:
            raise ValueError(f"attention: RoPE needs an even head_dim, got {self.head_dim}")
        self.rope = a.rope
        self.rope_theta = a.rope_theta
        self.window = a.sliding_window
        self.doc_mask = a.doc_mask
        std = cfg.init_std
        d = cfg.d_model
        self.q_proj = make_linear(d, self.n_heads * self.head_dim, a.bias, std)
        self.k_proj = make_linear(d, self.n_kv_heads * self.head_dim, a.bias, std)
        self.v_proj = make_linear(d, self.n_kv_heads * self.head_dim, a.bias, std)
        self.o_proj = make_linear(self.n_heads * self.head_dim, d, a.bias, std / math.sqrt(2 * n_layer))

    def allocate_state(self, batch_size: int, device=None, dtype=torch.float32) -> KVCache:
        kv = torch.zeros(batch_size, self.n_kv_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(
            k=kv,
            v=kv.clone(),
            valid=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
            pos=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def _qkv(self, u: torch.Tensor):
        lead = u.shape[:-1]
        q = self.q_proj(u).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(u).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(u).view(*lead, self.n_kv_heads, self.head_dim)
        return q, k, v

    def _sdpa(self, q, k, v, mask=None, is_causal=False):
        """q [B, H, Lq, D], k/v [B, Hkv, Lk, D]."""
        gqa = self.n_heads != self.n_kv_heads
        if mask is not None:
            return masked_sdpa(q, k, v, mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)

    def forward(
        self,
        u: torch.Tensor,
        seq_idx: torch.Tensor | None = None,
        state: KVCache | None = None,
        return_state: bool = False,
        single_doc: bool | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """u [B, L, d_model] -> (out [B, L, d_model], new cache or None). `single_doc` (every row is one
        document) may be passed by the caller so that the host sync happens once per model call; None: found
        out here (a host sync when seq_idx is given). False takes the document-mask path whatever the batch
        holds, with no host read: on a single-document batch it gives the fast path's result through the
        masked kernel (the mask is then plain causal)."""
        bsz, seqlen, _ = u.shape
        dev = u.device
        if not self.doc_mask:
            seq_idx = None
        if seq_idx is None:
            single_doc = True
        elif single_doc is None:
            single_doc = single_document(seq_idx)

        q, k, v = self._qkv(u)  # [B, L, heads, D]
        pos = None
        if self.rope or return_state:
            offset = None if state is None else state.pos
            pos = doc_positions(None if single_doc else seq_idx, offset, bsz, seqlen, dev)
        if self.rope:
            q = rope_rotate(q, pos, self.rope_theta)
            k = rope_rotate(k, pos, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]

        past = 0 if state is None else state.length
        if past:
            k_all = torch.cat([state.k.to(k.dtype), k], dim=2)
            v_all = torch.cat([state.v.to(v.dtype), v], dim=2)
        else:
            k_all, v_all = k, v

        key_doc = None
        if not single_doc:
            key_doc = seq_idx if not past else torch.cat([seq_idx[:, :1].expand(bsz, past), seq_idx], dim=1)
        if past == 0 and self.window == 0 and single_doc:
            out = self._sdpa(q, k_all, v_all, is_causal=True)
        else:
            qi = torch.arange(seqlen, device=dev)[:, None] + past  # stream index of each query
            kj = torch.arange(past + seqlen, device=dev)[None, :]
            mask = kj <= qi
            if self.window:
                mask = mask & (qi - kj < self.window)
            mask = mask[None]  # [1, L, S]
            if key_doc is not None:
                mask = mask & (seq_idx[:, :, None] == key_doc[:, None, :])
            if past:
                valid = torch.cat([state.valid, torch.ones(bsz, seqlen, dtype=torch.bool, device=dev)], dim=1)
                mask = mask & valid[:, None, :]
            out = self._sdpa(q, k_all, v_all, mask=mask[:, None])
        out = self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))

        new_state = None
        if return_state:
            valid = torch.ones(bsz, past + seqlen, dtype=torch.bool, device=dev)
            if past:
                valid[:, :past] = state.valid
            if key_doc is not None:
                valid = valid & (key_doc == seq_idx[:, -1:])
            last_pos = pos[:, -1]
            k_keep, v_keep = k_all, v_all
            if self.window and k_keep.shape[2] > self.window:
                w = self.window
                k_keep, v_keep, valid = k_keep[:, :, -w:], v_keep[:, :, -w:], valid[:, -w:]
            new_state = KVCache(k=k_keep, v=v_keep, valid=valid, pos=last_pos + 1)
        return out, new_state

    def step(self, u: torch.Tensor, state: KVCache) -> tuple[torch.Tensor, KVCache]:
        """One token: u [B, d_model] -> (out [B, d_model], new cache). Resets are applied by the caller."""
        bsz = u.shape[0]
        q, k, v = self._qkv(u[:, None])  # [B, 1, heads, D]
        if self.rope:
            pos = state.pos[:, None]
            q = rope_rotate(q, pos, self.rope_theta)
            k = rope_rotate(k, pos, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k_all = torch.cat([state.k.to(k.dtype), k], dim=2)
        v_all = torch.cat([state.v.to(v.dtype), v], dim=2)
        valid = torch.cat([state.valid, torch.ones(bsz, 1, dtype=torch.bool, device=u.device)], dim=1)
        if self.window and k_all.shape[2] > self.window:
            w = self.window
            k_all, v_all, valid = k_all[:, :, -w:], v_all[:, :, -w:], valid[:, -w:]
        out = self._sdpa(q, k_all, v_all, mask=valid[:, None, None, :])
        out = self.o_proj(out.transpose(1, 2).reshape(bsz, self.n_heads * self.head_dim))
        return out, KVCache(k=k_all, v=v_all, valid=valid, pos=state.pos + 1)


# ----------------------------------------------------------------------------------------------------
# the block kind `*`
# ----------------------------------------------------------------------------------------------------
def check_attn_section(cfg, need, rope: bool = True) -> None:
    """model.attn.* (read by `*` and by B'MOJO's attention, which has no RoPE)."""
    m, p = cfg.model, cfg.parallel
    a = attn_dims(m)
    need(m.attn.n_heads > 0, "model.attn.n_heads must be positive")
    need(m.attn.head_dim is not None or m.d_model % m.attn.n_heads == 0,
         f"model.attn.n_heads={m.attn.n_heads} must divide model.d_model={m.d_model} (or set model.attn.head_dim)")
    need(a["n_heads"] % a["n_kv_heads"] == 0,
         f"model.attn.n_kv_heads={a['n_kv_heads']} must divide model.attn.n_heads={a['n_heads']}")
    need(not rope or not m.attn.rope or a["head_dim"] % 2 == 0, f"RoPE needs an even head dim, got {a['head_dim']}")
    need(m.attn.sliding_window >= 0,
         f"model.attn.sliding_window must be >= 0 (0 = full attention), got {m.attn.sliding_window}")
    need(a["n_heads"] % p.tp == 0, f"parallel.tp={p.tp} must divide model.attn.n_heads ({a['n_heads']})")
    need(a["n_kv_heads"] % p.tp == 0 or p.tp % a["n_kv_heads"] == 0,
         f"parallel.tp={p.tp} and model.attn.n_kv_heads={a['n_kv_heads']}: one must divide the other "
         "(K/V heads split across TP ranks, or replicated when tp > n_kv_heads)")


def attn_flops(m: ModelConfig, L: int) -> dict:
    a = attn_dims(m)
    d, nh, nkv, hd = m.d_model, a["n_heads"], a["n_kv_heads"], a["head_dim"]
    proj = 2 * L * d * (nh * hd + 2 * nkv * hd) + 2 * L * nh * hd * d  # q, k, v, o
    # q.k and p.v: 2 hd each per (query, key) pair and query head (GQA shares k/v, not the FLOPs)
    scores = 2 * 2 * hd * nh * causal_pairs(L, m.attn.sliding_window)
    return {"attn_proj": proj, "attn_scores": scores}


def attn_activation_bytes(m, a: int, ctx) -> tuple[int, int]:
    hq, hkv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    # q, k, v (SDPA saves them), SDPA output + logsumexp, the output made contiguous for o_proj
    local = a * (2 * hq * hd + 2 * hkv * hd + hq * hd) + 4 * hq
    if ctx.cp > 1:  # keys / values all-gathered over the CP group, saved at full length
        local += a * 2 * hkv * hd * (ctx.cp - 1)
    if m.window or ctx.doc_mask:  # explicit mask path: a [L, L] bias per row (memory-efficient SDPA)
        local += a * ctx.seq_len  # (masked_sdpa's padding of 64 mod 128 key lengths is left out: <= 64 keys)
    return local, 0


def attn_tp_layout(attn, ranks: int, sp: bool) -> TPLayout:
    """q heads split, K/V heads split (or replicated when n_kv_heads < ranks), o_proj row-parallel. Also the
    attention half of B'MOJO (same projection names)."""
    Hq, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    if Hq % ranks:
        raise ValueError(f"tensor parallelism: tp={ranks} must divide the attention heads ({Hq})")
    if Hkv % ranks and ranks % Hkv:
        raise ValueError(f"tensor parallelism: attention n_kv_heads={Hkv} and tp={ranks}: one must divide the other")
    q = Split(Hq * hd)
    kv = Split(Hkv * hd) if Hkv % ranks == 0 else Replicate(Hkv * hd, Hkv)
    lay = TPLayout()
    for n, pc in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        lay.params[n + ".weight"] = Cut(0, (pc,))
        lay.params[n + ".bias"] = Cut(0, (pc,))
    lay.params["o_proj.weight"] = Cut(1, (q,))
    lay.params["o_proj.bias"] = Cut(0, (Replicate(attn.o_proj.weight.shape[0], 1, partial=sp),))
    lay.sizes = {"n_heads": Hq // ranks, "n_kv_heads": max(Hkv // ranks, 1)}
    lay.row_parallel = {"o_proj": sp}
    return lay


def _attn_carried(mixer) -> str | None:
    """BPTT: a sliding window carries its KV cache; full attention sees only the current window."""
    return "window" if getattr(mixer, "window", 0) > 0 else None


BLOCK_KIND = register(BlockKind(
    letter="*", name="attention", mixer=Attention, sections=("attn",), state=KVCache,
    check=check_attn_section, flop_keys=("attn_proj", "attn_scores"), flops=attn_flops,
    activation_bytes=attn_activation_bytes, tp_layout=attn_tp_layout,
    # cuda_graph: with the model's capture_safe (single_doc=False) the forward and backward read nothing on the
    # host, with or without document resets and sliding window
    cp="attention", bptt=_attn_carried, cuda_graph="yes", fsdp_bf16_gather=True, single_doc_hint=True,
))
