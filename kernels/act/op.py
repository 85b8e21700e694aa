"""swiglu's custom op (megassm::swiglu: silu(a) * b, the gated MLP's activation): fake and autograd
registrations and the eager caller."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import (eager_caller, first_on_triton, fresh, pick, reference_backward, restore, save,
                        traceable_backward, triton_module, use_triton)
from . import reference

triton_act = triton_module("megassm.kernels.act.triton_act")  # swiglu_fwd / _bwd


# --------------------------------------------------------------------------------------------------------
# swiglu: silu(a) * b (the gated MLP's activation)


@torch.library.custom_op("megassm::swiglu", mutates_args=())
def swiglu_op(a: Tensor, b: Tensor) -> Tensor:
    if pick(a):
        return triton_act().swiglu_fwd(a, b)
    return fresh(reference.swiglu(a, b))


@swiglu_op.register_fake
def _(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _swiglu_bwd(ctx, gout):
    args, _ = restore(ctx)
    a, b = args
    if use_triton(a):
        return triton_act().swiglu_bwd(gout, a, b)
    return reference_backward(reference.swiglu, ctx, args, (gout,))


swiglu_op.register_autograd(traceable_backward("swiglu", _swiglu_bwd, first_on_triton), setup_context=save)


swiglu_call = eager_caller(swiglu_op, save, _swiglu_bwd)
