"""Tensor-parallel building blocks, written here (not megatron-core's tensor_parallel layers, which allocate
on `torch.cuda.current_device()` and fuse weight-gradient accumulation with CUDA-only paths; ours run the
same code on gloo/CPU and NCCL/GPU).

Regions (Megatron's f / g operators):
    copy_to_tp(x)      fwd identity      bwd all-reduce    (input of column-parallel projections)
    reduce_from_tp(x)  fwd all-reduce    bwd identity      (output of row-parallel projections; in place on x,
                                                            a fresh projection output)

Modules (substituted by megassm.parallel.tp for the single-device module, holding its parameters, so parameter
names and init rules stay those of the canonical model; parallel/substitute.py):
    ColumnParallelLinear    nn.Linear holding rows [out/tp, in], the only reader of its mixer's input
                            (parallel.tp_overlap): it enters the TP region itself and overlaps the region's
                            backward collective with its weight-gradient matmul; column_parallel(x, linears)
                            does the same for several projections reading one input (the MLP's w1 and w3)
    RowParallelLinear       nn.Linear holding columns [out, in/tp]; reduces (or reduce-scatters, SP) its
                            output before adding the (replicated) bias
    AlignedLinear           nn.Linear whose output rows are laid out `out_pad` features wider in memory than
                            its rank-local width, so every row starts on 16 bytes (see out_pad); also
                            ColumnParallelLinear.out_pad
    VocabParallelEmbedding  nn.Embedding holding rows [V/tp, d]; tokens outside the shard give 0; summed
                            over the group (reduce-scattered along the sequence under SP)
    vocab_parallel_cross_entropy(logits_local, labels, vocab_start, group): per-token CE from vocab-sharded
                            logits; two small all-reduces ([N] max, then [2, N] sum), full logits never
                            gathered; backward needs no communication.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megassm.kernels.grad_blocks import PAD_ZEROED

from . import comm
from .sp import gather_from_sp, reduce_scatter_to_sp

__all__ = ["copy_to_tp", "reduce_from_tp", "region_in", "region_out", "matmul_weight", "column_parallel",
           "ColumnParallelLinear", "RowParallelLinear", "AlignedLinear", "out_pad", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100

# Matmul outputs (and the gradients read back from them) whose rows are a multiple of this many features: 16
# bytes in bf16. cuBLAS's Hopper kernels read and write rows through the TMA, which needs 16-byte-aligned row
# strides; a rank-local width that is not (mamba2-2.7b's in_proj at TP 4: 2,836 features) falls back to
# Ampere kernels (seen on an H100: `cutlass_80_tensorop_bf16_s16816gemm`, docs/benchmarks.md).
ALIGN_FEATURES = 8


def out_pad(n: int) -> int:
    """Features to add to a row of n so that it is a multiple of ALIGN_FEATURES."""
    return (-n) % ALIGN_FEATURES


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """In place on `x` (marked dirty): callers pass a projection's fresh output, which nothing else reads (an op
    that saved it for its backward would make autograd raise, never compute silently wrong gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return comm.all_reduce(x.contiguous(), group)
        ctx.mark_dirty(x)
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if comm.world(group) == 1 else _ReduceFromTP.apply(x, group)


def region_in(x: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Entry of a TP region (before the column-parallel projections of a mixer / the LM head)."""
    return gather_from_sp(x, group) if sp else copy_to_tp(x, group)


def region_out(x: torch.Tensor, group, sp: bool) -> torch.Tensor:
    """Exit of a TP region (after the row-parallel projection): the one collective of a layer forward."""
    return reduce_scatter_to_sp(x, group) if sp else reduce_from_tp(x, group)


def matmul_weight(linear: nn.Linear) -> torch.Tensor:
    """The tensor a Linear multiplies with: its weight's bf16 copy under train.cast_weights_once (the module's
    `weight_cache`, training/weight_cache.py), else the weight."""
    w = getattr(linear, "weight_cache", None)
    return linear.weight if w is None else w


class _ColumnParallel(torch.autograd.Function):
    """region_in(x), then F.linear(x, w_i, b_i) for each column-parallel projection reading x, under the caller's
    autocast, with the backward reordered: the input gradient (the projections' sum) first, its all-reduce (SP:
    reduce-scatter along the sequence) begun, the weight gradients computed while the collective runs, then
    the wait (Megatron's asynchronous tensor-parallel all-reduce). The products are the ones autograd forms for
    autocast's F.linear (MmBackward on the folded 2-D input, the casts back, the sum of two consumers'
    gradients), so every gradient equals the region hook + separate Linears' bit for bit."""

    @staticmethod
    def forward(ctx, x, group, sp, pads, *params):  # params: w_1, b_1, w_2, b_2, ... (a bias may be None)
        dev = x.device.type
        ctx.group, ctx.sp, ctx.x_dtype, ctx.pads = group, sp, x.dtype, pads
        ctx.dtypes = [None if p is None else p.dtype for p in params]
        if sp:
            x = comm.all_gather_tokens(x, group)
        # autocast's casts, made here so the backward sees the same tensors (into padded rows where `pads` asks)
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        if dt is not None:
            x = x.to(dt)
        ys, weights = [], []
        with torch.autocast(dev, enabled=False):
            for w, b, pad in zip(params[::2], params[1::2], pads):
                if pad:
                    w, y = _aligned(x, w, b, pad, dt or w.dtype)
                else:
                    if dt is not None:
                        w, b = w.to(dt), None if b is None else b.to(dt)
                    y = F.linear(x, w, b)
                ys.append(y)
                weights.append(w)
        ctx.save_for_backward(x, *weights)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *gs):
        x, *weights = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        # a padded projection's gradient over its padded width (_padded_grad; its weight copy's pad rows are 0)
        g2s = [g.reshape(-1, g.shape[-1]) for g in gs]
        gps = [_padded_grad(g2, pad) if pad else g2 for g2, pad in zip(g2s, ctx.pads)]
        dx = None
        for gp, w in zip(gps, weights):
            part = gp.mm(w).view(x.shape).to(ctx.x_dtype)
            dx = part if dx is None else dx + part
        dx, work = (comm.reduce_scatter_tokens_start(dx, ctx.group) if ctx.sp
                    else comm.all_reduce_start(dx, ctx.group))
        grads = []  # beside the collective
        for g2, gp, w_dtype, b_dtype in zip(g2s, gps, ctx.dtypes[::2], ctx.dtypes[1::2]):
            # g^T x, as autograd's mm backward forms it for a column-major weight view: a contiguous [out, in]
            # gradient (x^T g transposed is a strided one, which AccumulateGrad adds elementwise without
            # vectorising: 26 ms per mamba2-2.7b TP 2 step on an H100)
            grads.append(gp.t().mm(x2)[:g2.shape[1]].to(w_dtype))
            grads.append(None if b_dtype is None else g2.sum(0).to(b_dtype))
        return comm.wait(dx, work), None, None, None, *grads


def _aligned(x, w, b, pad, dtype):
    """F.linear(x, w, b) in `dtype` computed into rows of n + pad features (w and b cast into zero-padded copies:
    the cast autocast makes anyway) and returned as the first n of each row, so the output's row stride is a
    multiple of ALIGN_FEATURES. Returns (the weight's padded copy [n + pad, k], the output view)."""
    n, k = w.shape
    wp = torch.empty((n + pad, k), dtype=dtype, device=w.device)
    wp[:n].copy_(w)
    wp[n:].zero_()
    bp = None
    if b is not None:
        bp = torch.empty(n + pad, dtype=dtype, device=b.device)
        bp[:n].copy_(b)
        bp[n:].zero_()
    return wp, F.linear(x.to(dtype), wp, bp).narrow(-1, 0, n)


def _padded_grad(g2: torch.Tensor, pad: int) -> torch.Tensor:
    """The output gradient g2 [M, n] as [M, n + pad] rows whose last pad columns are zeros, for the backward
    matmuls of a padded Linear: cuBLAS runs its Hopper kernels only when the reduced width (dgrad) and the
    rows (wgrad) are multiples of ALIGN_FEATURES; a view of [M, n] rows n + pad apart is not enough (H100,
    n 2,836: 0.27 ms dgrad on an Ampere kernel vs 0.08). The gradient buffer of split_last(share_grads=True)
    is such rows with the pad zeroed (kernels/core/grad_blocks.py GradBlocks): used as it is; anything else is copied in."""
    m, n = g2.shape
    base = g2._base
    if (base is not None and getattr(base, PAD_ZEROED, False) and base.is_contiguous() and base.shape[-1] == n + pad
            and base.numel() == m * (n + pad) and g2.data_ptr() == base.data_ptr() and g2.stride() == (n + pad, 1)):
        return base.view(m, n + pad)
    full = g2.new_empty((m, n + pad))
    full[:, n:].zero_()
    full[:, :n].copy_(g2)
    return full


class _AlignedLinear(torch.autograd.Function):
    """F.linear(x, w, b) under the caller's autocast with its output rows padded in memory (_aligned). The
    backward forms autocast's F.linear products (g w and g^T x, then the casts back) over the padded width
    (_padded_grad; the weight copy's pad rows are zeros, so the input gradient is the same sum), and returns
    the weight gradient's first n rows."""

    @staticmethod
    def forward(ctx, x, w, b, pad):
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else w.dtype
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        ctx.pad = pad
        x = x.to(dt)  # autocast's cast of the input, once: _aligned's is then a no-op
        with torch.autocast(dev, enabled=False):
            wp, y = _aligned(x, w, b, pad, dt)
        ctx.save_for_backward(x, wp)
        return y

    @staticmethod
    def backward(ctx, g):
        x, wp = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        n = g.shape[-1]
        g2 = g.reshape(-1, n)  # a view when the rows collapse, whatever their stride
        need = ctx.needs_input_grad
        gp = _padded_grad(g2, ctx.pad) if need[0] or need[1] else None
        dx = gp.mm(wp).view(x.shape).to(x_dtype) if need[0] else None
        dw = gp.t().mm(x.reshape(-1, x.shape[-1]))[:n].to(w_dtype) if need[1] else None
        db = g2.sum(0).to(b_dtype) if need[2] and b_dtype is not None else None
        return dx, dw, db, None


def column_parallel(x: torch.Tensor, linears, group, sp: bool) -> list[torch.Tensor]:
    """[linear(region_in(x)) for linear in linears] with the region's backward collective run beside their
    weight gradients (parallel.tp_overlap); the Linears must be the only readers of x."""
    if comm.world(group) == 1:
        return [F.linear(x, matmul_weight(m), m.bias) for m in linears]
    params = [t for m in linears for t in (matmul_weight(m), m.bias)]
    pads = tuple(getattr(m, "out_pad", 0) for m in linears)
    return list(_ColumnParallel.apply(x, group, sp and x.dim() == 3, pads, *params))


class ColumnParallelLinear(nn.Linear):
    """Holds weight rows [out_local, in]; the TP region's entry for a mixer whose input nothing else reads:
    region_in (identity, or the SP all-gather) and the projection in one autograd node, so that the backward
    collective of the region runs beside this Linear's weight-gradient matmul (parallel.tp_overlap)."""

    tp_group = None
    sp = False
    out_pad = 0  # output rows padded in memory by this many features (AlignedLinear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel(x, [self], self.tp_group, self.sp)[0]

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]}, out_local={self.weight.shape[0]}, bias={self.bias is not None}, "
                f"sp={self.sp}, overlap=True")


class AlignedLinear(nn.Linear):
    """nn.Linear whose output rows are `out_pad` features wider in memory than its width (the returned tensor is
    a view of the first out_features of each row), for a rank-local width that is not a multiple of
    ALIGN_FEATURES (parallel/tp.py, a TPLayout's `aligned_out`): the matmuls of the forward and backward then
    run cuBLAS's Hopper kernels. Its readers must take strided rows (Mamba-2's in_proj: split_last)."""

    out_pad = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = matmul_weight(self)
        if not self.out_pad:
            return F.linear(x, w, self.bias)
        return _AlignedLinear.apply(x, w, self.bias, self.out_pad)


class RowParallelLinear(nn.Linear):
    """Holds weight columns [out, in_local]; x [..., in_local] -> reduced [..., out] (+ bias after)."""

    tp_group = None
    sp = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = region_out(F.linear(x, matmul_weight(self)), self.tp_group, self.sp and x.dim() == 3)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}, sp={self.sp}"


class VocabParallelEmbedding(nn.Embedding):
    tp_group = None
    sp = False
    vocab_start = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n_local = self.weight.shape[0]
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= n_local)
        emb = F.embedding(local.masked_fill(outside, 0), self.weight)
        emb = emb.masked_fill(outside[..., None], 0.0)
        return region_out(emb, self.tp_group, self.sp and tokens.dim() == 2)

    def extra_repr(self) -> str:
        return f"rows={self.vocab_start}..{self.vocab_start + self.weight.shape[0]}, dim={self.weight.shape[1]}, sp={self.sp}"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        # logits [N, V_local] fp32, target [N] int64 (IGNORE_INDEX allowed)
        n_local = logits.shape[-1]
        m = comm.all_reduce_max(logits.max(dim=-1).values, group)
        shifted = logits - m[:, None]
        local = target - vocab_start
        mine = (local >= 0) & (local < n_local)
        idx = local.masked_fill(~mine, 0)
        picked = shifted.gather(1, idx[:, None])[:, 0].masked_fill(~mine, 0.0)
        exp = shifted.exp()
        stats = comm.all_reduce(torch.stack([picked, exp.sum(dim=-1)]), group)
        valid = target != IGNORE_INDEX
        loss = (stats[1].log() - stats[0]).masked_fill(~valid, 0.0)
        exp.div_(stats[1][:, None])  # softmax, local shard
        ctx.save_for_backward(exp, idx, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(1, idx[:, None], -mine.to(grad.dtype)[:, None])
        grad.mul_((g * valid.to(g.dtype))[:, None])
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Per-token cross-entropy [N] (0 where labels == -100) from vocab-sharded logits [..., V_local]."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return _VocabParallelCE.apply(flat, labels.reshape(-1), int(vocab_start), group)
