"""What one rank sends per optimizer step, collective by collective, inside its node and across the network: the
dry run prints it (`megassm-train --dry-run`), docs/across-nodes.md tabulates it.

    flows = step_flows(cfg, vocab)                 # [Flow] for the first rank of every pipeline stage
    t = totals(flows)                              # {"inside": bytes, "across": bytes} per rank and step

The model is NCCL's ring algorithms. A ring reduce-scatter or all-gather over n ranks passes (n - 1) / n of the
buffer through every rank, an all-reduce twice that. The ranks of a job are numbered node by node (torchrun gives
a node consecutive ranks), so a ring over ranks on k > 1 nodes has k of its n links crossing nodes: on average
k / n of what a rank sends leaves its node. A node with one network adapter per GPU (the usual 8 x 400 Gb/s
InfiniBand) carries each GPU's share on its own adapter; NCCL builds several rings, each leaving a node through
another GPU. (NCCL may pick a tree for all-reduces across nodes; its bytes per rank are of the same order.) A
point-to-point send (pipeline stages) crosses whole when its peer is on another node.

Counted per step: the data-parallel engine's gradient and weight traffic (by engine: ddp all-reduce, the ddp
engine's distributed optimizer (zero_stage=1) reduce-scatter + all-gather, FSDP2's all-gathers and
reduce-scatters with HSDP's replica all-reduce, DeepSpeed's by stage, approximately: its own buckets decide),
tensor parallelism's activation collectives (one per mixer forward and backward, again for recomputed blocks),
context parallelism's exchanges (Mamba-2 states and conv halo, attention K/V) and its gradient sum, pipeline
boundaries. Not counted: the scalars (loss, norms), the vocab-parallel loss's [N]-sized reductions, checkpoints.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from megassm.config import Config, data_parallel_size, world_size

__all__ = ["Flow", "step_flows", "totals", "gpus_per_node", "format_flows", "ring_sent", "layout_warnings", "to_dict"]


def ring_sent(kind: str, n: int, buffer: float) -> float:
    """Bytes one rank sends in a ring collective over n ranks on a buffer of `buffer` bytes (the full, unsharded
    buffer: the reduce-scatter's input, the all-gather's output, the all-reduce's tensor)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * buffer
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * buffer
    if kind == "p2p":
        return float(buffer)
    raise ValueError(f"unknown collective {kind!r}")


@dataclass
class Flow:
    what: str  # e.g. "FSDP2 gradient reduce-scatter (fp32)"
    kind: str  # all_reduce | reduce_scatter | all_gather | p2p
    group: str  # dp | shard | replicate | dp_cp | tp | cp | pp
    n: int  # ranks in the group (2 for p2p)
    nodes: int  # nodes the group spans
    buffer: float  # bytes of the full buffer per call
    calls: float  # calls per optimizer step
    pp_rank: int = 0

    @property
    def sent(self) -> float:
        return ring_sent(self.kind, self.n, self.buffer) * self.calls

    @property
    def across(self) -> float:
        if self.nodes <= 1:
            return 0.0
        return self.sent if self.kind == "p2p" else self.sent * self.nodes / self.n

    @property
    def inside(self) -> float:
        return self.sent - self.across


def gpus_per_node(cfg: Config) -> int:
    """parallel.gpus_per_node, else the launcher's LOCAL_WORLD_SIZE (torchrun), else the whole job on one node."""
    if cfg.parallel.gpus_per_node:
        return cfg.parallel.gpus_per_node
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local or world_size(cfg)


def _nodes(ranks: list[int], g: int) -> int:
    return len({r // g for r in ranks})


def _layout_groups(cfg: Config, rank: int) -> dict:
    """The global ranks of `rank`'s groups, order tp-cp-dp-pp (parallel/state.py rank_layout)."""
    p = cfg.parallel
    ws, tp, cp, pp = world_size(cfg), p.tp, p.cp, p.pp
    dp = ws // (tp * cp * pp)
    t, c = rank % tp, (rank // tp) % cp
    d, s = (rank // (tp * cp)) % dp, rank // (tp * cp * dp)

    def at(t_, c_, d_, s_):
        return t_ + tp * (c_ + cp * (d_ + dp * s_))

    out = {"tp": [at(x, c, d, s) for x in range(tp)], "cp": [at(t, x, d, s) for x in range(cp)],
           "dp": [at(t, c, x, s) for x in range(dp)], "pp": [at(t, c, d, x) for x in range(pp)],
           "dp_cp": sorted(at(t, y, x, s) for x in range(dp) for y in range(cp))}
    size = p.shard_size or dp
    k = d // size
    out["shard"] = out["dp"][k * size:(k + 1) * size]
    out["replicate"] = out["dp"][d % size::size]
    return out


def _param_split(model) -> tuple[int, int]:
    """(matmul parameters FSDP2 shards, the others) of a (TP-cut) meta model."""
    from megassm.parallel.fsdp2 import sharded_params

    total = sum(q.numel() for q in model.parameters())
    sharded = sum(q.numel() for q in sharded_params(model))
    return sharded, total - sharded


def step_flows(cfg: Config, vocab: int | None = None, bf16: bool | None = None) -> list[Flow]:
    """The collectives of one optimizer step for the first rank of each pipeline stage (every other rank of a
    stage sends the same)."""
    from megassm.training.memory import rank_models

    m, t, p = cfg.model, cfg.train, cfg.parallel
    vocab = m.vocab_size or vocab or 257
    if bf16 is None:
        bf16 = t.precision in ("auto", "bf16")
    a = 2 if bf16 else 4  # activation bytes under autocast
    ws, dp = world_size(cfg), data_parallel_size(cfg)
    g = gpus_per_node(cfg)
    accum = t.global_batch // (t.micro_batch * dp)
    windows = t.bptt_windows if t.bptt else 1
    micro = accum * windows  # forward + backward passes per step
    tokens = t.micro_batch * t.seq_len // p.cp  # one rank's tokens of a micro-batch
    flows: list[Flow] = []
    zero1 = p.engine == "ddp" and p.zero_stage == 1
    stride = ws // p.pp
    for r, model in enumerate(rank_models(cfg, vocab)):
        groups = _layout_groups(cfg, r * stride)

        def add(what, kind, group, buffer, calls, n=None):
            ranks = groups[group]
            size = len(ranks) if n is None else n
            if size > 1 and calls > 0 and buffer > 0:
                flows.append(Flow(what, kind, group, size, _nodes(ranks, g), float(buffer), float(calls), r))

        sharded, small = _param_split(model)
        n_local = sharded + small
        # --- data parallelism: the engine's gradients and weights --------------------------------------------
        if zero1 and (dp > 1 or p.cp > 1):
            grp = "dp_cp" if p.cp > 1 else "dp"
            add("distributed optimizer: gradient reduce-scatter (fp32 sums)", "reduce_scatter", grp, 4 * n_local, 1)
            add("distributed optimizer: parameter all-gather (fp32)", "all_gather", grp, 4 * n_local, 1)
        elif dp > 1 and p.engine == "ddp":
            add("DDP gradient all-reduce (fp32)", "all_reduce", "dp", 4 * n_local, 1)
        elif dp > 1 and p.engine == "fsdp2":
            gb = 2 if bf16 and p.fsdp_param_dtype != "fp32" else 4
            rb = 4 if p.fsdp_reduce_dtype == "fp32" or gb == 4 else 2
            gathers = {"step": 1, "micro_batch": micro, "block": 2 * micro}[p.fsdp_reshard]
            emb = 0 if model.embedding is None else model.embedding.weight.numel()
            low = sharded - emb  # the embedding unit is gathered in fp32 (the lookup reads fp32 rows)
            add(f"FSDP2 weight all-gather ({'bf16' if gb == 2 else 'fp32'})", "all_gather", "shard",
                gb * low + 4 * emb, gathers)
            syncs = 1 if p.fsdp_grad_sync == "step" else micro
            add(f"FSDP2 gradient reduce-scatter ({'fp32' if rb == 4 else 'bf16'})", "reduce_scatter", "shard",
                rb * sharded, syncs)
            if 0 < p.shard_size < dp:
                add(f"HSDP replica all-reduce of the gradient shards ({'fp32' if rb == 4 else 'bf16'})", "all_reduce",
                    "replicate", rb * sharded / p.shard_size, 1)
            add("small parameters' gradient all-reduce (fp32)", "all_reduce", "dp", 4 * small, 1)
        elif dp > 1 and p.engine == "deepspeed":
            lp = 2 if bf16 else 4
            stage = p.zero_stage
            if stage == 0:
                add("DeepSpeed ZeRO-0 gradient all-reduce", "all_reduce", "dp", lp * n_local, 1)
            else:
                add(f"DeepSpeed ZeRO-{stage} gradient reduce-scatter", "reduce_scatter", "dp", lp * n_local,
                    micro if stage >= 2 else 1)
                add(f"DeepSpeed ZeRO-{stage} weight all-gather", "all_gather", "dp", lp * n_local,
                    2 * micro if stage == 3 else 1)
        # --- context parallelism -------------------------------------------------------------------------------
        if p.cp > 1:
            if not zero1:  # the distributed optimizer's reduce-scatter over DP x CP sums over CP too
                add("CP gradient all-reduce (fp32)", "all_reduce", "cp", 4 * n_local, 1)
            for layer in model.layers:
                mix = layer.mixer
                if layer.kind == "M":
                    state = t.micro_batch * (mix.nheads * mix.headdim * mix.d_state + mix.nheads) * 4
                    halo = t.micro_batch * (mix.d_conv - 1) * mix.conv_dim * a
                    for what, buf in (("CP Mamba-2 state exchange", state), ("CP Mamba-2 conv halo", halo)):
                        add(what + " (forward all-gather, backward reduce-scatter)", "all_gather", "cp",
                            p.cp * buf, 2 * micro)
                elif layer.kind == "*":
                    kv = tokens * 2 * mix.n_kv_heads * mix.head_dim * a
                    add("CP attention K/V (forward all-gather, backward reduce-scatter)", "all_gather", "cp",
                        p.cp * kv, 2 * micro)
        # --- tensor parallelism: one collective per mixer forward and backward, again when recomputed -------------
        if p.tp > 1:
            act = tokens * m.d_model * a
            n_blocks = len(model.layers)
            recomputed = 0
            if t.activation_checkpointing:
                recomputed = min(n_blocks, t.activation_checkpointing_blocks or n_blocks)
            per_micro = 2 * n_blocks + recomputed
            plan = getattr(model, "pp_plan", None)
            per_micro += (1 if plan is None or plan.first else 0) + (1 if plan is None or plan.last else 0)
            what = "TP all-gather + reduce-scatter of activations (SP)" if p.sp else "TP all-reduce of activations"
            add(what, "all_reduce", "tp", act, per_micro * micro)
        # --- pipeline boundaries: hidden (activation dtype) + fp32 residual, forward and backward ---------------------
        if p.pp > 1:
            boundary = tokens * m.d_model * (a + 4) / (p.tp if p.sp else 1)
            ranks = groups["pp"]
            v = p.pp_virtual
            for direction, peer in (("forward", r + 1), ("backward", r - 1)):
                wraps = 0 <= peer < p.pp
                if v > 1 or wraps:
                    dst = ranks[peer % p.pp]
                    sends = v if v > 1 else 1
                    if v > 1 and not wraps:
                        sends = v - 1  # the first / last rank's outer stages end the pipeline
                    flows.append(Flow(f"PP {direction} send (hidden + fp32 residual)", "p2p", "pp", 2,
                                      _nodes([ranks[r], dst], g), boundary, sends * micro, r))
    return flows


def layout_warnings(cfg: Config) -> list[str]:
    """Legal layouts whose data-parallel traffic crosses nodes more than it needs to (the dry run prints them)."""
    p, t = cfg.parallel, cfg.train
    g, ws = gpus_per_node(cfg), world_size(cfg)
    dp = data_parallel_size(cfg)
    out = []
    if p.engine != "fsdp2" or dp == 1 or ws <= g:
        return out
    accum = t.global_batch // (t.micro_batch * dp)
    span = (p.shard_size or dp) * p.tp * p.cp * p.pp  # consecutive ranks of one shard group
    if 0 < p.shard_size < dp and span % g and g % span:
        out.append(f"parallel.shard_size={p.shard_size}: a shard group of {span} GPUs straddles nodes of {g} "
                   "(parallel.gpus_per_node); make shard_size x tp a divisor or a multiple of the GPUs per node")
    elif p.shard_size in (0, dp) and accum > 1 and p.fsdp_grad_sync == "micro_batch":
        out.append(f"parallel.engine=fsdp2 over {dp} ranks on {ws // g} nodes reduce-scatters each of the {accum} "
                   f"micro-batches' gradients across nodes: parallel.shard_size={max(1, g // (p.tp * p.cp * p.pp))} "
                   "(HSDP) keeps them inside a node and crosses once a step (docs/across-nodes.md)")
    return out


def totals(flows: list[Flow], pp_rank: int | None = None) -> dict:
    """{"sent", "inside", "across"} bytes per rank and step (the pipeline rank that sends most across nodes when
    `pp_rank` is None)."""
    by_rank: dict = {}
    for f in flows:
        d = by_rank.setdefault(f.pp_rank, {"sent": 0.0, "inside": 0.0, "across": 0.0})
        d["sent"] += f.sent
        d["inside"] += f.inside
        d["across"] += f.across
    if not by_rank:
        return {"sent": 0.0, "inside": 0.0, "across": 0.0, "pp_rank": 0}
    r = pp_rank if pp_rank is not None else max(by_rank, key=lambda k: (by_rank[k]["across"], by_rank[k]["sent"]))
    return {**by_rank.get(r, {"sent": 0.0, "inside": 0.0, "across": 0.0}), "pp_rank": r}


def format_flows(cfg: Config, flows: list[Flow]) -> str:
    """The dry run's lines: the totals, then each collective (GB = 1e9 bytes)."""
    g = gpus_per_node(cfg)
    ws = world_size(cfg)
    nodes = -(-ws // g)
    tot = totals(flows)
    where = "" if cfg.parallel.pp == 1 else f" (pipeline rank {tot['pp_rank']})"
    lines = [f"# traffic per GPU per optimizer step{where}, ring collectives, {nodes} node(s) of {min(g, ws)} GPU(s) "
             f"(parallel.gpus_per_node): inside nodes {tot['inside'] / 1e9:.2f} GB, across nodes {tot['across'] / 1e9:.2f} "
             "GB (docs/across-nodes.md)"]
    for f in flows:
        if f.pp_rank != tot["pp_rank"]:
            continue
        span = f"{f.nodes} nodes" if f.nodes > 1 else "1 node"
        lines.append(f"#   {f.what}: {f.group} group of {f.n} ({span}), {f.calls:g} x {f.buffer / 1e9:.3f} GB per "
                     f"step: sends {f.inside / 1e9:.2f} GB inside, {f.across / 1e9:.2f} GB across")
    if len(lines) == 1:
        lines.append("#   (no collectives: one rank)")
    return "\n".join(lines)


def to_dict(flows: list[Flow]) -> dict:
    return {"totals": totals(flows), "flows": [{**asdict(f), "sent": f.sent, "inside": f.inside, "across": f.across}
                                                for f in flows]}
