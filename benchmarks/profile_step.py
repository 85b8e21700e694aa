"""Where a training step's GPU time goes: torch.profiler over a few steps of benchmarks/train_step.py's step,
printing the top kernels by total CUDA time (JSON lines: name, ms per step, % of step).

    python benchmarks/profile_step.py --config configs/mamba2-1.3b.yaml --seq-len 2048 --micro-batch 4
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from megassm.config import load_config
from megassm.models import build_model
from megassm.training.optim import build_optimizer, clip_grad_norm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="also record host-side ops: wall vs GPU-busy time and "
                    "the top ops by self CPU time")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, ["data.builtin=stdlib", *args.overrides])
    dev = torch.device("cuda")
    model = build_model(cfg.model, vocab_size=cfg.model.vocab_size, device="cpu")
    model.init_weights(0)
    model = model.to(dev)
    opt = build_optimizer(model.param_groups(cfg.optim.weight_decay), cfg.optim, "cuda")
    toks = torch.randint(0, cfg.model.vocab_size, (args.micro_batch, args.seq_len + 1), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(toks[:, :-1], labels=toks[:, 1:])
        out.loss.backward()
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    import time

    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.cpu else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    rows = [(e.key, e.device_time_total / 1e3 / args.steps, e.count // args.steps) for e in prof.key_averages()
            if e.device_time_total > 0]
    total = sum(r[1] for r in rows)
    rows.sort(key=lambda r: -r[1])
    print(json.dumps({"config": args.config, "gpu_ms_per_step": round(total, 2),
                      "wall_ms_per_step_profiled": round(wall_ms, 2),
                      "tokens_per_step": args.micro_batch * args.seq_len}), flush=True)
    if args.cpu:
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
        for e in cpu:
            print(json.dumps({"cpu_op": e.key[:80], "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / args.steps, 2),
                              "calls": e.count // args.steps}), flush=True)
    for name, t, n in rows[: args.top]:
        print(json.dumps({"kernel": name[:90], "ms": round(t, 2), "calls": n, "pct": round(100 * t / total, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
