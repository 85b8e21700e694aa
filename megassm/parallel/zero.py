"""ZeRO-1 for the ddp engine (`parallel.engine=ddp parallel.zero_stage=1`): the AdamW states sharded over
the data-parallel group, composing with tensor, context and pipeline parallelism (Megatron's distributed
optimizer; DeepSpeed's ZeRO and FSDP2 shard over a pure DP layout only, docs/parallelism.md "Engines"). With
context parallelism the group is DP x CP (`groups.dp_cp_group`, Megatron's data-parallel group "with context
parallel"): the CP ranks hold the same parameters and, after the CP gradient sum, the same gradients, so they
split the states too (at CP 4, 1/4 of AdamW's 8 bytes a parameter per rank, even at DP 1).

    flat = FlatParams(model.parameters(), groups.dp_group)       # before DDP: params become views of one buffer
    opt = ShardedAdamW(build_optimizer(...), flat)               # AdamW over this rank's slice of the buffer
    ... backward, DP all-reduce of the gradients, clipping (the usual TP / PP / CP paths) ...
    opt.step()                                                   # AdamW on the slice, then all-gather
    opt.zero_grad(set_to_none=True)

Each dtype's parameters (in `model.parameters()` order) are laid end to end in one flat buffer, padded to a
multiple of DP; DP rank r owns the contiguous slice [r * S, (r + 1) * S). A parameter may straddle two
ranks. The inner torch AdamW optimizes views of the owned slice (one per parameter piece, in the piece's
original parameter group, so weight decay and lr scales are kept), with the matching views of the full
gradients as their grads: its m and v exist for 1/DP of the elements. After the step one all-gather per
dtype writes every rank's slice into every rank's buffer, i.e. into the parameters themselves.

Checkpoints stay canonical: `state_dict()` (collective over DP) returns what a torch AdamW over the local
(TP-sharded / this stage's) parameters would, so the TP, PP and plain checkpoint paths are unchanged, and
`load_state_dict` takes such a dict and keeps this rank's slice. A run saved with ZeRO-1 resumes without it,
at another DP size, or with another engine, and the other way round.

Communication per step: the gradients' all-reduce (DDP, unchanged) plus one all-gather of the weights, i.e.
1.5x a plain DDP step's bytes. Megatron reduce-scatters the gradients instead (1x) by owning the gradient
buffer too; that is the next step here (docs/parallelism.md).
"""
from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("megassm.parallel.zero")

__all__ = ["FlatParams", "ShardedAdamW"]


class FlatParams:
    """The parameters re-pointed into one flat buffer per dtype (and device), and this DP rank's slice.

    `pieces`: for every parameter piece this rank owns, (param, start, end) in the parameter's flattened
    elements, in buffer order."""

    def __init__(self, params, dp_group):
        self.group = dp_group
        self.dp = dist.get_world_size(dp_group)
        self.rank = dist.get_rank(dp_group)
        self.params = list(dict.fromkeys(params))  # tied parameters once
        by_key: dict = {}
        for p in self.params:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        self.buffers = []  # (flat buffer, shard size, [(param, offset in the buffer)])
        self.pieces: list[tuple[torch.nn.Parameter, int, int]] = []
        self._piece_at: list[tuple[int, int]] = []  # per piece: (buffer index, its start in this rank's slice)
        for (dtype, device), ps in by_key.items():
            n = sum(p.numel() for p in ps)
            shard = -(-n // self.dp)
            flat = torch.zeros(shard * self.dp, dtype=dtype, device=device)
            lo, hi = self.rank * shard, (self.rank + 1) * shard
            off, layout = 0, []
            for p in ps:
                k = p.numel()
                flat[off:off + k].copy_(p.detach().reshape(-1))
                p.data = flat[off:off + k].view_as(p)  # same Parameter object: plans, hooks, names unchanged
                layout.append((p, off))
                a, b = max(lo, off), min(hi, off + k)
                if a < b:
                    self.pieces.append((p, a - off, b - off))
                    self._piece_at.append((len(self.buffers), a - lo))
                off += k
            self.buffers.append((flat, shard, layout))
        owned = sum(b - a for _, a, b in self.pieces)
        log.info("ZeRO-1: %d parameters in %d flat buffer(s) over %d ranks; this rank owns %.3fM elements "
                 "(%d pieces) and their AdamW states", len(self.params), len(self.buffers), self.dp, owned / 1e6,
                 len(self.pieces))

    @torch.no_grad()
    def all_gather(self) -> None:
        """Every rank's updated slice into every rank's buffer (so into the parameters)."""
        for flat, shard, _ in self.buffers:
            mine = flat[self.rank * shard:(self.rank + 1) * shard]
            # in place (the input is the output's own slice): no copy of the slice (NCCL and gloo take it)
            dist.all_gather_into_tensor(flat, mine, group=self.group)

    gather_chunk = 1 << 26  # elements per rank per all-gather when checkpointing (256 MB of fp32)

    @torch.no_grad()
    def all_gather_to_cpu(self, values: list[torch.Tensor]) -> dict:
        """One tensor per owned piece (shaped like the piece) assembled into full per-parameter CPU fp32
        tensors on every rank: {param: tensor shaped like the param}. Collective over DP; the device
        never holds more than `gather_chunk` elements per rank of it (a full copy of the AdamW states on the GPU
        is what ZeRO-1 saves)."""
        out = {}
        for bi, (flat, shard, layout) in enumerate(self.buffers):
            spans = [(s, s + v.numel(), v.reshape(-1)) for (bj, s), v in zip(self._piece_at, values) if bj == bi]
            full = torch.empty(self.dp, shard, dtype=torch.float32)  # CPU
            for c0 in range(0, shard, self.gather_chunk):
                c1 = min(shard, c0 + self.gather_chunk)
                local = torch.zeros(c1 - c0, dtype=torch.float32, device=flat.device)
                for a, b, v in spans:
                    if a < c1 and b > c0:
                        local[max(a, c0) - c0:min(b, c1) - c0] = v[max(a, c0) - a:min(b, c1) - a]
                got = torch.empty(self.dp * (c1 - c0), dtype=torch.float32, device=flat.device)
                dist.all_gather_into_tensor(got, local, group=self.group)
                full[:, c0:c1].copy_(got.view(self.dp, c1 - c0))
            full = full.view(-1)
            for p, off in layout:
                out[p] = full[off:off + p.numel()].view(p.shape)
        return out


class ShardedAdamW:
    """A torch AdamW (`full`, built over the model's parameter groups, no state yet) turned into one over
    this rank's pieces of `flat`. Quacks like the optimizer it replaces: `param_groups` are the full
    groups (the lr scheduler writes them; they are copied into the inner optimizer before each step),
    `state_dict` / `load_state_dict` speak the full optimizer's format."""

    collective_state_dict = True  # state_dict() must be called on every DP rank

    def __init__(self, full: torch.optim.Optimizer, flat: FlatParams):
        if not isinstance(full, torch.optim.AdamW):
            raise TypeError(f"ZeRO-1 shards AdamW, got {type(full).__name__}")
        if full.state:
            raise ValueError("ZeRO-1: build the sharded optimizer before the first step (the full one has state)")
        self.flat = flat
        self.param_groups = full.param_groups
        self.defaults = full.defaults
        group_of = {id(p): gi for gi, g in enumerate(full.param_groups) for p in g["params"]}
        missing = [p for p in flat.params if id(p) not in group_of]
        if missing:
            raise ValueError(f"ZeRO-1: {len(missing)} parameters are in no optimizer group")
        self._views = []  # (param, start, end, view of the buffer)
        inner_groups = {}
        for p, a, b in flat.pieces:
            v = p.data.view(-1)[a:b]  # a view of the flat buffer: the step writes the parameter in place
            self._views.append((p, a, b, v))
            inner_groups.setdefault(group_of[id(p)], []).append(v)
        self._inner_of = sorted(inner_groups)  # inner group i <-> full group self._inner_of[i]
        groups = [{**{k: val for k, val in self.param_groups[gi].items() if k != "params"},
                   "params": inner_groups[gi]} for gi in self._inner_of]
        # a rank can own nothing when DP exceeds the elements (tiny models): it only all-gathers
        accepted = inspect.signature(torch.optim.AdamW).parameters  # defaults also hold derived keys
        kwargs = {k: v for k, v in full.defaults.items() if k in accepted}
        self.inner = torch.optim.AdamW(groups, **kwargs) if groups else None

    # -- the step --------------------------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        if self.inner is None:
            return
        for ig, gi in zip(self.inner.param_groups, self._inner_of):
            for k, val in self.param_groups[gi].items():
                if k != "params":
                    ig[k] = val

    @torch.no_grad()
    def step(self) -> None:
        self._sync_hyperparameters()
        if self.inner is not None:
            for p, a, b, v in self._views:
                v.grad = None if p.grad is None else p.grad.reshape(-1)[a:b]  # read only: a copy would do
            self.inner.step()
            for _, _, _, v in self._views:
                v.grad = None
        self.flat.all_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.flat.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    # -- checkpoints: the full (unsharded) AdamW format ----------------------------------------------
    def _index(self) -> dict:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _piece_states(self) -> list[dict]:
        if self.inner is None:
            return [{} for _ in self._views]
        return [self.inner.state.get(v, {}) for _, _, _, v in self._views]

    @torch.no_grad()
    def state_dict(self) -> dict:
        """The full optimizer's state dict (collective over DP), with CPU tensors: m and v all-gathered, the
        per-parameter step from whichever rank owns a piece of it."""
        states = self._piece_states()
        index = self._index()
        dev = self.flat.buffers[0][0].device if self.flat.buffers else torch.device("cpu")
        steps = torch.full((len(index),), -1.0, dtype=torch.float64, device=dev)
        for (p, _, _, _), st in zip(self._views, states):
            if "step" in st:
                steps[index[id(p)]] = float(st["step"])
        if self.flat.dp > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.flat.group)
        full = {}
        for key in ("exp_avg", "exp_avg_sq"):
            vals = [st[key] if key in st else torch.zeros(b - a, device=v.device)
                    for (_, a, b, v), st in zip(self._views, states)]
            full[key] = self.flat.all_gather_to_cpu(vals)
        state = {}
        for p in self.flat.params:
            i = index[id(p)]
            if steps[i] < 0:
                continue  # never stepped: no state, as torch's AdamW
            state[i] = {"step": torch.tensor(float(steps[i]), dtype=torch.float32),
                        "exp_avg": full["exp_avg"][p].to(p.dtype).clone(),
                        "exp_avg_sq": full["exp_avg_sq"][p].to(p.dtype).clone()}
        groups, off = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(off, off + len(g["params"])))})
            off += len(g["params"])
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Load a full optimizer state dict (not collective): this rank keeps its pieces' m and v."""
        saved = sd["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError("ZeRO-1: the optimizer state's parameter groups do not match the model's "
                             f"({[len(s['params']) for s in saved]} vs {[len(g['params']) for g in self.param_groups]})")
        for s, g in zip(saved, self.param_groups):  # hyperparameters as saved (torch's behaviour)
            for k, val in s.items():
                if k != "params":
                    g[k] = val
        by_saved = {}
        for s, g in zip(saved, self.param_groups):
            for si, p in zip(s["params"], g["params"]):
                by_saved[id(p)] = si
        if self.inner is None:
            return
        inner_index = {id(v): j for j, v in enumerate(v for g in self.inner.param_groups for v in g["params"])}
        inner_state = {}
        for p, a, b, v in self._views:
            st = sd["state"].get(by_saved[id(p)], sd["state"].get(str(by_saved[id(p)])))
            if not st:
                continue
            step = st["step"].clone() if torch.is_tensor(st["step"]) else torch.tensor(float(st["step"]))
            inner_state[inner_index[id(v)]] = {"step": step, **{k: st[k].reshape(-1)[a:b].clone()
                                                                for k in ("exp_avg", "exp_avg_sq")}}
        self._sync_hyperparameters()
        inner_sd = self.inner.state_dict()
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_sd["param_groups"]})

    @property
    def state(self) -> dict:
        """The inner optimizer's state (this rank's pieces); for inspection only."""
        return {} if self.inner is None else self.inner.state
