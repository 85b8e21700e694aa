"""Data-parallel engines (`parallel.engine`): how gradients meet across data-parallel ranks, how the
optimizer steps, and how the states reach the canonical checkpoint.

    engine = build_engine(cfg, model, groups, device)      # after the TP/CP/PP plans, before the optimizer
    optimizer = engine.make_optimizer(lambda: build_optimizer(model.param_groups(wd), cfg.optim, dev))
    for i in range(accum):
        with engine.micro_batch(last=i == accum - 1):
            out = engine.forward(tokens, seq_idx=..., labels=...)
            engine.backward(out.loss, accum)
    engine.reduce_grads()                                  # what the engine did not reduce in the backward
    norm = engine.clip_and_step(max_norm, check)           # clip, check (raises / declines), optimizer step

  ddp        torch DistributedDataParallel over the DP group: bucketed all-reduce overlapped with the
             backward; accumulation under no_sync(). Under PP (the schedule runs the stage modules) and BPTT
             with several windows per backward (DDP wants one forward per backward), and under
             train.cuda_graph (DDP's hooks cannot be replayed), the gradients are averaged after the step's
             backward by bucketed all-reduces (parallel/dp.py) instead (logged). parallel.zero_stage=1 replaces
             DDP with the distributed optimizer (parallel/distopt.py, Megatron's): gradients reduce-scattered
             into an fp32 buffer the engine owns, AdamW on this rank's slice, parameters all-gathered (the bytes
             of one all-reduce), the AdamW states sharded over DP, with cp > 1 over DP x CP (also at DP 1, over
             the CP ranks); composes with TP, CP, PP, BPTT and CUDA graphs.
  fsdp2      torch fully_shard per residual block + the root: the matmul weights, their gradients and
             AdamW states sharded over the DP group (ZeRO-3), all-gathered in bf16 under bf16 training
             (MixedPrecisionPolicy; no autocast weight casts), gradients reduce-scattered in fp32 after every
             micro-batch's backward; the small per-channel parameters stay fp32 replicas (FSDP2Engine).
             With tp > 1 (and sp), FSDP2 x TP: the TP plan first, then fully_shard over the DP group of
             each TP rank's local tensors (fsdp2_tp.py). pp = cp = 1.
  deepspeed  DeepSpeed ZeRO stage parallel.zero_stage (0-3) with our AdamW as its client optimizer and a
             config derived from ours (deepspeed_config): batch triad, bf16, clipping, stage; a JSON partial
             (parallel.deepspeed_config) may add other keys (offload, buckets) but never the derived ones.
             DeepSpeed clips and steps; bf16 keeps bf16 weights with fp32 masters (DeepSpeed's own mixed
             precision). tp = pp = cp = 1, no BPTT.

The engines live in engine_base.py (the base), engines.py (ddp, the choice), distopt.py, fsdp2.py and
deepspeed_engine.py.
Checkpoints stay canonical for every engine (the single-device state dict and AdamW state): FSDP2 through
torch.distributed.checkpoint's full state dicts, DeepSpeed through its fp32-fragment API. A run saved with
one engine resumes with another, or at another DP size.
With one data-parallel rank no engine is needed and none is built (plain single-device stepping), except the
distributed optimizer with CP (over the CP ranks).
"""
from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from megassm.config import Config, ConfigError, data_parallel_size

from .engine_base import Engine
from .state import ParallelGroups

log = logging.getLogger("megassm.parallel.engines")

__all__ = ["check_engine", "build_engine", "DDPEngine"]


def check_engine(cfg: Config) -> None:
    """Refuse engine layouts that are not built, before any model is built or a GPU is touched."""
    p = cfg.parallel
    if p.engine == "ddp" and p.zero_stage > 1:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} with parallel.engine=ddp: ddp shards the AdamW states "
                          "(zero_stage=1, parallel/distopt.py) but not gradients or weights; use parallel.engine=fsdp2 "
                          "or deepspeed for ZeRO-2/3")
    if p.engine == "fsdp2" and p.zero_stage != 0:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} applies to parallel.engine=deepspeed or ddp "
                          "(stage 1); with parallel.engine=fsdp2 leave it 0 (fsdp2 always shards parameters, "
                          "gradients and optimizer states)")
    if p.engine != "deepspeed" and p.deepspeed_config:
        raise ConfigError(f"parallel.deepspeed_config={p.deepspeed_config} needs parallel.engine=deepspeed")
    from .deepspeed_engine import load_partial

    if data_parallel_size(cfg) == 1 or p.engine == "ddp":
        if p.engine == "deepspeed" and p.deepspeed_config:
            load_partial(p.deepspeed_config)  # a broken partial fails now, not at the first DP run
        return
    if p.engine == "fsdp2":  # FSDP2 x TP (parallel/fsdp2_tp.py); not with pipeline or context parallelism
        others = [f"parallel.{k}={getattr(p, k)}" for k in ("pp", "cp") if getattr(p, k) > 1]
        if others:
            raise ConfigError(
                f"parallel.engine=fsdp2 with {', '.join(others)}: the fsdp2 engine shards over the data-parallel "
                "group of a data-parallel or tensor-parallel (parallel.tp, with or without parallel.sp) layout only "
                "in this version; use parallel.engine=ddp (parallel.zero_stage=1 shards the AdamW states) with "
                "pipeline / context parallelism (docs/parallelism.md, 'Engines')")
    else:
        others = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp") if getattr(p, k) > 1]
        if others:
            raise ConfigError(
                f"parallel.engine={p.engine} with {', '.join(others)}: the {p.engine} engine shards over the data-"
                "parallel group of a pure data-parallel layout only in this version; use parallel.engine=ddp with "
                "tensor / context / pipeline parallelism, or parallel.engine=fsdp2 with tensor parallelism "
                "(docs/parallelism.md, 'Engines')")
    if p.engine == "deepspeed":
        if cfg.train.bptt:
            raise ConfigError("parallel.engine=deepspeed with train.bptt=true: the BPTT carrier runs its own "
                              "backward through several windows, which DeepSpeed's engine.backward does not "
                              "take; use parallel.engine=ddp or fsdp2 for BPTT")
        try:
            import deepspeed  # noqa: F401
        except ImportError as e:
            raise ConfigError("parallel.engine=deepspeed but DeepSpeed is not installed "
                              "(pip install 'megassm[deepspeed]')") from e
        if p.deepspeed_config:
            load_partial(p.deepspeed_config)


# ----------------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------------


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, model, groups, cfg, device):
        super().__init__(model, groups, cfg)
        self.overlapped = groups.pp == 1 and not cfg.train.bptt and not cfg.train.cuda_graph
        if not self.overlapped:
            why = ("pipeline stages run by the schedule" if groups.pp > 1 else "BPTT windows share one backward"
                   if cfg.train.bptt else "the micro-batches are CUDA graph replays (train.cuda_graph)")
            log.info("engine ddp: %s; gradients averaged over the %d DP ranks by bucketed all-reduces "
                     "after the step's backward (no overlap)", why, groups.dp)
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The gradients live in DDP's buckets (gradient_as_bucket_view) for good: defined before DDP is built, it
        # turns them into bucket views, and the steps zero them in place. Freed to None after a step instead,
        # the next step's no_sync micro-batches would accumulate into fresh tensors beside the buckets: two
        # copies of every gradient until the last micro-batch (a TP 2 x DDP 7B layout ran out of memory so).
        with torch.no_grad():
            for q in model.parameters():
                if q.requires_grad and q.grad is None:
                    q.grad = torch.zeros_like(q)
        self.grads_to_none = False
        # the model has no buffers to keep in sync; torch >= 2.13 names the switch forward_sync_buffers
        buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})
        self.module = DDP(model, process_group=groups.dp_group, **buffers,
                          gradient_as_bucket_view=True, bucket_cap_mb=cfg.parallel.bucket_mb,
                          device_ids=[device.index] if device.type == "cuda" else None)
        log.info("engine ddp: torch DistributedDataParallel over %d DP ranks, %g MB buckets, all-reduce "
                 "overlapped with the backward", groups.dp, cfg.parallel.bucket_mb)

    def micro_batch(self, last: bool):
        if self.overlapped and not last:
            return self.module.no_sync()  # accumulate locally; the last micro-batch's backward reduces
        return contextlib.nullcontext()

    def reduce_grads(self) -> None:
        if not self.overlapped:
            super().reduce_grads()


def build_engine(cfg: Config, model, groups: ParallelGroups, device: torch.device, bf16: bool) -> Engine:
    """The engine of parallel.engine for this model (after the TP / CP / PP plans and activation
    checkpointing). One data-parallel rank: the plain Engine whatever the setting (logged), except the distributed
    optimizer with CP, which shards over the CP ranks."""
    check_engine(cfg)
    name = cfg.parallel.engine
    if name == "ddp" and cfg.parallel.zero_stage == 1 and groups.dp * groups.cp > 1:
        from .distopt import DistOptEngine

        return DistOptEngine(model, groups, cfg, device)  # over DP x CP: also at DP 1, over the CP ranks
    if groups.dp == 1:
        if name != "ddp" or cfg.parallel.zero_stage:
            log.info("parallel.engine=%s (zero_stage %d) with one data-parallel rank: nothing to shard; plain "
                     "stepping", name, cfg.parallel.zero_stage)
        return Engine(model, groups, cfg)
    if name == "ddp":
        return DDPEngine(model, groups, cfg, device)
    if name == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(model, groups, cfg, device, bf16)
    from .deepspeed_engine import DeepSpeedEngine

    return DeepSpeedEngine(model, groups, cfg, device, bf16)
