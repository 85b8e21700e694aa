"""The distributed optimizer of the ddp engine (`parallel.engine=ddp parallel.zero_stage=1`), Megatron-LM's
layout: the gradients reduce-scattered into a flat fp32 buffer the engine owns, AdamW on this rank's shard, the
parameters all-gathered. The AdamW states are sharded over the ranks holding the same parameters: the DP group,
or DP x CP with context parallelism (`groups.dp_cp_group`, Megatron's data-parallel group "with context
parallel"; also at DP 1, over the CP ranks). Composes with TP (+SP), CP, PP, BPTT and CUDA graphs; FSDP2 and
DeepSpeed shard over a pure DP (or DP x TP) layout only (docs/parallelism.md "Engines").

    engine = DistOptEngine(model, groups, cfg, device)   # build_engine: parameters and grads become buffer views
    optimizer = engine.make_optimizer(build)             # AdamW over this rank's shard of every bucket
    with engine.micro_batch(last): ... backward ...      # the last one's backward starts the reduce-scatters
    runtime.finish_grads(model, groups, engine)          # engine.reduce_grads(): wait (or run them), / DP
    norm = engine.clip_and_step(max_norm, check)         # norm of the shards, AdamW, all-gather, zero in place

Layout (FlatBuffers). The parameters of one dtype and device are laid end to end in reverse model order (the
order in which the backward produces their gradients), each starting at a multiple of ALIGN elements, and cut
into buckets of about parallel.bucket_mb of whole parameters (a larger parameter is a bucket alone), each padded
to a multiple of ALIGN x the group size. Every parameter becomes a view of the parameter buffer and its .grad a
view of a gradient buffer of the same layout and dtype: fp32, since the parameters here are fp32 (bf16 autocast
computes). Both are allocated once and kept for the whole run; the gradients are zeroed in place after a step
(the optimizer's zero_grad never frees them). Rank r of the group owns slice r of every bucket: a parameter may
straddle ranks, and a small model can leave a rank owning nothing.

Per step, per bucket: one reduce_scatter_tensor of the gradients (fp32 sums), in place into this rank's slice of
the bucket, divided by DP (an average over DP and a sum over CP: no separate CP all-reduce); AdamW on the
slice; one all_gather_into_tensor of the parameters from the slices, in their dtype (fp32). Ring algorithms send
(n - 1) / n of a buffer per rank for each, so a step sends `distopt_bytes_per_step` = (n - 1) / n x (4 + 4)
bytes per parameter: exactly an fp32 all-reduce's 2 (n - 1) / n x 4. Both collectives are in place: the buckets
add no transient memory, only their padding.

Overlap. Where a micro-batch is one plain autograd backward that accumulates into the parameters (no PP
schedule, no BPTT windows, no CUDA-graph replays, no train.cast_weights_once copies), the last micro-batch's
backward starts a bucket's reduce-scatter (async_op) from post-accumulate-grad hooks as soon as every parameter
of it has its gradient; buckets start in index order on every rank (one ready early waits for those before it),
so the ranks issue the same collectives in the same order. reduce_grads() waits for them. The earlier
micro-batches only accumulate. Otherwise reduce_grads() runs the reduce-scatters after the step's backward
(logged). runtime.finish_grads orders this with the TP / PP / CP gradient syncs. Under CUDA graphs the captured
backward adds into the buffer's gradients (training/cuda_graph.py, kept_grads).

Clipping: the squared norm of this rank's slices only, TP-replicated components weighted nparts / tp (counted
once over their replicas) and the last pipeline stage's copy of a tied embedding left out, summed over the
group, then TP, then PP: the single-process norm. The clip scales the slices (all that the step reads).

Checkpoints stay canonical: `state_dict()` (collective over the group) returns what a torch AdamW over the local
(TP-sharded / this stage's) parameters would, `load_state_dict` takes such a dict and keeps this rank's slices,
and sharded checkpoints (training/checkpoint/sharded_chunks.py) write and read the owned pieces (`_views`) as boxes of the
canonical tensors. A run saved here resumes in one process, under plain DDP, FSDP2 or at another DP size, and
the other way round.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math

import torch
import torch.distributed as dist

from . import comm
from .engine_base import Engine

log = logging.getLogger("megassm.parallel.distopt")

__all__ = ["ALIGN", "distopt_bytes_per_step", "plan_buckets", "flat_boxes", "range_boxes", "Bucket", "FlatBuffers",
           "DistributedAdamW", "DistOptEngine"]

# elements: parameter starts at multiples of 64 (256 bytes of fp32; Megatron pads them so too) and bucket ends
# such that every rank's slice starts at one too, so kernels and collectives get aligned pointers
ALIGN = 64


def distopt_bytes_per_step(n_params_local: int, group_size: int, grad_bytes: int = 4, param_bytes: int = 4) -> float:
    """Bytes one rank sends per optimizer step: the reduce-scatter of `n_params_local` gradients and the
    all-gather of as many parameters over `group_size` ranks, each (n - 1) / n of the buffer under a ring
    algorithm. With fp32 gradients and parameters, exactly an fp32 all-reduce's 2 (n - 1) / n x 4 bytes per
    parameter. The engine's buffers also carry their padding (FlatBuffers.numel: < ALIGN x n per bucket)."""
    n = group_size
    if n <= 1:
        return 0.0
    return (n - 1) / n * n_params_local * (grad_bytes + param_bytes)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def plan_buckets(numels: list[int], group_size: int, bucket_elems: int) -> list[tuple[list[int], int]]:
    """The buckets of parameters of `numels` elements laid end to end in that order (the reverse model order):
    [(each member's offset in the bucket, the bucket's padded size)]. Whole parameters, each at a multiple of
    ALIGN; a bucket closes once it holds `bucket_elems` (a larger parameter is one alone) and is padded to a
    multiple of ALIGN x group_size, so every rank's slice starts aligned too."""
    cut, offs, end = [], [], 0
    for k in numels:
        off = _round_up(end, ALIGN)
        offs.append(off)
        end = off + k
        if end >= bucket_elems:
            cut.append((offs, end))
            offs, end = [], 0
    if offs:
        cut.append((offs, end))
    return [(offs, _round_up(max(end, 1), ALIGN * group_size)) for offs, end in cut]


# ----------------------------------------------------------------------------------------------------
# a flat element range of a row-major tensor as boxes (clipping under TP, sharded checkpoints)
# ----------------------------------------------------------------------------------------------------
def flat_boxes(shape, a: int, b: int) -> list:
    """The flat element range [a, b) of a row-major tensor of `shape` as boxes (offsets, sizes), in order; each
    box is contiguous in the flat order, so the range's flat values viewed per box tile it."""
    shape = tuple(shape)
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,) if shape else (), (b - a,) if shape else ())]
    inner = math.prod(shape[1:])
    r0, r1 = a // inner, (b - 1) // inner
    if r0 == r1:
        return [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], a - r0 * inner, b - r0 * inner)]
    out = []
    if a % inner:
        out += [((r0,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], a - r0 * inner, inner)]
        r0 += 1
    full = b // inner
    if full > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (full - r0,) + shape[1:]))
    if b % inner:
        out += [((full,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], 0, b - full * inner)]
    return out


def range_boxes(shape, a: int, b: int, values: torch.Tensor) -> list:
    """[(offsets, view)]: the flat range [a, b) of a tensor of `shape` whose values are `values` ((b - a,)), as
    views of `values` shaped like the boxes of flat_boxes."""
    out = []
    for offs, sizes in flat_boxes(shape, a, b):
        start, stride = 0, 1
        for d in range(len(shape) - 1, -1, -1):
            start += offs[d] * stride
            stride *= shape[d]
        start -= a
        out.append((offs, values[start:start + math.prod(sizes)].view(sizes)))
    return out


# ----------------------------------------------------------------------------------------------------
# the buffers
# ----------------------------------------------------------------------------------------------------
class Bucket:
    """A range of the flat buffers: `params` / `grads` its views (padded size, a multiple of the group size),
    `members` [(param, offset in the bucket)], this rank's slice `param_shard` / `grad_shard` (`shard` elements)."""

    def __init__(self, params: torch.Tensor, grads: torch.Tensor, members: list, n: int, rank: int):
        self.params, self.grads, self.members = params, grads, members
        self.shard = params.numel() // n
        self.lo = rank * self.shard
        self.param_shard = params[self.lo:self.lo + self.shard]
        self.grad_shard = grads[self.lo:self.lo + self.shard]
        self.waiting: set = set()  # the last micro-batch: parameters whose gradient is still to come
        self.work = None  # its reduce-scatter, begun


class FlatBuffers:
    """The parameters and their gradients as views of flat buffers (one pair per dtype and device), cut into
    buckets; this rank owns slice `rank` of every bucket (the module docstring).

    `pieces`: (param, start, end) for every owned piece, in the parameter's flattened elements, in buffer order.
    `dp`: the group's gradient sum is divided by it (the CP ranks' share stays a sum). `overlap`: hooks start a
    bucket's reduce-scatter in the backward after `arm()`."""

    def __init__(self, params, group, bucket_bytes: int, dp: int, overlap: bool):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.dp = dp
        self.params = list(dict.fromkeys(params))  # tied parameters once
        self.flats: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter buffer, gradient buffer)
        self.buckets: list[Bucket] = []
        self.bucket_of: dict = {}
        self.pieces: list[tuple[torch.nn.Parameter, int, int]] = []
        self._piece_at: list[tuple[int, int]] = []  # per piece: (bucket index, its start in this rank's slice)
        by_key: dict = {}
        for p in self.params:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        with torch.no_grad():
            for (dtype, device), ps in by_key.items():
                self._lay_out(ps[::-1], dtype, device, bucket_bytes)
        self.grad_shards = [b.grad_shard for b in self.buckets]
        self._grads = [(p, p.grad) for p in self.params if p.requires_grad]
        self._armed = False
        self._next = 0  # the next bucket to start, in index order
        if overlap:
            for p, _ in self._grads:
                p.register_post_accumulate_grad_hook(self._on_grad)
        owned = sum(b - a for _, a, b in self.pieces)
        log.info("distributed optimizer: %d parameters (%.3fM elements with padding) in %d bucket(s) of <= %.3g MB "
                 "over %d ranks; this rank owns %.3fM elements (%d pieces) and their AdamW states",
                 len(self.params), self.numel / 1e6, len(self.buckets), bucket_bytes / 2 ** 20, self.n, owned / 1e6,
                 len(self.pieces))

    @property
    def numel(self) -> int:
        """Elements of the buffers, padding included: what each collective of a step moves."""
        return sum(b.params.numel() for b in self.buckets)

    def _lay_out(self, ps: list, dtype, device, bucket_bytes: int) -> None:
        per = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        cut = plan_buckets([p.numel() for p in ps], self.n, per)
        pflat = torch.zeros(sum(size for _, size in cut), dtype=dtype, device=device)
        gflat = torch.zeros_like(pflat)
        self.flats.append((pflat, gflat))
        start, it = 0, iter(ps)
        for offs, size in cut:
            members = [(next(it), off) for off in offs]
            b = Bucket(pflat[start:start + size], gflat[start:start + size], members, self.n, self.rank)
            lo, hi = b.lo, b.lo + b.shard
            for p, off in members:
                k = p.numel()
                b.params[off:off + k].copy_(p.detach().reshape(-1))
                p.data = b.params[off:off + k].view_as(p)  # same Parameter object: plans, hooks, names unchanged
                if p.requires_grad:
                    p.grad = b.grads[off:off + k].view_as(p)
                self.bucket_of[p] = b
                a, e = max(lo, off), min(hi, off + k)
                if a < e:
                    self.pieces.append((p, a - off, e - off))
                    self._piece_at.append((len(self.buckets), a - lo))
            self.buckets.append(b)
            start += size

    # -- the gradients -------------------------------------------------------------------------------
    def arm(self) -> None:
        """The step's last micro-batch begins: its backward starts each bucket's reduce-scatter once the bucket's
        gradients are all accumulated."""
        for b in self.buckets:
            b.waiting = {p for p, _ in b.members if p.requires_grad}
        self._next = 0
        self._armed = True

    def _on_grad(self, p) -> None:
        if not self._armed:
            return
        b = self.bucket_of[p]
        if b.work is not None:
            raise RuntimeError(f"distributed optimizer: a gradient of a parameter {tuple(p.shape)} was accumulated "
                               "after its bucket's reduce-scatter began (a parameter reached twice by separate "
                               "backward passes in one micro-batch?)")
        b.waiting.discard(p)
        while self._next < len(self.buckets) and not self.buckets[self._next].waiting:
            self._start(self.buckets[self._next])

    def _start(self, b: Bucket) -> None:
        # in place: the input is the bucket, the output its own slice of it (Megatron's layout; NCCL and gloo take it)
        b.work = dist.reduce_scatter_tensor(b.grad_shard, b.grads, group=self.group, async_op=True)
        self._next += 1

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """Every bucket reduce-scattered (those the backward has not begun now, in order) and waited for: this
        rank's slices hold the gradients summed over the group, divided by DP."""
        for p, g in self._grads:
            if p.grad is not g:
                raise RuntimeError(f"distributed optimizer: the gradient of a parameter {tuple(p.shape)} is no longer "
                                   "its view of the gradient buffer (set to None or replaced outside the engine)")
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        for b in self.buckets:
            b.work.wait()
            b.work = None
        self._armed = False
        self._next = 0
        if self.dp > 1:
            torch._foreach_div_(self.grad_shards, self.dp)

    @torch.no_grad()
    def zero_grads(self) -> None:
        for _, g in self.flats:
            g.zero_()

    # -- the parameters ------------------------------------------------------------------------------
    @torch.no_grad()
    def all_gather(self) -> None:
        """Every rank's slices into every rank's buffer (so into the parameters), bucket by bucket."""
        works = [dist.all_gather_into_tensor(b.params, b.param_shard, group=self.group, async_op=True)
                 for b in self.buckets]
        for w in works:
            w.wait()

    gather_chunk = 1 << 26  # elements per rank per all-gather when checkpointing (256 MB of fp32)

    @torch.no_grad()
    def all_gather_to_cpu(self, values: list[torch.Tensor]) -> dict:
        """One tensor per owned piece (shaped like the piece) assembled into full per-parameter CPU fp32 tensors
        on every rank: {param: tensor shaped like the param}. Collective over the group; the device never holds
        more than `gather_chunk` elements per rank of it (a full copy of the AdamW states on the GPU is what the
        sharding saves)."""
        spans: dict = {}
        for (bi, s), v in zip(self._piece_at, values):
            spans.setdefault(bi, []).append((s, s + v.numel(), v.reshape(-1)))
        out = {}
        for bi, b in enumerate(self.buckets):
            full = torch.empty(self.n, b.shard, dtype=torch.float32)  # CPU
            for c0 in range(0, b.shard, self.gather_chunk):
                c1 = min(b.shard, c0 + self.gather_chunk)
                local = torch.zeros(c1 - c0, dtype=torch.float32, device=b.params.device)
                for a, e, v in spans.get(bi, ()):
                    if a < c1 and e > c0:
                        local[max(a, c0) - c0:min(e, c1) - c0] = v[max(a, c0) - a:min(e, c1) - a]
                got = torch.empty(self.n * (c1 - c0), dtype=torch.float32, device=b.params.device)
                dist.all_gather_into_tensor(got, local, group=self.group)
                full[:, c0:c1].copy_(got.view(self.n, c1 - c0))
            full = full.view(-1)
            for p, off in b.members:
                out[p] = full[off:off + p.numel()].view(p.shape)
        return out


# ----------------------------------------------------------------------------------------------------
# the optimizer
# ----------------------------------------------------------------------------------------------------
class DistributedAdamW:
    """A torch AdamW (`full`, built over the model's parameter groups, no state yet) turned into one over this
    rank's pieces of `buffers`. Quacks like the optimizer it replaces: `param_groups` are the full groups (the lr
    scheduler writes them; they are copied into the inner optimizer before each step), `state_dict` /
    `load_state_dict` speak the full optimizer's format."""

    collective_state_dict = True  # state_dict() must be called on every rank of the group

    def __init__(self, full: torch.optim.Optimizer, buffers: FlatBuffers):
        if not isinstance(full, torch.optim.AdamW):
            raise TypeError(f"the distributed optimizer shards AdamW, got {type(full).__name__}")
        if full.state:
            raise ValueError("distributed optimizer: build it before the first step (the full optimizer has state)")
        self.buffers = buffers
        self.param_groups = full.param_groups
        self.defaults = full.defaults
        group_of = {id(p): gi for gi, g in enumerate(full.param_groups) for p in g["params"]}
        missing = [p for p in buffers.params if id(p) not in group_of]
        if missing:
            raise ValueError(f"distributed optimizer: {len(missing)} parameters are in no optimizer group")
        self._views = []  # (param, start, end, view of the parameter buffer)
        inner_groups = {}
        for p, a, b in buffers.pieces:
            v = p.data.view(-1)[a:b]  # a view of the buffer: the step writes the parameter in place
            if p.grad is not None:
                v.grad = p.grad.view(-1)[a:b]  # and reads the gradient buffer in place, for the whole run
            self._views.append((p, a, b, v))
            inner_groups.setdefault(group_of[id(p)], []).append(v)
        self._inner_of = sorted(inner_groups)  # inner group i <-> full group self._inner_of[i]
        groups = [{**{k: val for k, val in self.param_groups[gi].items() if k != "params"},
                   "params": inner_groups[gi]} for gi in self._inner_of]
        # a rank can own nothing when the group exceeds the elements (tiny models): it only all-gathers
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
        """AdamW on this rank's slices (their gradients reduced by FlatBuffers.reduce_scatter), then the
        all-gather of the parameters."""
        self._sync_hyperparameters()
        if self.inner is not None:
            self.inner.step()
        self.buffers.all_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers in place, whatever `set_to_none` says: the gradients are views of buffers the
        engine keeps for the run (a freed gradient would make the next backward allocate one beside them)."""
        self.buffers.zero_grads()

    # -- checkpoints: the full (unsharded) AdamW format ----------------------------------------------
    def _index(self) -> dict:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _piece_states(self) -> list[dict]:
        if self.inner is None:
            return [{} for _ in self._views]
        return [self.inner.state.get(v, {}) for _, _, _, v in self._views]

    @torch.no_grad()
    def state_dict(self) -> dict:
        """The full optimizer's state dict (collective over the group), with CPU tensors: m and v all-gathered,
        the per-parameter step from whichever rank owns a piece of it."""
        states = self._piece_states()
        index = self._index()
        dev = self.buffers.flats[0][0].device if self.buffers.flats else torch.device("cpu")
        steps = torch.full((len(index),), -1.0, dtype=torch.float64, device=dev)
        for (p, _, _, _), st in zip(self._views, states):
            if "step" in st:
                steps[index[id(p)]] = float(st["step"])
        if self.buffers.n > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.buffers.group)
        full = {}
        for key in ("exp_avg", "exp_avg_sq"):
            vals = [st[key] if key in st else torch.zeros(b - a, device=v.device)
                    for (_, a, b, v), st in zip(self._views, states)]
            full[key] = self.buffers.all_gather_to_cpu(vals)
        state = {}
        for p in self.buffers.params:
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
            raise ValueError("distributed optimizer: the optimizer state's parameter groups do not match the "
                             f"model's ({[len(s['params']) for s in saved]} vs "
                             f"{[len(g['params']) for g in self.param_groups]})")
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


# ----------------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------------
def _norm_views(model, buffers: FlatBuffers) -> dict:
    """{weight: [views of this rank's gradient slices]}: the weighted sum of their squared norms, summed over the
    group, TP and PP, is the squared norm of the canonical gradient. Under TP each ShardSpec piece weighs
    nparts / tp (a replicated component counts once over its replicas); the last stage's copy of a tied
    embedding is left out (the first stage's counts)."""
    from .pp import tied_copy, unwrap, pp_plan_of
    from .tp import box_pieces, plan_of

    inner = unwrap(model)
    tplan, pplan = plan_of(inner), pp_plan_of(inner)
    skip = tied_copy(pplan) if pplan is not None else set()
    name_of = {id(p): n for n, p in inner.named_parameters()}
    out: dict = {}
    for p, a, b in buffers.pieces:
        name = name_of[id(p)]
        if name in skip or p.grad is None:
            continue
        flat = p.grad.view(-1)[a:b]
        if tplan is None:
            out.setdefault(1.0, []).append(flat)
            continue
        for offs, box in range_boxes(p.shape, a, b, flat):
            for pc, v in box_pieces(offs, box, tplan.specs[name]):
                out.setdefault(pc.nparts / tplan.tp, []).append(v)
    return out


class DistOptEngine(Engine):
    """The ddp engine with parallel.zero_stage=1 (no torch DDP): the module docstring."""

    name = "ddp"
    grads_to_none = False  # views of the gradient buffer, for the whole run

    def __init__(self, model, groups, cfg, device):
        super().__init__(model, groups, cfg)
        # the ranks holding the same parameters: DP, and with CP each CP rank's gradient is its tokens' share,
        # which the reduce-scatter over DP x CP sums (runtime.finish_grads then runs no CP all-reduce)
        group = groups.dp_cp_group if groups.cp > 1 else groups.dp_group
        self.sums_cp = groups.cp > 1
        # the hooks need each micro-batch to be one autograd backward that accumulates into the parameters
        self.overlapped = (groups.pp == 1 and not cfg.train.bptt and not cfg.train.cuda_graph
                           and not cfg.train.cast_weights_once)
        self.reduced_in_backward = self.overlapped
        self.buffers = FlatBuffers(model.parameters(), group, int(cfg.parallel.bucket_mb * 2 ** 20), dp=groups.dp,
                                   overlap=self.overlapped)
        self._norm = _norm_views(model, self.buffers)
        self._norm_groups = [group] + [g for g, size in ((groups.tp_group, groups.tp), (groups.pp_group, groups.pp))
                                       if size > 1]
        if self.overlapped:
            when = "overlapped with the last micro-batch's backward"
        else:
            when = "after the step's backward (%s)" % (
                "pipeline stages run by the schedule" if groups.pp > 1 else "BPTT windows share one backward"
                if cfg.train.bptt else "the micro-batches are CUDA graph replays (train.cuda_graph)"
                if cfg.train.cuda_graph else "train.cast_weights_once: the Linear weights' gradients come from "
                "their bf16 copies' hooks, not from their own accumulation")
        log.info("engine ddp, distributed optimizer over %d ranks (DP %d x CP %d): reduce-scatter of fp32 gradients "
                 "%s, AdamW on this rank's slices, all-gather of the parameters; %.4g MB sent per step per rank",
                 self.buffers.n, groups.dp, groups.cp, when,
                 distopt_bytes_per_step(self.buffers.numel, self.buffers.n) / 1e6)

    def make_optimizer(self, build):
        self.optimizer = DistributedAdamW(build(), self.buffers)
        return self.optimizer

    def micro_batch(self, last: bool):
        if self.overlapped and last:
            self.buffers.arm()
        return contextlib.nullcontext()

    def reduce_grads(self) -> None:
        self.buffers.reduce_scatter()

    @torch.no_grad()
    def clip_grads(self, max_norm: float) -> float:
        """Norm of the canonical gradient from this rank's slices (the module docstring); scales the slices."""
        total = torch.zeros((), dtype=torch.float32, device=self.buffers.flats[0][1].device)
        for weight, views in self._norm.items():
            sq = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).pow(2).sum()
            total += sq if weight == 1.0 else sq * weight
        for group in self._norm_groups:
            total = comm.all_reduce(total, group)
        value = float(total.sqrt())
        if max_norm > 0 and math.isfinite(value):
            coef = min(1.0, max_norm / (value + 1e-6))
            if coef < 1.0:
                torch._foreach_mul_(self.buffers.grad_shards, coef)
        return value
