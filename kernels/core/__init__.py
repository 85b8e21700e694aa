"""megassm.kernels: the ops the models call, behind one stable set of signatures.

This module is the dispatch point. Each op lives in a folder of its own under kernels/ (kernels/<op>/, installed
as megassm.kernels.<op>: its Triton kernels, its pure-PyTorch reference and its custom-op registration); every op
is a `torch.library.custom_op` (namespace "megassm", kernels/<op>/op.py) with fake and autograd registrations;
inside, the backend is chosen per call (`dispatch.py`) from the environment variable MEGASSM_KERNELS=auto|triton|torch
(auto, the default: the op's Triton kernels when the tensors are on CUDA and triton imports, its pure-PyTorch
reference otherwise). The references stay the test oracle. In eager mode a call that resolves to the reference runs
it directly (plain autograd, no recompute in the backward), and a Triton call runs the op's implementation and
backward through a plain autograd.Function (`<op>.op.*_call`: the custom-op dispatcher's host overhead left the GPU
idle); under torch.compile every call goes through the custom op. The backend in use is logged once, at INFO on the
"megassm.kernels" logger, on the first call of any op (and again only if a later call switches backend).
"""
from __future__ import annotations

import torch

from . import dispatch, grad_blocks
from .act import op as act_ops
from .act import reference as act_ref
from .coffee import op as coffee_ops
from .coffee import reference as coffee_ref
from .conv1d import op as conv_ops
from .conv1d import reference as conv_ref
from .loss import op as loss_ops
from .loss import reference as loss_ref
from .mamba2_ssd import op as ssd_ops
from .mamba2_ssd import reference as ssd_ref
from .mamba2_ssd.readout import state_readout_add
from .norm import op as norm_ops
from .norm import reference as norm_ref
from .scan import op as scan_ops
from .scan import reference as scan_ref

__all__ = [
    "backend",
    "state_readout_add",
    "ssd",
    "ssd_sequential",
    "ssd_step",
    "causal_conv1d",
    "causal_conv1d_step",
    "rmsnorm",
    "gated_rmsnorm",
    "add_rmsnorm",
    "swiglu",
    "gated_rmsnorm_sumsq",
    "gated_rmsnorm_apply",
    "gated_rmsnorm_bwd_dot",
    "gated_rmsnorm_bwd_apply",
    "selective_scan",
    "selective_scan_sequential",
    "selective_scan_step",
    "coffee_scan",
    "split_last",
    "cross_entropy",
]

# name of the backend announced last ("reference" / "triton"), False before the first call
_announced = False


def backend() -> str:
    """Backend a call on this machine's default device resolves to: "reference" (pure PyTorch) or "triton".

    The decision is per call (device and dtype of the tensors): with MEGASSM_KERNELS=auto, CPU tensors use the
    reference even on a machine with a GPU.
    """
    m = dispatch.mode()
    if m == "torch":
        return "reference"
    if m == "triton":
        return "triton"
    return "triton" if torch.cuda.is_available() and dispatch.triton_available() else "reference"


def _eager_reference(x) -> bool:
    """Calls that resolve to the reference run it directly in eager mode (plain autograd: no recompute in the
    backward, bit-identical by construction); under torch.compile they go through the custom op (one opaque
    op in the graph). Triton calls go through <op>.op.*_call (the op's own implementation and backward)."""
    if torch.compiler.is_compiling() or dispatch.use_triton(x):
        return False
    dispatch.announce(False, x)
    return True


def _tuple_or_none(v):
    return None if v is None else tuple(float(a) for a in v)


def ssd(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=True,
    dt_limit=None,
    initial_states=None,
    seq_idx=None,
    chunk_size=256,
    return_final_states=False,
):
    """Chunked SSD scan (see megassm.kernels.mamba2_ssd.reference for the math and shapes). Returns y [B,L,H,P]
    (x.dtype), or (y, final_states [B,H,P,N] fp32) with return_final_states."""
    ssd_ref.check_ssd_args(x, dt, A, B, C)
    if _eager_reference(x):
        return ssd_ref.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                             dt_limit=dt_limit, initial_states=initial_states, seq_idx=seq_idx,
                             chunk_size=chunk_size, return_final_states=return_final_states)
    y, fin, _ = ssd_ops.ssd_call(x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), _tuple_or_none(dt_limit),
                                initial_states, seq_idx, int(chunk_size), bool(return_final_states))
    return (y, fin) if return_final_states else y


def split_last(x, sizes, share_grads=False):
    """torch.split(x, sizes, dim=-1), whose backward takes the blocks' gradients without a copy when the ops
    after it wrote them as blocks of one buffer (the Triton SSD backward does for x, B, C split from the
    Mamba-2 conv output); otherwise it concatenates them, as torch.split's backward does. share_grads: the
    pieces carry one gradient buffer (grad_blocks.GradBlocks) that the Triton backwards of the ops reading them (the
    gated norm's z, the conv's x, the SSD's dt) write into: Mamba-2's [z | xBC | dt] split from in_proj."""
    sizes = list(sizes)
    blocks = None
    if share_grads and x.requires_grad and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        blocks = grad_blocks.GradBlocks(x, sizes)
    pieces = grad_blocks.SplitLast.apply(x, sizes, blocks)
    if blocks is not None:
        blocks.tag(pieces)
    return pieces


def ssd_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=None):
    """One decode token: (y [B,H,P] in x.dtype, new_state [B,H,P,N] fp32). See ssd.reference.ssd_step."""
    if _eager_reference(x):
        return ssd_ref.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit)
    return ssd_ops.ssd_step_op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), _tuple_or_none(dt_limit))


def causal_conv1d(
    x, weight, bias=None, initial_state=None, seq_idx=None, activation="silu", return_final_state=False
):
    """Causal depthwise conv1d (+SiLU), channels last x [B,L,C], weight [C,W]. See conv1d.reference.causal_conv1d."""
    if _eager_reference(x):
        return conv_ref.causal_conv1d(x, weight, bias, initial_state=initial_state, seq_idx=seq_idx,
                                       activation=activation, return_final_state=return_final_state)
    y, fin = conv_ops.causal_conv1d_call(x, weight, bias, initial_state, seq_idx, activation, bool(return_final_state))
    return (y, fin) if return_final_state else y


def causal_conv1d_step(state, x, weight, bias=None, activation="silu"):
    """One decode token: state [B,C,W-1], x [B,C] -> (y [B,C], new_state fp32)."""
    if _eager_reference(x):
        return conv_ref.causal_conv1d_step(state, x, weight, bias, activation=activation)
    return conv_ops.causal_conv1d_step_op(state, x, weight, bias, activation)


def rmsnorm(x, weight, eps=1e-5, out_dtype=None):
    """x / rms(x) * weight over the last dim (fp32 statistics); the output in out_dtype (default x.dtype), e.g.
    an fp32 residual normed straight into bf16 (the gradient comes back in x.dtype)."""
    if out_dtype == x.dtype:
        out_dtype = None
    if _eager_reference(x):
        return norm_ref.rmsnorm(x, weight, eps, out_dtype)
    return norm_ops.rmsnorm_call(x, weight, float(eps), out_dtype)


def gated_rmsnorm(x, z, weight, ngroups=1, eps=1e-5, norm_before_gate=False):
    """Grouped RMS norm with a SiLU gate. See norm.reference.gated_rmsnorm."""
    if _eager_reference(x):
        return norm_ref.gated_rmsnorm(x, z, weight, ngroups=ngroups, eps=eps, norm_before_gate=norm_before_gate)
    return norm_ops.gated_rmsnorm_call(x, z, weight, int(ngroups), float(eps), bool(norm_before_gate))


def add_rmsnorm(x, residual, weight, eps=1e-5):
    """(rmsnorm(residual + x) * weight in x.dtype, new fp32 residual). See norm.reference.add_rmsnorm."""
    if _eager_reference(x):
        return norm_ref.add_rmsnorm(x, residual, weight, eps)
    return norm_ops.add_rmsnorm_call(x, residual, weight, float(eps))


def swiglu(a, b):
    """silu(a) * b (the gated MLP's activation; a = w1 u, b = w3 u). See act.reference.swiglu. The Triton path
    keeps a and b for the backward, not silu(a), and rounds once."""
    if a.shape != b.shape:
        raise ValueError(f"swiglu: a {tuple(a.shape)} and b {tuple(b.shape)} must have the same shape")
    if _eager_reference(a):
        return act_ref.swiglu(a, b)
    return act_ops.swiglu_call(a, b)


def cross_entropy(logits, labels, ignore_index=-100):
    """Per-row cross-entropy losses [N] in fp32 (0 where labels == ignore_index) of logits [N, V] (bf16, fp16 or
    fp32) against labels [N]: F.cross_entropy(logits.float(), labels, reduction="none"). The Triton path reads the
    logits without an fp32 copy and writes their gradient in the logits' dtype (kernels/loss/triton_ce.py)."""
    if logits.dim() != 2 or labels.dim() != 1 or labels.shape[0] != logits.shape[0]:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} must be [N, V] and labels "
                         f"{tuple(labels.shape)} [N]")
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"cross_entropy: labels must be integers, got {labels.dtype}")
    if _eager_reference(logits):
        return loss_ref.cross_entropy(logits, labels, int(ignore_index))
    return loss_ops.cross_entropy_call(logits, labels, int(ignore_index))[0]


# gated_rmsnorm in stages, for norm groups whose channels are spread over devices (tensor parallelism with fewer
# Mamba-2 groups than ranks, parallel/tp.py): the caller sums `sumsq` (forward) and `dot` (backward) over the
# devices between the stages and writes the autograd Function itself. Plain functions: no autograd, no custom op.
# sumsq / dot: [..., G] fp32 (fp64 for fp64); group_size: the width of a whole group, over all devices.
def _staged(x) -> bool:
    use = dispatch.use_triton(x)
    dispatch.announce(use, x)
    return use


def gated_rmsnorm_sumsq(x, z, ngroups=1, norm_before_gate=False):
    """Each row's per-group sum of squares of x * silu(z) (of x when norm_before_gate or z is None)."""
    if _staged(x):
        return norm_ops.triton_norm().gated_rmsnorm_sumsq(x, z, int(ngroups), bool(norm_before_gate))
    return norm_ref.gated_rmsnorm_sumsq(x, z, ngroups, norm_before_gate)


def gated_rmsnorm_apply(x, z, weight, sumsq, group_size, eps=1e-5, norm_before_gate=False):
    """gated_rmsnorm(x, z, weight) with the groups' statistics given (sumsq summed over the devices)."""
    if _staged(x):
        return norm_ops.triton_norm().gated_rmsnorm_apply(x, z, weight, sumsq, int(group_size), float(eps),
                                                        bool(norm_before_gate))
    return norm_ref.gated_rmsnorm_apply(x, z, weight, sumsq, group_size, eps, norm_before_gate)


def gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, group_size, eps=1e-5, norm_before_gate=False):
    """Backward, first stage: each row's per-group sum of dn * n, to be summed over the devices."""
    if _staged(x):
        return norm_ops.triton_norm().gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, int(group_size), float(eps),
                                                          bool(norm_before_gate))
    return norm_ref.gated_rmsnorm_bwd_dot(dout, x, z, weight, sumsq, group_size, eps, norm_before_gate)


def gated_rmsnorm_bwd_apply(dout, x, z, weight, sumsq, dot, group_size, eps=1e-5, norm_before_gate=False,
                            dz_to_block=False):
    """Backward, second stage: (dx, dz, dweight) of gated_rmsnorm_apply with the summed `dot`. dz_to_block: dz is
    z's own gradient, so on the Triton path it goes into z's block of a split_last(share_grads=True) buffer
    (grad_blocks.grad_block) when z is such a piece."""
    if _staged(x):
        return norm_ops.triton_norm().gated_rmsnorm_bwd_apply(
            dout, x, z, weight, sumsq, dot, int(group_size), float(eps), bool(norm_before_gate),
            out_dz=grad_blocks.grad_block(z) if dz_to_block else None)
    return norm_ref.gated_rmsnorm_bwd_apply(dout, x, z, weight, sumsq, dot, group_size, eps, norm_before_gate)


def selective_scan(x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, decay="exp",
                   initial_state=None, seq_idx=None, return_final_state=False):
    """Selective (diagonal) scan of the seed mixers `S` (decay="exp", Mamba-1) and `L` (decay="longhorn"); see
    megassm.kernels.scan.reference for the math and shapes. Returns y [B,L,D] (x.dtype), or (y, final_state
    [B,D,N] fp32) with return_final_state."""
    scan_ref.check_scan_args(x, delta, A, B, C, decay)
    if _eager_reference(x):
        return scan_ref.selective_scan(x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                        delta_softplus=delta_softplus, decay=decay, initial_state=initial_state,
                                        seq_idx=seq_idx, return_final_state=return_final_state)
    y, fin = scan_ops.selective_scan_call(x, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), str(decay),
                                     initial_state, seq_idx, bool(return_final_state))
    return (y, fin) if return_final_state else y


def selective_scan_step(state, x, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        decay="exp"):
    """One decode token: state [B,D,N], x/delta/z [B,D], B/C [B,N] or [B,G,N] -> (y [B,D], new_state fp32)."""
    if _eager_reference(x):
        return scan_ref.selective_scan_step(state, x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                             delta_softplus=delta_softplus, decay=decay)
    return scan_ops.selective_scan_step_op(state, x, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), str(decay))


# the oracle is never dispatched: it is the definition every backend is checked against
ssd_sequential = ssd_ref.ssd_sequential
selective_scan_sequential = scan_ref.selective_scan_sequential


def coffee_scan(v, lam, w, C, w_out=None, x0=None, seq_idx=None):
    """COFFEE's state-feedback recurrence (seed mixer `C`) run token by token, with its read-out fused:
    v [B, L, D], lam / w / C / w_out [D, n], x0 [B, D, n] or None, seq_idx [B, L] or None. Returns
    (y [B, L, D], final state [B, D, n]) in fp32 (fp64 for fp64 inputs); see megassm.kernels.coffee.reference
    for the math. Triton on the GPU (the [B, L, D, n] states never touch memory), the reference loop otherwise."""
    if v.dim() != 3 or lam.dim() != 2 or lam.shape[0] != v.shape[-1]:
        raise ValueError(f"coffee_scan: v [B, L, D] and lam [D, n] expected, got {tuple(v.shape)} and "
                         f"{tuple(lam.shape)}")
    for name, t in (("w", w), ("C", C), ("w_out", w_out)):
        if t is not None and t.shape != lam.shape:
            raise ValueError(f"coffee_scan: {name} {tuple(t.shape)} must have lam's shape {tuple(lam.shape)}")
    if _eager_reference(v):
        return coffee_ref.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    y, fin, _ = coffee_ops.coffee_scan_call(v, lam, w, C, w_out, x0, seq_idx)
    return y, fin
