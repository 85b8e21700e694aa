"""Context parallelism by passing chunk states between ranks (design.md "Context parallelism").

    apply_tensor_parallel(model, groups.tp_group, sp)      # optional, first (with or without SP)
    apply_context_parallel(model, groups.cp_group)         # in place; parameters are untouched
    out = model(tokens_r, seq_idx=seq_idx_r, labels=labels_r, states=..., return_states=...)

The model does not know about it: a forward pre-hook on the model gathers every rank's document boundaries
(`CPContexts.begin`), the Mamba-2 and attention mixers are replaced by variants that read them
(`CPContexts.of(seq_idx)`, keyed by the seq_idx the hook hands on), and the model's `loss_reduction` makes the
loss the global mean.

Rank r of the CP group holds the contiguous slice r of every row (`local_slice`): tokens, labels and
seq_idx with the row's GLOBAL document ids. The model then computes exactly what one device computes on
the whole rows:

  Mamba-2   causal conv: the previous rank's last d_conv-1 pre-conv rows (the halo) enter as the conv's
            initial state, rows of another document than this slice's first token zeroed; rank 0 takes the
            carried conv state instead. SSD: the local slice from a zero state (rank 0: the carried state)
            gives y_r and the final state S_r (fp32); with the total log-decay g_r = sum(dt*A) over the
            slice, (S_r, g_r) are all-gathered (B*H*P*N + B*H fp32 per rank, whatever the length), and
            every rank forms its incoming state h_r = sum_{j<r} exp(g_{j+1} + ... + g_{r-1}) S_j, where
            S_j only counts when rank j's last token and rank r's first token are in the same document (ids
            are nondecreasing, so then no reset lies between them). The outputs of the tokens of this
            slice's first document get y_t += C_t . (exp(dA_1 + ... + dA_t) h_r) (one per-head product, no
            second scan), before the gated norm.
  attention keys/values (after RoPE at global in-document positions) are all-gathered with the row's
            seq_idx; local queries attend with the causal / sliding-window / document mask offset by the
            slice start. The backward of the all-gather reduce-scatters the K/V gradients.
  MLP, norms, embedding, head: local.
  loss      mean over the labelled tokens of all ranks (`global_mean_loss`): every rank returns the global
            value; its backward differentiates this rank's own tokens, so the parameter gradients summed
            over the CP group (`allreduce_cp_grads`) equal the single-device ones.
  states    the carried states enter rank 0 (SSM, conv) and every rank (KV caches); the final states are
            computed on every rank from the gathered data (the scan up to the last rank, the last rank's
            halo, the gathered keys), so they are identical on all ranks. Their gradients add up over the
            ranks like every other cross-rank path.

Every exchange is an autograd-aware all-gather (comm.gather_dim_autograd) whose result every rank uses, so
the backward collectives always pair up. Per Mamba-2 layer: 2 all-gathers forward (halo, states), 2
reduce-scatters backward; per attention layer 1 + 1; per forward one small all-gather of document-id
boundaries (the whole seq_idx when the model has attention) and one all-reduce (loss, token count).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from megassm import kernels
from megassm.models.attention import Attention, doc_positions, rope_rotate
from megassm.models.lm import IGNORE_INDEX, LanguageModel
from megassm.models.mamba2 import Mamba2Mixer
from megassm.models.registry import block_kind
from megassm.models.state import KVCache

from . import comm
from .dp import allreduce_grads
from .substitute import substitute

__all__ = ["CPPlan", "CPContext", "CPContexts", "apply_context_parallel", "cp_plan_of", "local_slice", "global_mean_loss",
           "global_token_count", "allreduce_cp_grads"]


@dataclass
class CPPlan:
    group: object
    world: int
    rank: int
    halo: int  # d_conv - 1: pre-conv rows each Mamba-2 layer needs from the previous rank
    full_seq_idx: bool  # gather the whole seq_idx (attention masks and positions) or only its boundaries


@dataclass
class CPContext:
    """What every layer of one forward needs to know about the other ranks' document ids."""

    plan: CPPlan
    bounds: torch.Tensor  # [R, B, 1 + halo]: each rank's first id, then the ids of its last `halo` tokens
    full: torch.Tensor | None  # [B, R*L] the whole rows' seq_idx (models with attention)

    @property
    def first(self) -> torch.Tensor:  # [R, B]
        return self.bounds[:, :, 0]

    @property
    def last(self) -> torch.Tensor:  # [R, B]
        return self.bounds[:, :, -1]

    @property
    def halo_ids(self) -> torch.Tensor:  # [R, B, halo]
        return self.bounds[:, :, 1:]


def cp_plan_of(model: nn.Module) -> CPPlan | None:
    return getattr(model, "cp_plan", None)


def local_slice(t: torch.Tensor, cp_group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous slice of `t` along `dim` (the sequence)."""
    n = comm.world(cp_group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ValueError(f"context parallelism: length {t.shape[dim]} is not divisible by cp={n}")
    return t.chunk(n, dim=dim)[comm.rank(cp_group)]


def _build_context(plan: CPPlan, sid: torch.Tensor) -> CPContext:
    bsz, L = sid.shape
    k = plan.halo
    if plan.full_seq_idx:
        full = comm.all_gather_dim(sid, 1, plan.group)  # [B, R*L]
        per = full.view(bsz, plan.world, L).transpose(0, 1)  # [R, B, L]
        bounds = torch.cat([per[:, :, :1], per[:, :, L - k:]], dim=2)
    else:
        full = None
        mine = torch.cat([sid[:, :1], sid[:, L - k:]], dim=1)
        bounds = comm.all_gather_dim(mine[None], 0, plan.group)
    return CPContext(plan=plan, bounds=bounds, full=full)


def _no_autocast(t: torch.Tensor):
    return torch.autocast(t.device.type, enabled=False)


# ----------------------------------------------------------------------------------------------------
# Mamba-2
# ----------------------------------------------------------------------------------------------------
def incoming_state(S_all: torch.Tensor, g_all: torch.Tensor, last: torch.Tensor, target: torch.Tensor,
                   t: int) -> torch.Tensor:
    """The state entering position t of the rank order (t = R: after the last rank):
    sum_{j<t} exp(g_{j+1} + ... + g_{t-1}) S_j over the ranks j whose last document id equals `target`.
    S_all [R, B, H, P, N], g_all [R, B, H], last [R, B], target [B]. Returns [B, H, P, N].
    The exponent sums only its own terms (no difference of prefix sums: exact for large totals)."""
    R = S_all.shape[0]
    j = torch.arange(R, device=S_all.device)
    between = (j[None, :] > j[:, None]) & (j[None, :] < t)  # [j, k]: j < k < t
    logw = (between[:, :, None, None].to(g_all.dtype) * g_all[None]).sum(dim=1)  # [R, B, H]
    ok = (j < t)[:, None] & (last == target[None])  # [R, B]
    w = torch.where(ok[..., None], torch.exp(logw), torch.zeros_like(logw))
    return (w[..., None, None] * S_all).sum(dim=0)


class _HaloTap(torch.autograd.Function):
    """xBC's last k rows, which the next rank's conv reads. Their gradient arrives through the halo exchange,
    i.e. after this rank's conv backward has written xBC's gradient; where that gradient is a block of the
    in_proj split's buffer (kernels.split_last(share_grads=True)), the k rows are added into it in place and
    no gradient is returned, instead of autograd's full-size zeros + rows and a full-size sum (3 passes of
    [B, L, conv_dim] per layer). Valid because the conv and this tap are xBC's only readers. Elsewhere (the
    reference backend): the usual gradient."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        ctx.save_for_backward(x)  # the conv keeps x anyway; under checkpointing, the recomputed piece
        return x[:, x.shape[1] - k:].clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        L, k = x.shape[1], ctx.k
        block = kernels.grad_blocks.handed_block(x)
        if block is not None:
            block[:, L - k:].add_(g)
            return None, None
        dx = torch.zeros_like(x)
        dx[:, L - k:] = g
        return dx, None


class _CPMamba2:
    """Mixin over Mamba2Mixer (or its TP variants): the conv halo and the chunk-state hand-off."""

    cp_contexts: "CPContexts"  # set by apply_context_parallel

    def conv(self, xBC, seq_idx, conv_state, return_state):
        ctx = self.cp_contexts.of(seq_idx)
        R, r, k = ctx.plan.world, ctx.plan.rank, self.d_conv - 1
        bsz, L, _ = xBC.shape
        cdt = torch.promote_types(xBC.dtype, torch.float32)
        halos = comm.gather_dim_autograd(_HaloTap.apply(xBC, k)[None], 0, ctx.plan.group)  # [R, B, k, C]
        prev = (r - 1) % R  # rank 0 reads nothing from the last rank (all masked) but keeps the graph uniform
        keep = (ctx.halo_ids[prev] == ctx.first[r][:, None]) & (r > 0)  # [B, k]: same document as our first token
        init = torch.where(keep[..., None], halos[prev], torch.zeros_like(halos[prev])).transpose(1, 2).to(cdt)
        if r == 0 and conv_state is not None:
            init = init + conv_state.to(cdt)
        y = super().conv(xBC, seq_idx, init, False)[0]
        final = None
        if return_state:  # what the last rank's own conv would return: its last k rows of its last document
            own = ctx.halo_ids[R - 1] == ctx.last[R - 1][:, None]
            final = torch.where(own[..., None], halos[R - 1], torch.zeros_like(halos[R - 1]))
            final = final.transpose(1, 2).to(cdt).contiguous()
        return y, final

    def scan(self, x, dt, B, C, seq_idx, ssm_state, return_state):
        ctx = self.cp_contexts.of(seq_idx)
        R, r = ctx.plan.world, ctx.plan.rank
        y, S = super().scan(x, dt, B, C, seq_idx, ssm_state if r == 0 else None, True)
        bsz, L, H, P = x.shape
        N = B.shape[3]
        cdt = torch.promote_types(x.dtype, torch.float32)
        with _no_autocast(x):
            dtp = dt.to(cdt) + self.dt_bias.to(cdt)
            dtp = F.softplus(dtp)
            if self.dt_limit is not None:
                dtp = dtp.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
            # [B, L, H] log-decay from the slice start; scanned along a contiguous last dim (torch's scan over an
            # outer dim took 2.9 ms per call at 16K tokens on an H200, a third of the CP step)
            cs = (dtp * self._A().to(cdt)).transpose(1, 2).contiguous().cumsum(dim=-1).transpose(1, 2)
            buf = torch.cat([S.to(cdt).reshape(bsz, H * P * N), cs[:, -1]], dim=1)
            allb = comm.gather_dim_autograd(buf[None], 0, ctx.plan.group)  # [R, B, HPN + H]
            S_all = allb[..., : H * P * N].reshape(R, bsz, H, P, N)
            g_all = allb[..., H * P * N:]
            h = incoming_state(S_all, g_all, ctx.last, ctx.first[r], r)  # [B, H, P, N]
            alive = seq_idx == ctx.first[r][:, None]  # [B, L]: tokens before the slice's first reset
            w = torch.where(alive[..., None], torch.exp(cs), torch.zeros_like(cs))  # [B, L, H]
            # y + w * (C . h): one pass over y forward and over its gradient backward (kernels/mamba2_ssd/readout.py)
            y = kernels.state_readout_add(y, C, h, w)
            final = incoming_state(S_all, g_all, ctx.last, ctx.last[R - 1], R) if return_state else None
        return y, final


# ----------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------
class _CPAttention:
    """Mixin over Attention: K/V all-gathered over the CP group, masks and RoPE positions offset."""

    cp_contexts: "CPContexts"  # set by apply_context_parallel

    def forward(self, u, seq_idx=None, state=None, return_state=False, single_doc=None):
        ctx = self.cp_contexts.of(seq_idx)
        R, r = ctx.plan.world, ctx.plan.rank
        bsz, L, _ = u.shape
        Lg, dev = R * L, u.device
        sid, sid_full = (seq_idx, ctx.full) if self.doc_mask else (None, None)

        q, k, v = self._qkv(u)  # [B, L, heads, D]
        pos_full = None
        if self.rope or return_state:
            pos_full = doc_positions(sid_full, None if state is None else state.pos, bsz, Lg, dev)
        if self.rope:
            pos = pos_full[:, r * L:(r + 1) * L]
            q = rope_rotate(q, pos, self.rope_theta)
            k = rope_rotate(k, pos, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, D]
        hk = k.shape[1]
        kv = comm.gather_dim_autograd(torch.cat([k, v], dim=1), 2, ctx.plan.group)  # [B, 2*hk, R*L, D]
        k_all, v_all = kv[:, :hk], kv[:, hk:]

        past = 0 if state is None else state.length
        if past:
            k_all = torch.cat([state.k.to(k_all.dtype), k_all], dim=2)
            v_all = torch.cat([state.v.to(v_all.dtype), v_all], dim=2)
        key_doc = None
        if sid_full is not None:
            key_doc = sid_full if not past else torch.cat([sid_full[:, :1].expand(bsz, past), sid_full], dim=1)

        # only the key columns some local query can see: up to the slice end, and back one window
        start = past + r * L  # stream index of the first local query
        lo = max(0, start - self.window + 1) if self.window else 0
        hi = start + L
        qi = torch.arange(L, device=dev)[:, None] + start
        kj = torch.arange(lo, hi, device=dev)[None, :]
        mask = kj <= qi
        if self.window:
            mask = mask & (qi - kj < self.window)
        mask = mask[None]  # [1, L, S]
        if key_doc is not None:
            mask = mask & (sid[:, :, None] == key_doc[:, None, lo:hi])
        if past:
            valid = torch.cat([state.valid, torch.ones(bsz, Lg, dtype=torch.bool, device=dev)], dim=1)
            mask = mask & valid[:, None, lo:hi]
        out = self._sdpa(q, k_all[:, :, lo:hi], v_all[:, :, lo:hi], mask=mask[:, None])
        out = self.o_proj(out.transpose(1, 2).reshape(bsz, L, self.n_heads * self.head_dim))

        new_state = None
        if return_state:  # the cache after the rows' last token: the same on every rank
            valid = torch.ones(bsz, past + Lg, dtype=torch.bool, device=dev)
            if past:
                valid[:, :past] = state.valid
            if key_doc is not None:
                valid = valid & (key_doc == sid_full[:, -1:])
            k_keep, v_keep = k_all, v_all
            if self.window and k_keep.shape[2] > self.window:
                w = self.window
                k_keep, v_keep, valid = k_keep[:, :, -w:], v_keep[:, :, -w:], valid[:, -w:]
            new_state = KVCache(k=k_keep, v=v_keep, valid=valid, pos=pos_full[:, -1] + 1)
        return out, new_state


# ----------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------
def global_mean_loss(loss_sum: torch.Tensor, count: torch.Tensor, cp_group) -> torch.Tensor:
    """sum over the CP group of the ranks' loss sums / their token counts, on every rank. The backward
    is the identity on this rank's own sum, so gradients summed over the group are the global mean's."""
    both = torch.stack([loss_sum.float(), count.to(loss_sum.device, torch.float32)])
    red = comm.sum_fwd_identity_bwd(both, cp_group)
    return red[0] / red[1].clamp(min=1)


def global_token_count(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """Labelled tokens of the whole rows: summed over the CP group when `model` is context-parallel."""
    n = (labels != IGNORE_INDEX).sum()
    plan = cp_plan_of(_unwrap(model))
    return n if plan is None else comm.all_reduce(n.clone(), plan.group)


class CPContexts:
    """The CPContext of each forward of one context-parallel model, kept outside the model. `begin`, the model's
    forward pre-hook, builds it (every rank's document boundaries: one small all-gather) and hands the blocks the
    int32 seq_idx it is filed under; the CP mixers look it up by the seq_idx they are given (`of`). Filed by that
    tensor (held weakly) rather than as "the last forward's": activation checkpointing recomputes a block in the
    backward from the arguments it kept, whatever forwards ran since, and so finds its own forward's context."""

    def __init__(self, plan: CPPlan):
        self.plan = plan
        self._by_seq_idx = WeakIdKeyDictionary()

    def begin(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """LanguageModel.forward(tokens, seq_idx=None, ...)'s pre-hook: seq_idx becomes the int32 ids of this
        rank's slice (zeros when none were given), filed with the forward's CPContext."""
        plan = self.plan
        tokens = args[0] if args else kwargs["tokens"]
        seq_idx = args[1] if len(args) > 1 else kwargs.get("seq_idx")
        if seq_idx is None:
            sid = torch.zeros(tokens.shape, dtype=torch.int32, device=tokens.device)
        else:
            if seq_idx.shape != tokens.shape:
                raise ValueError(f"seq_idx {tuple(seq_idx.shape)} must match tokens {tuple(tokens.shape)}")
            sid = seq_idx.to(torch.int32)
        if tokens.shape[1] < plan.halo:
            raise ValueError(f"context parallelism: {tokens.shape[1]} tokens per rank, fewer than the conv halo "
                             f"({plan.halo}); use longer sequences or a smaller parallel.cp")
        self._by_seq_idx[sid] = _build_context(plan, sid)
        if len(args) > 1:
            return (args[0], sid, *args[2:]), kwargs
        return args, {**kwargs, "seq_idx": sid}

    def of(self, seq_idx: torch.Tensor | None) -> CPContext:
        ctx = None if seq_idx is None else self._by_seq_idx.get(seq_idx)
        if ctx is None:
            raise RuntimeError("context parallelism: a layer was called with a seq_idx no model forward prepared; "
                               "call the model itself (its forward gathers the document boundaries), not a layer "
                               "alone")
        return ctx


@dataclass(frozen=True)
class CPTreatment:
    """What context parallelism does to one kind of mixer: `mixin` goes before the mixer's class (its
    exchanges), `base` is the class it expects, `halo` the pre-conv rows it needs from the previous rank,
    `full_seq_idx` whether it reads the whole rows' document ids (masks, positions) or only the boundaries."""

    mixin: type
    base: type
    halo: Callable = lambda mixer: 1
    full_seq_idx: bool = False


# the treatments a block kind may name (models/registry.py `cp`); None: position-wise, nothing to exchange
CP_TREATMENTS = {
    "local": None,
    "mamba2": CPTreatment(_CPMamba2, Mamba2Mixer, halo=lambda mixer: mixer.d_conv - 1),
    "attention": CPTreatment(_CPAttention, Attention, full_seq_idx=True),
}

_CLASSES: dict = {}


def _with(mixin, cls):
    """cls with `mixin`'s methods first (cached, so every layer of one kind shares the class)."""
    if issubclass(cls, mixin):
        return cls
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"CP{cls.__name__}", (mixin, cls), {})
    return _CLASSES[key]


def _unwrap(model):
    return getattr(model, "module", model)


def apply_context_parallel(model: LanguageModel, cp_group) -> LanguageModel:
    """Make `model` (single-device or already tensor-parallel) context-parallel over `cp_group`, in place
    (None or one rank: no-op). Parameters are not touched: they are replicated over the CP group and
    their gradients must be summed over it (`allreduce_cp_grads`)."""
    R = comm.world(cp_group)
    if R == 1:
        return model
    if cp_plan_of(model) is not None:
        raise RuntimeError("apply_context_parallel: the model is already context-parallel")
    halo, full, mixers = 1, False, []
    for i, layer in model.layers.items():
        kind = block_kind(layer.kind)
        if kind.cp is None or kind.cp not in CP_TREATMENTS:
            raise ValueError(f"context parallelism: no plan for block letter {layer.kind!r} ({kind.name})")
        treat = CP_TREATMENTS[kind.cp]
        if treat is None:  # position-wise: nothing crosses ranks
            continue
        if not isinstance(layer.mixer, treat.base):
            raise ValueError(f"context parallelism: layer {i} is not a {treat.base.__name__}")
        halo = max(halo, treat.halo(layer.mixer))
        full = full or treat.full_seq_idx
        mixers.append((layer, treat.mixin))
    model.cp_plan = CPPlan(group=cp_group, world=R, rank=comm.rank(cp_group), halo=halo, full_seq_idx=full)
    contexts = CPContexts(model.cp_plan)
    for layer, mixin in mixers:
        substitute(layer, "mixer", _with(mixin, type(layer.mixer)), cp_contexts=contexts)
    model.register_forward_pre_hook(contexts.begin, with_kwargs=True)
    model.loss_reduction = functools.partial(global_mean_loss, cp_group=cp_group)
    return model


@torch.no_grad()
def allreduce_cp_grads(params, cp_group) -> None:
    """Sum the gradients over the CP group (each rank holds the gradient of its own tokens' loss), in buckets
    (parallel/dp.py)."""
    allreduce_grads(params, cp_group, average=False)
