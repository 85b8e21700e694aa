"""Activation checkpointing per block (train.activation_checkpointing), applied from outside after the
TP/SP, CP and PP plans:

    apply_activation_checkpointing(model)    # in place

Each residual block keeps only its inputs in the forward and recomputes its activations in the backward
(torch.utils.checkpoint, non-reentrant): activation memory drops from all of a block's intermediates to
one [B, L, d_model] pair per block, for about one extra forward. Non-reentrant checkpointing calls the
block again with the very same arguments (the context-parallel context `cp=` included), and it supports the
block's (hidden, residual, state) outputs.
"""
from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from megassm.models.blocks import Block

from .substitute import substitute

__all__ = ["apply_activation_checkpointing"]


class _CheckpointedBlock:
    """Mixin over Block: the forward runs under torch.utils.checkpoint."""

    def forward(self, *args, **kwargs):
        # the blocks draw no random numbers (no dropout): no RNG state to save and restore
        return checkpoint(super().forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


_CLASSES: dict = {}


def apply_activation_checkpointing(model: nn.Module, n_blocks: int = 0) -> nn.Module:
    """Checkpoint the residual blocks of `model` (a LanguageModel, possibly already parallel): every block, or
    with n_blocks > 0 the first n_blocks of those this rank holds (under PP: of its stages, as Megatron's
    recompute-num-layers), a memory knob between all and none at 1/len(blocks) of the recompute each. Each is
    replaced in `model.layers` (and in the pipeline stage modules that hold it) by a checkpointed variant
    holding the same submodules."""
    replaced = {}
    items = list(model.layers.items())
    for i, layer in items[:n_blocks] if n_blocks else items:
        if not isinstance(layer, Block):
            raise ValueError(f"activation checkpointing: {type(layer).__name__} is not a residual block")
        cls = type(layer)
        if issubclass(cls, _CheckpointedBlock):
            continue
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_CheckpointedBlock, cls), {})
        replaced[id(layer)] = substitute(model.layers, str(i), _CLASSES[cls])
    plan = getattr(model, "pp_plan", None)
    for stage in (plan.modules if plan is not None else ()):  # built before: they hold the blocks themselves
        for b, block in stage.layers.items():
            if id(block) in replaced:
                stage.layers[b] = replaced[id(block)]
    return model
