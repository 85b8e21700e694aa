"""Pipeline-parallel scaling: tokens/s per GPU and peak memory at PP = 1/2/4 (1F1B, or GPipe / interleaved),
against the pipeline-bubble estimate. One JSON object per (model, pp) on stdout (rank 0).

    torchrun --nproc_per_node 4 benchmarks/pp_scaling.py                                  # hybrid-7b, mamba2-2.7b
    torchrun --nproc_per_node 4 benchmarks/pp_scaling.py --pp 2 4 --pp-virtual 2 --n-micro 8
    torchrun --nproc_per_node 4 benchmarks/pp_scaling.py --schedule gpipe
    torchrun --nproc_per_node 2 benchmarks/pp_scaling.py model.d_model=64 model.pattern=M*M- model.vocab_size=256 \
        --pp 1 2 --seq-len 64 --n-micro 4 --device cpu                                    # smoke run (gloo)

Dotted config overrides go FIRST (before the options: --configs / --pp take several values).

Each step is the trainer's: `--n-micro` micro-batches of `--micro-batch` x `--seq-len` random tokens per
pipeline through `parallel.pp.train_step` (bf16 autocast, fp32 masters), tied-embedding gradient sum, the
data-parallel gradient average over the W / pp pipelines (W processes), the global grad norm + clipping,
fused AdamW. tokens/s per GPU = W x n_micro x micro x seq / step / W. bubble_est = (pp - 1) / (v x n_micro +
pp - 1) (1F1B / GPipe; v virtual stages per rank); est_efficiency = 1 - bubble_est is what a perfectly
balanced pipeline with free communication would reach against PP=1. Weights are random (the canonical CPU
init of 7B takes minutes); out-of-memory layouts are reported, not fatal.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist

from tp_scaling import _device_init

warnings.simplefilter("ignore")
DEV = "cuda"


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def run(cfg_path, pp, schedule, virtual, micro, n_micro, seq_len, steps, warmup, overrides) -> dict:
    from megassm.config import load_config
    from megassm.models import build_model
    from megassm.parallel import pp as ppl
    from megassm.parallel.dp import allreduce_grads
    from megassm.parallel.state import build_groups
    from megassm.training.optim import build_optimizer, clip_grad_norm

    cfg = load_config(cfg_path, ["data.builtin=stdlib", *overrides], validate_config=False)
    name = os.path.splitext(os.path.basename(cfg_path))[0]
    groups = build_groups(pp=pp)
    world = dist.get_world_size()
    v = virtual if pp > 1 else 1
    row = dict(model=name, pp=pp, schedule=schedule, virtual=v, world=world, pipelines=world // pp,
               micro_batch=micro, n_micro=n_micro, seq_len=seq_len,
               device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu")
    model = build_model(cfg.model, device="meta")
    n_params = model.num_parameters()
    row["params_b"] = n_params / 1e9
    if pp > 1:
        try:
            ppl.split_model(model, pp, groups.pp_rank, virtual=v, group=groups.pp_group, emb_group=groups.emb_group)
        except ValueError as e:
            row["status"] = f"skipped: {e}"
            return row
        row["layout"] = model.pp_plan.layout
    held = sum(p.numel() for p in model.parameters())
    held = torch.tensor(float(held), device=DEV)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)  # the heaviest stage decides
    total_mem = torch.cuda.get_device_properties(0).total_memory if DEV == "cuda" else 2**40
    if held.item() * 16 > 0.75 * total_mem:
        row["status"] = f"skipped: ~{held.item() * 16 / 2**30:.0f} GiB of weights + AdamW state on one GPU"
        return row
    model = model.to_empty(device=DEV)
    torch.manual_seed(1 + (groups.pp_rank if pp > 1 else 0))
    _device_init(model)
    if pp > 1:
        ppl.apply_pipeline_parallel(model, schedule=schedule)
    opt = build_optimizer(model.param_groups(0.1), cfg.optim, DEV)
    vocab = cfg.model.vocab_size
    gen = torch.Generator(device=DEV).manual_seed(1234 + groups.dp_rank)  # same batches along a pipeline

    def autocast():
        return torch.autocast(DEV, dtype=torch.bfloat16, enabled=DEV == "cuda")

    def batches():
        out = []
        for _ in range(n_micro):
            toks = torch.randint(0, vocab, (micro, seq_len + 1), device=DEV, generator=gen)
            out.append(dict(tokens=toks[:, :-1], labels=toks[:, 1:],
                            seq_idx=torch.zeros(micro, seq_len, dtype=torch.int32, device=DEV)))
        return out

    def step():
        bs = batches()
        if pp > 1:
            ppl.train_step(model, bs, autocast)
            ppl.sync_embedding_grads(model)
        else:
            for b in bs:
                with autocast():
                    loss = model(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss
                (loss / n_micro).backward()
        allreduce_grads(list(model.parameters()), groups.dp_group)
        if pp > 1:
            ppl.clip_grad_norm_pp(model, 1.0)
        else:
            clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        if DEV == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(warmup):
            step()
        _sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        t_step = (time.perf_counter() - t) / steps
    except torch.OutOfMemoryError:
        row["status"] = "oom"
        return row
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0, device=DEV)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tokens = (world // pp) * n_micro * micro * seq_len
    bubble = (pp - 1) / (v * n_micro + pp - 1)
    row.update(status="ok", step_s=t_step, tokens_per_s_per_gpu=tokens / t_step / world,
               peak_mem_gib_max=peak.item(), bubble_est=bubble, est_efficiency=1 - bubble)
    del model, opt
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["configs/hybrid-7b.yaml", "configs/mamba2-2.7b.yaml"])
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--pp-virtual", type=int, default=1, help="stages per pipeline rank (> 1: interleaved)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--n-micro", type=int, default=8, help="micro-batches per step (the accumulation count)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    from megassm.parallel.state import destroy, init_distributed

    if DEV == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not init_distributed(DEV):
        dist.init_process_group("nccl" if DEV == "cuda" else "gloo", init_method="tcp://127.0.0.1:29556",
                                rank=0, world_size=1)
    rank = dist.get_rank()
    for cfg_path in args.configs:
        base = None
        for pp in args.pp:
            if dist.get_world_size() % pp:
                continue
            row = run(cfg_path, pp, args.schedule, args.pp_virtual, args.micro_batch, args.n_micro, args.seq_len,
                      args.steps, args.warmup, args.overrides)
            if row.get("status") == "ok":
                if pp == 1:
                    base = row
                if base is not None:
                    row["efficiency_vs_pp1"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            if rank == 0:
                print(json.dumps(row), flush=True)
    destroy()


if __name__ == "__main__":
    main()
