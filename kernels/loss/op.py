"""The LM head's cross-entropy as a custom op (megassm::cross_entropy): per-row fp32 losses and the log-sum-exp
the Triton backward reads, its fake and autograd registrations and the eager caller."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import (compute_dtype, eager_caller, first_on_triton, fresh_all, pick, reference_backward, restore,
                        save, traceable_backward, triton_module, use_triton)
from . import reference

triton_ce = triton_module("megassm.kernels.loss.triton_ce")  # cross_entropy_fwd / _bwd


# --------------------------------------------------------------------------------------------------------
# cross-entropy of the LM head: per-row fp32 losses (and the log-sum-exp the Triton backward reads)


def _ce_ref(logits, labels, ignore_index):
    # the op's outputs: the losses and each row's log-sum-exp (what the Triton backward reads)
    lse = torch.logsumexp(logits.detach().to(compute_dtype(logits)), dim=-1)
    return reference.cross_entropy(logits, labels, ignore_index), lse


@torch.library.custom_op("megassm::cross_entropy", mutates_args=())
def cross_entropy_op(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    if pick(logits):
        return triton_ce().cross_entropy_fwd(logits, labels, ignore_index)
    return fresh_all(_ce_ref(logits, labels, ignore_index))


@cross_entropy_op.register_fake
def _(logits, labels, ignore_index):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=compute_dtype(logits)), logits.new_empty(n, dtype=compute_dtype(logits))


def _ce_setup(ctx, inputs, output):
    save(ctx, inputs, output, keep_output=True)
    ctx.mark_non_differentiable(output[1])


def _ce_bwd(ctx, gloss, _glse):
    args, outs = restore(ctx)
    logits, labels, ignore_index = args
    if use_triton(logits):
        return triton_ce().cross_entropy_bwd(gloss, logits, labels, outs[1], ignore_index), None, None
    return reference_backward(_ce_ref, ctx, args, (gloss, None))


cross_entropy_op.register_autograd(traceable_backward("cross_entropy", _ce_bwd, first_on_triton),
                                   setup_context=_ce_setup)


cross_entropy_call = eager_caller(cross_entropy_op, _ce_setup, _ce_bwd)
