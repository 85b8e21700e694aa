"""The fsdp2 engine (`parallel.engine=fsdp2`): torch fully_shard over the data-parallel group, with bf16
all-gathers of the matmul weights and fp32 replicas of the small per-channel parameters (FSDP2Engine;
docs/parallelism.md "Data-parallel engines"). Beside tensor parallelism (parallel.tp > 1) it shards each TP
rank's local tensors over that rank's DP group (FSDP2 x TP; the TP-specific parts in fsdp2_tp.py)."""
from __future__ import annotations

import contextlib
import inspect
import logging
import os

import torch

from megassm.config import ConfigError
from megassm.models.registry import block_kinds

from . import fsdp2_tp
from .dp import allreduce_grads
from .engine_base import Engine
from .tp import plan_of

log = logging.getLogger("megassm.parallel.engines")

__all__ = ["FSDP2Engine", "fsdp_param_dtype", "sharded_params"]


# the blocks whose matmul weights FSDP2 may gather in bf16 (models/registry.py `fsdp_bf16_gather`): their
# Linear weights are consumed by F.linear only (the seed mixers read some of theirs inside their own kernels,
# which take them as DDP gives them: fp32)
_BF16_GATHER_KINDS = tuple(k.letter for k in block_kinds() if k.fsdp_bf16_gather)


def sharded_params(module) -> list:
    """Parameters of the nn.Linear / nn.Embedding modules under `module` (TP's parallel layers included):
    the ones FSDP2 shards (the memory estimate prices them the same way). Everything else (norm weights,
    A_log, dt_bias, D, conv weights and biases) is small and stays an fp32 replica on every DP rank."""
    from torch import nn

    return [p for m in module.modules() if isinstance(m, (nn.Linear, nn.Embedding)) for p in m.parameters(recurse=False)]


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
    reads seq_idx on the host at attention blocks, so the CPU cannot be relied on to run ahead).

    Under tensor parallelism the model arrives TP-planned (plain TP-local tensors, parallel/tp.py) and the units
    are sharded over the DP group only (a 1-D mesh of this TP rank's DP peers): every TP rank's local tensors
    sharded over DP. The TP gradient sync runs on the gradient shards (runtime.finish_grads), the clipping norm
    sums over DP and TP with TP-replicated components counted once, and the canonical states gather over both
    (fsdp2_tp.py)."""

    name = "fsdp2"
    handles_states = True

    def __init__(self, model, groups, cfg, device, bf16: bool = False):
        super().__init__(model, groups, cfg)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        p = cfg.parallel
        self.tp_plan = plan_of(model)  # FSDP2 x TP: the model holds TP-local tensors already
        # this TP rank's DP peers only: 1-D (FSDP2), or HSDP's 2-D [replicas, shard_size] (shard inside a node,
        # replicate across nodes); with TP the job's mesh is then replicate x shard x tp, TP fastest
        self.hsdp = None
        self.shard_group = groups.dp_group  # the ranks whose gradient shards are disjoint: the clip norm sums over it
        if 0 < p.shard_size < groups.dp:
            from .state import hsdp_groups

            self.hsdp = hsdp_groups(groups, p.shard_size)
            self.shard_group = self.hsdp.shard_group
            mesh = DeviceMesh.from_group([self.hsdp.replicate_group, self.hsdp.shard_group], device.type,
                                         mesh=torch.tensor(self.hsdp.mesh), mesh_dim_names=("replicate", "shard"))
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)  # torchrun: ranks per node
            mine = next(row for row in self.hsdp.mesh if groups.rank in row)
            if local and len({r // local for r in mine}) > 1 and groups.rank == 0:
                log.warning("HSDP: a shard group (ranks %s) spans %d nodes of %d ranks: its reduce-scatters cross the "
                            "network every micro-batch; parallel.shard_size x tp = the GPUs per node keeps them inside",
                            mine, len({r // local for r in mine}), local)
        else:
            mesh = DeviceMesh.from_group(groups.dp_group, device.type)
        self.grad_sync = p.fsdp_grad_sync
        gather = fsdp_param_dtype(p.fsdp_param_dtype, bf16)
        reduce = {"fp32": torch.float32, "bf16": torch.bfloat16}[p.fsdp_reduce_dtype]
        low = MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=reduce, cast_forward_inputs=False)
        full = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce if gather is not None else None,
                                    cast_forward_inputs=False)
        sharded = {id(q) for q in sharded_params(model)}
        replicated = [q for q in model.parameters() if id(q) not in sharded]
        ignored = set(replicated)
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
        n_rep = sum(q.numel() for q in replicated)
        over_tp = "" if self.tp_plan is None else (f" (TP rank {groups.tp_rank}'s local tensors, TP {groups.tp}"
                                                   f"{' + SP' if self.tp_plan.sp else ''})")
        over = (f"{groups.dp} DP ranks" if self.hsdp is None else
                f"{groups.dp} DP ranks as HSDP: shard groups of {self.hsdp.shard_size}, {self.hsdp.replicas} replicas "
                "all-reduced on the step's last micro-batch only")
        when = ("every micro-batch" if self.grad_sync == "micro_batch" else
                "once per step (parallel.fsdp_grad_sync=step: whole fp32 gradients accumulate locally)")
        log.info("engine fsdp2: fully_shard per block%s + root over %s%s: %.2fM sharded parameter elements "
                 "on this rank (fp32 shards and AdamW states), all-gathered in %s, gradients reduce-scattered in %s "
                 "%s; %.3fM small parameters (norms, A_log, dt_bias, D, conv) kept as fp32 replicas, "
                 "all-reduced once per step; gathered weights freed after each %s; prefetch %d block(s)%s", "" if tied else
                 " + embedding", over, over_tp, n_local / 1e6, "bf16" if gather is not None else "fp32",
                 p.fsdp_reduce_dtype if gather is not None else "fp32", when, n_rep / 1e6, {"block": "block's forward and backward",
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

    def canonical_order(self) -> list[tuple[dict, list[str]]]:
        """The single-device optimizer's groups: [(hyperparameters, parameter names)], the hyperparameters as the
        live groups hold them now (the scheduler's lr). The canonical index order of optim.pt and of a sharded
        checkpoint's layout (this optimizer splits every group in two: sharded and replicated parameters)."""
        name_of = {id(q): n for n, q in self.model.named_parameters()}
        live = {name_of[id(q)]: g for g in self.optimizer.param_groups for q in g["params"]}
        return [({k: v for k, v in live[names[0]].items() if k != "params"} if names else dict(opts), list(names))
                for opts, names in self._canonical]

    def micro_batch(self, last: bool):
        for unit in self.units:
            if self.reshard == "step":  # keep the gathered weights for the step's next micro-batch, free after the last
                unit.set_reshard_after_backward(last, recurse=False)
            if self.hsdp is not None:  # the replicas (across nodes) meet once per step; the shards sum meanwhile
                unit.set_requires_all_reduce(last, recurse=False)
            if self.grad_sync == "step":  # no reduce-scatter until the last micro-batch: unsharded fp32 sums
                unit.set_requires_gradient_sync(last, recurse=False)
        return contextlib.nullcontext()

    def release(self) -> None:
        """Free gathered weights that outlive a forward without backward (evaluation under reshard=step or
        micro_batch), before the optimizer changes the shards or a checkpoint reads them."""
        for unit in self.units:
            unit.reshard()

    def reduce_grads(self) -> None:
        # the sharded gradients were reduce-scattered (averaged over DP) in the backward; the replicas' now. Looked
        # up in the model each time: start-up allocates the sharded meta model after fully_shard (to_empty), which
        # may swap Parameter objects
        from torch.distributed.tensor import DTensor

        allreduce_grads([q for q in self.model.parameters() if not isinstance(q, DTensor)], self.groups.dp_group)

    @torch.no_grad()
    def clip_and_step(self, max_norm: float, check) -> float:
        import math

        from torch.distributed.tensor import DTensor

        from . import comm

        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        plain = [g for g in grads if not isinstance(g, DTensor)]  # identical on every DP rank
        dev = (shards or plain)[0].device
        def sq_sum(ts):  # one multi-tensor norm kernel, no squared copies of the gradients
            if not ts:
                return torch.zeros((), device=dev, dtype=torch.float32)
            return torch.stack(torch._foreach_norm(ts)).float().pow(2).sum()

        if self.tp_plan is not None:  # over DP and TP, TP-replicated components once
            total = fsdp2_tp.grad_sq(self.model, self.groups, self.shard_group).sqrt()
        else:  # HSDP: the replicas hold equal shards, so the sum runs over one shard group
            total = (comm.all_reduce(sq_sum(shards), self.shard_group) + sq_sum(plain)).sqrt()
        norm = float(total)
        if max_norm > 0 and math.isfinite(norm):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(shards + plain, coef)
        try:
            take = check(norm) is not False  # False: declined (Engine.clip_and_step)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        if take:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _fqn_groups(self) -> list[list[str]]:
        name_of = {id(q): n for n, q in self.model.named_parameters()}
        return [[name_of[id(q)] for q in g["params"]] for g in self.optimizer.param_groups]

    def gather_states(self):
        """Full (canonical) model and AdamW states on rank 0 (collective over DP, and TP; None elsewhere), in the
        canonical groups' order."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        if self.tp_plan is not None:  # DP all-gather then TP all-gather, tensor by tensor (fsdp2_tp.py)
            return fsdp2_tp.gather_states(self.model, self.optimizer, self.canonical_order(), self.groups)

        msd, osd = get_state_dict(self.model, self.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.groups.rank != 0:
            return None, None
        names = [n for _, ns in self._canonical for n in ns]
        index = {n: i for i, n in enumerate(names)}
        state = {index[n]: v for n, v in osd["state"].items()}
        groups, off = [], 0
        for opts, ns in self.canonical_order():  # the live hyperparameters (the scheduler's lr), not the initial ones
            groups.append({**opts, "params": list(range(off, off + len(ns)))})
            off += len(ns)
        return msd, {"state": state, "param_groups": groups}

    def load_states(self, model_state: dict, optim_state: dict | None) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        plan = self.tp_plan  # FSDP2 x TP: the canonical tensors cut to this rank's TP-local ones, then sharded
        if plan is not None:
            model_state = {n: fsdp2_tp.tp_local(v, n, plan) for n, v in model_state.items()}
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
        if plan is not None:
            state = {n: {k: fsdp2_tp.tp_local(v, n, plan) for k, v in st.items()} for n, st in state.items()}
        groups = [{**hyper[fqns[0]], "params": fqns} for fqns in self._fqn_groups()]
        set_optimizer_state_dict(self.model, self.optimizer, {"state": state, "param_groups": groups}, options=opts)


def fsdp_param_dtype(setting: str, bf16: bool):
    """parallel.fsdp_param_dtype -> the MixedPrecisionPolicy param_dtype (None: gather the fp32 shards)."""
    if setting == "fp32" or (setting == "auto" and not bf16):
        return None
    return torch.bfloat16


