"""Pipeline parallelism: the blocks split into stages over the ranks of a pipeline group, run by the
schedules of torch.distributed.pipelining (1F1B, GPipe, interleaved 1F1B with virtual stages).

    model = build_model(cfg.model, vocab_size=V, device="meta")       # shapes only
    split_model(model, pp, pp_rank, virtual=1, group=pp_group, emb_group=emb_group)  # keep this rank's stages
    model.to_empty(device="cpu"); init_stage_weights(model, seed)   # canonical weights, by name
    apply_tensor_parallel(model, tp_group, sp)                       # optional: TP inside every stage
    apply_pipeline_parallel(model, schedule="1f1b")                  # stage modules, schedules
    loss_sum = train_step(model, micro_batches, autocast)            # forward + backward of one step
    sync_embedding_grads(model); clip_grad_norm_pp(model, max_norm)  # tied copies summed; global norm

Stages are cut at `|` in the pattern, else balanced by parameter count (`balance_stages`). Global stage s
of pp x virtual stages lives on pipeline rank s % pp (Megatron's / torch's interleaved order). A rank keeps
only its blocks in `model.layers`, which is keyed by global block index (models/lm.py `Layers`): the other
blocks are deleted, so every parameter keeps its single-device name ("layers.9.mixer..." is block 9 on any
rank) and init, checkpoints and every plan that walks `model.layers` need no renaming. Each stage runs the
model's own code (`LanguageModel.forward_blocks` over its blocks). The embedding lives on the first stage,
the final norm and the head on the last one; with tied embeddings the last stage holds a copy of the
embedding weight (same canonical init, same checkpoint entry), whose gradient is summed with the first
stage's over the embedding group (first + last pipeline rank), so both copies take identical optimizer
steps.

What crosses a stage boundary is the block pair (hidden, fp32 residual) of one micro-batch (sequence
shards under SP). Every pipeline rank of a data-parallel rank reads the same batches, so `seq_idx` is
given to every stage by its own rank (the schedule chunks it like the inputs), the tokens to the first
stage, the labels to the last. (Why torch's schedules and not megatron-core's: docs/parallelism.md.)
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from megassm.models.init import draw, param_seed, rule_of

from . import comm

log = logging.getLogger("megassm.pp")

__all__ = ["PPPlan", "pp_plan_of", "balance_stages", "stage_layout", "split_model", "init_stage_weights",
           "StageModule", "apply_pipeline_parallel", "train_step", "eval_losses", "eval_batch_losses",
           "sync_embedding_grads",
           "grad_norm_pp", "clip_grad_norm_pp", "gather_canonical_states", "load_canonical_states", "SCHEDULES"]

SCHEDULES = ("1f1b", "gpipe")


def unwrap(model):
    return getattr(model, "module", model)


def pp_plan_of(model: nn.Module) -> "PPPlan | None":
    return getattr(unwrap(model), "pp_plan", None)


# ----------------------------------------------------------------------------------------------------
# where the blocks go
# ----------------------------------------------------------------------------------------------------
def balance_stages(costs: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[list[int]]:
    """Cut blocks with `costs` (parameter counts) into `n_stages` contiguous non-empty stages that minimize
    the largest stage cost; the first stage also carries `first_extra` (the embedding), the last one
    `last_extra` (final norm + head). Exact (dynamic programming over cut points, integer arithmetic),
    deterministic; among equally good splits the earliest cuts win (the first stages, which keep the most
    micro-batches' activations in flight under 1F1B, take the fewest blocks). Returns block indices per
    stage."""
    n = len(costs)
    if n_stages < 1:
        raise ValueError(f"pipeline: need at least one stage, got {n_stages}")
    if n < n_stages:
        raise ValueError(f"pipeline: {n} blocks cannot fill {n_stages} stages (each stage needs a block)")
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + int(c))

    def load(s: int, i: int, j: int) -> int:  # stage s holds blocks i .. j-1
        return pre[j] - pre[i] + (first_extra if s == 0 else 0) + (last_extra if s == n_stages - 1 else 0)

    inf = float("inf")
    # best[s][j]: the smallest max-load of blocks 0..j-1 in stages 0..s; cut[s][j]: start of stage s there
    best = [[inf] * (n + 1) for _ in range(n_stages)]
    cut = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = load(0, 0, j)
    for s in range(1, n_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                v = max(best[s - 1][i], load(s, i, j))
                if v < best[s][j]:  # strict: the smallest i (earliest cut) wins ties
                    best[s][j], cut[s][j] = v, i
    bounds, j = [], n
    for s in range(n_stages - 1, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    bounds.append((0, j))
    return [list(range(i, j)) for i, j in reversed(bounds)]


def stage_layout(model: nn.Module, n_stages: int) -> list[list[int]]:
    """Global block indices of each of `n_stages` stages: the `|` cuts of the pattern when it has any (their
    count must be n_stages), else `balance_stages` by parameter count (works on a meta model)."""
    stages = model.stages
    if len(stages) > 1:
        if len(stages) != n_stages:
            raise ValueError(f"model.pattern '{model.pattern}' has {len(stages)} stages (cut by '|') but the "
                             f"pipeline has {n_stages} (parallel.pp x parallel.pp_virtual)")
        empty = [s for s, blocks in enumerate(stages) if not blocks]
        if empty:
            raise ValueError(f"model.pattern '{model.pattern}': pipeline stage(s) {empty} have no block")
        return [list(s) for s in stages]
    costs = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    first = model.embedding.weight.numel()
    last = model.norm_f.weight.numel() + (
        model.lm_head.weight.numel() if model.lm_head is not None else model.embedding.weight.numel())
    return balance_stages(costs, n_stages, first, last)


# ----------------------------------------------------------------------------------------------------
# the plan
# ----------------------------------------------------------------------------------------------------
@dataclass
class PPPlan:
    group: object  # the pipeline group (stage order = group rank order)
    pp: int
    rank: int
    virtual: int
    layout: list  # global block indices of every global stage (pp * virtual of them)
    stage_ids: list  # the global stages held here: rank, rank + pp, ...
    own: list  # global indices of the blocks held here, in order (the keys of model.layers)
    tied: bool
    emb_group: object = None  # first + last pipeline rank (tied embeddings)
    schedule: str = "1f1b"
    state_names: list = field(default_factory=list)  # the single-device state_dict keys, in order
    decay_names: list = field(default_factory=list)  # the single-device optimizer's order (param_groups)
    no_decay_names: list = field(default_factory=list)
    modules: list = field(default_factory=list)  # StageModule per held stage (apply_pipeline_parallel)
    schedules: dict = field(default_factory=dict)  # (n_microbatches, train) -> torch schedule

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def split_model(model: nn.Module, pp: int, rank: int, virtual: int = 1, group=None, emb_group=None,
                layout: list | None = None) -> nn.Module:
    """Keep only pipeline rank `rank`'s stages of the single-device `model` (best built on the meta device:
    nothing is allocated for the other stages), in place: its blocks, the embedding on the first stage
    (and a copy on the last with tied embeddings), final norm and head on the last. Records the canonical
    parameter order for checkpoints. Materialize with `model.to_empty(device=...)`, then
    `init_stage_weights(model, seed)`."""
    if pp_plan_of(model) is not None:
        raise RuntimeError("split_model: the model is already split into pipeline stages")
    if getattr(model, "tp_plan", None) is not None or getattr(model, "cp_plan", None) is not None:
        raise RuntimeError("split_model: split the single-device model first, then apply the TP / CP plans")
    if not 0 <= rank < pp:
        raise ValueError(f"split_model: pipeline rank {rank} outside 0..{pp - 1}")
    n_stages = pp * virtual
    layout = stage_layout(model, n_stages) if layout is None else [list(s) for s in layout]
    if [b for s in layout for b in s] != list(range(model.n_layers)) or len(layout) != n_stages:
        raise ValueError(f"split_model: layout {layout} is not {n_stages} contiguous stages of the "
                         f"{model.n_layers} blocks in order")
    state_names = list(model.state_dict().keys())
    decay, no_decay = [], []
    for name, _ in model.named_parameters():
        (no_decay if rule_of(model, name).no_wd else decay).append(name)
    stage_ids = [rank + c * pp for c in range(virtual)]
    own = [b for s in stage_ids for b in layout[s]]
    plan = PPPlan(group=group, pp=pp, rank=rank, virtual=virtual, layout=layout, stage_ids=stage_ids, own=own,
                  tied=model.lm_head is None, emb_group=emb_group, state_names=state_names,
                  decay_names=decay, no_decay_names=no_decay)
    for b in range(model.n_layers):  # the held blocks keep their global keys, hence their names
        if b not in own:
            del model.layers[b]
    if not plan.first and not (plan.last and plan.tied):
        model.embedding = None
    if not plan.last:
        model.norm_f = None
        if model.lm_head is not None:
            model.lm_head = None
    model.pp_plan = plan
    return model


@torch.no_grad()
def init_stage_weights(model: nn.Module, seed: int) -> None:
    """Canonical init of a split model: each parameter gets the value its (single-device) name gets from
    `LanguageModel.init_weights(seed)`."""
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(f"init_stage_weights: parameter '{name}' is on the meta device; materialize the "
                               "model first (model.to_empty(device=...))")
        rule = rule_of(model, name)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(seed, name))
        p.copy_(draw(rule, tuple(p.shape), gen))
        p._no_weight_decay = rule.no_wd


# ----------------------------------------------------------------------------------------------------
# stage modules and schedules
# ----------------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: a stage's input gradients are sent to the
    previous stage as they are, and under SP autograd may hand back strided views."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


class StageModule(nn.Module):
    """Global stage `index` of a split model, for torch's PipelineStage: it holds the model's own submodules
    of this stage under their model names (so its parameters are exactly this stage's) and runs the model's
    code. First: tokens -> embedding -> blocks; middle: (hidden, residual) -> blocks; both return the pair
    (hidden, fp32 residual); last: -> blocks -> fused add + final norm -> head -> logits (the vocabulary
    shard under TP). `seq_idx` (keyword) reaches every stage. The forward runs under `self.autocast()` (set
    per step by the caller), so the schedule's backward runs outside autocast."""

    def __init__(self, model: nn.Module, index: int, blocks: list[int], first: bool, last: bool):
        super().__init__()
        self.index, self.first, self.last = index, first, last
        tied_head = last and model.lm_head is None
        self.embedding = model.embedding if (first or tied_head) else None  # the last stage's: the tied head
        self.layers = type(model.layers)((b, model.layers[b]) for b in blocks)  # the same blocks, same keys
        self.norm_f = model.norm_f if last else None
        self.lm_head = model.lm_head if last else None
        object.__setattr__(self, "lm", model)  # not a submodule: its parameters belong to the stages
        self.block_ids = list(blocks)  # global block indices (also the BPTT carrier's keys)
        self.autocast = contextlib.nullcontext
        self.carrier = None  # BPTT (training/bptt.py): set by train_step(..., carrier=) for one schedule run

    def forward(self, *args, seq_idx: torch.Tensor | None = None, bptt_mb: torch.Tensor | None = None,
                bptt_reset: torch.Tensor | None = None):
        """`bptt_mb` (CPU, [micro-batch] filled with the micro-batch's index) and `bptt_reset` ([micro-batch]
        bool: the row starts a new document) come with a BPTT step: the blocks start from the carrier's
        states of that micro-batch and hand their final states back."""
        lm = self.lm
        carrier = self.carrier if bptt_mb is not None else None
        states = None
        if carrier is not None:
            m = int(bptt_mb[0])
            states = carrier.stage_begin(m, bptt_reset, self.block_ids)
        with self.autocast():
            if self.first:
                hidden, residual = lm.embedding(args[0]), None
            else:
                hidden, residual = (_ContiguousGrad.apply(t) for t in args)
            hidden, residual, finals = lm.forward_blocks(hidden, residual, seq_idx=seq_idx, blocks=self.block_ids,
                                                         states=states, return_states=carrier is not None)
            if carrier is not None:
                carrier.stage_end(m, self.block_ids, finals)
            if self.last:
                normed, _ = lm.norm_f.add_forward(hidden, residual)
                if lm.loss_chunk_tokens:  # the loss function runs the head chunk by chunk (_loss_fn)
                    return normed
                return lm._head(normed)
        return hidden.contiguous(), residual.contiguous()  # sent as they are (SP shards are strided views)


def apply_pipeline_parallel(model: nn.Module, schedule: str = "1f1b") -> nn.Module:
    """Build the stage modules of a split (and possibly tensor-parallel) model; schedules are made on first
    use. `schedule`: 1f1b (interleaved 1F1B with virtual stages) or gpipe (looped BFS with virtual stages)."""
    plan = pp_plan_of(model)
    if plan is None:
        raise RuntimeError("apply_pipeline_parallel: split the model first (split_model)")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got '{schedule}'")
    plan.schedule = schedule
    plan.modules = [StageModule(model, s, plan.layout[s], s == 0, s == plan.n_stages - 1) for s in plan.stage_ids]
    plan.schedules = {}
    n_params = sum(p.numel() for p in model.parameters())
    log.info("pipeline rank %d/%d: stage(s) %s, blocks %s, %.2fM parameters held (%s schedule)", plan.rank,
             plan.pp, plan.stage_ids, [plan.layout[s] for s in plan.stage_ids], n_params / 1e6, schedule)
    return model


def _loss_fn(model: nn.Module, n: int):
    last = next((m for m in pp_plan_of(model).modules if m.last), None)  # only the last stage computes a loss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if model.loss_chunk_tokens:  # `logits` is the final norm's output: head + loss in chunks, under the
            with last.autocast():  # stage's autocast, as the head would have run inside the stage
                loss = model.head_loss(logits, labels)
        else:
            loss = model.loss_fn(logits, labels)
        scaled = loss / n  # as the single-device accumulation: (loss / n).backward() per micro-batch
        scaled.raw = loss.detach()  # the micro-batch's own loss, for the caller
        return scaled

    return loss_fn


def _schedule(model: nn.Module, n: int, train: bool):
    """The torch schedule for `n` micro-batches (cached per (n, train): each has its own PipelineStage
    objects, so train and eval steps never re-plan each other's buffers)."""
    plan = pp_plan_of(model)
    key = (n, train)
    if key in plan.schedules:
        return plan.schedules[key]
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleLoopedBFS)

    dev = next(model.parameters()).device
    stages = [PipelineStage(m, m.index, plan.n_stages, dev, group=plan.group) for m in plan.modules]
    loss_fn = _loss_fn(unwrap(model), n)
    if plan.virtual == 1:
        # torch's 1F1B needs n >= stages; with fewer micro-batches every schedule is all warm-up = GPipe
        cls = Schedule1F1B if (plan.schedule == "1f1b" and train and n >= plan.pp) else ScheduleGPipe
        held = stages[0]
    else:
        cls = ScheduleInterleaved1F1B if (plan.schedule == "1f1b" and train) else ScheduleLoopedBFS
        held = stages
    if "scale_grads" not in inspect.signature(cls.__init__).parameters:
        raise RuntimeError(f"pipeline parallelism needs torch.distributed.pipelining schedules with scale_grads= "
                           f"(torch >= 2.6); this is torch {torch.__version__}")
    try:
        sched = cls(held, n_microbatches=n, loss_fn=loss_fn, scale_grads=False)  # loss_fn scales by 1/n
    except ValueError as e:
        raise ValueError(f"pipeline: {n} micro-batches with parallel.pp={plan.pp} x "
                         f"parallel.pp_virtual={plan.virtual}: {e}") from e
    plan.schedules[key] = sched
    return sched


def _run(model: nn.Module, batches: list[dict], autocast, train: bool, carrier=None,
         per_batch: bool = False) -> torch.Tensor:
    plan = pp_plan_of(model)
    if not plan.modules:
        raise RuntimeError("pipeline: call apply_pipeline_parallel(model) first")
    n = len(batches)
    sched = _schedule(model, n, train)
    for m in plan.modules:
        m.autocast = autocast

    def cat(key):
        return torch.cat([b[key] for b in batches]) if batches[0].get(key) is not None else None

    kwargs = {}
    seq_idx = cat("seq_idx")
    if seq_idx is not None:
        kwargs["seq_idx"] = seq_idx
    args = (cat("tokens"),) if plan.first else ()
    target = cat("labels") if plan.last else None
    losses = [] if plan.last else None
    if carrier is not None:  # BPTT: which micro-batch each row belongs to (chunked like the inputs)
        mb = batches[0]["tokens"].shape[0]
        kwargs["bptt_mb"] = torch.arange(n).repeat_interleave(mb)  # CPU: read without a device sync
        if batches[0].get("reset") is not None:
            kwargs["bptt_reset"] = cat("reset")
    if "return_outputs" in inspect.signature(sched.step).parameters:  # keep no merged logits (torch >= 2.8)
        kwargs["return_outputs"] = False
    for m in plan.modules:
        m.carrier = carrier
    try:
        if train:
            sched.step(*args, target=target, losses=losses, **kwargs)
        else:
            sched.eval(*args, target=target, losses=losses, **kwargs)
    finally:
        for m in plan.modules:
            m.carrier = None
    if carrier is not None:
        carrier.commit()
    dev = next(model.parameters()).device
    total = torch.zeros(n if per_batch else (), device=dev, dtype=torch.float32)
    if plan.last:
        if len(losses) != n:
            raise RuntimeError(f"pipeline: {len(losses)} losses for {n} micro-batches")
        for i, loss in enumerate(losses):
            raw = (loss.raw if hasattr(loss, "raw") else loss.detach() * n).float()
            if per_batch:
                total[i] = raw
            else:
                total += raw
    return comm.all_reduce(total, plan.group)  # the last stage's sum (or losses), on every stage


def train_step(model: nn.Module, batches: list[dict], autocast=contextlib.nullcontext, carrier=None) -> torch.Tensor:
    """Forward and backward of one step's micro-batches (dicts with tokens, labels, seq_idx of one
    micro-batch each, as the data loader gives them) through the pipeline schedule. Gradients accumulate
    as in the single-device loop ((loss / n).backward() per micro-batch). Returns the sum of the
    micro-batch losses (fp32 scalar) on every rank of the pipeline group. Collective over the pipeline
    (and TP) group. `carrier`: a BPTT StateCarrier (training/bptt.py): micro-batch m's blocks start from its
    carried states (rows with batch["reset"] cleared) and its final states are carried on."""
    return _run(model, batches, autocast, train=True, carrier=carrier)


@torch.no_grad()
def eval_losses(model: nn.Module, batches: list[dict], autocast=contextlib.nullcontext) -> torch.Tensor:
    """Forward only: the sum of the batches' losses, on every rank of the pipeline group."""
    return _run(model, batches, autocast, train=False)


@torch.no_grad()
def eval_batch_losses(model: nn.Module, batches: list[dict], autocast=contextlib.nullcontext) -> torch.Tensor:
    """Forward only: each batch's loss (mean over its labelled tokens), [len(batches)] fp32 on every rank of the
    pipeline group, so the caller can weight them by their token counts."""
    return _run(model, batches, autocast, train=False, per_batch=True)


# ----------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def sync_embedding_grads(model: nn.Module) -> None:
    """Tied embeddings: sum the gradients of the first stage's embedding and the last stage's copy (over
    the embedding group), so both copies take the same optimizer step."""
    plan = pp_plan_of(model)
    if plan is None or not plan.tied or plan.pp == 1 or plan.emb_group is None:
        return
    w = unwrap(model).embedding.weight
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    red = comm.all_reduce(w.grad, plan.emb_group)
    if red is not w.grad:
        w.grad.copy_(red)


def tied_copy(plan: PPPlan) -> set:
    """Names counted elsewhere in the global norm: the last stage's copy of a tied embedding."""
    return {"embedding.weight"} if plan.tied and plan.last and not plan.first else set()


@torch.no_grad()
def grad_norm_pp(model: nn.Module) -> torch.Tensor:
    """L2 norm of the whole model's canonical gradient: per stage over TP (replicas counted once, see
    tp.grad_sq_tp), then summed over the pipeline group, the tied embedding counted once. Call after
    sync_tp_grads / sync_embedding_grads."""
    from .tp import grad_sq_tp

    inner = unwrap(model)
    plan = pp_plan_of(inner)
    sq = grad_sq_tp(inner, exclude=tied_copy(plan))
    sq = sq.to(next(inner.parameters()).device)
    return comm.all_reduce(sq, plan.group).sqrt()


@torch.no_grad()
def clip_grad_norm_pp(model: nn.Module, max_norm: float) -> float:
    """optim.clip_grad_norm for the whole pipelined model: the global norm, the same coefficient on every
    rank."""
    import math

    value = float(grad_norm_pp(model).item())
    if max_norm > 0 and math.isfinite(value):
        coef = min(1.0, max_norm / (value + 1e-6))
        if coef < 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    return value


# ----------------------------------------------------------------------------------------------------
# canonical checkpoints
# ----------------------------------------------------------------------------------------------------
def param_kinds(plan: PPPlan) -> dict:
    kinds = {n: "decay" for n in plan.decay_names}
    kinds.update({n: "no_decay" for n in plan.no_decay_names})
    return kinds


def _optimizer_by_name(optimizer, model, plan: PPPlan) -> dict:
    """This stage's canonical optimizer state keyed by parameter name, plus the hyperparameters of
    its decay / no-decay groups."""
    from .tp import optimizer_params, optimizer_state_to_canonical

    sd = optimizer_state_to_canonical(optimizer, model)  # TP shards gathered (collective)
    names = [n for n, _ in optimizer_params(optimizer, model)]
    kinds = param_kinds(plan)
    groups = {}
    for g in sd["param_groups"]:
        if g["params"]:
            groups.setdefault(kinds[names[g["params"][0]]], {k: v for k, v in g.items() if k != "params"})
    # CPU copies: they are pickled to the first pipeline rank, which must not unpickle them onto another
    # rank's GPU (and checkpoints hold CPU tensors)
    state = {names[i]: {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
             for i, st in sd["state"].items()}
    return {"state": state, "groups": groups}


def gather_canonical_states(model: nn.Module, optimizer, groups) -> tuple[dict | None, dict | None]:
    """(model_state, optim_state) of the whole model in the single-device layout (names, shapes, optimizer
    parameter order) on global rank 0; (None, None) elsewhere. Collective: call on every rank (TP shards are
    gathered inside each stage, then the stages' states go to the first pipeline rank)."""
    from .tp import canonical_state_dict

    inner = unwrap(model)
    plan = pp_plan_of(inner)
    local = canonical_state_dict(inner)
    opt = _optimizer_by_name(optimizer, inner, plan) if optimizer is not None else None
    if groups.tp_rank or groups.dp_rank or groups.cp_rank:  # every pipeline of replicas holds the same
        return None, None
    objs = [None] * plan.pp if plan.rank == 0 else None
    if plan.pp > 1:
        dst = dist.get_global_rank(plan.group, 0) if plan.group is not None else 0
        dist.gather_object((local, opt), objs, dst=dst, group=plan.group)
    else:
        objs = [(local, opt)]
    if plan.rank != 0:
        return None, None
    merged = {}
    for st, _ in objs:
        for k, v in st.items():
            merged.setdefault(k, v)  # a tied embedding: the first stage's (the copies are equal)
    missing = [k for k in plan.state_names if k not in merged]
    if missing:
        raise RuntimeError(f"pipeline checkpoint: no stage holds {missing}")
    model_state = {k: merged[k] for k in plan.state_names}
    if optimizer is None:
        return model_state, None
    order = plan.decay_names + plan.no_decay_names
    index = {n: i for i, n in enumerate(order)}
    state, hyper = {}, {}
    for _, o in objs:
        for name, st in o["state"].items():
            state.setdefault(index[name], st)
        for kind, hp in o["groups"].items():
            hyper.setdefault(kind, hp)
    param_groups, off = [], 0
    for kind, names in (("decay", plan.decay_names), ("no_decay", plan.no_decay_names)):
        if names:
            param_groups.append({**hyper[kind], "params": list(range(off, off + len(names)))})
            off += len(names)
    return model_state, {"state": dict(sorted(state.items())), "param_groups": param_groups}


@torch.no_grad()
def load_canonical_states(model: nn.Module, optimizer, model_state: dict, optim_state: dict | None) -> None:
    """Load a canonical (single-device) checkpoint into this rank's stages (and TP shards)."""
    from .tp import optimizer_params, load_canonical_optimizer_state, load_canonical_state_dict

    inner = unwrap(model)
    plan = pp_plan_of(inner)
    missing = sorted(k for k in inner.state_dict() if k not in model_state)
    unexpected = sorted(set(model_state) - set(plan.state_names))
    if missing or unexpected:
        raise KeyError(f"pipeline checkpoint: missing {missing}, unexpected {unexpected}")
    load_canonical_state_dict(inner, {k: model_state[k] for k in inner.state_dict()})
    if optimizer is None or optim_state is None:
        return
    order = plan.decay_names + plan.no_decay_names
    n_saved = sum(len(g["params"]) for g in optim_state["param_groups"])
    if n_saved != len(order):
        raise ValueError(f"pipeline checkpoint: the optimizer state has {n_saved} parameters, the model {len(order)}")
    kinds = param_kinds(plan)
    hyper = {kinds[order[g["params"][0]]]: {k: v for k, v in g.items() if k != "params"}
             for g in optim_state["param_groups"] if g["params"]}
    index = {n: i for i, n in enumerate(order)}
    mine = optimizer.state_dict()
    names = [n for n, _ in optimizer_params(optimizer, inner)]
    state = {}
    for i, name in enumerate(names):
        st = optim_state["state"].get(index[name])
        if st:
            state[i] = st
    param_groups = [{**hyper[kinds[names[g["params"][0]]]], "params": g["params"]} for g in mine["param_groups"]]
    load_canonical_optimizer_state(optimizer, inner, {"state": state, "param_groups": param_groups})
