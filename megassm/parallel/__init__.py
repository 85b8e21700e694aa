"""megassm.parallel: parallel plans applied from outside to the single-device model.

    state.py   process groups (megatron.core.parallel_state, gloo or nccl)
    tp.py      tensor (+ sequence) parallel plan: apply_tensor_parallel, grad sync / norm, canonical state
    layers.py  row-parallel linear, vocab-parallel embedding and cross-entropy, TP regions
    sp.py      sequence-parallel gather / reduce-scatter
    cp.py      context parallel plan: apply_context_parallel (chunk states passed between ranks)
    pp.py      pipeline parallelism: split_model, apply_pipeline_parallel, train_step (torch.distributed.pipelining)
    checkpointing.py  per-block activation checkpointing: apply_activation_checkpointing
    engine_base.py  the data-parallel engines' base (Engine); engines.py torch DDP and the choice
               (parallel.engine); fsdp2.py torch FSDP2; deepspeed_engine.py DeepSpeed ZeRO; distopt.py ZeRO-1
    dp.py      flat data-parallel gradient all-reduce (DDP's path under PP and multi-window BPTT)
    comm.py    counted collectives
See docs/parallelism.md.
"""
from .cp import apply_context_parallel  # noqa: F401
from .pp import apply_pipeline_parallel, split_model  # noqa: F401
from .state import ParallelGroups, build_groups, init_distributed  # noqa: F401
from .tp import (  # noqa: F401
    apply_tensor_parallel,
    canonical_state_dict,
    clip_grad_norm_tp,
    load_canonical_optimizer_state,
    load_canonical_state_dict,
    optimizer_state_to_canonical,
    sync_tp_grads,
)
