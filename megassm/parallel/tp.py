"""Tensor (+ sequence) parallel plan, applied from outside to the single-device model.

    model = build_model(cfg.model, vocab_size=V); model.init_weights(seed)       # canonical weights
    apply_tensor_parallel(model, groups.tp_group, sp=cfg.parallel.sp)           # in place: shards them

Every parameter keeps its name; its tensor becomes this rank's shard, described by a `ShardSpec` (kept in
`model.tp_plan.specs`): along one dim the canonical tensor is a concatenation of components (e.g. Mamba-2
in_proj rows = [z | x | B | C | dt]); each component is cut into `nparts` equal slices and rank q holds slice
`parts[q]`. nparts == tp: sharded; nparts < tp: replicated over tp / nparts ranks (norm weights: nparts 1;
Mamba-2 B/C when tp > ngroups; attention K/V when tp > n_kv_heads). `partial` marks replicated components
whose replicas hold partial gradients that `sync_tp_grads` sums (B/C and K/V always; every replicated
weight under sequence parallelism, whose activations are sequence shards).

Each block kind declares its layout as data (models/registry.py `TPLayout`, the `tp_layout` of the kind's
entry in its mixer's file): which parameter pieces shard how, the local sizes, which Linears become
row-parallel and which parallel variant (defined here) replaces a module. `apply_tensor_parallel` interprets
it; modules are replaced in their parent by the parallel class (`substitute`), never retyped in place.

Layer by layer:
  Mamba-2   in_proj per component [z|x|B|C|dt] column-parallel (plain local Linear), conv / A_log / dt_bias /
            D / norm weight rank-local, grouped norm over local groups, out_proj row-parallel: the layer's
            one all-reduce (reduce-scatter under SP). tp > ngroups: B/C rows of in_proj and conv replicated;
            the norm group then spans ranks: its sum of squares (one fp32 number per token and group) is
            all-reduced before the norm kernel normalizes (and its backward's sum of dn * n likewise), then
            out_proj reduces as usual.
  attention q heads split, K/V heads split (or replicated when n_kv_heads < tp), o_proj row-parallel.
  MLP       w1 / w3 column-parallel, w2 row-parallel.
  COFFEE    in_proj column-parallel by channel, lam / w / C / w_out cut by channel, out_proj row-parallel
            (one all-reduce; each rank runs the recurrence / Newton solver on its own channels).
  B'MOJO    its SSM as Mamba-2 with an all-reduce (not reduce-scatter) after out_proj: the full y feeds the
            innovation scores and the fading tokens; attention heads split, o_proj row-parallel (two).
  Mamba-1 / Longhorn  in_proj [x | z] column-parallel by channel, conv / dt_proj (beta_proj) rows / A_log / D
            rank-local, x_proj row-parallel with its small output (dt_low, B, C: R + 2N per token) all-reduced
            because every channel needs it (the first all-reduce), out_proj row-parallel (the second): two
            all-reduces per layer forward, two backward (SP: all-gather in, the x_proj all-reduce, reduce-scatter).
  LM        vocab-parallel embedding and head (tied or not), vocab-parallel cross-entropy.
Each mixer's input passes `region_in` (a forward pre-hook: identity fwd / all-reduce bwd, or the SP
all-gather), each mixer's output is reduced once by its row-parallel projection. With parallel.tp_overlap a
mixer whose input only its entry Linear reads (Mamba-2: in_proj) has no hook: the entry is a
ColumnParallelLinear that enters the region itself and begins the backward all-reduce (SP: reduce-scatter)
before its weight gradient, waiting after it, so the collective runs beside that matmul; the MLP's w1 and w3
do the same in one node (its fan-out variant). Attention keeps the hook.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megassm import kernels
from megassm.models.bmojo import BMojoMixer
from megassm.models.lm import IGNORE_INDEX, LanguageModel
from megassm.models.mamba2 import Mamba2Mixer
from megassm.models.mlp import GatedMLP
from megassm.models.registry import Replicate, Split, TPLayout, block_kind

from . import comm
from .layers import (AlignedLinear, ColumnParallelLinear, RowParallelLinear, matmul_weight, VocabParallelEmbedding,
                     column_parallel, copy_to_tp, out_pad, reduce_from_tp, region_in, vocab_parallel_cross_entropy)
from .sp import split_to_sp
from .substitute import substitute

__all__ = ["Piece", "ShardSpec", "TPPlan", "apply_tensor_parallel", "sync_tp_grads", "clip_grad_norm_tp",
           "grad_norm_tp", "grad_sq_tp", "canonical_state_dict", "load_canonical_state_dict", "gather_canonical",
           "shard_canonical", "state_shard_specs", "optimizer_state_to_canonical", "load_canonical_optimizer_state",
           "canonical_grads", "plan_of", "local_box", "local_pieces", "box_pieces"]


@dataclass(frozen=True)
class Piece:
    size: int  # canonical size along the spec's dim
    nparts: int  # slices the component is cut into
    parts: tuple  # slice held by each tp rank
    partial: bool = False  # replicas hold partial gradients (summed by sync_tp_grads)


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    pieces: tuple

    @property
    def replicated(self) -> bool:
        return all(p.nparts == 1 for p in self.pieces)


@dataclass
class TPPlan:
    group: object
    tp: int
    rank: int
    sp: bool
    specs: dict = field(default_factory=dict)
    vocab_start: int = 0


def plan_of(model: nn.Module) -> TPPlan | None:
    return getattr(model, "tp_plan", None)


# ----------------------------------------------------------------------------------------------------
# slicing and gathering by spec
# ----------------------------------------------------------------------------------------------------
def shard_canonical(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    out, off = [], 0
    for pc in spec.pieces:
        comp = full.narrow(spec.dim, off, pc.size)
        out.append(comp.chunk(pc.nparts, dim=spec.dim)[pc.parts[rank]])
        off += pc.size
    if off != full.shape[spec.dim]:
        raise ValueError(f"shard spec covers {off} of {full.shape[spec.dim]} along dim {spec.dim}")
    return torch.cat(out, dim=spec.dim).contiguous()


def _assemble(locals_: list, spec: ShardSpec) -> torch.Tensor:
    out, loff = [], 0
    for pc in spec.pieces:
        ln = pc.size // pc.nparts
        for j in range(pc.nparts):
            q = pc.parts.index(j)
            out.append(locals_[q].narrow(spec.dim, loff, ln))
        loff += ln
    return torch.cat(out, dim=spec.dim)


def gather_canonical(t: torch.Tensor, spec: ShardSpec, plan: TPPlan) -> torch.Tensor:
    """The canonical full tensor from every rank's shard (a collective over the TP group)."""
    if spec.replicated or plan.tp == 1:
        return t
    t = t.contiguous()
    lst = [torch.empty_like(t) for _ in range(plan.tp)]
    dist.all_gather(lst, t, group=plan.group)
    return _assemble(lst, spec)


# ----------------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------------
def _sharded(size: int, tp: int) -> Piece:
    return Piece(size, tp, tuple(range(tp)))


def _replica(size: int, nparts: int, tp: int, partial: bool = True) -> Piece:
    """Cut into nparts slices, each replicated over tp // nparts consecutive ranks."""
    per = tp // nparts
    return Piece(size, nparts, tuple(q // per for q in range(tp)), partial)


class _SpanningGatedNorm(torch.autograd.Function):
    """The Mamba-2 gated norm of this rank's channels when its group spans the `tp / ngroups` ranks of `group`
    holding the group's other channels (tp > ngroups). The statistics of a row's group are sums over those
    ranks: forward, each rank's sum of squares (one fp32 number per token and group), all-reduced before the
    normalization; backward, each rank's sum of dn * n, all-reduced before the gradients
    (kernels.gated_rmsnorm_sumsq / _apply / _bwd_dot / _bwd_apply: the Triton norm kernel in stages on the
    GPU). With G groups the buffer is [..., G], this rank's group in its slot: the other groups' ranks add
    zeros to it."""

    @staticmethod
    def forward(ctx, y, z, weight, mixer):
        norm = mixer.norm
        ss = kernels.gated_rmsnorm_sumsq(y, z, 1, norm.norm_before_gate)
        ss = _slot_sum(ss, mixer)
        out = kernels.gated_rmsnorm_apply(y, z, weight, ss, mixer.group_size, norm.eps, norm.norm_before_gate)
        ctx.save_for_backward(y, z, weight, ss)
        ctx.mixer = mixer
        return out

    @staticmethod
    def backward(ctx, dout):
        y, z, weight, ss = ctx.saved_tensors
        m = ctx.mixer
        nbg, eps = m.norm.norm_before_gate, m.norm.eps
        dot = _slot_sum(kernels.gated_rmsnorm_bwd_dot(dout, y, z, weight, ss, m.group_size, eps, nbg), m)
        # dz into z's block of the in_proj gradient (split_last(share_grads=True)): no cat in the split's backward
        dy, dz, dw = kernels.gated_rmsnorm_bwd_apply(dout, y, z, weight, ss, dot, m.group_size, eps, nbg,
                                                     dz_to_block=ctx.needs_input_grad[1])
        return dy, dz, dw, None


def _slot_sum(t: torch.Tensor, mixer) -> torch.Tensor:
    """t [..., 1]: this rank's part of its group's statistic -> the sum over the group's ranks [..., 1]."""
    G = mixer.n_slots
    if G == 1:
        return comm.all_reduce(t, mixer.tp_group)
    buf = F.pad(t, (mixer.slot, G - 1 - mixer.slot))
    return comm.all_reduce(buf, mixer.tp_group)[..., mixer.slot:mixer.slot + 1]


class _SpanningNormMamba2Mixer(Mamba2Mixer):
    """TP > ngroups: a norm group spans tp/ngroups ranks; its statistics are summed over them by a small
    all-reduce ([..., ngroups] fp32 per token, forward and backward; `_SpanningGatedNorm`), then out_proj is
    the usual row-parallel projection (one bf16 all-reduce, or reduce-scatter under SP)."""

    norm_spans_ranks = True
    tp_group = None
    sp = False
    n_slots = 1
    slot = 0
    group_size = 1

    def norm_out_proj(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(_SpanningGatedNorm.apply(y, z, self.norm.weight, self))


class VocabParallelHead:
    """The model's vocab-parallel head and loss (LanguageModel.head_override): logits are this rank's
    vocabulary shard, the cross-entropy is reduced over the TP group."""

    def __init__(self, plan: TPPlan):
        self.plan = plan

    @property
    def sp_ways(self) -> int:
        return self.plan.tp if self.plan.sp else 1

    def head(self, model: LanguageModel, h: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        h = region_in(h, plan.group, plan.sp and h.dim() == 3)
        w = model.embedding.weight if model.lm_head is None else model.lm_head.weight
        return F.linear(h, w)

    def loss_terms(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self.plan
        per_token = vocab_parallel_cross_entropy(logits, labels, plan.vocab_start, plan.group)
        return per_token.sum(), (labels.reshape(-1) != IGNORE_INDEX).sum()


class _TPBMojoMixer(BMojoMixer):
    """The full SSM output y (all-reduced by the SSM's out_proj) enters the column-parallel fading k/v
    projections: identity forward, all-reduce of its gradient backward."""

    tp_group = None
    sp = False

    def fading_in(self, y: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(y, self.tp_group)

    def residual_y(self, y: torch.Tensor) -> torch.Tensor:
        """y is replicated; under SP the output (after o_proj's reduce-scatter) is this rank's sequence shard:
        add that shard of y (backward: all-gather, so every rank's y gets the full gradient)."""
        return split_to_sp(y, self.tp_group) if self.sp and y.dim() == 3 else y


class _FanOutMLP(GatedMLP):
    """parallel.tp_overlap: w1 and w3 in one node entering the TP region (parallel/layers.py column_parallel), so
    the region's backward collective runs beside their weight gradients."""

    tp_group = None
    sp = False

    def project_in(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate, *up = column_parallel(u, [self.w1] if self.w3 is None else [self.w1, self.w3], self.tp_group, self.sp)
        return gate, (up[0] if up else None)


class ReplicatedRowLinear(nn.Linear):
    """Row-parallel Linear whose output every rank needs in full for its own channels' work (Mamba-1 /
    Longhorn x_proj): all-reduce forward (whatever SP says: the input is the full sequence), and the gradient
    of that replicated output, which each rank only holds for its channels, all-reduced backward."""

    tp_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = copy_to_tp(reduce_from_tp(F.linear(x, matmul_weight(self)), self.tp_group), self.tp_group)
        return y if self.bias is None else y + self.bias


def _region_hook(group, sp):
    def hook(module, args):
        return (region_in(args[0], group, sp and args[0].dim() == 3),) + tuple(args[1:])

    return hook


def _piece(pc, tp: int) -> Piece:
    """A layout piece (models/registry.py) as this TP group's Piece."""
    if isinstance(pc, Split):
        return _sharded(pc.size, tp)
    if isinstance(pc, Replicate):
        return _replica(pc.size, pc.groups, tp, pc.partial)
    raise TypeError(f"tensor parallelism: unknown layout piece {pc!r}")


def _variant_mamba2_norm_spans_ranks(mixer, plan: TPPlan, groups: int, group_size: int, sp: bool):
    """TP > ngroups: each rank's B/C group is its slot in the norm statistics' all-reduce."""
    return _SpanningNormMamba2Mixer, dict(tp_group=plan.group, sp=sp, n_slots=groups,
                                       slot=plan.rank // (plan.tp // groups), group_size=group_size)


def _variant_bmojo(mixer, plan: TPPlan, sp: bool):
    return _TPBMojoMixer, dict(tp_group=plan.group, sp=sp)


def _variant_mlp_fan_out(mixer, plan: TPPlan):
    return _FanOutMLP, dict(tp_group=plan.group, sp=plan.sp)


# the parallel module variants a TPLayout may name (models/registry.py TPLayout.variants and fan_out): name ->
# (module, plan, **args) -> (class, attributes)
TP_VARIANTS = {"mamba2_norm_spans_ranks": _variant_mamba2_norm_spans_ranks, "bmojo": _variant_bmojo,
               "mlp_fan_out": _variant_mlp_fan_out}


def _set_size(mixer: nn.Module, path: str, value) -> None:
    """One of the layout's `sizes`: a shape attribute the mixer's forward reads (d_inner, nheads, ...) set to its
    per-rank value. Only an existing size of the same type is set, so a layout resizes and never adds or
    replaces behaviour."""
    owner, _, attr = path.rpartition(".")
    module = mixer.get_submodule(owner) if owner else mixer
    old = getattr(module, attr, None)
    if type(old) is not type(value) or not isinstance(value, (int, list)):
        raise ValueError(f"tensor parallelism: layout size {path!r} of {type(mixer).__name__} is not an int or list "
                         f"size the module has (it has {old!r})")
    setattr(module, attr, value)


def apply_layout(block: nn.Module, layout: TPLayout, pre: str, plan: TPPlan, overlap: bool = False) -> bool:
    """Apply one mixer's TPLayout: its parameters' ShardSpecs into plan.specs (names prefixed by `pre`), its
    local sizes, its row-parallel projections and variants substituted in place of the single-device
    modules; with `overlap`, its entry Linear (if it has one) becomes the ColumnParallelLinear that enters
    the region itself, or its fan-out variant replaces the mixer. `block` is the mixer's parent (the mixer is its `mixer`). Returns whether the mixer
    still needs the region hook on its input."""
    tp = plan.tp
    for name, cut in layout.params.items():
        plan.specs[pre + name] = ShardSpec(cut.dim, tuple(_piece(pc, tp) for pc in cut.pieces))
    mixer = block.mixer
    for path, value in layout.sizes.items():
        _set_size(mixer, path, value)
    for path, sp in layout.row_parallel.items():
        substitute(mixer, path, RowParallelLinear, tp_group=plan.group, sp=sp)
    for path in layout.replicated_row:
        substitute(mixer, path, ReplicatedRowLinear, tp_group=plan.group)
    entered = overlap and (layout.entry is not None or layout.fan_out is not None)
    variants = dict(layout.variants)
    if entered and layout.entry is not None:
        substitute(mixer, layout.entry, ColumnParallelLinear, tp_group=plan.group, sp=plan.sp)
    elif entered:
        if "" in variants:
            raise ValueError(f"tensor parallelism: {type(mixer).__name__} has both a variant and a fan-out variant")
        variants[""] = layout.fan_out
    # submodules first, the mixer itself last (its variant then holds the substituted children)
    for path, (name, args) in sorted(variants.items(), key=lambda kv: -len(kv[0])):
        if name not in TP_VARIANTS:
            raise ValueError(f"tensor parallelism: no parallel variant named {name!r}")
        cls, attrs = TP_VARIANTS[name](mixer.get_submodule(path), plan, **args)
        substitute(block, "mixer." + path if path else "mixer", cls, **attrs)
    _align_outputs(block.mixer, layout, tp)
    return not entered


def _align_outputs(mixer: nn.Module, layout: TPLayout, tp: int) -> None:
    """The layout's `aligned_out` Linears whose rank-local width is not a multiple of 8 features compute into
    padded rows (AlignedLinear, or ColumnParallelLinear.out_pad under parallel.tp_overlap)."""
    for path in layout.aligned_out:
        cut = layout.params[path + ".weight"]
        local = sum(pc.size // pc.nparts for pc in (_piece(p, tp) for p in cut.pieces))
        pad = out_pad(local)
        if not pad:
            continue
        lin = mixer.get_submodule(path)
        if isinstance(lin, ColumnParallelLinear):
            lin.out_pad = pad
        elif type(lin) is nn.Linear:
            substitute(mixer, path, AlignedLinear, out_pad=pad)
        else:
            raise ValueError(f"tensor parallelism: cannot pad the output rows of {type(lin).__name__} '{path}'")


@torch.no_grad()
def apply_tensor_parallel(model: LanguageModel, tp_group, sp: bool = False, overlap: bool = False) -> LanguageModel:
    """Shard `model` (holding canonical weights) in place for the TP group `tp_group` (None or size 1: no-op).
    `overlap` (parallel.tp_overlap): the mixers whose layout names an entry Linear (ColumnParallelLinear) or a
    fan-out variant run their region's backward collective beside the weight gradients. Returns the model; its `tp_plan` describes
    every parameter's layout."""
    tp, rank = comm.world(tp_group), comm.rank(tp_group)
    if tp == 1:
        return model
    if plan_of(model) is not None:
        raise RuntimeError("apply_tensor_parallel: the model is already tensor-parallel")
    if model.vocab_size_padded % tp:
        raise ValueError(f"tensor parallelism: tp={tp} must divide the padded vocabulary {model.vocab_size_padded} "
                         "(raise model.pad_vocab_multiple)")
    plan = TPPlan(group=tp_group, tp=tp, rank=rank, sp=sp)
    specs = plan.specs
    d = model.config.d_model
    rep = ShardSpec(0, (_replica(d, 1, tp, partial=sp),))
    for i, layer in model.layers.items():  # global block indices: the parameter names (also on a PP stage)
        kind = block_kind(layer.kind)
        if kind.tp_layout is None:
            raise ValueError(f"tensor parallelism: no plan for block letter {layer.kind!r} ({kind.name})")
        specs[f"layers.{i}.norm.weight"] = rep
        if apply_layout(layer, kind.tp_layout(layer.mixer, tp, sp), f"layers.{i}.mixer.", plan, overlap):
            layer.mixer.register_forward_pre_hook(_region_hook(tp_group, sp))
    specs["norm_f.weight"] = rep
    vp = model.vocab_size_padded
    specs["embedding.weight"] = ShardSpec(0, (_sharded(vp, tp),))
    specs["lm_head.weight"] = ShardSpec(0, (_sharded(vp, tp),))
    plan.vocab_start = rank * (vp // tp)
    if model.embedding is not None:  # a pipeline stage without the embedding (parallel/pp.py) has none
        substitute(model, "embedding", VocabParallelEmbedding, tp_group=tp_group, sp=sp, vocab_start=plan.vocab_start)

    for name, p in list(model.named_parameters()):
        if name not in specs:
            raise ValueError(f"tensor parallelism: no shard spec for parameter '{name}'")
        mod_name, _, local = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        new = nn.Parameter(shard_canonical(p.data, specs[name], rank), requires_grad=p.requires_grad)
        if hasattr(p, "_no_weight_decay"):
            new._no_weight_decay = p._no_weight_decay
        mod._parameters[local] = new
    names = {n for n, _ in model.named_parameters()}
    plan.specs = {k: v for k, v in specs.items() if k in names}
    model.tp_plan = plan
    model.head_override = VocabParallelHead(plan)
    return model


# ----------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------
def local_box(t: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """(offsets, local tensor): the part of the TP-local tensor `t` this rank holds and where it sits in it. A
    plain tensor is all of itself; a DTensor (FSDP2's shard over the data-parallel ranks of a TP-local parameter
    or gradient, parallel/fsdp2.py) gives its local shard and the shard's offsets."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return (0,) * t.dim(), t
    local = t.to_local()
    if local.numel() == 0:  # an uneven FSDP2 split can leave a rank without rows
        return (0,) * t.dim(), local
    (chunk,) = t.__create_chunk_list__()
    return tuple(chunk.offsets), local


def local_pieces(grad: torch.Tensor, spec: ShardSpec):
    """(piece, view) for each ShardSpec piece of the local tensor that this rank holds a part of: the whole piece
    for a plain tensor, its rows inside this rank's shard for an FSDP2 DTensor. The TP ranks of one data-parallel
    rank hold shards of equal shapes at equal offsets, so their views of a piece line up."""
    offs, local = local_box(grad)
    yield from box_pieces(offs, local, spec)


def box_pieces(offs: tuple, local: torch.Tensor, spec: ShardSpec):
    """(piece, view) for each ShardSpec piece that the box `local` of a TP-local tensor, at offsets `offs` in it,
    holds a part of (local_pieces; the distributed optimizer's flat slices, parallel/distopt.py)."""
    if local.numel() == 0:
        return
    d = spec.dim
    b0, b1 = offs[d], offs[d] + local.shape[d]
    off = 0
    for pc in spec.pieces:
        ln = pc.size // pc.nparts
        lo, hi = max(b0, off), min(b1, off + ln)
        if lo < hi:
            yield pc, local.narrow(d, lo - b0, hi - lo)
        off += ln


@torch.no_grad()
def sync_tp_grads(model: nn.Module) -> None:
    """Sum the partial gradients of replicated components over their replicas (one all-reduce in all; the
    pieces go into and out of its buffer by two multi-tensor copies). Under FSDP2 x TP the gradients are DP
    shards (DTensors) of the TP-local ones: each rank sums the rows of the replicated components inside its
    shard (`local_pieces`), which line up over the TP group."""
    plan = plan_of(model)
    if plan is None:
        return
    views = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        for pc, g in local_pieces(p.grad, plan.specs[name]):
            if pc.partial:
                views.append((g, pc.nparts, pc.parts[plan.rank]))
    if not views:
        return
    sizes = [g.numel() * n for g, n, _ in views]
    # a piece cut into n > 1 slices fills only its own slice j of its n slots: the others must read 0
    new = views[0][0].new_zeros if any(n > 1 for _, n, _ in views) else views[0][0].new_empty
    buf = new(sum(sizes), dtype=torch.float32)
    slots, off = [], 0
    for (g, n, j), s in zip(views, sizes):
        ln = g.numel()
        slots.append(buf[off + j * ln: off + (j + 1) * ln].view(g.shape))
        off += s
    grads = [g for g, _, _ in views]
    torch._foreach_copy_(slots, grads)
    comm.all_reduce(buf, plan.group)
    torch._foreach_copy_(grads, slots)


@torch.no_grad()
def grad_norm_tp(model: nn.Module) -> torch.Tensor:
    """Global L2 norm of the canonical gradient: each replicated component counted once (call after
    sync_tp_grads). A collective over the TP group."""
    return grad_sq_tp(model).sqrt()


@torch.no_grad()
def grad_sq_tp(model: nn.Module, exclude=()) -> torch.Tensor:
    """Squared L2 norm of the canonical gradient over the TP group (grad_norm_tp squared), leaving out the
    parameters named in `exclude` (pipeline parallelism: the last stage's copy of a tied embedding). A
    replicated component's square counts nparts / tp on each rank (its replicas sum to one); the norms come
    from one multi-tensor kernel per such weight."""
    plan = plan_of(model)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None and n not in exclude]
    dev = params[0][1].grad.device if params else torch.device("cpu")
    by_weight: dict = {}
    for name, p in params:
        if plan is None:
            by_weight.setdefault(1.0, []).append(p.grad)
            continue
        for pc, g in local_pieces(p.grad, plan.specs[name]):
            by_weight.setdefault(pc.nparts / plan.tp, []).append(g)
    total = torch.zeros((), device=dev, dtype=torch.float32)
    for weight, grads in by_weight.items():
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).pow(2).sum()
        total += sq if weight == 1.0 else sq * weight
    if plan is not None:
        total = comm.all_reduce(total, plan.group)
    return total


@torch.no_grad()
def clip_grad_norm_tp(model: nn.Module, max_norm: float) -> float:
    """Like optim.clip_grad_norm, with the norm of the canonical gradient across TP ranks."""
    total = grad_norm_tp(model)
    value = float(total.item())
    if max_norm > 0 and math.isfinite(value):
        coef = min(1.0, max_norm / (value + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], coef)
    return value


def _head_spec(spec: ShardSpec, unit: int) -> ShardSpec:
    """A channel ShardSpec (along rows of size heads * unit) re-expressed in heads, along dim 1."""
    return ShardSpec(1, tuple(Piece(p.size // unit, p.nparts, p.parts, p.partial) for p in spec.pieces))


def state_shard_specs(states: list, model: nn.Module) -> dict:
    """How a TP model's per-block recurrent states are cut: {"i.name": ShardSpec along the state tensor's
    channel / head dim (1)} for the i-th held block's MambaState conv (the conv channels' pieces) and ssm
    (heads) and KVCache k / v (kv heads); {} without TP. `states` is one entry per held block, in order
    (None = stateless)."""
    from megassm.models.state import KVCache, MambaState

    plan = plan_of(model)
    if plan is None:
        return {}
    specs = {}
    for i, (b, s) in enumerate(zip(model.layers.keys(), states)):
        pre = f"layers.{b}.mixer."
        if isinstance(s, MambaState):
            specs[f"{i}.conv"] = ShardSpec(1, plan.specs[pre + "conv1d.weight"].pieces)
            specs[f"{i}.ssm"] = ShardSpec(1, plan.specs[pre + "A_log"].pieces)
        elif isinstance(s, KVCache):
            specs[f"{i}.k"] = specs[f"{i}.v"] = _head_spec(plan.specs[pre + "k_proj.weight"],
                                                           model.layers[b].mixer.head_dim)
    return specs


# ----------------------------------------------------------------------------------------------------
# canonical state (checkpoints, tests)
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def canonical_state_dict(model: nn.Module) -> dict:
    """The single-device state dict (CPU tensors) on every rank of the TP group (collective)."""
    plan = plan_of(model)
    out = {}
    for name, t in model.state_dict().items():
        if plan is not None and name in plan.specs:
            t = gather_canonical(t, plan.specs[name], plan)
        out[name] = t.detach().cpu().clone()
    return out


@torch.no_grad()
def canonical_grads(model: nn.Module) -> dict:
    """Canonical-layout gradients {name: tensor} (collective; call after sync_tp_grads)."""
    plan = plan_of(model)
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if plan is not None:
            g = gather_canonical(g, plan.specs[name], plan)
        out[name] = g.detach().cpu().clone()
    return out


@torch.no_grad()
def load_canonical_state_dict(model: nn.Module, state: dict) -> None:
    plan = plan_of(model)
    own = model.state_dict()
    missing = set(own) - set(state)
    unexpected = set(state) - set(own)
    if missing or unexpected:
        raise KeyError(f"load_canonical_state_dict: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for name, t in own.items():
        full = state[name]
        if plan is not None and name in plan.specs:
            full = shard_canonical(full, plan.specs[name], plan.rank)
        if full.shape != t.shape:
            raise ValueError(f"load_canonical_state_dict: '{name}' has shape {tuple(full.shape)}, expected {tuple(t.shape)}")
        t.copy_(full.to(t.device, t.dtype))


def optimizer_params(optimizer, model):
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for grp in optimizer.param_groups:
        for p in grp["params"]:
            out.append((names[id(p)], p))
    return out


@torch.no_grad()
def optimizer_state_to_canonical(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """optimizer.state_dict() with every per-parameter tensor in the canonical layout (collective): the
    result loads into the same optimizer built on the single-device model."""
    sd = optimizer.state_dict()
    plan = plan_of(model)
    if plan is None:
        return sd
    # state_dict() shares the per-parameter dicts with the live optimizer: copy before replacing tensors
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    for idx, (name, p) in enumerate(optimizer_params(optimizer, model)):
        st = sd["state"].get(idx)
        if not st:
            continue
        for k, v in list(st.items()):
            if torch.is_tensor(v) and v.shape == p.shape and v.dim() > 0:
                # .to: the distributed optimizer hands its gathered states over on the CPU (parallel/distopt.py)
                st[k] = gather_canonical(v.to(p.device), plan.specs[name], plan).cpu().clone()
    return sd


@torch.no_grad()
def load_canonical_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, sd: dict) -> None:
    plan = plan_of(model)
    if plan is not None:
        sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
        for idx, (name, p) in enumerate(optimizer_params(optimizer, model)):
            st = sd["state"].get(idx)
            if not st:
                continue
            spec = plan.specs[name]
            for k, v in list(st.items()):
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                    st[k] = shard_canonical(v, spec, plan.rank)
    optimizer.load_state_dict(sd)
