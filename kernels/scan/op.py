"""The selective scan's custom ops (megassm::selective_scan, megassm::selective_scan_step; seed mixers S Mamba-1
and L Longhorn): fake and autograd registrations and the eager caller. The decode step has a Triton forward only;
its backward is the reference one."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dispatch import (compute_dtype, eager_caller, empty_f32, first_on_triton, fresh_all, pick, reference_backward,
                        register_step, restore, save, traceable_backward, triton_module, use_triton)
from . import reference

triton_scan = triton_module("megassm.kernels.scan.triton_scan")  # selective_scan_fwd / _bwd / _step_fwd


# --------------------------------------------------------------------------------------------------------
# selective scan (seed mixers S Mamba-1 and L Longhorn)


def _scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx,
                   return_final_state):
    out = reference.selective_scan(x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                   delta_softplus=delta_softplus, decay=decay, initial_state=initial_state,
                                   seq_idx=seq_idx, return_final_state=return_final_state)
    if return_final_state:
        return out
    return out, empty_f32(x)


@torch.library.custom_op("megassm::selective_scan", mutates_args=())
def selective_scan_op(
    x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
    delta_bias: Optional[Tensor], delta_softplus: bool, decay: str, initial_state: Optional[Tensor],
    seq_idx: Optional[Tensor], return_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if pick(x):
        y, fin = triton_scan().selective_scan_fwd(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay,
                                                     initial_state, seq_idx, return_final_state)
        return y, (fin if return_final_state else empty_f32(x))
    return fresh_all(_scan_ref_full(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state,
                                     seq_idx, return_final_state))


@selective_scan_op.register_fake
def _(x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay, initial_state, seq_idx, return_final_state):
    b, _, d = x.shape
    fin = x.new_empty((b, d, B.shape[-1]), dtype=compute_dtype(x)) if return_final_state else empty_f32(x)
    return x.new_empty(x.shape), fin


def _scan_bwd(ctx, gy, gfinal):
    args, _ = restore(ctx)
    x = args[0]
    if use_triton(x):
        (x, delta, A, B, C, D, z, delta_bias, softplus, decay, init, seq_idx, ret) = args
        grads = triton_scan().selective_scan_bwd(gy, gfinal if ret else None, x, delta, A, B, C, D, z, delta_bias,
                                                    softplus, decay, init, seq_idx)
        dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit = grads
        need = ctx.needs_input_grad
        keep = [g if need[i] else None for i, g in zip((0, 1, 2, 3, 4, 5, 6, 7, 10),
                                                        (dx, ddelta, dA, dB, dC, dD, dz, dbias, dinit))]
        return (*keep[:8], None, None, keep[8], None, None)
    return reference_backward(_scan_ref_full, ctx, args, (gy, gfinal))


selective_scan_op.register_autograd(traceable_backward("selective_scan", _scan_bwd, first_on_triton),
                                    setup_context=save)

def _scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay):
    return reference.selective_scan_step(state, x, delta, A, B, C, D=D, z=z, delta_bias=delta_bias,
                                         delta_softplus=delta_softplus, decay=decay)


@torch.library.custom_op("megassm::selective_scan_step", mutates_args=())
def selective_scan_step_op(
    state: Tensor, x: Tensor, delta: Tensor, A: Optional[Tensor], B: Tensor, C: Tensor, D: Optional[Tensor],
    z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool, decay: str,
) -> tuple[Tensor, Tensor]:
    if pick(x):
        return triton_scan().selective_scan_step_fwd(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                                        decay)
    return fresh_all(_scan_step_ref(state, x, delta, A, B, C, D, z, delta_bias, delta_softplus, decay))


register_step(selective_scan_step_op, _scan_step_ref)


selective_scan_call = eager_caller(selective_scan_op, save, _scan_bwd)
