"""The planner's model of one optimizer step of a layout (docs/planner.md "The model").

    cal = Calibration.load("configs/planner/h100-80gb.json")
    p = predict(cfg, cal, network="ib400")       # cfg: a validated Config with its layout and world size
    p.step_s, p.tokens_per_s_per_gpu, p.mfu, p.exposed_comm_s, p.bubble

Per rank and step:
  compute   = micro-batches x (the rank's blocks at its shapes + the model's ends), from the calibration's block
              table (graph times under train.cuda_graph, else eager: the GPU or the host, whichever is slower),
              activation checkpointing's recompute where on, FSDP2's own copies by its measured ratio, CP's
              treatment by its measured ratio; less one gradient accumulation where a step's first micro-batch
              writes fresh gradients (the table's micro-batches accumulate into held ones);
  optimizer = clipping + AdamW over the parameters the rank steps (its shard under FSDP2 / the distributed
              optimizer / DeepSpeed): the slower of the GPU (ns per parameter over large tensors) and the host
              (us per tensor);
  comm      = each collective of training/traffic.py (the dry run's flows) through an alpha-beta model of its link
              class (inside a node, across nodes), with the overlap the trainer really has (`_exposed`);
  bubble    = the pipeline schedule's idle share, (pp - 1) / (v x m + pp - 1) of the compute.
step = compute + optimizer + exposed comm, over (1 - bubble) under PP.

Each term is a small function with a unit test on a hand-worked case (tests/test_planner.py).
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field

from megassm.config import Config, blocks_of, data_parallel_size, world_size
from megassm.planner.calibrate import block_signature, head_signature

__all__ = ["Calibration", "Link", "LINKS", "NETWORKS", "Prediction", "predict", "collective_s", "bubble",
           "MissingCalibration"]


class MissingCalibration(LookupError):
    """The calibration file has no entry for a block / shape the layout needs (named in the message)."""


# ----------------------------------------------------------------------------------------------------
# links: documented vendor figures, not measured here (no multi-GPU machine)
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """alpha-beta of one link class, per GPU: a collective call costs `alpha_s` plus the bytes a rank sends over
    `bw` (bytes/s), whose effective value rises with the message size: bw x size / (size + half_size) (NCCL's
    rings reach their bus bandwidth only for large messages)."""

    name: str
    alpha_s: float
    bw: float
    half_size: float
    source: str

    def seconds(self, sent_bytes: float, message_bytes: float) -> float:
        if sent_bytes <= 0:
            return 0.0
        eff = self.bw * message_bytes / (message_bytes + self.half_size)
        return self.alpha_s + sent_bytes / eff


LINKS = {
    "nvlink-h100": Link("nvlink-h100", 15e-6, 360e9, 32e6,
                        "NVLink 4 on H100 SXM: 450 GB/s per direction per GPU (NVIDIA H100 datasheet), taken at 80% "
                        "as NCCL's ring bus bandwidth on large messages; half of it at ~32 MB messages and ~15 us a "
                        "call, the shape of nccl-tests all_reduce_perf curves published for 8 x H100 SXM"),
    "ib400": Link("ib400", 20e-6, 45e9, 32e6,
                  "one 400 Gb/s InfiniBand NDR adapter per GPU (ConnectX-7): 50 GB/s, ~90% reached; nccl-tests "
                  "report ~400 GB/s multi-node bus bandwidth for 8 such adapters per node"),
    "eth100": Link("eth100", 30e-6, 11e9, 32e6,
                   "one 100 Gb/s Ethernet (RoCE) adapter per GPU: 12.5 GB/s, ~90% reached"),
}
NETWORKS = {"ib400": "ib400", "eth100": "eth100"}  # --network -> the across-node link (inside: NVLink)


def collective_s(kind: str, n: int, nodes: int, buffer: float, inside: Link, across: Link) -> float:
    """Seconds of one ring collective over n ranks on `nodes` nodes (training/traffic.py's model of the bytes): the
    bytes that stay in a node go over NVLink, the k/n that cross over the adapters, both at once; the slower sets
    the time."""
    from megassm.training.traffic import ring_sent

    sent = ring_sent(kind, n, buffer)
    if sent <= 0:
        return 0.0
    if nodes <= 1:
        return inside.seconds(sent, buffer)
    cross = sent if kind == "p2p" else sent * nodes / n
    return max(inside.seconds(sent - cross, buffer) if sent > cross else 0.0, across.seconds(cross, buffer))


def bubble(pp: int, virtual: int, micro: int) -> float:
    """Idle share of a 1F1B / interleaved pipeline step: (pp - 1) / (v x m + pp - 1)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (virtual * micro + pp - 1)


# bytes a parameter: clipping (norm: read the gradient; scale: read + write it) + fused AdamW (read the parameter,
# gradient and both moments, write the parameter and both moments), all fp32; a gradient accumulation (read both,
# write one)
OPTIMIZER_BYTES = 4 + 8 + 16 + 12
ACCUMULATE_BYTES = 12

# ----------------------------------------------------------------------------------------------------
# the compute table
# ----------------------------------------------------------------------------------------------------
@dataclass
class Calibration:
    data: dict
    path: str = ""

    @classmethod
    def load(cls, path: str) -> "Calibration":
        with open(path) as f:
            return cls(json.load(f), path)

    @property
    def gpu(self) -> str:
        return self.data.get("gpu", "?")

    def _rows(self, table: str, key: str) -> list[dict]:
        rows = self.data.get(table, {}).get(key)
        if not rows:
            raise MissingCalibration(f"{self.path or 'the calibration'} has no '{key}' (measure it: megassm-plan "
                                     "calibrate --config CONFIG --out FILE on a GPU)")
        return rows

    @staticmethod
    def _per_token(rows: list[dict], tokens: int, value: str) -> float:
        """Milliseconds at `tokens`, from the per-token cost of the measured sizes: linear in log(tokens)
        between the two nearest, the nearest one's beyond them (small micro-batches cost more per token)."""
        pts = sorted((r["tokens"], r[value] / r["tokens"]) for r in rows)
        xs = [math.log(t) for t, _ in pts]
        x = math.log(tokens)
        i = bisect.bisect_left(xs, x)
        if i <= 0:
            per = pts[0][1]
        elif i >= len(pts):
            per = pts[-1][1]
        else:
            (x0, (_, y0)), (x1, (_, y1)) = (xs[i - 1], pts[i - 1]), (xs[i], pts[i])
            per = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        return per * tokens

    def block_ms(self, key: str, tp: int, sp: bool, tokens: int, graph: bool, ac: bool) -> float:
        """One block's forward + backward on one rank at `tokens` tokens a micro-batch (its local widths at `tp`)."""
        rows = [r for r in self._rows("blocks", key) if r["tp"] == tp]
        if not rows:
            raise MissingCalibration(f"{self.path}: '{key}' is not calibrated at TP {tp}")
        same_sp = [r for r in rows if r["sp"] == sp] or rows
        graphs = [r for r in same_sp if r["mode"] == "graph" and not r["ac"]] or \
            [r for r in same_sp if not r["ac"]]
        ms = self._per_token(graphs, tokens, "block_ms")
        if not graph:  # eager: the host's launches when they take longer than the GPU (never below the GPU's time)
            eager = [r for r in same_sp if r["mode"] == "eager" and not r["ac"]]
            if eager:
                ms = max(ms, self._per_token(eager, tokens, "block_ms"))
        if ac:  # the recompute: the forward again, from the table's checkpointed rows, else a forward's third
            acs = [r for r in rows if r["ac"] and r["mode"] == "graph"]
            base = [r for r in rows if not r["ac"] and r["mode"] == "graph"]
            if acs and base:
                ratio = sum(r["block_ms"] for r in acs) / sum(
                    next((b["block_ms"] for b in base if b["tokens"] == a["tokens"]), a["block_ms"]) for a in acs)
            else:
                ratio = 4 / 3
            ms *= ratio
        return ms

    def ends_ms(self, key: str, tp: int, sp: bool, tokens: int, graph: bool) -> float:
        """The model's ends (embedding, final norm, head + loss) at a rank's shapes: measured at each TP degree
        beside the blocks; else TP 1's split by tp (the head's vocabulary is)."""
        rows = [r for r in self._rows("ends", key) if not r["ac"]]
        mode = "graph" if graph else "eager"
        for pick in ([r for r in rows if r["tp"] == tp and r["sp"] == sp and r["mode"] == mode],
                     [r for r in rows if r["tp"] == tp and r["mode"] == "graph"],
                     [r for r in rows if r["tp"] == tp]):
            if pick:
                return self._per_token(pick, tokens, "ends_ms")
        one = [r for r in rows if r["tp"] == 1 and r["mode"] == "graph"] or [r for r in rows if r["tp"] == 1] or rows
        return self._per_token(one, tokens, "ends_ms") / tp

    def optimizer_s(self, params: float, tensors: int) -> float:
        """Clipping + AdamW over `params` parameters in `tensors` tensors: the slower of the GPU (memory bound, the
        large tensors' ns per parameter) and the host (each tensor's own cost, measured over small ones)."""
        o = self.data.get("optimizer", {})
        if "large_ns_per_param" in o and "tensor_us" in o:
            return max(o["large_ns_per_param"] * 1e-9 * params, o["tensor_us"] * 1e-6 * tensors)
        if "ns_per_param" in o:  # an earlier file (the records written with it stay reproducible): predict() notes it
            return o["ns_per_param"] * 1e-9 * params
        raise MissingCalibration(f"{self.path or 'the calibration'}: the optimizer is not calibrated")

    def accumulate_s(self, params: float) -> float:
        """What adding a micro-batch's gradients into the ones already held costs (`grad += new`). The calibration
        times accumulating micro-batches; a step's first one writes fresh gradients where the engine frees them after
        each step. Measured (`accumulate_ns_per_param`) where the file has it; else its 12 bytes a parameter (read 8,
        write 4) at the memory rate of the optimizer's large-tensor step, which moves ~40; 0 for a file with neither
        (the earliest: the synthetic optimizer figure only)."""
        o = self.data.get("optimizer", {})
        if "accumulate_ns_per_param" in o:
            return o["accumulate_ns_per_param"] * 1e-9 * params
        ns = o.get("large_ns_per_param")
        return 0.0 if ns is None else ns * 1e-9 * params * ACCUMULATE_BYTES / OPTIMIZER_BYTES

    @property
    def optimizer_synthetic_only(self) -> bool:
        """An earlier calibration file: the optimizer timed over 200 tensors of 1M parameters only."""
        return "large_ns_per_param" not in self.data.get("optimizer", {})

    def fsdp2_ratio(self, reshard: str) -> float:
        """FSDP2's micro-batch against the plain eager one, measured on a fake data-parallel group (its copies and
        the bf16 weights it gathers, no transfer)."""
        f = self.data.get("fsdp2", {})
        mode = "block" if reshard == "block" else "step"
        if "none" not in f or mode not in f:
            raise MissingCalibration(f"{self.path}: FSDP2's copies are not calibrated")
        return f[mode]["ms"] / f["none"]["ms"]

    def cp_ratio(self, cp: int) -> float:
        """A CP rank's Mamba-2 block against one device's at the same tokens (the chunk-state hand-off's work)."""
        rows = {r["cp"]: r for r in self.data.get("cp", [])}
        if cp == 1:
            return 1.0
        if 1 not in rows or not any(c > 1 for c in rows):
            raise MissingCalibration(f"{self.path}: context parallelism is not calibrated")
        c = cp if cp in rows else max(k for k in rows if k > 1)
        return rows[c]["block_ms"] / rows[1]["block_ms"]


# ----------------------------------------------------------------------------------------------------
# the step
# ----------------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    step_s: float
    compute_s: float
    optimizer_s: float
    exposed_comm_s: float
    exposed_inside_s: float
    exposed_across_s: float
    bubble: float
    tokens_per_s_per_gpu: float
    mfu: float | None
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _exposed(flow, t: float, last_bwd_s: float, fwd_s: float, overlapped_reduce: bool, units: int) -> float:
    """The part of a collective's time (t, per step) that no compute hides, by the trainer's own overlap:
    - the DDP / distributed-optimizer gradient reduction in the last micro-batch's backward (bucket by bucket)
      where that backward is one autograd call; after the backward otherwise (graphs, PP, BPTT);
    - FSDP2's gathers prefetched ahead of each block (the first unit's shows), its reduce-scatters and HSDP's
      all-reduce in the backward (the last unit's shows);
    - everything else (TP / SP activations, CP exchanges, pipeline sends, the parameter all-gather after the
      step, the small parameters' all-reduce) on the critical path."""
    what = flow.what
    if what.startswith(("DDP gradient", "distributed optimizer: gradient")):
        if not overlapped_reduce:
            return t
        return max(t - last_bwd_s, t / max(1, units))
    if what.startswith("FSDP2 weight all-gather"):
        per = t / max(1.0, flow.calls)
        return per / max(1, units) + max(0.0, t - flow.calls * fwd_s)
    if what.startswith("FSDP2 gradient reduce-scatter"):
        per = t / max(1.0, flow.calls)
        return flow.calls * (per / max(1, units) + max(0.0, per - last_bwd_s))
    if what.startswith("HSDP replica all-reduce"):
        return t / max(1, units) + max(0.0, t - last_bwd_s)
    if what.startswith("DeepSpeed"):
        return t * 0.5  # DeepSpeed's overlap_comm hides part of its bucketed reductions; its buckets decide
    return t


def _fresh_first_gradients(cfg: Config, dp: int) -> bool:
    """Whether each step's first micro-batch writes fresh gradients (parallel/engines.py build_engine: the plain
    engine at one data-parallel rank, and DDP outside its overlapped backward, free them after each step), rather
    than adding into kept ones (torch DDP's bucket views, the distributed optimizer's buffer, FSDP2, DeepSpeed)."""
    p, t = cfg.parallel, cfg.train
    if p.engine == "ddp" and p.zero_stage == 1 and dp * p.cp > 1:
        return False  # the distributed optimizer's gradients are its buffer's views for the whole run
    if dp == 1:
        return True
    return p.engine == "ddp" and (p.pp > 1 or t.bptt or t.cuda_graph)


def predict(cfg: Config, cal: Calibration, network: str = "ib400", gpus_per_node: int | None = None,
            vocab: int | None = None, comm: bool = True) -> Prediction:
    """Predicted step of `cfg`'s layout (its parallel.* keys, world size, batch) on GPUs of `cal`'s kind.
    `comm=False`: a rank alone (torch's fake process group: no collective costs anything)."""
    from megassm.training import traffic
    from megassm.training.flops import flops_per_sequence, peak_flops_for_name
    from megassm.training.memory import rank_models

    m, t, p = cfg.model, cfg.train, cfg.parallel
    vocab = m.vocab_size or vocab or 257
    ws, dp = world_size(cfg), data_parallel_size(cfg)
    accum = t.global_batch // (t.micro_batch * dp)
    windows = t.bptt_windows if t.bptt else 1
    micro = accum * windows
    tokens = t.micro_batch * t.seq_len // p.cp
    graph = bool(t.cuda_graph)
    notes = []
    inside = LINKS["nvlink-h100"]
    across = LINKS[NETWORKS[network]]
    if gpus_per_node:
        cfg.parallel.gpus_per_node = gpus_per_node
    models = rank_models(cfg, vocab)
    flows = traffic.step_flows(cfg, vocab=vocab, bf16=True)
    worst = None
    for r, model in enumerate(models):
        plan = getattr(model, "pp_plan", None)
        first, last = (plan is None or plan.first), (plan is None or plan.last)
        block_s = 0.0
        n_ac = 0
        if t.activation_checkpointing:
            n_ac = t.activation_checkpointing_blocks or len(model.layers)
        for i, layer in enumerate(model.layers.values() if hasattr(model.layers, "values") else model.layers):
            key = block_signature(m, layer.kind)
            ms = cal.block_ms(key, p.tp, p.sp, tokens, graph, ac=i < n_ac)
            if layer.kind == "M" and p.cp > 1:
                ms *= cal.cp_ratio(p.cp)
            block_s += ms / 1e3
        ends_s = cal.ends_ms(head_signature(m, vocab), p.tp, p.sp, tokens, graph) / 1e3
        # the ends live on the pipeline's first (embedding) and last (final norm, head + loss) stages: half each
        ends_s *= 0.5 * first + 0.5 * last
        per_micro = block_s + ends_s
        if p.engine == "fsdp2" and dp > 1:
            per_micro *= cal.fsdp2_ratio(p.fsdp_reshard)
        compute = micro * per_micro
        params = list(model.parameters())
        held = sum(q.numel() for q in params)
        # a step's first micro-batch writes fresh gradients where the engine frees them after each step (one
        # data-parallel rank; DDP outside its overlapped backward); the table's micro-batches accumulate
        if _fresh_first_gradients(cfg, dp):
            compute -= cal.accumulate_s(held)
        shard = dp * (p.cp if (p.engine == "ddp" and p.zero_stage == 1) else 1)
        if p.engine == "fsdp2" and dp > 1:
            shard = p.shard_size or dp
        if p.engine == "deepspeed" and dp > 1 and p.zero_stage >= 1:
            shard = dp
        sharded = p.zero_stage == 1 or p.engine in ("fsdp2", "deepspeed")
        # the distributed optimizer and DeepSpeed step flat buffers (a few tensors); DDP and FSDP2 each parameter
        flat = p.engine == "deepspeed" or (p.engine == "ddp" and p.zero_stage == 1 and shard > 1)
        opt = cal.optimizer_s(held / (shard if sharded else 1), 1 if flat else len(params))
        # communication, exposed
        last_bwd = (2.0 / 3.0) * per_micro
        fwd = per_micro / 3.0
        overlapped = p.pp == 1 and not t.bptt and not graph and p.engine == "ddp" and not t.cast_weights_once
        units = max(1, len(model.layers))
        exp_in = exp_across = 0.0
        for f in (f for f in flows if f.pp_rank == r and comm):
            tt = f.calls * collective_s(f.kind, f.n, f.nodes, f.buffer, inside, across)
            e = _exposed(f, tt, last_bwd, fwd, overlapped, units)
            if f.nodes > 1:
                exp_across += e
            else:
                exp_in += e
        bub = bubble(p.pp, p.pp_virtual, micro)
        step = (compute / (1.0 - bub) if bub else compute) + opt + exp_in + exp_across
        if worst is None or step > worst[0]:
            worst = (step, compute, opt, exp_in, exp_across, bub)
    step, compute, opt, exp_in, exp_across, bub = worst
    tokens_step = t.global_batch * t.seq_len * windows
    tps = tokens_step / step / ws
    fl = flops_per_sequence(m, models[0].vocab_size_padded if hasattr(models[0], "vocab_size_padded") else vocab,
                            t.seq_len)
    peak = peak_flops_for_name(cal.gpu)
    mfu = (tps * 3.0 * fl["total"] / t.seq_len / peak) if peak else None
    if cal.optimizer_synthetic_only:
        notes.append(f"{cal.path or 'the calibration'} times the optimizer over 200 tensors of 1M parameters only "
                     "(an earlier file): its step is taken at that figure, which overstates real shapes by ~20%")
    if p.engine == "deepspeed":
        notes.append("DeepSpeed: its buckets and overlap are approximated (half of its reductions exposed)")
    return Prediction(step, compute, opt, exp_in + exp_across, exp_in, exp_across, bub, tps, mfu, notes)


def blocks_in(cfg: Config) -> list[str]:
    return list(blocks_of(cfg.model.pattern))
