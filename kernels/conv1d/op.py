"""The causal conv's custom ops (megassm::causal_conv1d, megassm::causal_conv1d_step): fake and autograd
registrations and the eager caller. The decode step has a Triton forward only; its backward is the reference one."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dispatch import (compute_dtype, eager_caller, empty_f32, first_on_triton, fresh_all, pick, reference_backward,
                        register_step, restore, save, traceable_backward, triton_module, use_triton)
from ..grad_blocks import grad_block
from . import reference

triton_conv = triton_module("megassm.kernels.conv1d.triton_conv")  # causal_conv1d_fwd / _bwd, causal_conv1d_step_fwd


# --------------------------------------------------------------------------------------------------------
# causal conv1d


def _conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    out = reference.causal_conv1d(x, weight, bias, initial_state=initial_state, seq_idx=seq_idx,
                                  activation=activation, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, empty_f32(x)


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r} (expected 'silu' or None)")


@torch.library.custom_op("megassm::causal_conv1d", mutates_args=())
def causal_conv1d_op(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], activation: Optional[str], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if pick(x):
        y, fin = triton_conv().causal_conv1d_fwd(x, weight, bias, initial_state, seq_idx,
                                                    activation is not None, return_final_state)
        return y, (fin if return_final_state else empty_f32(x))
    return fresh_all(_conv_ref_full(x, weight, bias, initial_state, seq_idx, activation, return_final_state))


@causal_conv1d_op.register_fake
def _(x, weight, bias, initial_state, seq_idx, activation, return_final_state):
    b, _, c = x.shape
    w = weight.shape[-1]
    fin = x.new_empty((b, c, w - 1), dtype=compute_dtype(x)) if return_final_state else empty_f32(x)
    return x.new_empty(x.shape), fin


def _conv_bwd(ctx, gy, gfinal):
    args, _ = restore(ctx)
    x, weight, bias, init, seq_idx, activation, ret = args
    if use_triton(x):
        need = ctx.needs_input_grad
        dx, dw, db, dinit = triton_conv().causal_conv1d_bwd(
            x, weight, bias, init, seq_idx, activation is not None, gy, gfinal if ret else None,
            out_dx=grad_block(x) if need[0] else None)
        return (dx if need[0] else None, dw if need[1] else None, db if need[2] else None,
                dinit if need[3] else None, None, None, None)
    return reference_backward(_conv_ref_full, ctx, args, (gy, gfinal))


causal_conv1d_op.register_autograd(traceable_backward("causal_conv1d", _conv_bwd, first_on_triton),
                                   setup_context=save)


def _conv_step_ref(state, x, weight, bias, activation):
    y, new = reference.causal_conv1d_step(state, x, weight, bias, activation=activation)
    return y, new.contiguous()


@torch.library.custom_op("megassm::causal_conv1d_step", mutates_args=())
def causal_conv1d_step_op(
    state: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]
) -> tuple[Tensor, Tensor]:
    _check_activation(activation)
    if pick(x):
        return triton_conv().causal_conv1d_step_fwd(state, x, weight, bias, activation is not None)
    return fresh_all(_conv_step_ref(state, x, weight, bias, activation))


register_step(causal_conv1d_step_op, _conv_step_ref)


causal_conv1d_call = eager_caller(causal_conv1d_op, save, _conv_bwd)
