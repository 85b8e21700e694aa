"""The SSD's custom ops (megassm::ssd, megassm::ssd_step): fake and autograd registrations, and the eager
callers that skip the custom-op dispatcher (ssd_call). Reference backward: the reference forward recomputed and
differentiated (dispatch.reference_backward); Triton backward: triton_ssd_bwd, which recomputes what it needs from
the saved inputs. The decode step has a Triton forward only; its backward (rarely needed) is the reference one."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import env
from ..dispatch import (compute_dtype, eager_caller, empty_f32, fresh_all, pick, reference_backward, register_step,
                        restore, save, traceable_backward, triton_module, use_triton)
from ..grad_blocks import grad_block, packed_rows, xbc_grad_buffer
from . import reference

triton_ssd = triton_module("megassm.kernels.mamba2_ssd.triton_ssd")  # ssd_fwd, supported, kept_state_shape
triton_ssd_bwd = triton_module("megassm.kernels.mamba2_ssd.triton_ssd_bwd")  # ssd_bwd
triton_step = triton_module("megassm.kernels.mamba2_ssd.triton_step")  # ssd_step_fwd


# --------------------------------------------------------------------------------------------------------
# SSD


def _ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
                  return_final_states):
    out = reference.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                        dt_limit=None if dt_limit is None else tuple(dt_limit), initial_states=initial_states,
                        seq_idx=seq_idx, chunk_size=chunk_size, return_final_states=return_final_states)
    if return_final_states:
        return out
    return out, empty_f32(x)


def _ssd_triton_takes(x: Tensor, chunk_size: int) -> bool:
    return triton_ssd().supported(x, chunk_size)


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
    if pick(x) and _ssd_triton_takes(x, chunk_size):
        y, fin, kept = triton_ssd().ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                                initial_states, seq_idx, chunk_size, return_final_states,
                                                env.ssd_save_states())
        return y, (fin if return_final_states else empty_f32(x)), (kept if kept is not None else empty_f32(x))
    y, fin = fresh_all(_ssd_ref_full(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                                      seq_idx, chunk_size, return_final_states))
    return y, fin, empty_f32(x)


@ssd_op.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, initial_states, seq_idx, chunk_size,
      return_final_states):
    b, _, h, p = x.shape
    n = B.shape[-1]
    fin = x.new_empty((b, h, p, n), dtype=compute_dtype(x)) if return_final_states else empty_f32(x)
    kept = empty_f32(x)
    saved = (triton_ssd().kept_state_shape(x, B, chunk_size, env.ssd_save_states())
             if use_triton(x) and _ssd_triton_takes(x, chunk_size) else None)
    if saved is not None:
        kept = x.new_empty(saved[0], dtype=saved[1])
    return x.new_empty(x.shape), fin, kept


def _ssd_setup(ctx, inputs, output):
    _, fin, buf = output
    keep = buf.numel() > 0
    save(ctx, inputs, ((buf, fin) if inputs[13] else (buf,)) if keep else (), keep_output=keep)
    ctx.mark_non_differentiable(buf)


def _ssd_bwd(ctx, gy, gfinal, _gkept=None):
    args, kept = restore(ctx)
    x = args[0]
    if _ssd_bwd_launches(args):
        (x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx, chunk, ret) = args
        grads = triton_ssd_bwd().ssd_bwd(
            gy, gfinal if ret else None, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, init, seq_idx,
            chunk, kept=(kept[0], kept[1] if ret else None) if kept else None,
            out_xbc=xbc_grad_buffer(x, B) if packed_rows(x, B, C) else None,
            out_ddt=grad_block(dt) if ctx.needs_input_grad[1] else None)
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
        return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, None, None, dinit, None, None, None
    return reference_backward(_ssd_ref_full, ctx, args, (gy, gfinal))


def _ssd_bwd_launches(args) -> bool:
    return use_triton(args[0]) and _ssd_triton_takes(args[0], args[12])


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
    if pick(x):
        return triton_step().ssd_step_fwd(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit)
    return fresh_all(_ssd_step_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit))


register_step(ssd_step_op, _ssd_step_ref)


ssd_call = eager_caller(ssd_op, _ssd_setup, _ssd_bwd)
