"""Activation checkpointing per block (train.activation_checkpointing), applied from outside after the
TP/SP, CP and PP plans:

    apply_activation_checkpointing(model)    # in place

Each residual block keeps only its inputs in the forward and recomputes its activations in the backward
(torch.utils.checkpoint, non-reentrant): activation memory drops from all of a block's intermediates to
one [B, L, d_model] pair per block, for about one extra forward. Non-reentrant checkpointing calls the
block again with the very same arguments, and it supports the block's (hidden, residual, state) outputs. Under
context parallelism the recomputed mixers find their forward's exchange context by that same seq_idx tensor
(parallel/cp.py CPContexts), whatever forwards ran in between.

keep="sum" (`train.activation_checkpointing_keep=sum`): the block's residual add runs outside the checkpoint
and the checkpoint keeps only the fp32 sum (residual + hidden, what the block's fused add + norm computes
first), 4 bytes an element instead of the pair's 6 (bf16 hidden + fp32 residual) under bf16 autocast: a third
less of what checkpointing holds, which at long sequences is most of the activation memory. The values are the
same (the add is the same fp32 add; the norm then runs on the sum with its output in the hidden's dtype); the
cost is the add's own pass over [B, L, d_model] and the gradient's split into two tensors.
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from megassm.models.blocks import Block

from .substitute import substitute

__all__ = ["apply_activation_checkpointing"]


KEEP = ("pair", "sum")  # what a checkpointed block keeps: its (hidden, residual) inputs, or their fp32 sum


class _CheckpointedBlock:
    """Mixin over Block: the forward runs under torch.utils.checkpoint."""

    checkpoint_keep = "pair"

    def forward(self, hidden, residual, *args, **kwargs):
        # the blocks draw no random numbers (no dropout): no RNG state to save and restore
        if residual is None or self.checkpoint_keep == "pair":  # the first block: the embedding alone
            return checkpoint(super().forward, hidden, residual, *args, use_reentrant=False,
                              preserve_rng_state=False, **kwargs)
        summed = residual + hidden  # fp32: the fused add's sum; an add keeps nothing for its backward
        out, state = checkpoint(self.forward_summed, summed, hidden.dtype, *args, use_reentrant=False,
                                preserve_rng_state=False, **kwargs)
        return out, summed, state


_CLASSES: dict = {}


def apply_activation_checkpointing(model: nn.Module, n_blocks: int = 0, keep: str = "pair") -> nn.Module:
    """Checkpoint the residual blocks of `model` (a LanguageModel, possibly already parallel): every block, or
    with n_blocks > 0 the first n_blocks of those this rank holds (under PP: of its stages, as Megatron's
    recompute-num-layers), a memory knob between all and none at 1/len(blocks) of the recompute each. Each is
    replaced in `model.layers` (and in the pipeline stage modules that hold it) by a checkpointed variant
    holding the same submodules. `keep`: what each keeps (the module docstring)."""
    if keep not in KEEP:
        raise ValueError(f"activation checkpointing: keep must be one of {', '.join(KEEP)}, got {keep!r}")
    replaced = {}
    items = list(model.layers.items())
    for i, layer in items[:n_blocks] if n_blocks else items:
        if not isinstance(layer, Block):
            raise ValueError(f"activation checkpointing: {type(layer).__name__} is not a residual block")
        cls = type(layer)
        if issubclass(cls, _CheckpointedBlock):
            layer.checkpoint_keep = keep
            continue
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
        replaced[id(layer)] = substitute(model.layers, str(i), _CLASSES[cls], checkpoint_keep=keep)
    plan = getattr(model, "pp_plan", None)
    for stage in (plan.modules if plan is not None else ()):  # built before: they hold the blocks themselves
        for b, block in stage.layers.items():
            if id(block) in replaced:
                stage.layers[b] = replaced[id(block)]
    return model
