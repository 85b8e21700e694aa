"""Per-GPU memory estimate of a training layout, without a GPU and without real weights.

    est = estimate(cfg)            # dict: one entry per pipeline rank, components in bytes, the peak
    print(format_table(est))       # the table `megassm-train --dry-run` prints (and json.dumps(est))

Parameters are counted on meta-device models cut exactly as training cuts them: `parallel/pp.split_model`
for this pipeline rank's stages and `parallel/tp.apply_tensor_parallel` for its tensor-parallel shard (run
under torch's in-process "fake" process group, so nothing is communicated or allocated). The local sizes
of every mixer (heads, groups, MLP width, vocabulary slice) are then read off the sharded modules.

What counts, per GPU (docs/launch.md "Memory estimate" has the derivation and the comparison with the
measured peaks of docs/benchmarks.md):

  weights / grads / optimizer   bytes per parameter by engine (ENGINE_BYTES), divided over the
                                data-parallel ranks where ZeRO / FSDP2 shards them; one data-parallel rank
                                builds no engine (parallel/engines.py build_engine): priced as plain ddp
  buffers                       deepspeed: the gradient buckets of its ZeRO optimizer (`deepspeed_terms`)
  weight copies                 bf16 autocast casts of the matmul weights, saved for the backward; with
                                train.fp8 under one process / ddp, the FP8 operands of the FP8 Linears'
                                weights (2 bytes a parameter, the same as their autocast casts) are held
                                through the optimizer step too (training/fp8.py FP8WeightCache)
  activations                   the tensors each block saves for its backward, per token (`block_bytes`),
                                times tokens per micro-batch (micro_batch x seq_len / cp), times the
                                micro-batches a pipeline rank holds in flight (1F1B / GPipe / interleaved),
                                times train.bptt_windows; with activation checkpointing only each block's
                                inputs plus one block being recomputed
  head                          logits (bf16), their fp32 copy and the saved log-softmax of one micro-batch
                                (of one chunk with train.loss_chunk_tokens); with the fused loss of a bf16
                                run without tensor parallelism, the logits and their gradient
  peak                          the largest of: end of forward / start of backward, the backward sweep
                                (activations freed while gradients appear), the optimizer step

Not counted (they are outside torch.cuda.max_memory_allocated, which the benchmarks report): the CUDA
context (~0.5-1 GiB), allocator fragmentation (reserved exceeds allocated by a few %), NCCL buffers.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass

from megassm.config import Config, data_parallel_size, world_size
from megassm.models.registry import ActivationContext, block_kind

__all__ = ["ENGINE_BYTES", "engine_bytes", "deepspeed_zero_settings", "deepspeed_terms", "fsdp2_terms", "block_bytes", "head_bytes", "checkpointed_bytes", "inflight_microbatches",
           "rank_models", "estimate", "layout_warnings", "format_table", "to_json", "GiB", "GPU_MEMORY_GIB",
           "GPU_NAMES", "CONTEXT_GIB", "reserve_factor", "needed_gib", "fits"]

GiB = float(2 ** 30)

# bytes per parameter: (weights, grads, optimizer) and the ZeRO stage from which each is sharded over dp.
#   ddp       fp32 master weights used in place, fp32 grads, AdamW m + v (fp32); bf16 autocast makes
#             per-step bf16 copies of the matmul weights (counted as "weight copies")
#   deepspeed ZeRO's mixed precision: bf16 weights and grads, fp32 master copy + m + v in the optimizer
#             (2 + 2 + 12; the ZeRO paper's K = 12); no autocast copies (the weights are bf16 already).
#             Which DeepSpeed 0.19.8 buffer each is, and the buckets beside them: `deepspeed_terms`
#   fsdp2     the matmul weights (nn.Linear / nn.Embedding): fp32 shards, fp32 gradient shards and AdamW
#             states over dp (ZeRO-3); the small per-channel parameters: fp32 replicas with their own grads and
#             states (parallel/fsdp2.py FSDP2Engine; `fsdp2_terms`). Gathered weights in the all-gather dtype
#             (bf16 under bf16 training): the block being computed plus the prefetched ones (fsdp_reshard=block),
#             or the whole model (micro_batch, step: kept from the forward to the backward); with fp32
#             all-gathers under bf16 autocast, autocast's bf16 copies as under DDP. FSDP2 x TP: all of this for
#             the TP-local model (rank_models cuts it as training does), sharded over the dp ranks
ENGINE_BYTES = {
    "ddp": {"weights": 4, "grads": 4, "optimizer": 8},
    "deepspeed": {"weights": 2, "grads": 2, "optimizer": 12},
    "fsdp2": {"weights": 4, "grads": 4, "optimizer": 8},
}


def engine_bytes(engine: str, zero_stage: int, bf16: bool, dp: int) -> dict:
    """Bytes per local parameter of weights, grads and optimizer states, after sharding over `dp` ranks."""
    b = dict(ENGINE_BYTES[engine])
    if engine == "deepspeed" and not bf16:  # fp32 training: fp32 weights / grads, no master copy
        # (but ZeRO 1/2 clone their fp32 partition of the flat fp32 weights all the same: 4 + 8)
        b = {"weights": 4, "grads": 4, "optimizer": 12 if zero_stage in (1, 2) else 8}
    stage = 3 if engine == "fsdp2" else zero_stage
    if stage >= 1:
        b["optimizer"] /= dp
    if stage >= 2:
        b["grads"] /= dp
    if stage >= 3:
        b["weights"] /= dp
    return b


# DeepSpeed 0.19.8's defaults for the zero_optimization keys the estimate reads (runtime/zero/config.py)
_DS_ZERO_DEFAULTS = {"overlap_comm": None, "contiguous_gradients": True, "reduce_bucket_size": int(5e8),
                     "stage3_prefetch_bucket_size": int(5e7), "stage3_max_live_parameters": int(1e9),
                     "sub_group_size": int(1e9)}


def deepspeed_zero_settings(cfg: Config, bf16: bool) -> dict:
    """The zero_optimization keys of the DeepSpeed JSON this run would get (parallel/deepspeed_engine.py
    `deepspeed_config`, the partial parallel.deepspeed_config merged), DeepSpeed's defaults for those it lacks."""
    from megassm.parallel.deepspeed_engine import deepspeed_config

    zero = deepspeed_config(cfg, bf16).get("zero_optimization", {})
    out = {k: zero.get(k, v) for k, v in _DS_ZERO_DEFAULTS.items()}
    if out["overlap_comm"] is None:  # DeepSpeed: on for stage 3 only
        out["overlap_comm"] = cfg.parallel.zero_stage == 3
    return out


def deepspeed_terms(n: int, dp: int, stage: int, bf16: bool, zero: dict, biggest_block: int = 0) -> dict:
    """Bytes per GPU of DeepSpeed 0.19.8 (`deepspeed.initialize` with our torch AdamW as the client optimizer) for
    `n` parameters over `dp` ranks; `zero`: deepspeed_zero_settings. lp: the model's dtype (bf16 mode: 2; 4 in
    fp32). Keys: weights, grads (held through the micro-batches of a step), optimizer, buckets (the gradient
    buckets, held through the backward), gather (ZeRO-3's gathered weights), boundary_grads (ZeRO-1: the
    partition's gradients that appear in the last micro-batch's backward), step_grads (the gradients at the
    optimizer step, which replace `grads` there).

    stage 0, bf16 (engine.py DDP_BFLOAT16 -> fp16/unfused_optimizer.py FP16_UnfusedOptimizer: our AdamW is no
        DeepSpeed FusedAdam): the model's bf16 weights and .grad (accumulated, all-reduced at the boundary),
        fp32 masters per parameter (fp32_groups) + AdamW m, v; at the step an fp32 copy of every gradient;
        fp32: no wrapper, our AdamW on the fp32 model
    stage 1, 2 (zero/stage_1_and_2.py DeepSpeedZeroOptimizer; our bf16 config accumulates in bf16, so no
        grad_accum buffer): the model's weights are views of bit16_groups_flat (lp n); the fp32 partition
        single_partition_of_fp32_groups (4 n / dp, a clone even in fp32) + AdamW m, v on it (8 n / dp).
        Gradients: ZeRO-1 keeps every parameter's own .grad (lp n), accumulated over the micro-batches and
        reduced only in the last one's backward, where each is copied into a bucket and, for this rank's
        partition, into grads_in_partition (lp n / dp) as the buckets fill (boundary_grads); ZeRO-2 reduces
        every micro-batch's and keeps grads_in_partition only. Buckets (setup_buckets): contiguous_gradients
        -> reduce_bucket_size elements of lp, twice with overlap_comm (ZeRO-1: from the first backward of a
        step to the last; ZeRO-2: each backward). Step (DeepSpeedZeroOptimizer.step): grads_in_partition, its
        flat copy and that copy in fp32, 2 lp + 4 bytes per partition element (lp = 4: the .to(fp32) is no copy)
    stage 3 (zero/stage3.py DeepSpeedZeroOptimizer_Stage3): lp n / dp partitioned weights, the block being
        computed plus up to stage3_prefetch_bucket_size prefetched elements gathered (capped at
        stage3_max_live_parameters), grad_partitions_flat_buffer (lp n / dp), fp32 partitions + AdamW
        (12 n / dp), one reduce bucket of reduce_bucket_size (contiguous_gradients, allocated at start-up);
        step, per sub-group of sub_group_size elements: the flat gradients and their fp32 copy.
    Not counted: parameters under stage3_param_persistence_threshold kept whole (norms, biases: <0.1% of a
    7B model), the straddling parameters grads_in_partition holds whole (at most two per parameter group),
    the reduce / reduce-scatter temporaries and the all-gather of the step (bucket-sized or in place)."""
    lp = 2 if bf16 else 4
    b = engine_bytes("deepspeed", stage, bf16, dp)
    shard = n / dp
    out = {"weights": b["weights"] * n, "grads": b["grads"] * n, "optimizer": b["optimizer"] * n,
           "buckets": 0.0, "gather": 0.0, "boundary_grads": 0.0, "step_grads": b["grads"] * n}
    if stage == 0:
        if bf16:
            out["step_grads"] = (lp + 4) * n  # FP16_UnfusedOptimizer.step: fp32_param.grad = grad.to(fp32)
        return out
    bucket = zero["reduce_bucket_size"] if zero["contiguous_gradients"] else 0
    if stage in (1, 2):
        out["buckets"] = float(lp * bucket * (2 if zero["overlap_comm"] else 1))
        out["step_grads"] = (2 * lp + (4 if lp != 4 else 0)) * shard
        if stage == 1:
            out["boundary_grads"] = lp * shard
        return out
    out["buckets"] = float(lp * bucket)
    live = min(biggest_block + zero["stage3_prefetch_bucket_size"], zero["stage3_max_live_parameters"], n)
    out["gather"] = float(lp * max(live, biggest_block))
    out["step_grads"] = out["grads"] + (lp + (4 if lp != 4 else 0)) * min(zero["sub_group_size"], shard)
    return out


def fsdp2_terms(model, dp: int, gather_bytes: int, reshard: str, prefetch: int,
                grad_sync: str = "micro_batch") -> dict:
    """Bytes per GPU of the fsdp2 engine's states for `model` (a meta model as the engine sees it: TP-sharded
    under FSDP2 x TP, whose local tensors FSDP2 shards over the dp ranks; under HSDP `dp` is the shard group's
    size, parallel.shard_size): the matmul
    weights sharded over dp (fp32 weights and gradients, AdamW m + v), the other parameters whole on every
    rank; `gather`: the weights all-gathered at once (gather_bytes each), the blocks in flight under
    reshard=block (the current one plus `prefetch`, the last block kept, the head with the root), the whole
    model under micro_batch / step. grad_sync=step (parallel.fsdp_grad_sync): the matmul weights' gradients
    accumulate unsharded in fp32 until the step's last backward reduce-scatters them (`unsharded_grads`, added to
    the gradients)."""
    from megassm.parallel.fsdp2 import sharded_params

    def matmul_numel(mod) -> int:
        return sum(q.numel() for q in sharded_params(mod))

    total = sum(q.numel() for q in model.parameters())
    sharded = matmul_numel(model)
    replicated = total - sharded
    shard = -(-sharded // dp)
    per_block = [matmul_numel(layer) for layer in model.layers]
    head = matmul_numel(model.lm_head) if model.lm_head is not None else 0
    emb = model.embedding.weight.numel() if model.embedding is not None else 0
    if reshard == "block":
        live = sorted(per_block, reverse=True)[:1 + prefetch] + ([per_block[-1]] if per_block else [])
        gather = gather_bytes * (sum(live) + head)
    else:
        gather = gather_bytes * (sum(per_block) + head)
    if model.lm_head is None:  # tied: the root's embedding, gathered in fp32 for the lookup and the head
        gather += 4 * emb
    elif reshard != "block":  # the untied embedding: its own fp32 unit, kept with the rest
        gather += 4 * emb
    unsharded = 4 * sharded if grad_sync == "step" else 0
    return {"weights": 4 * shard + 4 * replicated, "grads": 4 * shard + 4 * replicated + unsharded,
            "optimizer": 8 * shard + 8 * replicated, "gather": gather, "sharded": sharded, "replicated": replicated,
            "unsharded_grads": unsharded}


# ----------------------------------------------------------------------------------------------------
# activations per token, per block kind, from the block's local (TP-sharded) sizes
# ----------------------------------------------------------------------------------------------------
def block_bytes(block, a: int, cfg: Config, *, sp_tp: int = 1, cp: int = 1, seq_len: int = 0,
                doc_mask: bool = True) -> dict:
    """Bytes per token a block saves for its backward: {"stream": residual-stream tensors (sequence
    shards under SP: divide by sp_tp), "local": the mixer's own (already the TP shard)}. `a` is the
    activation dtype size (2 under bf16 autocast, 4 in fp32). `block` is a (possibly TP-sharded) Block."""
    d = cfg.model.d_model
    # fused add + RMSNorm saves its input x (the previous mixer's output), the new fp32 residual and its
    # output (the mixer's input, saved again by the first projection: the same tensor)
    stream = (2 * a + 4) * d
    kind = block_kind(block.kind)
    if kind.activation_bytes is None:
        raise ValueError(f"memory estimate: no activation model for block letter {block.kind!r}")
    extra = a * d if sp_tp > 1 else 0  # SP: the all-gathered mixer input is saved by the first projection
    # the kind's own tensors (models/registry.py `activation_bytes`, in the mixer's file)
    ctx = ActivationContext(cfg=cfg.model, sp_tp=sp_tp, cp=cp, seq_len=seq_len, doc_mask=doc_mask)
    local, more_stream = kind.activation_bytes(block.mixer, a, ctx)
    return {"stream": stream + more_stream, "local": local + extra}


def head_bytes(vocab_local: int, a: int, fused: bool = False) -> int:
    """Per token, on the last stage: the logits, their fp32 copy for the loss and the saved log-softmax; with
    the fused Triton loss (kernels/loss/triton_ce.py: a GPU run without the vocab-parallel head) the logits, kept
    for the backward, and their gradient."""
    return 2 * a * vocab_local if fused else (a + 8) * vocab_local


def checkpointed_bytes(a: int, d: int, sp_tp: int = 1, keep: str = "pair") -> int:
    """Per token and block under activation checkpointing: the block's inputs (hidden + fp32 residual), or with
    train.activation_checkpointing_keep=sum their fp32 sum alone (parallel/checkpointing.py)."""
    return (4 if keep == "sum" else a + 4) * d // sp_tp


def inflight_microbatches(schedule: str, pp: int, virtual: int, rank: int, n_micro: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at once, in units of the rank's full
    per-micro-batch activations (an interleaved virtual stage holds 1/virtual of them)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(n_micro)
    if virtual == 1:  # 1F1B: pp - rank forwards before the first backward
        return float(min(pp - rank, n_micro))
    # interleaved 1F1B (torch.distributed.pipelining's warm-up): chunk-micro-batches in flight
    rounds = max(1, n_micro // pp)
    per_round = n_micro // rounds
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), n_micro * virtual)
    return (warmup + 1) / virtual


# ----------------------------------------------------------------------------------------------------
# the models, cut as training cuts them
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _fake_tp_group(tp: int):
    """A process group of `tp` ranks that never communicates (torch's in-process fake backend), for
    running the real TP plan on a meta model."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


_RANK_MODELS: dict = {}  # (model config, vocab, tp, sp, pp, virtual) -> the meta models; callers only read them


def rank_models(cfg: Config, vocab: int) -> list:
    """One meta-device model per pipeline rank, split into that rank's stages and TP-sharded as rank 0 of
    its TP group (every TP rank holds the same sizes). Cached (the layout planner asks for the same cuts many times):
    the models are shared, read only."""
    p = cfg.parallel
    key = (repr(cfg.model), vocab, p.tp, p.sp, p.pp, p.pp_virtual)
    if key not in _RANK_MODELS:
        if len(_RANK_MODELS) > 64:
            _RANK_MODELS.clear()
        _RANK_MODELS[key] = _rank_models(cfg, vocab)
    return _RANK_MODELS[key]


def _rank_models(cfg: Config, vocab: int) -> list:
    from megassm.models import build_model
    from megassm.parallel import pp as ppl
    from megassm.parallel.tp import apply_tensor_parallel

    p = cfg.parallel
    models = []
    for r in range(p.pp):
        m = build_model(cfg.model, vocab_size=vocab, device="meta")
        if p.pp > 1:
            ppl.split_model(m, p.pp, r, virtual=p.pp_virtual)
        if p.tp > 1:
            with _fake_tp_group(p.tp) as g:
                apply_tensor_parallel(m, g, sp=p.sp)
        models.append(m)
    return models


def _fp8_params(model) -> int:
    """Parameters of the Linears train.fp8 computes in FP8 (training/fp8.py `fp8_plan`)."""
    from megassm.training.fp8 import fp8_plan

    return sum(model.get_submodule(name).weight.numel() for name in fp8_plan(model)[0])


def _matmul_params(model) -> int:
    """Parameters that bf16 autocast casts for a matmul (Linear weights and the head); the embedding lookup,
    norms, conv and per-head parameters stay fp32."""
    from torch import nn

    n = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, nn.Linear))
    plan = getattr(model, "pp_plan", None)
    last = plan is None or plan.last
    if model.lm_head is None and last and model.embedding is not None:  # tied: the head casts the embedding
        n += model.embedding.weight.numel()
    return n


@dataclass
class _Block:
    kind: str
    params: int
    matmul: int
    act: float  # bytes of one micro-batch's saved activations (full, no checkpointing)


# ----------------------------------------------------------------------------------------------------
# the estimate
# ----------------------------------------------------------------------------------------------------
def estimate(cfg: Config, vocab: int | None = None, bf16: bool | None = None, doc_mask: bool | None = None,
             fused_loss: bool | None = None) -> dict:
    """Per-GPU memory of the layout in `cfg` (see the module docstring). `vocab`: the tokenizer's vocabulary
    when model.vocab_size is unset (default 257, the byte tokenizer); `bf16`: autocast (default: the
    config's precision, `auto` meaning a GPU run); `doc_mask`: whether the batches pack several documents
    per row so attention takes its masked path (default model.attn.doc_mask); `fused_loss`: whether the loss
    runs the fused Triton cross-entropy (default: a bf16 run without tensor parallelism; False prices the
    eager loss, as peaks measured before 2026-12-06 ran it)."""
    from torch import nn

    m, t, p = cfg.model, cfg.train, cfg.parallel
    vocab = m.vocab_size or vocab or 257
    if bf16 is None:
        bf16 = t.precision in ("auto", "bf16")
    a = 2 if bf16 else 4
    if doc_mask is None:
        doc_mask = m.attn.doc_mask
    if fused_loss is None:  # bf16 is a GPU run (Triton kernels); tp == 1 keeps the whole head on the rank
        fused_loss = bf16 and p.tp == 1
    ws = world_size(cfg)
    dp = data_parallel_size(cfg)
    accum = t.global_batch // (t.micro_batch * dp)
    tokens = t.micro_batch * t.seq_len // p.cp  # per micro-batch on one rank
    sp_tp = p.tp if p.sp else 1
    # one data-parallel rank: build_engine builds no engine whatever parallel.engine says (plain fp32 stepping),
    # except the distributed optimizer (ddp, zero_stage=1), which shards over DP x CP (parallel/distopt.py): also
    # at DP 1, over the CP ranks
    distopt = p.engine == "ddp" and p.zero_stage == 1 and dp * p.cp > 1
    engine, stage = (p.engine, p.zero_stage) if dp > 1 or distopt else ("ddp", 0)
    eb = engine_bytes(engine, stage, bf16, dp * p.cp if distopt else dp)
    gather_dtype = None  # fsdp2: bytes of a gathered weight element
    if engine == "fsdp2":
        gather_dtype = 2 if bf16 and p.fsdp_param_dtype != "fp32" else 4
    zero = deepspeed_zero_settings(cfg, bf16) if engine == "deepspeed" else None
    autocast_copies = bf16 and (engine == "ddp" or gather_dtype == 4)
    windows = t.bptt_windows if t.bptt else 1
    grads_accumulate = accum > 1 or p.pp > 1 or windows > 1
    # the distributed optimizer's fp32 gradient buffer is allocated once and held for the whole run
    grads_held = grads_accumulate or distopt

    ranks = []
    for r, model in enumerate(rank_models(cfg, vocab)):
        plan = getattr(model, "pp_plan", None)
        last = plan is None or plan.last
        blocks = []
        for layer in model.layers:
            bb = block_bytes(layer, a, cfg, sp_tp=sp_tp, cp=p.cp, seq_len=t.seq_len, doc_mask=doc_mask)
            per_tok = bb["stream"] / sp_tp + bb["local"]
            blocks.append(_Block(layer.kind, sum(q.numel() for q in layer.parameters()),
                                 sum(mod.weight.numel() for mod in layer.modules() if isinstance(mod, nn.Linear)),
                                 per_tok * tokens))
        n_params = sum(q.numel() for q in model.parameters())
        n_matmul = _matmul_params(model)
        vocab_local = model.vocab_size_padded // p.tp
        head_tokens = tokens  # the logits of one micro-batch, or of one chunk (train.loss_chunk_tokens)
        if t.loss_chunk_tokens:
            head_tokens = min(tokens, max(1, t.loss_chunk_tokens // t.micro_batch) * t.micro_batch * sp_tp)
        head = head_bytes(vocab_local, a, fused=fused_loss) * head_tokens if last else 0.0
        inflight = inflight_microbatches(p.pp_schedule, p.pp, p.pp_virtual, r, accum) * windows

        weights = eb["weights"] * n_params
        grads = eb["grads"] * n_params
        optim = eb["optimizer"] * n_params
        step_grads = grads
        copies = 2.0 * n_matmul if autocast_copies else 0.0
        gather = buffers = boundary_grads = 0.0
        if gather_dtype is not None:
            ft = fsdp2_terms(model, p.shard_size or dp, gather_dtype, p.fsdp_reshard, p.fsdp_prefetch,
                             p.fsdp_grad_sync)
            weights, grads, optim, gather = ft["weights"], ft["grads"], ft["optimizer"], ft["gather"]
            step_grads = grads
            eb = dict(eb, grads=grads / max(n_params, 1))  # per-block gradient shares below
        elif distopt:  # its flat buffers, parameters and fp32 gradients, padded per bucket (the reduce-scatter and
            # the all-gather run in place in them: no transient); AdamW on 1/(dp x cp) of the elements
            from megassm.parallel.distopt import plan_buckets

            per = max(1, int(p.bucket_mb * 2 ** 20) // 4)
            padded = sum(size for _, size in plan_buckets([q.numel() for q in model.parameters()][::-1],
                                                          dp * p.cp, per))
            weights, grads = eb["weights"] * padded, eb["grads"] * padded
            step_grads = grads
        elif zero is not None:
            ds = deepspeed_terms(n_params, dp, stage, bf16, zero, max((b.params for b in blocks), default=0))
            weights, grads, optim, gather = ds["weights"], ds["grads"], ds["optimizer"], ds["gather"]
            buffers, boundary_grads, step_grads = ds["buckets"], ds["boundary_grads"], ds["step_grads"]

        # the timeline: forward end, then the backward block by block (last first), then the optimizer step
        # which of this rank's blocks recompute (train.activation_checkpointing_blocks: the first N; 0: all)
        n_ck = (t.activation_checkpointing_blocks or len(blocks)) if t.activation_checkpointing else 0
        ac = [k < n_ck for k in range(len(blocks))]
        ck = checkpointed_bytes(a, m.d_model, sp_tp, t.activation_checkpointing_keep) * tokens
        saved = [(ck if ac[k] else b.act) * inflight for k, b in enumerate(blocks)]
        cast = [2.0 * b.matmul if autocast_copies else 0.0 for b in blocks]
        block_grads = [eb["grads"] * b.params for b in blocks]
        other_grads = grads - sum(block_grads)  # embedding, final norm, head
        held_grads = grads if grads_held else 0.0
        # forward end: every block's saved tensors, the bf16 casts (autocast's cache holds them through the
        # forward even under checkpointing), the loss of the last micro-batch
        fwd_end = sum(saved) + copies + head + held_grads
        head_bwd = sum(saved) + copies + head + (grads if grads_held else other_grads)
        act_peak = max(fwd_end, head_bwd)
        # deepspeed ZeRO-1, the last micro-batch's backward: the gradients of the parameters done so far (the
        # head's, then block by block) have moved into the buckets, and once a bucket filled, this rank's
        # partition of them into grads_in_partition (boundary_grads); the others are still the accumulated ones
        emb = model.embedding.weight.numel() if model.embedding is not None else 0
        done = n_params - sum(b.params for b in blocks) - emb  # the head and final norm: their grads come first
        lp = grads / max(n_params, 1)
        for k in range(len(blocks) - 1, -1, -1):  # backward of block k
            live = sum(saved[:k + 1])
            if ac[k]:  # block k recomputed: its activations and its weights cast again
                live += blocks[k].act + cast[k]
            # the casts of the blocks not yet done that were not recomputed are still saved
            live += sum(c for c, r in zip(cast[:k + 1], ac) if not r)
            if boundary_grads:
                held = lp * (n_params - done) if grads_accumulate else 0.0
                last = live + held + (boundary_grads if done >= zero["reduce_bucket_size"] else 0.0)
                act_peak = max(act_peak, last)
                done += blocks[k].params
                if not grads_accumulate:  # one micro-batch per step: it is the last one
                    continue
            live += grads if grads_held else other_grads + sum(block_grads[k:])
            act_peak = max(act_peak, live)
        act_report = sum(saved) + max((b.act for b, r in zip(blocks, ac) if r), default=0.0)
        step_peak = weights + step_grads + optim  # optimizer step: every gradient and state
        if t.fp8 and engine == "ddp":  # FP8WeightCache: kept between steps, so present at the optimizer step
            step_peak += 2.0 * _fp8_params(model)
        peak = max(weights + optim + act_peak + gather + buffers, step_peak)
        sizes = {"weights": weights, "grads": grads, "optimizer": optim, "weight_copies": copies,
                 "activations": act_report, "head": head, "gather": gather, "buffers": buffers, "peak": peak}
        ranks.append({"pp_rank": r, "blocks": "".join(b.kind for b in blocks), "params": n_params,
                      "inflight_microbatches": inflight, **{k: int(round(v)) for k, v in sizes.items()}})
    worst = max(ranks, key=lambda x: x["peak"])
    return {
        "world_size": ws, "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp, "sp": p.sp,
        "engine": p.engine, "zero_stage": p.zero_stage, "precision": "bf16" if bf16 else "fp32",
        "shard_size": (p.shard_size or dp) if engine == "fsdp2" else 0, "fsdp_grad_sync": p.fsdp_grad_sync,
        "micro_batch": t.micro_batch, "seq_len": t.seq_len, "accumulation": accum,
        "activation_checkpointing": t.activation_checkpointing,
        "activation_checkpointing_blocks": t.activation_checkpointing_blocks, "doc_mask": doc_mask, "vocab": vocab,
        "tokens_per_microbatch_per_gpu": tokens,
        "ranks": ranks,
        "peak_per_gpu": worst["peak"], "peak_per_gpu_gib": round(worst["peak"] / GiB, 2),
        "worst_pp_rank": worst["pp_rank"],
    }


GPU_MEMORY_GIB = {"H100 80GB": 79.1, "H200 141GB": 139.8}  # what torch reports as total memory
# the cards a job can be checked against (`--gpu` of `megassm-train --dry-run` and `megassm-launch`)
GPU_NAMES = {"h100-80gb": "H100 80GB", "h200-141gb": "H200 141GB"}
CONTEXT_GIB = 1.0  # CUDA context and NCCL's own buffers, outside max_memory_allocated


def reserve_factor(cfg: Config) -> float:
    """The reserved peak over the allocated one the estimate predicts, by engine (docs/benchmarks.md "Memory estimate
    accuracy"): ~1.09 for our engines (hybrid-7b FSDP2 69.5 / 63.9, TP 2 x ZeRO-1 64.9 / 62.7); DeepSpeed's bucket
    churn leaves more cached: ZeRO-1 83.66 / 71.89 = 1.16, ZeRO-3 65.6 / 55.85 = 1.17 (4 x H100 / H200)."""
    return 1.18 if cfg.parallel.engine == "deepspeed" else 1.09


def needed_gib(cfg: Config, est: dict) -> float:
    """What a GPU must hold for this layout: the estimated peak times the engine's reserve factor (what the caching
    allocator keeps beside it), plus the CUDA context."""
    return est["peak_per_gpu"] / GiB * reserve_factor(cfg) + CONTEXT_GIB


def fits(cfg: Config, est: dict, card: str) -> bool:
    """Whether the layout's `needed_gib` stays under the memory of `card` (a GPU_MEMORY_GIB key)."""
    return needed_gib(cfg, est) < GPU_MEMORY_GIB[card]


def layout_warnings(cfg: Config, est: dict, gpu: str | None = None) -> list[str]:
    """Legal but costly layouts: pipeline stages out of balance, a pipeline with fewer micro-batches than
    stages, a peak that no GPU of GPU_MEMORY_GIB holds. `gpu`: the card the job is checked against (a
    GPU_MEMORY_GIB key); the fit to that card is then the caller's refusal, not a warning, and no fit warning is
    given here."""
    p = cfg.parallel
    out = []
    if p.pp > 1:
        params = [r["params"] for r in est["ranks"]]
        if max(params) > 1.25 * min(params):
            out.append(f"pipeline stages out of balance: parameters per pipeline rank "
                       f"{', '.join(f'{x / 1e6:.0f}M' for x in params)} (max/min {max(params) / min(params):.2f}); "
                       "move the '|' cuts in model.pattern or drop them to balance by parameters")
        n = est["accumulation"]
        if n < p.pp:
            bubble = (p.pp - 1) / (n + p.pp - 1)
            out.append(f"{n} micro-batch(es) per step for {p.pp} pipeline stages: the pipeline idles "
                       f"{100 * bubble:.0f}% of the step; raise train.global_batch or lower train.micro_batch "
                       f"(micro-batches per step = global_batch / (micro_batch x dp))")
    if gpu is not None:
        return out
    f = reserve_factor(cfg)
    held = [name for name in GPU_MEMORY_GIB if fits(cfg, est, name)]
    if not held:
        out.append(f"estimated peak {est['peak_per_gpu_gib']:.1f} GiB per GPU does not fit "
                   f"{' or '.join(GPU_MEMORY_GIB)} (with the allocator's cached memory, x{f:.2f} for "
                   f"parallel.engine={cfg.parallel.engine}, and ~1 GiB of CUDA context): "
                   "raise parallel.tp / parallel.pp, shard states (parallel.engine=fsdp2 or deepspeed zero_stage), "
                   "turn on train.activation_checkpointing or lower train.micro_batch")
    elif len(held) < len(GPU_MEMORY_GIB):
        out.append(f"estimated peak {est['peak_per_gpu_gib']:.1f} GiB per GPU fits only {' and '.join(held)} (with "
                   f"the allocator's cached memory, x{f:.2f} for parallel.engine={cfg.parallel.engine})")
    return out


def _ac_words(est: dict) -> str:
    if not est["activation_checkpointing"]:
        return "off"
    n = est.get("activation_checkpointing_blocks", 0)
    return f"on for the first {n} blocks of each stage" if n else "on"


def _hsdp_words(est: dict) -> str:
    words = ""
    if est.get("shard_size") and est["shard_size"] < est["dp"]:
        words += f" (HSDP: shard {est['shard_size']} x replicate {est['dp'] // est['shard_size']})"
    if est.get("engine") == "fsdp2" and est.get("fsdp_grad_sync") == "step":
        words += " (gradients synced once per step: unsharded fp32 sums held)"
    return words


def format_table(est: dict) -> str:
    """The estimate as a fixed-width table, GiB per GPU, one row per pipeline rank."""
    cols = [("weights", "weights"), ("grads", "grads"), ("optimizer", "optim"), ("weight_copies", "bf16 copies"),
            ("activations", "activations"), ("head", "logits/loss"), ("gather", "gathered"), ("buffers", "buffers"),
            ("peak", "PEAK")]
    head = f"{'pp rank':>7} {'blocks':>6} {'params':>9} " + " ".join(f"{h:>11}" for _, h in cols)
    lines = [
        f"# memory per GPU (GiB): world {est['world_size']} = tp {est['tp']} x cp {est['cp']} x pp {est['pp']} x "
        f"dp {est['dp']}{' (+SP)' if est['sp'] else ''}; engine {est['engine']}{_hsdp_words(est)} "
        f"zero_stage {est['zero_stage']}; "
        f"{est['precision']}; micro-batch {est['micro_batch']} x {est['seq_len']} tokens"
        f"{'' if est['cp'] == 1 else ' (%d per GPU)' % est['tokens_per_microbatch_per_gpu']}, accumulation "
        f"{est['accumulation']}; activation checkpointing {_ac_words(est)}",
        head,
    ]
    for r in est["ranks"]:
        lines.append(f"{r['pp_rank']:>7} {len(r['blocks']):>6} {r['params'] / 1e6:>8.1f}M " +
                     " ".join(f"{r.get(k, 0) / GiB:>11.2f}" for k, _ in cols))
    lines.append(f"# peak {est['peak_per_gpu_gib']:.2f} GiB per GPU (pipeline rank {est['worst_pp_rank']}); "
                 "allocated bytes as torch.cuda.max_memory_allocated counts them: add the CUDA context "
                 "(~1 GiB), NCCL buffers and allocator slack (docs/launch.md)")
    return "\n".join(lines)


def to_json(est: dict) -> str:
    """One JSON line (bytes as integers, `peak_per_gpu_gib` rounded)."""
    return json.dumps(est)
