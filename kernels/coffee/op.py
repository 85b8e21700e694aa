"""COFFEE's custom op (megassm::coffee_scan): the recurrence with its read-out fused (seed mixer C,
solver=sequential), its fake and autograd registrations and the eager caller."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dispatch import (compute_dtype, eager_caller, empty_f32, first_on_triton, fresh, pick, reference_backward,
                        restore, save, traceable_backward, triton_module, use_triton)
from . import reference

triton_coffee = triton_module("megassm.kernels.coffee.triton_coffee")  # coffee_scan_fwd / _bwd, SEGMENT


# --------------------------------------------------------------------------------------------------------
# COFFEE recurrence + read-out (seed mixer C, solver=sequential)


@torch.library.custom_op("megassm::coffee_scan", mutates_args=())
def coffee_scan_op(v: Tensor, lam: Tensor, w: Tensor, C: Tensor, w_out: Optional[Tensor], x0: Optional[Tensor],
                   seq_idx: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(y, final state, checkpoints): the Triton kernel's segment checkpoints are an output so that the
    backward (which recomputes from them) can save them; the reference returns an empty one."""
    if pick(v):
        return triton_coffee().coffee_scan_fwd(v, lam, w, C, w_out, x0, seq_idx)
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return fresh(y), fresh(fin), empty_f32(v)


@coffee_scan_op.register_fake
def _(v, lam, w, C, w_out, x0, seq_idx):
    b, L, d = v.shape
    n = lam.shape[-1]
    cdt = compute_dtype(v)
    nseg = -(-L // triton_coffee().SEGMENT) if use_triton(v) else 0
    ck = v.new_empty((b, nseg, d, n), dtype=cdt) if nseg else empty_f32(v)
    return v.new_empty((b, L, d), dtype=cdt), v.new_empty((b, d, n), dtype=cdt), ck


def _coffee_setup(ctx, inputs, output):
    save(ctx, inputs, (output[2],), keep_output=True)  # the checkpoints only (y is not needed)


def _coffee_ref_full(v, lam, w, C, w_out, x0, seq_idx):
    y, fin = reference.coffee_scan(v, lam, w, C, w_out, x0, seq_idx)
    return y, fin, empty_f32(v)


def _coffee_bwd(ctx, gy, gfin, gck):
    args, outs = restore(ctx)
    v = args[0]
    if use_triton(v):
        (v, lam, w, C, w_out, x0, seq_idx) = args
        dv, dlam, dw, dC, dwo, dx0 = triton_coffee().coffee_scan_bwd(gy, gfin, v, lam, w, C, w_out, seq_idx, outs[0])
        need = ctx.needs_input_grad
        grads = (dv, dlam.to(lam.dtype), dw.to(w.dtype), dC.to(C.dtype),
                 dwo.to(w_out.dtype) if dwo is not None else None, dx0.to(x0.dtype) if x0 is not None else None)
        return (*[g if need[i] else None for i, g in enumerate(grads)], None)
    return reference_backward(_coffee_ref_full, ctx, args, (gy, gfin, gck))


coffee_scan_op.register_autograd(traceable_backward("coffee_scan", _coffee_bwd, first_on_triton),
                                 setup_context=_coffee_setup)


coffee_scan_call = eager_caller(coffee_scan_op, _coffee_setup, _coffee_bwd)
