"""train.compile=true: torch.compile over each residual block's forward, the glue between the kernels.

    compile_blocks(model)    # in place, after the TP / CP / PP / activation-checkpointing plans

What it fuses is the PyTorch code between our kernels: the in-projection's split, the gates and activations,
the residual add of the MLP and attention blocks, the reshapes and casts. The kernels themselves (SSD, the
causal conv, the gated norms, cross-entropy) are `torch.library` custom ops with fake implementations
(kernels/<op>/op.py): each stays one opaque op inside the graph, never traced into.

Each block's bound `forward` is replaced by its compiled version, as torchtitan compiles per transformer block:
the module tree, the parameter names and so the checkpoints are unchanged, and the hooks an engine puts on the
block (FSDP2's all-gather and reshard, DDP's) stay outside the graph. Blocks of one kind share one compiled
graph (torch inlines the module: the parameters are graph inputs, not constants), so a 48-block model compiles
about once per block kind and input shape, not 48 times.

Where it is faster is measured, not assumed: docs/benchmarks.md "torch.compile" gives tokens/s with and without
on one H100, and the option stays off by default until a measurement says otherwise.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["compile_blocks", "RECOMPILE_LIMIT"]

log = logging.getLogger(__name__)

# Every block calls the same Block.forward code: its compiled variants (one per block kind x input shape x
# options such as return_state) count against one recompile limit, 8 by default in torch. Past the limit torch
# runs the block eagerly with only a warning; a hybrid with three block kinds and an evaluation shape reaches 8.
RECOMPILE_LIMIT = 64


def compile_blocks(model: nn.Module) -> int:
    """Compile the forward of every residual block in `model.layers` (those this rank holds); returns how many."""
    import torch._dynamo as dynamo

    if dynamo.config.cache_size_limit < RECOMPILE_LIMIT:
        dynamo.config.cache_size_limit = RECOMPILE_LIMIT
    n = 0
    for block in model.layers.values():
        # the instance attribute shadows the class's forward; nn.Module.__call__ -> _call_impl -> self.forward
        block.forward = torch.compile(block.forward)
        n += 1
    log.info("train.compile: torch.compile over the forward of %d blocks (the glue between the kernels)", n)
    return n
