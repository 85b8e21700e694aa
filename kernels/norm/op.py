"""The norms' custom ops (megassm::gated_rmsnorm, megassm::rmsnorm, megassm::add_rmsnorm): fake and autograd
registrations and the eager callers. rmsnorm is the gated kernel without a gate, in one group."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dispatch import (compute_dtype, eager_caller, first_on_triton, fresh, pick, reference_backward, restore, save,
                        traceable_backward, triton_module, use_triton)
from ..grad_blocks import grad_block
from . import reference

# gated_rmsnorm_fwd / _bwd, add_rmsnorm_fwd / _bwd, and the staged gated_rmsnorm_* (megassm.kernels)
triton_norm = triton_module("megassm.kernels.norm.triton_norm")


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
    if pick(x):
        return triton_norm().gated_rmsnorm_fwd(x, z, weight, ngroups, eps, norm_before_gate)
    out = _gated_ref(x, z, weight, ngroups, eps, norm_before_gate)
    return fresh(out.clone() if out is x else out)


@gated_rmsnorm_op.register_fake
def _(x, z, weight, ngroups, eps, norm_before_gate):
    return x.new_empty(x.shape)


def _gated_bwd(ctx, gout):
    args, _ = restore(ctx)
    x, z, weight, ngroups, eps, nbg = args
    if use_triton(x):
        dx, dz, dw = triton_norm().gated_rmsnorm_bwd(gout, x, z, weight, ngroups, eps, nbg,
                                                        out_dz=grad_block(z) if ctx.needs_input_grad[1] else None)
        return dx, dz, dw, None, None, None
    return reference_backward(_gated_ref, ctx, args, (gout,))


gated_rmsnorm_op.register_autograd(traceable_backward("gated_rmsnorm", _gated_bwd, first_on_triton),
                                   setup_context=save)


def _rmsnorm_ref(x, weight, eps, out_dtype):
    return reference.rmsnorm(x, weight, eps, out_dtype)


@torch.library.custom_op("megassm::rmsnorm", mutates_args=())
def rmsnorm_op(x: Tensor, weight: Optional[Tensor], eps: float, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    if pick(x):
        return triton_norm().gated_rmsnorm_fwd(x, None, weight, 1, eps, False, out_dtype=out_dtype)
    out = _rmsnorm_ref(x, weight, eps, out_dtype)
    return fresh(out.clone() if out is x else out)


@rmsnorm_op.register_fake
def _(x, weight, eps, out_dtype=None):
    return x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)


def _rmsnorm_bwd(ctx, gout):
    args, _ = restore(ctx)
    x, weight, eps, out_dtype = args
    if use_triton(x):  # the kernel reads gout in its own dtype and writes dx in x's
        dx, _, dw = triton_norm().gated_rmsnorm_bwd(gout, x, None, weight, 1, eps, False)
        return dx, dw, None, None
    return reference_backward(_rmsnorm_ref, ctx, args, (gout,))


rmsnorm_op.register_autograd(traceable_backward("rmsnorm", _rmsnorm_bwd, first_on_triton), setup_context=save)


def _add_ref(x, residual, weight, eps):
    return reference.add_rmsnorm(x, residual, weight, eps)


@torch.library.custom_op("megassm::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: float
                   ) -> tuple[Tensor, Tensor]:
    if pick(x):
        return triton_norm().add_rmsnorm_fwd(x, residual, weight, eps)
    out, res = _add_ref(x, residual, weight, eps)
    if res is x or res is residual:  # a custom op's outputs must not alias its inputs
        res = res.clone()
    if out is x:
        out = out.clone()
    return fresh(out), fresh(res)


@add_rmsnorm_op.register_fake
def _(x, residual, weight, eps):
    cdt = compute_dtype(x) if residual is None else torch.promote_types(compute_dtype(x), residual.dtype)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=cdt)


def _add_setup(ctx, inputs, output):
    save(ctx, inputs, output, keep_output=True)


def _add_bwd(ctx, gout, gres):
    args, outs = restore(ctx)
    x, residual, weight, eps = args
    if use_triton(x):
        new_res = outs[1]
        dx, dres, dw = triton_norm().add_rmsnorm_bwd(gout, gres, new_res, weight, eps, x.dtype,
                                                        None if residual is None else residual.dtype)
        need = ctx.needs_input_grad
        return dx if need[0] else None, dres if need[1] else None, dw if need[2] else None, None
    return reference_backward(_add_ref, ctx, args, (gout, gres))


add_rmsnorm_op.register_autograd(traceable_backward("add_rmsnorm", _add_bwd, first_on_triton),
                                 setup_context=_add_setup)


gated_rmsnorm_call = eager_caller(gated_rmsnorm_op, save, _gated_bwd)
rmsnorm_call = eager_caller(rmsnorm_op, save, _rmsnorm_bwd)
add_rmsnorm_call = eager_caller(add_rmsnorm_op, _add_setup, _add_bwd)
