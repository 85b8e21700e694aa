"""Data-parallel engines (`parallel.engine`): how gradients meet across data-parallel ranks, how the
optimizer steps, and how the states reach the canonical checkpoint.

    engine = build_engine(cfg, model, groups, device)      # after the TP/CP/PP plans, before the optimizer
    optimizer = engine.make_optimizer(lambda: build_optimizer(model.param_groups(wd), cfg.optim, dev))
    for i in range(accum):
        with engine.micro_batch(last=i == accum - 1):
            out = engine.forward(tokens, seq_idx=..., labels=...)
            engine.backward(out.loss, accum)
    engine.reduce_grads()                                  # what the engine did not reduce in the backward
    norm = engine.clip_and_step(max_norm, check)           # clip, check (raises), optimizer step

  ddp        torch DistributedDataParallel over the DP group: bucketed all-reduce overlapped with the
             backward; accumulation under no_sync(). Under PP (the schedule runs the stage modules) and BPTT
             with several windows per backward (DDP wants one forward per backward), and under
             train.cuda_graph (DDP's hooks cannot be replayed), the gradients are averaged after the step's
             backward by one flat all-reduce per dtype instead (logged). parallel.zero_stage=1 shards the
             AdamW states over the DP group (parallel/zero.py: Megatron's distributed optimizer), composing
             with TP, CP, PP, BPTT and CUDA graphs.
  fsdp2      torch fully_shard per residual block + the root: the matmul weights, their gradients and
             AdamW states sharded over the DP group (ZeRO-3), all-gathered in bf16 under bf16 training
             (MixedPrecisionPolicy; no autocast weight casts), gradients reduce-scattered in fp32 after every
             micro-batch's backward; the small per-channel parameters stay fp32 replicas (FSDP2Engine).
             tp = pp = cp = 1.
  deepspeed  DeepSpeed ZeRO stage parallel.zero_stage (0-3) with our AdamW as its client optimizer and a
             config derived from ours (deepspeed_config): batch triad, bf16, clipping, stage; a JSON partial
             (parallel.deepspeed_config) may add other keys (offload, buckets) but never the derived ones.
             DeepSpeed clips and steps; bf16 keeps bf16 weights with fp32 masters (DeepSpeed's own mixed
             precision). tp = pp = cp = 1, no BPTT.

Checkpoints stay canonical for every engine (the single-device state dict and AdamW state): FSDP2 through
torch.distributed.checkpoint's full state dicts, DeepSpeed through its fp32-fragment API. A run saved with
one engine resumes with another, or at another DP size.
With one data-parallel rank no engine is needed and none is built (plain single-device stepping).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os

import torch

from megassm.config import Config, ConfigError, data_parallel_size

from .dp import allreduce_grads
from .state import ParallelGroups

log = logging.getLogger("megassm.parallel.engines")

__all__ = ["check_engine", "deepspeed_config", "build_engine", "Engine", "DDPEngine", "FSDP2Engine",
           "DeepSpeedEngine", "DERIVED_DEEPSPEED_KEYS", "fsdp_param_dtype"]

# keys of the DeepSpeed config that come from the megassm config only (a partial may not set them)
DERIVED_DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                          "gradient_clipping", "bf16", "fp16", "zero_optimization.stage", "optimizer",
                          "scheduler")


def check_engine(cfg: Config) -> None:
    """Refuse engine layouts that are not built, before any model is built or a GPU is touched."""
    p = cfg.parallel
    if p.engine == "ddp" and p.zero_stage > 1:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} with parallel.engine=ddp: ddp shards the AdamW states "
                          "(zero_stage=1, parallel/zero.py) but not gradients or weights; use parallel.engine=fsdp2 "
                          "or deepspeed for ZeRO-2/3")
    if p.engine == "fsdp2" and p.zero_stage != 0:
        raise ConfigError(f"parallel.zero_stage={p.zero_stage} applies to parallel.engine=deepspeed or ddp "
                          "(stage 1); with parallel.engine=fsdp2 leave it 0 (fsdp2 always shards parameters, "
                          "gradients and optimizer states)")
    if p.engine != "deepspeed" and p.deepspeed_config:
        raise ConfigError(f"parallel.deepspeed_config={p.deepspeed_config} needs parallel.engine=deepspeed")
    if data_parallel_size(cfg) == 1 or p.engine == "ddp":
        if p.engine == "deepspeed" and p.deepspeed_config:
            _load_partial(p.deepspeed_config)  # a broken partial fails now, not at the first DP run
        return
    others = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "cp") if getattr(p, k) > 1]
    if others:
        raise ConfigError(
            f"parallel.engine={p.engine} with {', '.join(others)}: the {p.engine} engine shards over the data-"
            "parallel group of a pure data-parallel layout only in this version; use parallel.engine=ddp with "
            "tensor / context / pipeline parallelism (docs/parallelism.md, 'Engines')")
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
            _load_partial(p.deepspeed_config)


# ----------------------------------------------------------------------------------------------------
# DeepSpeed config
# ----------------------------------------------------------------------------------------------------


def _load_partial(path: str) -> dict:
    try:
        with open(path) as f:
            partial = json.load(f)
    except OSError as e:
        raise ConfigError(f"parallel.deepspeed_config: cannot read {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"parallel.deepspeed_config: {path}:{e.lineno}:{e.colno}: {e.msg}") from e
    if not isinstance(partial, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object, not {type(partial).__name__}")
    for key in DERIVED_DEEPSPEED_KEYS:
        head, _, tail = key.partition(".")
        node = partial.get(head)
        if (tail and isinstance(node, dict) and tail in node) or (not tail and head in partial):
            raise ConfigError(
                f"parallel.deepspeed_config: {path} sets '{key}', which megassm derives from its own config "
                "(train.global_batch / micro_batch, train.grad_clip, train.precision, parallel.zero_stage, optim.*); "
                "remove it there and set the megassm key instead")
    return partial


def _write_json_atomic(obj: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def deepspeed_config(cfg: Config, bf16: bool) -> dict:
    """The DeepSpeed JSON for this run, derived from the megassm config (never kept by hand): the batch
    triad, bf16, clipping, the ZeRO stage, plus the keys of the optional partial parallel.deepspeed_config."""
    t, p = cfg.train, cfg.parallel
    dp = data_parallel_size(cfg)
    zero = {"stage": p.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)}
    if p.zero_stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(5e8), stage3_param_persistence_threshold=int(1e5))
    out = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.global_batch // (t.micro_batch * dp),
        "gradient_clipping": float(t.grad_clip),
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 2 ** 31 - 1,  # megassm logs the metrics
        "wall_clock_breakdown": False,
    }
    if p.deepspeed_config:
        out = _merge(out, _load_partial(p.deepspeed_config))
    return out


# ----------------------------------------------------------------------------------------------------
# Engines
# ----------------------------------------------------------------------------------------------------


class Engine:
    """No data parallelism beyond what the other plans do (DP = 1), and the base of the engines: forward
    through the module, backward of loss / accum, clip over the canonical gradient, optimizer step."""

    name = "none"

    def __init__(self, model, groups: ParallelGroups, cfg: Config):
        self.model = model  # the (planned) model: parameters, names, param_groups
        self.module = model  # what the forward runs through
        self.groups = groups
        self.cfg = cfg
        self.optimizer = None

    def make_optimizer(self, build):
        self.optimizer = build()
        return self.optimizer

    def micro_batch(self, last: bool):
        return contextlib.nullcontext()

    def release(self) -> None:
        """Drop what an engine holds beyond a step (FSDP2: weights gathered by an evaluation forward)."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        (loss / accum).backward()

    def reduce_grads(self) -> None:
        """The DP part of the gradient sync that the backward did not do (after the TP / PP / CP syncs)."""
        if self.groups.dp > 1:
            allreduce_grads(list(self.model.parameters()), self.groups.dp_group)

    def clip_and_step(self, max_norm: float, check) -> float:
        """Clip to max_norm (norm of the canonical gradient), call check(norm) (which raises on a non-finite
        loss or norm; the step is then skipped), step the optimizer, zero the gradients. Returns the norm."""
        from .runtime import clip_grad_norm

        norm = clip_grad_norm(self.model, self.groups, max_norm)
        try:
            check(norm)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=self.grads_to_none)
            raise
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.grads_to_none)
        return norm

    # after a step the gradients are freed (None) unless they live in buffers the engine keeps (DDP's buckets)
    grads_to_none = True

    # canonical checkpoint states: (None, None) = the trainer's TP/PP/plain path handles them
    handles_states = False

    def gather_states(self):
        return None, None

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        raise NotImplementedError


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, model, groups, cfg, device):
        super().__init__(model, groups, cfg)
        self.flat = None
        if cfg.parallel.zero_stage == 1:  # before DDP: the parameters become views of the flat buffers
            from .zero import FlatParams

            self.flat = FlatParams(model.parameters(), groups.dp_group)
        self.overlapped = groups.pp == 1 and not cfg.train.bptt and not cfg.train.cuda_graph
        if not self.overlapped:
            why = ("pipeline stages run by the schedule" if groups.pp > 1 else "BPTT windows share one backward"
                   if cfg.train.bptt else "the micro-batches are CUDA graph replays (train.cuda_graph)")
            log.info("engine ddp: %s; gradients averaged over the %d DP ranks by one flat all-reduce per dtype "
                     "after the step's backward (no overlap)", why, groups.dp)
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        # The gradients live in DDP's buckets (gradient_as_bucket_view) for good: defined before DDP is built, it
        # turns them into bucket views, and the steps zero them in place. Freed to None after a step instead,
        # the next step's no_sync micro-batches would accumulate into fresh tensors beside the buckets: two
        # copies of every gradient until the last micro-batch (the TP 2 x ZeRO-1 7B layout ran out of memory so).
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

    def make_optimizer(self, build):
        self.optimizer = build()
        if self.flat is not None:  # ZeRO-1: AdamW over this rank's slice only
            from .zero import ShardedAdamW

            self.optimizer = ShardedAdamW(self.optimizer, self.flat)
        return self.optimizer

    def micro_batch(self, last: bool):
        if self.overlapped and not last:
            return self.module.no_sync()  # accumulate locally; the last micro-batch's backward reduces
        return contextlib.nullcontext()

    def reduce_grads(self) -> None:
        if not self.overlapped:
            super().reduce_grads()


# the blocks whose matmul weights FSDP2 may gather in bf16: their Linear weights are consumed by F.linear
# only (the seed mixers read some of theirs inside their own kernels, which take them as DDP gives them: fp32)
_BF16_GATHER_KINDS = ("M", "*", "-")


def _matmul_param_ids(module) -> set:
    """Parameters of the nn.Linear / nn.Embedding modules under `module` (TP's parallel layers included):
    the ones FSDP2 shards. Everything else (norm weights, A_log, dt_bias, D, conv weights and biases) is
    small and stays an fp32 replica on every DP rank."""
    from torch import nn

    return {id(p) for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding))
            for p in m.parameters(recurse=False)}


class FSDP2Engine(Engine):
    """torch fully_shard (FSDP2) over the DP group: one unit per residual block, the untied embedding its own
    unit, the root (head) last. The matmul weights (nn.Linear / nn.Embedding) are sharded: fp32 shards, fp32
    AdamW states, and with bf16 training they are all-gathered in bf16 (MixedPrecisionPolicy param_dtype,
    parallel.fsdp_param_dtype), so no per-op autocast cast and no autocast weight cache exist; their gradients
    are reduce-scattered in parallel.fsdp_reduce_dtype (fp32 by default) after every micro-batch's backward
    into fp32 shards. The small per-channel parameters (norms, A_log, dt_bias, D, conv) are left out of FSDP
    (ignored_params): fp32 replicas that the kernels read in fp32 as under DDP, their gradients averaged by one
    flat all-reduce per step. Block inputs are not cast (cast_forward_inputs=False): the residual stream stays
    fp32. parallel.fsdp_prefetch blocks ahead are all-gathered explicitly in forward and backward (the forward
    reads seq_idx on the host at attention blocks, so the CPU cannot be relied on to run ahead)."""

    name = "fsdp2"
    handles_states = True

    def __init__(self, model, groups, cfg, device, bf16: bool = False):
        super().__init__(model, groups, cfg)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        p = cfg.parallel
        mesh = DeviceMesh.from_group(groups.dp_group, device.type)
        gather = fsdp_param_dtype(p.fsdp_param_dtype, bf16)
        reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[p.fsdp_reduce_dtype]
        low = MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=reduce, cast_forward_inputs=False)
        full = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce if gather is not None else None,
                                    cast_forward_inputs=False)
        sharded = _matmul_param_ids(model)
        self.replicated = [q for q in model.parameters() if id(q) not in sharded]
        ignored = set(self.replicated)
        layers = list(model.layers)
        fp32_kinds = sorted({layer.kind for layer in layers if layer.kind not in _BF16_GATHER_KINDS})
        for i, layer in enumerate(layers):
            mp = low if layer.kind in _BF16_GATHER_KINDS else full
            # the last block's backward comes right after its forward: keep it gathered
            fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=ignored,
                        reshard_after_forward=p.fsdp_reshard == "block" and i < len(layers) - 1)
        tied = model.lm_head is None
        if not tied:  # the lookup reads fp32 rows, as under DDP (autocast leaves embeddings alone)
            fully_shard(model.embedding, mesh=mesh, mp_policy=full, ignored_params=ignored,
                        reshard_after_forward=p.fsdp_reshard == "block")
        # the root: the head (bf16 matmul) or, tied, the embedding itself (gathered fp32: the lookup reads it,
        # the head's matmul casts it under autocast)
        fully_shard(model, mesh=mesh, mp_policy=full if tied else low, ignored_params=ignored)
        k = p.fsdp_prefetch
        if k > 0:
            for i, layer in enumerate(layers):
                if i + 1 < len(layers):
                    layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + k])
                if i > 0:
                    layer.set_modules_to_backward_prefetch(layers[max(0, i - k):i][::-1])
        self.reshard = p.fsdp_reshard
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        n_local = sum(q.to_local().numel() for q in model.parameters() if id(q) in sharded)
        n_rep = sum(q.numel() for q in self.replicated)
        log.info("engine fsdp2: fully_shard per block%s + root over %d DP ranks: %.2fM sharded parameter elements "
                 "on this rank (fp32 shards and AdamW states), all-gathered in %s, gradients reduce-scattered in %s "
                 "every micro-batch; %.3fM small parameters (norms, A_log, dt_bias, D, conv) kept as fp32 replicas, "
                 "all-reduced once per step; gathered weights freed after each %s; prefetch %d block(s)%s", "" if tied else
                 " + embedding", groups.dp, n_local / 1e6, "bf16" if gather is not None else "fp32", p.fsdp_reduce_dtype
                 if gather is not None else "fp32", n_rep / 1e6, {"block": "block's forward and backward",
                 "micro_batch": "micro-batch's backward", "step": "step's last backward"}[p.fsdp_reshard], k,
                 f"; blocks {', '.join(fp32_kinds)} gathered in fp32 (their kernels read some weights directly)"
                 if fp32_kinds and gather is not None else "")

    def make_optimizer(self, build):
        """AdamW over the canonical groups, each split in two: the sharded (DTensor) parameters and the fp32
        replicas (torch's fused / foreach AdamW takes no mix of DTensors and plain tensors in one call)."""
        from torch.distributed.tensor import DTensor

        base = build()
        name_of = {id(q): n for n, q in self.model.named_parameters()}
        self._canonical = [({k: v for k, v in g.items() if k != "params"}, [name_of[id(q)] for q in g["params"]])
                           for g in base.param_groups]
        groups = []
        for g in base.param_groups:
            opts = {k: v for k, v in g.items() if k != "params"}
            for want in (True, False):
                params = [q for q in g["params"] if isinstance(q, DTensor) == want]
                if params:
                    groups.append({**opts, "params": params})
        accepted = inspect.signature(torch.optim.AdamW).parameters
        self.optimizer = torch.optim.AdamW(groups, **{k: v for k, v in base.defaults.items() if k in accepted})
        return self.optimizer

    def micro_batch(self, last: bool):
        if self.reshard == "step":  # keep the gathered weights for the step's next micro-batch, free after the last
            for unit in self.units:
                unit.set_reshard_after_backward(last, recurse=False)
        return contextlib.nullcontext()

    def release(self) -> None:
        """Free gathered weights that outlive a forward without backward (evaluation under reshard=step or
        micro_batch), before the optimizer changes the shards or a checkpoint reads them."""
        for unit in self.units:
            unit.reshard()

    def reduce_grads(self) -> None:
        # the sharded gradients were reduce-scattered (averaged over DP) in the backward; the replicas' now
        allreduce_grads(self.replicated, self.groups.dp_group)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float, check) -> float:
        import math

        from torch.distributed.tensor import DTensor

        from . import comm

        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        plain = [g for g in grads if not isinstance(g, DTensor)]  # identical on every DP rank
        dev = (shards or plain)[0].device
        sq = torch.zeros((), device=dev, dtype=torch.float32)
        for g in shards:
            sq += g.float().pow(2).sum()
        sq = comm.all_reduce(sq, self.groups.dp_group)
        for g in plain:
            sq += g.float().pow(2).sum()
        total = sq.sqrt()
        norm = float(total)
        if max_norm > 0 and math.isfinite(norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(shards + plain, coef)
        try:
            check(norm)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _fqn_groups(self) -> list[list[str]]:
        name_of = {id(q): n for n, q in self.model.named_parameters()}
        return [[name_of[id(q)] for q in g["params"]] for g in self.optimizer.param_groups]

    def gather_states(self):
        """Full (canonical) model and AdamW states on rank 0 (collective over DP; None elsewhere), in the
        canonical groups' order."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.groups.rank != 0:
            return None, None
        names = [n for _, ns in self._canonical for n in ns]
        index = {n: i for i, n in enumerate(names)}
        state = {index[n]: v for n, v in osd["state"].items()}
        groups, off = [], 0
        for opts, ns in self._canonical:
            groups.append({**opts, "params": list(range(off, off + len(ns)))})
            off += len(ns)
        return msd, {"state": state, "param_groups": groups}

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, model_state, options=opts)
        if optim_state is None:
            return
        saved = optim_state["param_groups"]
        if [len(g["params"]) for g in saved] != [len(ns) for _, ns in self._canonical]:
            raise ConfigError(f"checkpoint optimizer groups {[len(g['params']) for g in saved]} do not match this "
                              f"model's {[len(ns) for _, ns in self._canonical]}")
        names, hyper = [], {}
        for g, (_, ns) in zip(saved, self._canonical):
            for i, n in zip(g["params"], ns):
                names.append((int(i), n))
                hyper[n] = {k: v for k, v in g.items() if k != "params"}
        by_index = dict(names)
        state = {by_index[int(i)]: v for i, v in optim_state["state"].items()}
        groups = [{**hyper[fqns[0]], "params": fqns} for fqns in self._fqn_groups()]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": groups}, options=opts)


def fsdp_param_dtype(setting: str, bf16: bool):
    """parallel.fsdp_param_dtype -> the MixedPrecisionPolicy param_dtype (None: gather the fp32 shards)."""
    if setting == "fp32" or (setting == "auto" and not bf16):
        return None
    return torch.bfloat16


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    handles_states = True

    def __init__(self, model, groups, cfg, device, bf16: bool):
        super().__init__(model, groups, cfg)
        self.ds_config = deepspeed_config(cfg, bf16)
        self.stage = cfg.parallel.zero_stage
        self.bf16 = bf16
        self.ds = None
        if groups.rank == 0:  # the derived JSON beside the resolved config, for the record
            _write_json_atomic(self.ds_config, os.path.join(cfg.run.dir, "deepspeed_config.json"))

    def make_optimizer(self, build):
        import deepspeed

        base = build()
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        self._names = [[name_of[id(p)] for p in g["params"]] for g in base.param_groups]
        self._group_options = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
        root = self.model
        if self.stage == 3:
            root = _LossOnly(self.model)
            self._register_zero3_units(deepspeed.zero.register_external_parameter, root)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=root, optimizer=base,
                                                             config=self.ds_config, dist_init_required=False)
        self._loss_only = root is not self.model
        self.module = self.ds
        log.info("engine deepspeed: ZeRO stage %d over %d DP ranks, bf16 %s; config %s", self.stage,
                 self.groups.dp, self.bf16, json.dumps(self.ds_config, sort_keys=True))
        return self.optimizer

    def _register_zero3_units(self, register, root) -> None:
        """ZeRO-3 gathers a module's own parameters around that module's forward and backward. Our blocks
        use parameters of their children outside the children's forward (norm.add_forward, conv1d.weight,
        dt_proj.weight in the mixers), and the language model uses embedding.weight (tied head) and norm_f
        in its own forward; so every block gathers all its parameters as one unit (like fully_shard per
        block), and the model its embedding, final norm and head. DeepSpeed hooks the backward of a module
        through its outputs and cannot see into our LMOutput dataclass: the `root` (_LossOnly) returns the
        loss tensor, so its backward hook gathers those parameters again for the head's backward."""
        for layer in self.model.layers:
            for p in layer.parameters():
                register(layer, p)
        head = [self.model.embedding, self.model.norm_f] + ([self.model.lm_head] if self.model.lm_head else [])
        for p in [p for mod in head for p in mod.parameters()]:
            register(self.model, p)  # the forward (evaluation calls the model directly)
            register(root, p)  # the backward

    def forward(self, *args, **kwargs):
        if self._loss_only:
            from megassm.models.lm import LMOutput

            return LMOutput(loss=self.ds(*args, **kwargs), logits=None, states=None)
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor, accum: int) -> None:
        self.ds.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # a micro step: DeepSpeed counts it; the optimizer steps at the boundary only

    def reduce_grads(self) -> None:
        pass  # ZeRO reduces (or reduce-scatters) in its backward / step

    def clip_and_step(self, max_norm: float, check) -> float:
        # DeepSpeed clips (gradient_clipping) and steps at the accumulation boundary; the norm is known only
        # then, so a non-finite one stops training after this step (the checkpoints hold the earlier steps)
        if not self.ds.is_gradient_accumulation_boundary():
            raise RuntimeError("deepspeed engine: clip_and_step called off the accumulation boundary")
        pre = None
        if self.stage == 0 and not self.bf16:  # plain fp32 DeepSpeed keeps no norm: the grads are whole here
            from megassm.training.optim import clip_grad_norm

            pre = clip_grad_norm(self.model.parameters(), 0.0)  # the norm only
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else (pre if pre is not None else float("nan"))
        check(norm)
        return norm

    # canonical states through DeepSpeed's fp32 fragment API (works for ZeRO 0-3, collective for ZeRO-3)
    def _fp32(self, p):
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p)
        return (p.detach() if full is None else full).float().cpu().clone()

    def _opt_state(self, p, key: str):
        from deepspeed.utils import safe_get_full_optimizer_state

        full = safe_get_full_optimizer_state(p, key)
        if full is None:  # no fragment mapping (stage 0, fp32): the client optimizer holds the parameter
            st = self.optimizer.state.get(p, {})
            full = st.get(key)
        return None if full is None else full.float().cpu().clone()

    def _hp_flat(self) -> list:
        """The fp32 tensors the client AdamW steps under DeepSpeed: the flat fp32 partitions of ZeRO 1/2
        (single_partition_of_fp32_groups), of ZeRO-3 (fp32_partitioned_groups_flat) or of the bf16 optimizer
        (fp32_groups_flat_partition); the model's own parameters without any (stage 0, fp32)."""
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            flat = getattr(self.optimizer, attr, None)
            if flat:
                return list(flat)
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _base(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _sync_lp_from_hp(self) -> None:
        """After writing the fp32 masters: copy them into the model's (bf16 or fp32) parameters."""
        opt = self.optimizer
        if hasattr(opt, "update_lp_params"):  # ZeRO 1/2, bf16 optimizer (all-gathers over DP)
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: each rank its partition
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)

    def _relink_fragments(self) -> None:
        """DeepSpeed (0.19, ZeRO 1/2 and its bf16 optimizer) links each parameter to its optimizer-state
        fragment once, right after the first parameter group steps, so the later groups (ours: the no-decay
        group) are linked to an empty state; link again now that every group's state exists."""
        opt = self.optimizer
        if hasattr(opt, "_hp_optimizer_states_linked") and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def gather_states(self):
        self._relink_fragments()
        params = dict(self.model.named_parameters())
        msd = {}
        for k, v in self.model.state_dict().items():
            msd[k] = self._fp32(params[k]) if k in params else v.detach().cpu().clone()
        base = self._base()
        steps = [float(base.state[p]["step"]) for p in self._hp_flat() if "step" in base.state.get(p, {})]
        step = max(steps, default=0.0)
        state, index = {}, 0
        for names in self._names:
            for n in names:
                avg, sq = self._opt_state(params[n], "exp_avg"), self._opt_state(params[n], "exp_avg_sq")
                if avg is not None:
                    state[index] = {"step": torch.tensor(step), "exp_avg": avg, "exp_avg_sq": sq}
                index += 1
        groups, index = [], 0
        for names, opts in zip(self._names, self._group_options):
            groups.append({**opts, "params": list(range(index, index + len(names)))})
            index += len(names)
        if self.groups.rank != 0:
            return None, None
        return msd, {"state": state, "param_groups": groups}

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(model_state))
        if missing:
            raise ConfigError(f"checkpoint model state lacks {missing[:5]} (of {len(missing)})")
        mapped = any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in params.values())
        if not mapped:  # stage 0, fp32: the model's parameters are the masters, the client AdamW holds them
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(model_state[n])
            if optim_state is not None:
                self.optimizer.load_state_dict(optim_state)  # canonical = this optimizer's own layout
            return
        self._init_base_state()  # AdamW's state is created lazily; the fragments need it now
        self._relink_fragments()
        for n, p in params.items():
            safe_set_full_fp32_param(p, model_state[n].to(p.device))
        self._sync_lp_from_hp()
        if optim_state is None or not optim_state.get("state"):
            return
        flat = [n for names in self._names for n in names]
        step = 0.0
        for i, st in optim_state["state"].items():
            p = params[flat[int(i)]]
            step = float(st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, st[key].to(p.device), key)
        base = self._base()
        for p in self._hp_flat():
            base.state[p]["step"].fill_(step)

    def _init_base_state(self) -> None:
        """Zero AdamW state for every flat fp32 partition that has none yet, in the layout torch's AdamW
        creates at its first step (fp32 step on the device for fused / capturable, else on the CPU)."""
        base = self._base()
        on_dev = any(g.get("fused") or g.get("capturable") for g in base.param_groups)
        for p in self._hp_flat():
            if "exp_avg" in base.state.get(p, {}):
                continue
            base.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device if on_dev else "cpu"),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


class _LossOnly(torch.nn.Module):
    """ZeRO-3's root: the language model's loss as a plain tensor (see _register_zero3_units)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, *args, **kwargs):
        return self.lm(*args, **kwargs).loss


def build_engine(cfg: Config, model, groups: ParallelGroups, device: torch.device, bf16: bool) -> Engine:
    """The engine of parallel.engine for this model (after the TP / CP / PP plans and activation
    checkpointing). One data-parallel rank: the plain Engine whatever the setting (logged)."""
    check_engine(cfg)
    name = cfg.parallel.engine
    if groups.dp == 1:
        if name != "ddp" or cfg.parallel.zero_stage:
            log.info("parallel.engine=%s (zero_stage %d) with one data-parallel rank: nothing to shard; plain "
                     "stepping", name, cfg.parallel.zero_stage)
        return Engine(model, groups, cfg)
    if name == "ddp":
        return DDPEngine(model, groups, cfg, device)
    if name == "fsdp2":
        return FSDP2Engine(model, groups, cfg, device, bf16)
    return DeepSpeedEngine(model, groups, cfg, device, bf16)
