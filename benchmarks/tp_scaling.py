"""Tensor-parallel scaling: tokens/s per GPU at TP = 1/2/4, the share of step time spent in communication,
and the one-all-reduce-per-layer estimate. One JSON object per (model, tp) on stdout (rank 0).

    torchrun --nproc_per_node 4 benchmarks/tp_scaling.py                       # mamba2-2.7b and hybrid-7b
    torchrun --nproc_per_node 2 benchmarks/tp_scaling.py --tp 1 2 --sp
    torchrun --nproc_per_node 4 benchmarks/tp_scaling.py --configs configs/mamba2-2.7b.yaml --micro-batch 2
    torchrun --nproc_per_node 2 benchmarks/tp_scaling.py model.d_model=64 ... --device cpu   # smoke run (gloo)
    python3 benchmarks/tp_scaling.py --fake-world 4 --profile --configs configs/mamba2-2.7b.yaml   # one GPU

--fake-world K: one process stands for rank 0 of K (torch's "fake" process group: every collective returns at
once without moving data), so one GPU runs exactly what a TP rank computes, with no communication at all: the
per-GPU compute of TP 1 / 2 / 4 side by side on one GPU (the losses are not a real run's). --profile adds the
GPU ms of one step by kernel family (megassm.training.profiling), the GPU's idle share (host-bound time) and the
--top N kernels (12). Under --sp the fake group copies each all-gather's input into the output's blocks (the
memcpy kernels of those rows stand where NCCL's would run).
--cuda-graph replays each step's forward + backward from a CUDA graph (training/cuda_graph.py, as the trainer's
train.cuda_graph=true): the eager step is host-bound at micro-batch 1 (docs/benchmarks.md); the gradient sync,
clipping and the optimizer stay eager, as in the trainer.

Dotted config overrides go FIRST (before the options: --configs / --tp take several values).

With W processes and tp < W, the W / tp tensor-parallel groups run side by side on different random
batches without gradient sync (this measures TP alone), so tokens/s per GPU = tokens per group / step / tp.
The step is the trainer's: bf16 autocast, fp32 masters, fused AdamW, TP grad sync, clipping.
comm_share = 1 - step_no_comm / step, where step_no_comm replaces every collective of megassm.parallel.comm
by a local no-op of the same shape (numbers are then wrong but the compute is the same): the exposed
communication. est_comm_s = (2 per layer + 2) x the measured time of one all-reduce of [micro, seq, d_model]
bf16 over the TP group (SP: all-gather + reduce-scatter of the same total); est_efficiency =
t1 / (t1 + tp * est_comm) with t1 the TP=1 compute time per token per GPU. Weights are random (the
canonical CPU init of 7B would take minutes); out-of-memory layouts are reported, not fatal.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")
DEV = "cuda"  # --device cpu: a gloo smoke run of this script with tiny overrides (numbers meaningless)
FAKE_WORLD = 0  # --fake-world K: one process as rank 0 of K, collectives that do nothing
PROFILE = False
TOP = 12  # --top: kernels listed by --profile
CUDA_GRAPH = False  # --cuda-graph: forward + backward replayed from a CUDA graph (the trainer's GraphedMicroBatch)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _device_init(model) -> None:
    from megassm.models.init import rule_of

    with torch.no_grad():
        for name, p in model.named_parameters():
            r = rule_of(model, name)
            if r.kind == "normal":
                p.normal_(0.0, r.std)
            elif r.kind == "zeros":
                p.zero_()
            elif r.kind == "ones":
                p.fill_(1.0)
            elif r.kind == "uniform":
                p.uniform_(r.low, r.high)
            elif r.kind == "A_log":
                p.uniform_(r.low, r.high).log_()
            elif r.kind == "dt_bias":
                dt = torch.exp(torch.rand_like(p) * (math.log(r.high) - math.log(r.low)) + math.log(r.low))
                dt = dt.clamp(min=r.floor)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))


@contextlib.contextmanager
def _no_comm():
    from megassm.parallel import comm
    from megassm.parallel.sp import tokens_of_rank

    names = ("all_reduce", "all_reduce_max", "all_reduce_start", "all_gather_dim", "reduce_scatter_dim",
             "all_gather_tokens", "reduce_scatter_tokens", "reduce_scatter_tokens_start")
    saved = {n: getattr(comm, n) for n in names}

    def scatter(x, group):
        return tokens_of_rank(x, comm.world(group), comm.rank(group))

    comm.all_reduce = comm.all_reduce_max = lambda x, g: x
    comm.all_reduce_start = lambda x, g: (x, None)
    comm.all_gather_dim = lambda x, dim, g: torch.cat([x] * comm.world(g), dim=dim)
    comm.reduce_scatter_dim = lambda x, dim, g: x.chunk(comm.world(g), dim=dim)[comm.rank(g)].contiguous()
    comm.all_gather_tokens = lambda x, g: torch.cat([x] * comm.world(g), dim=1)
    comm.reduce_scatter_tokens = scatter
    comm.reduce_scatter_tokens_start = lambda x, g: (scatter(x, g), None)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(comm, n, f)


def _profiled(step) -> dict:
    """One more step under the trainer's StepProfiler: GPU ms by kernel family, the idle share, the top kernels."""
    from megassm.training.profiling import StepProfiler

    with StepProfiler(run_dir="", step=0, rank=0) as sp:
        step()
    summ = sp.summary(top=TOP)
    return {"profiled_step_ms": summ["step_ms"], "gpu_busy_ms": summ["gpu_busy_ms"], "idle_share": summ["idle_share"],
            "families_ms": summ["families"], "kernels": summ["kernels"], "top_kernels": summ["top"]}


def _time_collective(groups, shape, sp: bool, iters: int = 20) -> float:
    from megassm.parallel import comm

    if groups.tp == 1 or FAKE_WORLD:
        return 0.0
    x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)

    def once():
        if sp:
            comm.reduce_scatter_tokens(comm.all_gather_tokens(x.chunk(groups.tp, 1)[0], groups.tp_group),
                                       groups.tp_group)
        else:
            comm.all_reduce(x, groups.tp_group)

    for _ in range(3):
        once()
    _sync()
    t = time.perf_counter()
    for _ in range(iters):
        once()
    _sync()
    return (time.perf_counter() - t) / iters


def run(cfg_path, tp, sp, micro, seq_len, steps, warmup, overrides) -> dict:
    from megassm.config import load_config
    from megassm.models import build_model
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import apply_tensor_parallel, clip_grad_norm_tp, sync_tp_grads
    from megassm.training.optim import build_optimizer, clip_grad_norm

    cfg = load_config(cfg_path, ["data.builtin=stdlib", *overrides], validate_config=False)
    name = os.path.splitext(os.path.basename(cfg_path))[0]
    groups = build_groups(tp=tp)
    world = dist.get_world_size()
    row = dict(model=name, tp=tp, sp=sp, world=world, groups=world // tp, micro_batch=micro, seq_len=seq_len,
               device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", fake_world=FAKE_WORLD)
    meta = build_model(cfg.model, device="meta")
    n_params = meta.num_parameters()
    total_mem = torch.cuda.get_device_properties(0).total_memory if DEV == "cuda" else 2**40
    row["params_b"] = n_params / 1e9
    if n_params * 16 / tp > 0.75 * total_mem:
        row["status"] = f"skipped: ~{n_params * 16 / tp / 2**30:.0f} GiB of weights + AdamW state per GPU"
        return row
    model = meta
    if tp > 1:
        apply_tensor_parallel(model, groups.tp_group, sp=sp)  # on meta: shapes only
    model = model.to_empty(device=DEV)
    torch.manual_seed(groups.rank)
    _device_init(model)
    opt = build_optimizer(model.param_groups(0.1), cfg.optim, DEV)
    vocab = cfg.model.vocab_size
    gen = torch.Generator(device=DEV).manual_seed(1234 + groups.dp_rank)  # same batch within a TP group

    def fwd_bwd(batch):
        toks = batch["tokens"]
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            loss = model(toks[:, :-1], labels=toks[:, 1:]).loss
        loss.backward()
        return loss.detach()

    graphed = None
    if CUDA_GRAPH:
        from megassm.training.cuda_graph import GraphedMicroBatch

        model.capture_safe = True  # no host reads inside the captured forward (models/lm.py)
        graphed = GraphedMicroBatch(list(model.parameters()), fwd_bwd, collectives=tp > 1 and not FAKE_WORLD)
        row["cuda_graph"] = True

    def step():
        toks = torch.randint(0, vocab, (micro, seq_len + 1), device=DEV, generator=gen)
        if graphed is not None:
            graphed.begin_step()
            graphed({"tokens": toks})
        else:
            fwd_bwd({"tokens": toks})
        if tp > 1:
            sync_tp_grads(model)
            clip_grad_norm_tp(model, 1.0)
        else:
            clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed():
        for _ in range(warmup):
            step()
        _sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        return (time.perf_counter() - t) / steps

    try:
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_step = timed()
        if FAKE_WORLD:  # no communication to remove: the step is the compute
            t_nocomm = t_step
        else:
            with _no_comm():
                if graphed is not None:
                    graphed.release()  # captured again with the no-op collectives
                t_nocomm = timed()
        if PROFILE and DEV == "cuda":
            row.update(_profiled(step))
    except torch.OutOfMemoryError:
        row["status"] = "oom"
        return row
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
        if graphed is not None:
            graphed.release()
    tokens = micro * seq_len
    n_layers = meta.n_layers
    t_ar = _time_collective(groups, (micro, seq_len, cfg.model.d_model), sp)
    share = max(0.0, 1 - t_nocomm / t_step) if tp > 1 else 0.0  # no collectives at tp=1: timing noise
    row.update(status="ok", step_s=t_step, step_s_no_comm=t_nocomm, comm_share=share,
               tokens_per_s_per_gpu=tokens / t_step / tp, peak_mem_gib=peak, collective_ms=1e3 * t_ar,
               est_comm_s=(2 * n_layers + 2) * t_ar, n_layers=n_layers)
    del model, opt
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["configs/mamba2-2.7b.yaml", "configs/hybrid-7b.yaml"])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sp", action="store_true", help="sequence parallelism on (TP > 1)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--fake-world", type=int, default=0, metavar="K",
                    help="one process as rank 0 of K with no-op collectives: a TP rank's compute on one device")
    ap.add_argument("--profile", action="store_true", help="GPU ms of one step by kernel family")
    ap.add_argument("--top", type=int, default=12, help="--profile: list this many kernels by GPU time")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="replay each step's forward + backward from a CUDA graph, as train.cuda_graph=true does")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    global DEV, FAKE_WORLD, PROFILE, CUDA_GRAPH, TOP
    DEV, FAKE_WORLD, PROFILE, CUDA_GRAPH, TOP = args.device, args.fake_world, args.profile, args.cuda_graph, args.top
    if CUDA_GRAPH and DEV != "cuda":
        ap.error("--cuda-graph: CUDA graphs need --device cuda")
    if FAKE_WORLD and (FAKE_WORLD < 1 or os.environ.get("WORLD_SIZE", "1") != "1"):
        ap.error(f"--fake-world {FAKE_WORLD}: needs K >= 1 and a single process (not under torchrun)")
    from megassm.parallel.state import destroy, init_distributed

    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if FAKE_WORLD:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    elif not init_distributed(DEV):
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo", init_method="tcp://127.0.0.1:29555",
                                rank=0, world_size=1)
    rank = dist.get_rank()
    for cfg_path in args.configs:
        base = None
        for tp in args.tp:
            if dist.get_world_size() % tp:
                continue
            row = run(cfg_path, tp, args.sp and tp > 1, args.micro_batch, args.seq_len, args.steps, args.warmup,
                      args.overrides)
            if row.get("status") == "ok":
                if tp == 1:
                    base = row
                if base is not None:
                    row["efficiency_vs_tp1"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
                    t1 = base["step_s_no_comm"]  # TP=1 compute per step per GPU
                    row["est_efficiency"] = (t1 / tp) / (t1 / tp + row["est_comm_s"]) if tp > 1 else 1.0
            if rank == 0:
                print(json.dumps(row), flush=True)
    destroy()


if __name__ == "__main__":
    main()
