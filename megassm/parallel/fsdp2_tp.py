"""FSDP2 x TP (`parallel.engine=fsdp2 parallel.tp=N`, torchtitan's 2-D layout): the tensor-parallel plan first
(parallel/tp.py: every rank holds plain TP-local tensors), then fully_shard over the data-parallel group only
(parallel/fsdp2.py), so FSDP2 shards each TP rank's local tensors over the DP ranks of that TP rank. What the
engine needs beyond DP-only FSDP2, given the model's TP plan:

    sq = grad_sq(model, groups)          squared norm of the canonical gradient (collective over DP and TP)
    msd, osd = gather_states(model, optimizer, order, groups)   canonical states on rank 0 (collective)
    t = tp_local(t, name, plan)          a canonical tensor -> this rank's TP-local tensor (loading)

The TP gradient sync (tp.sync_tp_grads: the partial gradients of TP-replicated components summed over their
replicas) runs on FSDP2's gradient shards as they are: the TP ranks of one DP rank hold shards of equal shapes at
equal offsets of their TP-local tensors (tp.local_box), so the replicated components' rows line up.
"""
from __future__ import annotations

import torch

from . import comm
from .tp import gather_canonical, local_pieces, plan_of, shard_canonical

__all__ = ["grad_sq", "gather_states", "tp_local"]


@torch.no_grad()
def grad_sq(model, groups, shard_group=None) -> torch.Tensor:
    """Squared L2 norm of the canonical gradient (call after the TP sync and the engine's DP reduction), the same
    on every rank. Each rank sums the squares of what it holds: FSDP2's gradient shards (disjoint over DP: summed
    over the DP group) and the fp32 replicas of the small parameters (the same on every DP rank: counted once),
    each component weighted by nparts / tp so that a TP-replicated one counts once over its replicas; the sum
    then over the TP group. `shard_group`: the ranks whose shards are disjoint (HSDP: one shard group, whose
    replicas hold the same shards; default the DP group)."""
    from torch.distributed.tensor import DTensor

    plan = plan_of(model)
    sharded: dict[float, list] = {}
    plain: dict[float, list] = {}
    dev = next(model.parameters()).device
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        into = sharded if isinstance(p.grad, DTensor) else plain
        for pc, view in local_pieces(p.grad, plan.specs[name]):
            into.setdefault(pc.nparts / plan.tp, []).append(view)

    def sq(by_weight: dict) -> torch.Tensor:  # one multi-tensor norm kernel per weight, no squared copies
        total = torch.zeros((), device=dev, dtype=torch.float32)
        for w, views in by_weight.items():
            total += w * torch.stack(torch._foreach_norm(views)).float().pow(2).sum()
        return total

    dp = groups.dp_group if shard_group is None else shard_group
    return comm.all_reduce(comm.all_reduce(sq(sharded), dp) + sq(plain), groups.tp_group)


@torch.no_grad()
def _canonical(t: torch.Tensor, name: str, plan, keep: bool):
    """The canonical tensor of this rank's piece `t` of parameter `name` (a DTensor shard: all-gathered over DP
    first, then over TP by its ShardSpec); a CPU copy where `keep`, else None. Collective over DP and TP."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    spec = plan.specs.get(name)
    if spec is not None and t.dim() > 0:
        t = gather_canonical(t.contiguous(), spec, plan)
    return t.detach().cpu().clone() if keep else None


@torch.no_grad()
def gather_states(model, optimizer, order: list, groups):
    """(model_state, optim_state) in the canonical single-device layout on rank 0, (None, None) elsewhere; a
    collective over DP and TP that every rank calls. One tensor at a time is assembled on the device (its DP
    all-gather, then its TP all-gather) and only rank 0 keeps a CPU copy. `order`: the canonical optimizer groups
    [(hyperparameters, parameter names)] (FSDP2Engine.canonical_order); optim_state indexes the parameters in
    that order, as optim.pt of a single-device run."""
    plan = plan_of(model)
    keep = groups.rank == 0
    msd = {}
    for name, t in model.state_dict().items():
        v = _canonical(t, name, plan, keep)
        if keep:
            msd[name] = v
    params = dict(model.named_parameters())
    state, out_groups, i = {}, [], 0
    for hyper, names in order:
        out_groups.append({**hyper, "params": list(range(i, i + len(names)))})
        for name in names:
            st = {}
            for k, v in optimizer.state.get(params[name], {}).items():
                if torch.is_tensor(v) and v.dim() > 0:
                    v = _canonical(v, name, plan, keep)
                elif torch.is_tensor(v):
                    v = v.detach().cpu().clone()
                st[k] = v
            if st:
                state[i] = st
            i += 1
    if not keep:
        return None, None
    return msd, {"state": state, "param_groups": out_groups}


def tp_local(t: torch.Tensor, name: str, plan) -> torch.Tensor:
    """This TP rank's local tensor of a canonical parameter (or state shaped like it) `name`; tensors without a
    ShardSpec (and 0-dim ones) as they are. FSDP2 then keeps this rank's DP shard of it."""
    spec = plan.specs.get(name)
    if spec is None or not torch.is_tensor(t) or t.dim() == 0:
        return t
    return shard_canonical(t, spec, plan.rank)
