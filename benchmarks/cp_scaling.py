"""Context-parallel weak scaling: mamba2-1.3b training at 64K-512K tokens per sequence with CP=4 against
the CP=1 baseline at 1/4 the length, tokens/s and peak memory per GPU, and the bytes each layer moves:
ours (states + conv halo [+ attention K/V]) against Megatron's all-to-all Mamba CP. One JSON object per
run on stdout (rank 0), then a summary object.

    torchrun --nproc_per_node 4 benchmarks/cp_scaling.py                                  # 4 GPUs (H200)
    torchrun --nproc_per_node 4 benchmarks/cp_scaling.py --lengths 262144 524288 --checkpointing on
    torchrun --nproc_per_node 4 benchmarks/cp_scaling.py --comm-share                     # + exposed comm
    torchrun --nproc_per_node 4 benchmarks/cp_scaling.py train.loss_chunk_tokens=8192 --lengths 524288 \
        --checkpointing on                                  # 512K: the head + loss in 8K-token chunks
    python3 benchmarks/cp_scaling.py --fake-world 4 --profile --lengths 65536   # one GPU: a CP rank alone
    python3 benchmarks/cp_scaling.py --fake-world 4 --profile --cuda-graph --lengths 65536 131072 \
        --checkpointing on                           # the same replayed from CUDA graphs (train.cuda_graph)
    python3 benchmarks/cp_scaling.py train.activation_checkpointing_keep=sum train.loss_chunk_tokens=8192 \
        --fake-world 4 --cuda-graph --zero1 --lengths 524288 --checkpointing on      # 512K on an 80 GB card
    torchrun --nproc_per_node 2 benchmarks/cp_scaling.py model.d_model=64 model.pattern=MM \\
        model.vocab_size=256 model.mamba.d_state=16 model.mamba.headdim=16 --device cpu --cp 2 \\
        --lengths 256 512 --steps 1 --warmup 0                                            # smoke run (gloo)

Dotted config overrides go FIRST (before the options: --lengths takes several values).

Each run is the trainer's step on one sequence (micro-batch 1, `--micro-batch` to change): bf16 autocast,
fp32 masters, fused AdamW, CP gradient sum, clipping; one document per row (seq_idx all zeros, passed
as the trainer passes it). CP=cp: the world splits into world/cp CP groups, each on its own random
sequence (no data-parallel gradient sync: this measures CP alone). CP=1 baseline: every GPU trains its own
sequence of length/cp. weak_scaling_efficiency = tokens/s/GPU (CP=cp, L) / tokens/s/GPU (CP=1, L/cp).
--checkpointing auto: a run that runs out of memory is retried with per-block activation checkpointing
(train.activation_checkpointing); `checkpointing` in the row says which ran. An out-of-memory error that
hits the ranks of a CP group at different points can leave the others waiting in a collective (until the
600 s process-group timeout): for lengths that are near the memory limit, pass --checkpointing on.
Weights are random (the same on every rank), not the canonical init. CP rows also carry `grad_allreduce_s`:
the CP gradient sum alone (every parameter's fp32 gradient, `allreduce_cp_grads`), timed apart, once per step
whatever the length: the part of a CP step that a CP 1 baseline never pays (in a job with data parallelism it
merges into the DP gradient reduction, amortised over the step's micro-batches).

--fake-world K: one process is the LAST rank of K under torch's "fake" process group (collectives move no
data), the rank that receives every predecessor's states and so does the whole fix-up: one GPU runs what a
CP rank computes, beside the CP 1 baseline at 1/K of the length, with no communication. --profile adds GPU ms
by kernel family, the GPU's busy and idle time of one more step (the trainer's StepProfiler).
--cuda-graph: each step's forward + backward is one CUDA graph replay (the trainer's GraphedMicroBatch, as with
train.cuda_graph=true; CP's collectives inside the graph, its gradient sum after): the eager CP step launches
~3x CP 1's kernels and is host-bound at 64K. The graph is released before the eager gradient-sum timing.
--zero1: the distributed optimizer of parallel.zero_stage=1 (parallel/distopt.py): the parameters and their fp32
gradients in its flat buffers, the AdamW states sharded; a CP row over its CP group (the DP x CP group of a run
without DP), its gradient sum as the engine runs it (the reduce-scatter over the CP ranks instead of the CP
all-reduce); the CP 1 baseline over the world, as over DP (its ranks' gradients are not averaged here: the row
measures time and memory, not training).

Bytes per Mamba-2 layer and rank, forward (the backward moves the same again), B = micro-batch,
R = cp, L_r = L / R tokens per rank, activations in bf16 (2 bytes), states fp32:
  ours      all-gather of (S_r, g_r): (R-1) * B * (H*P*N + H) * 4   +   conv halo: (R-1) * B * (d_conv-1) *
            conv_dim * 2;   attention layers (hybrids): (R-1) * B * L_r * 2 * n_kv_heads * head_dim * 2
  megatron  megatron/core/ssm/mamba_context_parallel.py: all-to-alls of z, x, B, C, dt before the conv/SSM
            (B and C repeated to max(G, R) groups when G < R) and of y and z after it (gated norm): each
            moves (R-1)/R of its local size: (R-1)/R * B * L_r * (4*d_inner + 2*max(G, R)*N + H) * 2
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
DEV = "cuda"
PROFILE = False  # --profile
FAKE_WORLD = 0  # --fake-world
ZERO1 = False  # --zero1
CUDA_GRAPH = False  # --cuda-graph: forward + backward replayed from a CUDA graph (the trainer's GraphedMicroBatch)


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def _random_init(model, seed: int = 0) -> None:
    """Draw every parameter by its init rule on the device, from one seed: identical on every rank."""
    from megassm.models.init import rule_of

    gen = torch.Generator(device=DEV).manual_seed(seed)
    for name, p in model.named_parameters():
        r = rule_of(model, name)
        if r.kind == "normal":
            p.normal_(0.0, r.std, generator=gen)
        elif r.kind == "zeros":
            p.zero_()
        elif r.kind == "ones":
            p.fill_(1.0)
        elif r.kind == "uniform":
            p.uniform_(r.low, r.high, generator=gen)
        elif r.kind == "A_log":
            p.uniform_(r.low, r.high, generator=gen).log_()
        elif r.kind == "dt_bias":
            dt = torch.exp(torch.rand(p.shape, device=p.device, generator=gen) * (math.log(r.high) - math.log(r.low))
                           + math.log(r.low)).clamp(min=r.floor)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))


@contextlib.contextmanager
def _no_comm():
    """Every collective of megassm.parallel.comm replaced by a local no-op of the same shape (the numbers
    are then wrong but the compute is the same): step time without communication."""
    from megassm.parallel import comm

    saved = (comm.all_reduce, comm.all_gather_dim, comm.reduce_scatter_dim)
    comm.all_reduce = lambda x, g: x
    comm.all_gather_dim = lambda x, dim, g: torch.cat([x] * comm.world(g), dim=dim)
    comm.reduce_scatter_dim = lambda x, dim, g: x.chunk(comm.world(g), dim=dim)[comm.rank(g)].contiguous()
    try:
        yield
    finally:
        comm.all_reduce, comm.all_gather_dim, comm.reduce_scatter_dim = saved


def bytes_per_layer(cfg, cp: int, seq_len: int, micro: int) -> dict:
    """Forward bytes per layer and rank (see the module docstring), ours and Megatron's all-to-all CP."""
    from megassm.config import attn_dims, mamba_dims

    m = cfg.model
    R, Lr = cp, seq_len // cp
    out = {}
    if "M" in m.pattern:
        d = mamba_dims(m)
        H, P, N, G = d["nheads"], m.mamba.headdim, m.mamba.d_state, m.mamba.ngroups
        conv_dim = d["d_inner"] + 2 * G * N
        states = (R - 1) * micro * (H * P * N + H) * 4
        halo = (R - 1) * micro * (m.mamba.d_conv - 1) * conv_dim * 2
        out.update(mamba_ours=states + halo, mamba_ours_states=states, mamba_ours_halo=halo,
                   mamba_megatron=(R - 1) / R * micro * Lr * (4 * d["d_inner"] + 2 * max(G, R) * N + H) * 2,
                   megatron_all_to_alls_fwd=7, megatron_cp_limit=f"cp <= heads / tp = {H}")
        out["mamba_ratio_megatron_over_ours"] = out["mamba_megatron"] / out["mamba_ours"] if R > 1 else None
    if "*" in m.pattern:
        a = attn_dims(m)
        out["attention_ours"] = (R - 1) * micro * Lr * 2 * a["n_kv_heads"] * a["head_dim"] * 2
    return out


def run(cfg_path, cp, seq_len, micro, steps, warmup, ckpt, comm_share, overrides) -> dict:
    from megassm.config import load_config
    from megassm.models import build_model
    from megassm.parallel.checkpointing import apply_activation_checkpointing
    from megassm.parallel.cp import allreduce_cp_grads, apply_context_parallel, local_slice
    from megassm.parallel.state import build_groups
    from megassm.training.optim import build_optimizer, clip_grad_norm

    cfg = load_config(cfg_path, ["data.builtin=stdlib", *overrides], validate_config=False)
    groups = build_groups(cp=cp)
    world = dist.get_world_size()
    row = dict(model=os.path.splitext(os.path.basename(cfg_path))[0], cp=cp, world=world, seq_len=seq_len,
               tokens_per_gpu=micro * seq_len // cp, micro_batch=micro, checkpointing=ckpt,
               loss_chunk_tokens=cfg.train.loss_chunk_tokens,
               device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
               bytes_per_layer_fwd=bytes_per_layer(cfg, cp, seq_len, micro))
    model = build_model(cfg.model, device="meta").to_empty(device=DEV)
    _random_init(model)
    apply_context_parallel(model, groups.cp_group)
    model.loss_chunk_tokens = cfg.train.loss_chunk_tokens  # override train.loss_chunk_tokens=N: chunked head + loss
    if ckpt:
        apply_activation_checkpointing(model, keep=cfg.train.activation_checkpointing_keep)
    buffers = None
    if ZERO1:  # the AdamW states over the ranks holding the same parameters (parallel/distopt.py)
        from megassm.parallel.distopt import DistributedAdamW, FlatBuffers

        buffers = FlatBuffers(model.parameters(), groups.cp_group if cp > 1 else groups.dp_group,
                              int(cfg.parallel.bucket_mb * 2 ** 20), dp=1, overlap=False)
        opt = DistributedAdamW(build_optimizer(model.param_groups(0.1), cfg.optim, DEV), buffers)
        row["zero1_ranks"] = buffers.n
    else:
        opt = build_optimizer(model.param_groups(0.1), cfg.optim, DEV)
    vocab = cfg.model.vocab_size
    # the same sequence on the ranks of a CP group (seeded by the group's index), another per group
    gen = torch.Generator(device=DEV).manual_seed(1234 + groups.dp_rank)
    sid = torch.zeros(micro, seq_len // cp, dtype=torch.int32, device=DEV)

    def fwd_bwd(batch):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            loss = model(batch["x"], seq_idx=batch["sid"], labels=batch["y"]).loss
        loss.backward()
        return loss.detach()

    graphed = None
    if CUDA_GRAPH:
        from megassm.training.cuda_graph import GraphedMicroBatch

        model.capture_safe = True  # no host reads inside the captured forward (models/lm.py)
        graphed = GraphedMicroBatch(list(model.parameters()), fwd_bwd, kept_grads=buffers is not None,
                                    collectives=cp > 1 and not FAKE_WORLD)
        row["cuda_graph"] = True

    def step():
        toks = torch.randint(0, vocab, (micro, seq_len + 1), device=DEV, generator=gen)
        x, y = local_slice(toks[:, :-1], groups.cp_group), local_slice(toks[:, 1:], groups.cp_group)
        batch = {"x": x.contiguous(), "y": y.contiguous(), "sid": sid}
        if graphed is not None:
            graphed.begin_step()
            graphed(batch)
        else:
            fwd_bwd(batch)
        if buffers is not None and cp > 1:
            buffers.reduce_scatter()  # the CP sum into each rank's slices, in place
        else:
            allreduce_cp_grads(list(model.parameters()), groups.cp_group)
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def allreduce_s(n=3):  # the gradient sum over the CP group alone, per call: a fixed cost per step (CP 1 has none)
        toks = torch.randint(0, vocab, (micro, seq_len + 1), device=DEV, generator=gen)
        x, y = local_slice(toks[:, :-1], groups.cp_group), local_slice(toks[:, 1:], groups.cp_group)
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda"):
            model(x, seq_idx=sid, labels=y).loss.backward()
        params = list(model.parameters())
        allreduce_cp_grads(params, groups.cp_group)  # warm-up
        _sync()
        t = time.perf_counter()
        for _ in range(n):
            allreduce_cp_grads(params, groups.cp_group)
        _sync()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) / n

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
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t_step = timed()
        if PROFILE and DEV == "cuda":  # one more step: GPU ms by kernel family, busy / idle, the top kernels
            from megassm.training.profiling import StepProfiler

            with StepProfiler(run_dir="", step=0, rank=dist.get_rank()) as prof:
                step()
            summ = prof.summary(top=20)
            row.update(profiled_step_ms=summ["step_ms"], gpu_busy_ms=summ["gpu_busy_ms"],
                       idle_share=summ["idle_share"], comm_ms=summ["comm_ms"], families_ms=summ["families"],
                       kernels=summ["kernels"], top_kernels=summ["top"])
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
        if graphed is not None:  # its pool holds a whole step's memory: the eager passes below need it
            graphed.release()
            torch.cuda.empty_cache()
        if cp > 1:
            row["grad_allreduce_s"] = allreduce_s()
        if comm_share and cp > 1:  # a graph is captured again without the collectives
            with _no_comm():
                t_nocomm = timed()
            row.update(step_s_no_comm=t_nocomm, comm_share=max(0.0, 1 - t_nocomm / t_step))
    except torch.OutOfMemoryError:
        row["status"] = "oom"
        return row
    finally:
        if graphed is not None:
            graphed.release()
        model = opt = graphed = None  # free the memory before the next length (the closures above are done)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    row.update(status="ok", step_s=t_step, tokens_per_s_per_gpu=micro * seq_len / cp / t_step)
    return row


def _all_ok(row) -> bool:
    """Did every rank finish the run (an OOM on one rank is an OOM for the row)?"""
    flag = torch.tensor([1.0 if row.get("status") == "ok" else 0.0], device=DEV)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def run_auto(args, cp, seq_len) -> dict:
    modes = {"on": [True], "off": [False], "auto": [False, True]}[args.checkpointing]
    row = {}
    for ckpt in modes:
        row = run(args.config, cp, seq_len, args.micro_batch, args.steps, args.warmup, ckpt, args.comm_share,
                  args.overrides)
        if _all_ok(row):
            return row
        row["status"] = "oom"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mamba2-1.3b.yaml")
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072, 262144, 524288])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--comm-share", action="store_true", help="also time the step with collectives removed")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--fake-world", type=int, default=0, metavar="K",
                    help="one process as the last rank of K with no-op collectives: a CP rank's compute on one device")
    ap.add_argument("--profile", action="store_true", help="GPU ms of one step by kernel family")
    ap.add_argument("--zero1", action="store_true",
                    help="the distributed optimizer over the CP group (CP 1: over the world), as parallel.zero_stage=1")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="replay each step's forward + backward from a CUDA graph, as train.cuda_graph=true does")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    global DEV, PROFILE, CUDA_GRAPH, FAKE_WORLD, ZERO1
    DEV, PROFILE, CUDA_GRAPH, ZERO1 = args.device, args.profile, args.cuda_graph, args.zero1
    FAKE_WORLD = args.fake_world
    if CUDA_GRAPH and DEV != "cuda":
        ap.error("--cuda-graph: CUDA graphs need --device cuda")
    if args.fake_world and (args.fake_world < 2 or os.environ.get("WORLD_SIZE", "1") != "1"):
        ap.error(f"--fake-world {args.fake_world}: needs K >= 2 and a single process (not under torchrun)")
    from megassm.parallel.state import destroy, init_distributed

    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=args.fake_world - 1, world_size=args.fake_world)
    elif not init_distributed(DEV):
        raise SystemExit("run under torchrun with --nproc_per_node = a multiple of --cp (see the docstring)")
    if dist.get_world_size() % args.cp:
        raise SystemExit(f"world size {dist.get_world_size()} is not a multiple of --cp {args.cp}")
    rank = 0 if args.fake_world else dist.get_rank()  # a fake world's one process reports
    summary = []
    for L in args.lengths:
        par = run_auto(args, args.cp, L)
        base = run_auto(args, 1, L // args.cp)
        for row in (par, base):
            if rank == 0:
                print(json.dumps(row), flush=True)
        eff = None
        if par.get("status") == "ok" and base.get("status") == "ok":
            eff = par["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        summary.append(dict(seq_len=L, cp=args.cp, tokens_per_s_per_gpu=par.get("tokens_per_s_per_gpu"),
                            baseline_seq_len=L // args.cp, baseline_tokens_per_s_per_gpu=base.get("tokens_per_s_per_gpu"),
                            weak_scaling_efficiency=eff, peak_mem_gib=par.get("peak_mem_gib"),
                            baseline_peak_mem_gib=base.get("peak_mem_gib"), checkpointing=par.get("checkpointing"),
                            baseline_checkpointing=base.get("checkpointing"),
                            bytes_per_layer_fwd=par.get("bytes_per_layer_fwd")))
    if rank == 0:
        print(json.dumps({"summary": summary}), flush=True)
    destroy()


if __name__ == "__main__":
    main()
