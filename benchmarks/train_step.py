"""Whole-model training-step benchmark: tokens/s, MFU and peak memory, printed as JSON lines.

    python benchmarks/train_step.py --config configs/mamba2-1.3b.yaml --seq-len 2048 --micro-batch 4 2 1

Same step as the trainer: fp32 master weights, bf16 autocast, fused AdamW, gradient clipping, random
tokens (data loading is measured by the data benchmarks). `--cuda-graph` adds a row per size with the
forward + backward captured in one CUDA graph (the host's launch overhead removed). For each micro-batch size given, it runs
warm-up steps then timed steps and prints one JSON object; an out-of-memory size is reported as such.
MFU is given two ways: `mfu_6p` = 6 * params * tokens/s / peak (the convention of benchmarks/peers.py)
and `mfu_counted` from the FLOPs counted per layer type (docs/flops.md).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megassm.config import load_config
from megassm.models import build_model
from megassm.training.cuda_graph import GraphedMicroBatch
from megassm.training.flops import flops_per_sequence, peak_flops_for
from megassm.training.optim import build_optimizer, clip_grad_norm


def run_one(cfg, micro_batch: int, seq_len: int, steps: int, warmup: int, device: torch.device,
            cuda_graph: bool = False) -> dict:
    if device.type == "cuda":  # peaks over the whole run: a CUDA graph's pool is allocated at its capture
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab_size=cfg.model.vocab_size, device="cpu")
    model.init_weights(0)
    model = model.to(device)
    model.loss_chunk_tokens = cfg.train.loss_chunk_tokens  # head + loss in checkpointed chunks when > 0
    opt = build_optimizer(model.param_groups(cfg.optim.weight_decay), cfg.optim, device.type)
    vocab = cfg.model.vocab_size
    n_params = model.num_parameters()
    gen = torch.Generator(device="cpu").manual_seed(0)

    def batch():
        toks = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
        return toks[:, :-1].to(device), toks[:, 1:].to(device)

    def fwd_bwd(tokens, labels):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(tokens, labels=labels)
        out.loss.backward()
        return out.loss.detach()

    def step():
        loss = fwd_bwd(*batch())
        clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):  # also runs the kernels' autotuning, which must happen before a capture
        step()
    if cuda_graph:  # the trainer's train.cuda_graph path (megassm/training/cuda_graph.py)
        graphed = GraphedMicroBatch(list(model.parameters()), lambda b: fwd_bwd(b["tokens"], b["labels"]))

        def step():
            tokens, labels = batch()
            graphed.begin_step()
            loss = graphed({"tokens": tokens, "labels": labels})
            clip_grad_norm(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        step()  # warm-up replays and the capture
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss = loss.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tokens_per_s = micro_batch * seq_len / dt
    fl = flops_per_sequence(cfg.model, model.vocab_size_padded, seq_len)
    peak = peak_flops_for(device)
    res = {
        "pattern_blocks": model.n_layers,
        "params": n_params,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
        "cuda_graph": cuda_graph,
        "loss_chunk_tokens": cfg.train.loss_chunk_tokens,
        "step_ms": round(dt * 1e3, 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "loss": round(loss, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if device.type == "cuda" else None,
    }
    if peak:
        res["mfu_6p"] = round(6 * n_params * tokens_per_s / peak, 4)
        res["mfu_counted"] = round(3 * fl["total"] / seq_len * tokens_per_s / peak, 4)
    del model, opt
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also run each size with forward + backward captured in a CUDA graph")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, ["data.builtin=stdlib", *args.overrides])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for mb in args.micro_batch:
        for graphed in ((False, True) if args.cuda_graph and device.type == "cuda" else (False,)):
            row = {"bench": "train_step", "config": args.config,
                   "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
            try:
                row.update(run_one(cfg, mb, args.seq_len, args.steps, args.warmup, device, graphed))
            except torch.OutOfMemoryError:
                row.update({"micro_batch": mb, "seq_len": args.seq_len, "cuda_graph": graphed, "error": "out of memory"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
