"""The trainer's side of parallelism, in one place so that trainer.py only calls these:

    groups, device = setup(cfg, device)          init torch.distributed from torchrun env + groups
    model = split_stages(model, groups, cfg)     PP: this rank's stages of the meta model
    model = prepare_model(model, groups, cfg)    TP/SP plan, CP plan, PP stages, activation checkpointing (on meta)
    loss_sum = pipeline_step(model, batches, autocast)   PP: one step's forward + backward (schedule)
    batch = local_batch(batch, groups)           CP: this rank's contiguous slice of every row
    finish_grads(model, groups, engine)          TP partial-grad sync, PP tied-embedding sum, CP gradient sum,
                                                 and the DP reduction the engine left (parallel/engines.py)
    clip_grad_norm(model, groups, max_norm)      norm of the canonical gradient (replicas counted once)
    mean_over_dp(x, groups)                      average a scalar tensor over data-parallel ranks
    model_state, optim_state = gather_states(model, optimizer, groups)   canonical (collective)
    load_states(model, optimizer, model_state, optim_state)   canonical states -> this rank's shards
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import comm
from .cp import allreduce_cp_grads, apply_context_parallel, local_slice
from . import pp as ppl
from .clipping import clip_grad_norm as clip_local
from .dp import allreduce_grads
from .state import ParallelGroups, build_groups, init_distributed, single_process_groups
from .tp import (apply_tensor_parallel, canonical_state_dict, clip_grad_norm_tp, load_canonical_optimizer_state,
                 load_canonical_state_dict, optimizer_state_to_canonical, plan_of, sync_tp_grads)

__all__ = ["setup", "split_stages", "prepare_model", "pipeline_step", "pipeline_eval", "local_batch", "sum_over_dp", "finish_grads",
           "clip_grad_norm", "mean_over_dp", "gather_states", "load_states", "backend", "barrier", "is_rank0"]


def setup(cfg, device: torch.device) -> tuple[ParallelGroups, torch.device]:
    p = cfg.parallel
    ws = int(os.environ.get("WORLD_SIZE", "1"))
    if ws == 1 and not dist.is_initialized():
        return single_process_groups(), device
    init_distributed(device.type, timeout_s=p.timeout_s)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return build_groups(tp=p.tp, cp=p.cp, pp=p.pp), device


def split_stages(model, groups: ParallelGroups, cfg):
    """PP: keep this rank's stages of the meta `model` (parallel/pp.py); the blocks kept carry their single-device
    names. No-op without PP."""
    if groups.pp > 1:
        ppl.split_model(model, groups.pp, groups.pp_rank, virtual=cfg.parallel.pp_virtual, group=groups.pp_group,
                        emb_group=groups.emb_group)
    return model


def prepare_model(model, groups: ParallelGroups, cfg):
    """The plans, in order: TP / SP, CP, PP stage modules, activation checkpointing. They change what modules
    compute and cut parameters, never read their values, so they run on the meta model before start-up
    allocates what each rank holds (training/startup.py)."""
    if groups.tp > 1:
        apply_tensor_parallel(model, groups.tp_group, sp=cfg.parallel.sp, overlap=cfg.parallel.tp_overlap)
    if groups.cp > 1:
        apply_context_parallel(model, groups.cp_group)
    if groups.pp > 1:
        ppl.apply_pipeline_parallel(model, schedule=cfg.parallel.pp_schedule)
    if cfg.train.activation_checkpointing:
        from .checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, cfg.train.activation_checkpointing_blocks,
                                       keep=cfg.train.activation_checkpointing_keep)
    return model


# the per-token tensors of a batch (sliced along the sequence under CP); per-row ones (e.g. BPTT `reset`) stay
_PER_TOKEN = ("tokens", "labels", "seq_idx")


def local_batch(batch: dict, groups: ParallelGroups) -> dict:
    """CP: this rank's contiguous slice of every row. Every CP rank of a data-parallel rank reads the same
    batch (the data pipeline is indexed by the DP rank only), so the slices tile the rows."""
    if groups.cp == 1:
        return batch
    return {k: local_slice(v, groups.cp_group) if k in _PER_TOKEN else v for k, v in batch.items()}


def pipeline_step(model, batches: list, autocast) -> torch.Tensor:
    """PP: forward + backward of the step's micro-batches; the sum of their losses on every rank."""
    return ppl.train_step(model, batches, autocast)


def pipeline_eval(model, batches: list, autocast) -> torch.Tensor:
    """PP: each batch's loss [len(batches)] (forward only) on every rank."""
    return ppl.eval_batch_losses(model, batches, autocast)


def finish_grads(model, groups: ParallelGroups, engine=None) -> None:
    """The gradient syncs after a step's backward: TP partial-gradient sum, PP tied-embedding sum, CP sum, then the
    engine's DP reduction. They are sums (and a DP average) of the same gradients, so any order gives the same
    values, except where a collective is still writing: the distributed optimizer's reduce-scatters, begun in
    the backward (engine.reduced_in_backward), write in place into the gradient buffer the TP sum reads, so they
    are waited for first. The TP sum is then right in this rank's slice, the only part its step reads: the TP
    peers' buffers share one layout, so their slices line up; the rest, not reduced over DP, is never read. Its
    reduce-scatter over DP x CP also sums the CP ranks (engine.sums_cp): no CP all-reduce then."""
    early = engine is not None and engine.reduced_in_backward
    if early:
        engine.reduce_grads()
    if groups.tp > 1:
        sync_tp_grads(model)
    if groups.pp > 1:  # tied embeddings: the first stage's and the last stage's copy summed
        ppl.sync_embedding_grads(model)
    if groups.cp > 1 and not (engine is not None and engine.sums_cp):
        # each CP rank holds the gradient of its own tokens' share of the global loss
        allreduce_cp_grads(list(model.parameters()), groups.cp_group)
    if engine is not None:  # the data-parallel engine: what its backward did not reduce (parallel/engines.py)
        if not early:
            engine.reduce_grads()
    elif groups.dp > 1:
        allreduce_grads(list(model.parameters()), groups.dp_group)


def clip_grad_norm(model, groups: ParallelGroups, max_norm: float) -> float:
    if ppl.pp_plan_of(model) is not None:  # norm over the stages (and TP inside each)
        return ppl.clip_grad_norm_pp(model, max_norm)
    if plan_of(model) is not None:
        return clip_grad_norm_tp(model, max_norm)
    return clip_local(model.parameters(), max_norm)


def sum_over_dp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    if groups.dp == 1:
        return x
    return comm.all_reduce(x.detach().clone(), groups.dp_group)


def mean_over_dp(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    if groups.dp == 1:
        return x
    return comm.all_reduce(x.detach().clone(), groups.dp_group) / groups.dp


def gather_states(model, optimizer, groups: ParallelGroups):
    """(model_state, optim_state) in the canonical layout, or (None, None) without TP (the checkpoint then
    takes model.state_dict() itself). Collective over the TP group: call on every rank."""
    if ppl.pp_plan_of(model) is not None:  # PP: the stages' states gathered to rank 0
        return ppl.gather_canonical_states(model, optimizer, groups)
    if plan_of(model) is None:
        if getattr(optimizer, "collective_state_dict", False):  # the distributed optimizer: gathered on every rank
            return None, optimizer.state_dict()
        return None, None
    return canonical_state_dict(model), optimizer_state_to_canonical(optimizer, model)


def load_states(model, optimizer, model_state: dict, optim_state: dict | None) -> None:
    """Canonical states (as read from a checkpoint) -> this rank's shards / stages."""
    if ppl.pp_plan_of(model) is not None:
        ppl.load_canonical_states(model, optimizer, model_state, optim_state)
        return
    load_canonical_state_dict(model, model_state)
    if optimizer is not None and optim_state is not None:
        load_canonical_optimizer_state(optimizer, model, optim_state)


def backend(group) -> str:
    """The backend of a process group ("nccl", "gloo"); "none" without torch.distributed (one process)."""
    return dist.get_backend(group) if dist.is_initialized() else "none"


def barrier(groups: ParallelGroups) -> None:
    if groups.world_size > 1:
        dist.barrier()


def is_rank0(groups: ParallelGroups) -> bool:
    return groups.rank == 0
