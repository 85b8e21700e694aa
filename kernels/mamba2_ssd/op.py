"""torch.library custom ops (namespace "megassm") behind the public functions of megassm.kernels.

Every public op is one `torch.library.custom_op` with a fake (meta) implementation, so torch.compile and
activation checkpointing see a single opaque op, and an autograd registration. Inside the op the backend is
chosen per call from `MEGASSM_KERNELS` (kernels/core/dispatch.py: auto, triton, torch). Reference backward: the
reference forward recomputed and differentiated (dispatch._reference_backward). Triton backward: the Triton
backward kernels of the op (kernels/triton), which recompute what they need from the saved inputs (no
activations beyond the op's inputs are kept).

The decode-step ops have a Triton forward only; their backward (rarely needed) is the reference one.
The public functions in kernels/core/__init__.py call these ops for every Triton call and under torch.compile; in
eager mode a call that resolves to the reference skips the op and runs the reference directly (no recompute),
and a Triton call goes through the op's `*_call` (dispatch._eager_caller: a plain autograd.Function).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import env, reference
from .dispatch import (_cdt, _eager_caller, _empty_f32, _fresh, _fresh_all, _pick, _reference_backward, _restore,
                       _save, triton_kernels, use_triton)
from .dispatch import _announce, mode, triton_available, triton_error  # noqa: F401  (kernels/core/__init__.py, tests)
from .dispatch import traceable_backward
from .grad_blocks import grad_block, packed_rows, xbc_grad_buffer


def _first_on_triton(args) -> bool:
    """Whether an op's backward launches Triton (traceable_backward): its first input is on the Triton path."""
    return use_triton(args[0])


# --------------------------------------------------------------------------------------------------------
# SSD


def _ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
                  return_final_states):
    out = reference.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                        dt_limit=None if dt_limit is None else tuple(dt_limit), initial_states=initial_states,
                        seq_idx=seq_idx, chunk_size=chunk_size, return_final_states=return_final_states)
    if return_final_states:
        return out
    return out, _empty_f32(x)


def _ssd_triton_takes(x: Tensor, chunk_size: int) -> bool:
    return triton_kernels().ssd_supported(x, chunk_size)


@torch.library.custom_op("megassm::ssd", mutates_args=())
def ssd_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: Optional[Sequence[float]],
    initial_states: Optional[Tensor], seq_idx: Optional[Tensor], chunk_size: int, return_final_states: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(y, final states or empty, kept buffer or empty): the last is for the backward only, never returned by
    kernels.ssd: the states (MEGASSM_SSD_SAVE_STATES), or the true segment ends of a segmented chunk walk (the
    backward's recompute starts from them). The backward needs the final states only when they are returned
    (their gradient is the only way they enter it), and then the second output is them."""
    if _pick(x) and _ssd_triton_takes(x, chunk_size):
        y, fin, kept = triton_kernels().ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                                initial_states, seq_idx, chunk_size, return_final_states,
                                                env.ssd_save_states())
        return y, (fin if return_final_states else _empty_f32(x)), (kept if kept is not None else _empty_f32(x))
    y, fin = _fresh_all(_ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                                      seq_idx, chunk_size, return_final_states))
    return y, fin, _empty_f32(x)


@ssd_op.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
      return_final_states):
    b, _, h, p = x.shape
    n = B.shape[-1]
    fin = x.new_empty((b, h, p, n), dtype=_cdt(x)) if return_final_states else _empty_f32(x)
    kept = _empty_f32(x)
    saved = (triton_kernels().ssd_kept_state_shape(x, B, chunk_size, env.ssd_save_states())
             if use_triton(x) and _ssd_triton_takes(x, chunk_size) else None)
    if saved is not None:
        kept = x.new_empty(saved[0], dtype=saved[1])
    return x.new_empty(x.shape), fin, kept


def _ssd_setup(ctx, inputs, output):
    _, fin, buf = output
    keep = buf.numel() > 0
    _save(ctx, inputs, ((buf, fin) if inputs[13] else (buf,)) if keep else (), keep_output=keep)
    ctx.mark_non_differentiable(buf)


def _ssd_bwd(ctx, gy, gfinal, _gkept=None):
    args, kept = _restore(ctx)
    x = args[0]
    if _ssd_bwd_launches(args):
        (x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx, chunk, ret) = args
        grads = triton_kernels().ssd_bwd(
            gy, gfinal if ret else None, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx,
            chunk, kept=(kept[0], kept[1] if ret else None) if kept else None,
            out_xbc=xbc_grad_buffer(x, B) if packed_rows(x, B, C) else None,
            out_ddt=grad_block(dt) if ctx.needs_input_grad[1] else None)
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
        return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, None, None, dinit, None, None, None
    return _reference_backward(_ssd_ref_full, ctx, args, (gy, gfinal))


def _ssd_bwd_launches(args) -> bool:
    return use_triton(args[0]) and triton_kernels().HAS_SSD_BWD and _ssd_triton_takes(args[0], args[12])


ssd_op.register_autograd(traceable_backward("ssd", _ssd_bwd, _ssd_bwd_launches), setup_context=_ssd_setup)


# --------------------------------------------------------------------------------------------------------
# SSD decode step


def _ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    y, new = reference.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                dt_limit=None if dt_limit is None else tuple(dt_limit))
    return y, new


@torch.library.custom_op("megassm::ssd_step", mutates_args=())
def ssd_step_op(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], dt_bias: Optional[Tensor], dt_softplus: bool, dt_limit: Optional[Sequence[float]],
) -> tuple[Tensor, Tensor]:
    if _pick(x) and triton_kernels().HAS_SSD_STEP:
        return triton_kernels().ssd_step_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    return _fresh_all(_ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit))


@ssd_step_op.register_fake
def _(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _step_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _ssd_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_ssd_step_ref, ctx, args, (gy, gstate))


ssd_step_op.register_autograd(_ssd_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# causal conv1d


def _conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    out = reference.causal_conv1d(x, weight, bias, initial_state=initial_state, seq_idx=seq_idx,
                                  activation=activation, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, _empty_f32(x)


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r} (expected 'silu' or None)")


@torch.library.custom_op("megassm::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], activation: Optional[str], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if _pick(x):
        y, fin = triton_kernels().causal_conv1d_fwd(x, weight, bias, initial_state, seq_idx,
                                                    activation is not None, return_final_state)
        return y, (fin if return_final_state else _empty_f32(x))
    return _fresh_all(_conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state))


@causal_conv1d_op.register_fake
def _(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    b, _, c = x.shape
    w = weight.shape[-1]
    fin = x.new_empty((b, c, w - 1), dtype=_cdt(x)) if return_final_state else _empty_f32(x)
    return x.new_empty(x.shape), fin


def _conv_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _conv_bwd(ctx, gy, gfinal):
    args, _ = _restore(ctx)
    x, weight, bias, init, seq_idx, activation, ret = args
    if use_triton(x):
        need = ctx.needs_input_grad
        dx, dw, db, dinit = triton_kernels().causal_conv1d_bwd(
            x, weight, bias, init, seq_idx, activation is not None, gy, gfinal if ret else None,
            out_dx=grad_block(x) if need[0] else None)
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
                dinit if need[3] else None, None, None, None)
    return _reference_backward(_conv_ref_full, ctx, args, (gy, gfinal))


causal_conv1d_op.register_autograd(traceable_backward("causal_conv1d", _conv_bwd, _first_on_triton),
                                   setup_context=_conv_setup)


def _conv_step_ref(state, x, weight, bias, activation):
    y, new = reference.causal_conv1d_step(state, x, weight, bias, activation=activation)
    return y, new.contiguous()


@torch.library.custom_op("megassm::causal_conv1d_step", mutates_args=())
def causal_conv1d_step_op(
    state: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if _pick(x) and triton_kernels().HAS_CONV_STEP:
        return triton_kernels().causal_conv1d_step_fwd(state, x, weight, bias, activation is not None)
    return _fresh_all(_conv_step_ref(state, x, weight, bias, activation))


@causal_conv1d_step_op.register_fake
def _(state, x, weight, bias, activation):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _conv_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_conv_step_ref, ctx, args, (gy, gstate))


causal_conv1d_step_op.register_autograd(_conv_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# selective scan (seed mixers S Mamba-1 and L Longhorn)


def _scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx,
                   return_final_state):
    out = reference.selective_scan(x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                   delta_softplus=delta_softplus, decay=decay, initial_state=initial_state,
                                   seq_idx=seq_idx, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, _empty_f32(x)


@torch.library.custom_op("megassm::selective_scan", mutates_args=())
def selective_scan_op(
    x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, decay: str, initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if _pick(x):
        y, fin = triton_kernels().selective_scan_fwd(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay,
                                                     initial_state, seq_idx, return_final_state)
        return y, (fin if return_final_state else _empty_f32(x))
    return _fresh_all(_scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state,
                                     seq_idx, return_final_state))


@selective_scan_op.register_fake
def _(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx, return_final_state):
    b, _, d = x.shape
    fin = x.new_empty((b, d, B.shape[-1]), dtype=_cdt(x)) if return_final_state else _empty_f32(x)
    return x.new_empty(x.shape), fin


def _scan_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _scan_bwd(ctx, gy, gfinal):
    args, _ = _restore(ctx)
    x = args[0]
    if use_triton(x):
        (x, delta, A, B, C, D, z, delta_bias, softplus, decay, init, seq_idx, ret) = args
        grads = triton_kernels().selective_scan_bwd(gy, gfinal if ret else None, x, delta, A, B, C, D, z, delta_bias,
                                                    softplus, decay, init, seq_idx)
        dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit = grads
        need = ctx.needs_input_grad
        keep = [g if need[i] else None for i, g in zip((0, 1, 2, 3, 4, 5, 6, 7, 10),
                                                        (dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit))]
        return (*keep[:8], None, None, keep[8], None, None)
    return _reference_backward(_scan_ref_full, ctx, args, (gy, gfinal))


selective_scan_op.register_autograd(traceable_backward("selective_scan", _scan_bwd, _first_on_triton),
                                    setup_context=_scan_setup)


# --------------------------------------------------------------------------------------------------------
# COFFEE recurrence + read-out (seed mixer C, solver=sequential)


@torch.library.custom_op("megassm::coffee_scan", mutates_args=())
def coffee_scan_op(v: Tensor, lam: Tensor, w: Tensor, C: Tensor, w_out: Optional[Tensor], x0: Optional[Tensor],
                   seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(y, final state, checkpoints): the Triton kernel's segment checkpoints are an output so that the
    backward (which recomputes from them) can save them; the reference returns an empty one."""
    if _pick(v):
        return triton_kernels().coffee_scan_fwd(v, lam, w, C, w_out, x0, seq_idx)
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return _fresh(y), _fresh(fin), _empty_f32(v)


@coffee_scan_op.register_fake
def _(v, lam, w, C, w_out, x0, seq_idx):
    b, L, d = v.shape
    n = lam.shape[-1]
    cdt = _cdt(v)
    nseg = -(-L // triton_kernels().coffee.SEGMENT) if use_triton(v) else 0
    ck = v.new_empty((b, nseg, d, n), dtype=cdt) if nseg else _empty_f32(v)
    return v.new_empty((b, L, d), dtype=cdt), v.new_empty((b, d, n), dtype=cdt), ck


def _coffee_setup(ctx, inputs, output):
    _save(ctx, inputs, (output[2],), keep_output=True)  # the checkpoints only (y is not needed)


def _coffee_ref_full(v, lam, w, C, w_out, x0, seq_idx):
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return y, fin, _empty_f32(v)


def _coffee_bwd(ctx, gy, gfin, gck):
    args, outs = _restore(ctx)
    v = args[0]
    if use_triton(v):
        (v, lam, w, C, w_out, x0, seq_idx) = args
        dv, dlam, dw, dC, dwo, dx0 = triton_kernels().coffee_scan_bwd(gy, gfin, v, lam, w, C, w_out, seq_idx, outs[0])
        need = ctx.needs_input_grad
        grads = (dv, dlam.to(lam.dtype), dw.to(w.dtype), dC.to(C.dtype),
                 dwo.to(w_out.dtype) if dwo is not None else None, dx0.to(x0.dtype) if x0 is not None else None)
        return (*[g if need[i] else None for i, g in enumerate(grads)], None)
    return _reference_backward(_coffee_ref_full, ctx, args, (gy, gfin, gck))


coffee_scan_op.register_autograd(traceable_backward("coffee_scan", _coffee_bwd, _first_on_triton),
                                 setup_context=_coffee_setup)


def _scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    return reference.selective_scan_step(state, x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                         delta_softplus=delta_softplus, decay=decay)


@torch.library.custom_op("megassm::selective_scan_step", mutates_args=())
def selective_scan_step_op(
    state: Tensor, x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool, decay: str,
) -> tuple[Tensor, Tensor]:
    if _pick(x):
        return triton_kernels().selective_scan_step_fwd(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                        decay)
    return _fresh_all(_scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay))


@selective_scan_step_op.register_fake
def _(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    return x.new_empty(x.shape), state.new_empty(state.shape, dtype=_cdt(x))


def _scan_step_bwd(ctx, gy, gstate):
    args, _ = _restore(ctx)
    return _reference_backward(_scan_step_ref, ctx, args, (gy, gstate))


selective_scan_step_op.register_autograd(_scan_step_bwd, setup_context=_step_setup)


# --------------------------------------------------------------------------------------------------------
# norms


def _gated_ref(x, z, weight, ngroups, eps, norm_before_gate):
    return reference.gated_rmsnorm(x, z, weight, ngroups=ngroups, eps=eps, norm_before_gate=norm_before_gate)


@torch.library.custom_op("megassm::gated_rmsnorm", mutates_args=())
def gated_rmsnorm_op(
    x: Tensor, z: Optional[Tensor], weight: Optional[Tensor], ngroups: int, eps: float, norm_before_gate: bool
) -> Tensor:
    if x.shape[-1] % ngroups != 0:
        raise ValueError(f"gated_rmsnorm: dim {x.shape[-1]} not divisible by ngroups {ngroups}")
    if _pick(x):
        return triton_kernels().gated_rmsnorm_fwd(x, z, weight, ngroups, eps, norm_before_gate)
    out = _gated_ref(x, z, weight, ngroups, eps, norm_before_gate)
    return _fresh(out.clone() if out is x else out)


@gated_rmsnorm_op.register_fake
def _(x, z, weight, ngroups, eps, norm_before_gate):
    return x.new_empty(x.shape)


def _norm_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _gated_bwd(ctx, gout):
    args, _ = _restore(ctx)
    x, z, weight, ngroups, eps, nbg = args
    if use_triton(x):
        dx, dz, dw = triton_kernels().gated_rmsnorm_bwd(gout, x, z, weight, ngroups, eps, nbg,
                                                        out_dz=grad_block(z) if ctx.needs_input_grad[1] else None)
        return dx, dz, dw, None, None, None
    return _reference_backward(_gated_ref, ctx, args, (gout,))


gated_rmsnorm_op.register_autograd(traceable_backward("gated_rmsnorm", _gated_bwd, _first_on_triton),
                                   setup_context=_norm_setup)


def _rmsnorm_ref(x, weight, eps, out_dtype):
    return reference.rmsnorm(x, weight, eps, out_dtype)


@torch.library.custom_op("megassm::rmsnorm", mutates_args=())
def rmsnorm_op(x: Tensor, weight: Optional[Tensor], eps: float, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    if _pick(x):
        return triton_kernels().gated_rmsnorm_fwd(x, None, weight, 1, eps, False, out_dtype=out_dtype)
    out = _rmsnorm_ref(x, weight, eps, out_dtype)
    return _fresh(out.clone() if out is x else out)


@rmsnorm_op.register_fake
def _(x, weight, eps, out_dtype=None):
    return x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)


def _rmsnorm_bwd(ctx, gout):
    args, _ = _restore(ctx)
    x, weight, eps, out_dtype = args
    if use_triton(x):  # the kernel reads gout in its own dtype and writes dx in x's
        dx, _, dw = triton_kernels().gated_rmsnorm_bwd(gout, x, None, weight, 1, eps, False)
        return dx, dw, None, None
    return _reference_backward(_rmsnorm_ref, ctx, args, (gout,))


rmsnorm_op.register_autograd(traceable_backward("rmsnorm", _rmsnorm_bwd, _first_on_triton), setup_context=_norm_setup)


def _add_ref(x, residual, weight, eps):
    return reference.add_rmsnorm(x, residual, weight, eps)


@torch.library.custom_op("megassm::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float
                   ) -> tuple[Tensor, Tensor]:
    if _pick(x):
        return triton_kernels().add_rmsnorm_fwd(x, residual, weight, eps)
    out, res = _add_ref(x, residual, weight, eps)
    if res is x or res is residual:  # a custom op's outputs must not alias its inputs
        res = res.clone()
    if out is x:
        out = out.clone()
    return _fresh(out), _fresh(res)


@add_rmsnorm_op.register_fake
def _(x, residual, weight, eps):
    cdt = _cdt(x) if residual is None else torch.promote_types(_cdt(x), residual.dtype)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=cdt)


def _add_setup(ctx, inputs, output):
    _save(ctx, inputs, output, keep_output=True)


def _add_bwd(ctx, gout, gres):
    args, outs = _restore(ctx)
    x, residual, weight, eps = args
    if use_triton(x):
        new_res = outs[1]
        dx, dres, dw = triton_kernels().add_rmsnorm_bwd(gout, gres, new_res, weight, eps, x.dtype,
                                                        None if residual is None else residual.dtype)
        need = ctx.needs_input_grad
        return dx if need[0] else None, dres if need[1] else None, dw if need[2] else None, None
    return _reference_backward(_add_ref, ctx, args, (gout, gres))


add_rmsnorm_op.register_autograd(traceable_backward("add_rmsnorm", _add_bwd, _first_on_triton),
                                 setup_context=_add_setup)


# --------------------------------------------------------------------------------------------------------
# swiglu: silu(a) * b (the gated MLP's activation)


@torch.library.custom_op("megassm::swiglu", mutates_args=())
def swiglu_op(a: Tensor, b: Tensor) -> Tensor:
    if _pick(a):
        return triton_kernels().swiglu_fwd(a, b)
    return _fresh(reference.swiglu(a, b))


@swiglu_op.register_fake
def _(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _swiglu_setup(ctx, inputs, output):
    _save(ctx, inputs, output)


def _swiglu_bwd(ctx, gout):
    args, _ = _restore(ctx)
    a, b = args
    if use_triton(a):
        return triton_kernels().swiglu_bwd(gout, a, b)
    return _reference_backward(reference.swiglu, ctx, args, (gout,))


swiglu_op.register_autograd(traceable_backward("swiglu", _swiglu_bwd, _first_on_triton), setup_context=_swiglu_setup)


# --------------------------------------------------------------------------------------------------------
# cross-entropy of the LM head: per-row fp32 losses (and the log-sum-exp the Triton backward reads)


def _ce_ref(logits, labels, ignore_index):
    # the op's outputs: the losses and each row's log-sum-exp (what the Triton backward reads)
    lse = torch.logsumexp(logits.detach().to(_cdt(logits)), dim=-1)
    return reference.cross_entropy(logits, labels, ignore_index), lse


@torch.library.custom_op("megassm::cross_entropy", mutates_args=())
def cross_entropy_op(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    if _pick(logits):
        return triton_kernels().cross_entropy_fwd(logits, labels, ignore_index)
    return _fresh_all(_ce_ref(logits, labels, ignore_index))


@cross_entropy_op.register_fake
def _(logits, labels, ignore_index):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=_cdt(logits)), logits.new_empty(n, dtype=_cdt(logits))


def _ce_setup(ctx, inputs, output):
    _save(ctx, inputs, output, keep_output=True)
    ctx.mark_non_differentiable(output[1])


def _ce_bwd(ctx, gloss, _glse):
    args, outs = _restore(ctx)
    logits, labels, ignore_index = args
    if use_triton(logits):
        return triton_kernels().cross_entropy_bwd(gloss, logits, labels, outs[1], ignore_index), None, None
    return _reference_backward(_ce_ref, ctx, args, (gloss, None))


cross_entropy_op.register_autograd(traceable_backward("cross_entropy", _ce_bwd, _first_on_triton),
                                   setup_context=_ce_setup)


ssd_call = _eager_caller(ssd_op, _ssd_setup, _ssd_bwd)
causal_conv1d_call = _eager_caller(causal_conv1d_op, _conv_setup, _conv_bwd)
gated_rmsnorm_call = _eager_caller(gated_rmsnorm_op, _norm_setup, _gated_bwd)
rmsnorm_call = _eager_caller(rmsnorm_op, _norm_setup, _rmsnorm_bwd)
add_rmsnorm_call = _eager_caller(add_rmsnorm_op, _add_setup, _add_bwd)
swiglu_call = _eager_caller(swiglu_op, _swiglu_setup, _swiglu_bwd)
cross_entropy_call = _eager_caller(cross_entropy_op, _ce_setup, _ce_bwd)
selective_scan_call = _eager_caller(selective_scan_op, _scan_setup, _scan_bwd)
coffee_scan_call = _eager_caller(coffee_scan_op, _coffee_setup, _coffee_bwd)
