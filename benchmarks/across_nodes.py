"""The across-nodes table of docs/across-nodes.md, on paper: for 1 to 32 nodes of 8 x 80 GB GPUs and the 1.3B / 7B
configs, each candidate data-parallel layout's per-GPU memory (the dry run's estimate, training/memory.py) and
bytes per GPU per optimizer step inside and across nodes (the dry run's traffic, training/traffic.py), with the
time those bytes take at stated link speeds beside the step's compute at the measured single-node rate.
No GPU needed; one JSON line per (model, nodes, layout), then the markdown table.

    python benchmarks/across_nodes.py [--nodes 1 2 4 8 16 32] [--markdown]

Link speeds (stated, not measured here): inside a node 360 GB/s per GPU (NVLink 4: 450 GB/s a direction, ~80% in
NCCL's rings), across nodes 45 GB/s per GPU (one 400 Gb/s adapter per GPU, ~90%); with these, a ring over several
such nodes runs at about 8 x 45 = 360 GB/s of bus bandwidth, as nccl-tests report for H100 clusters. The compute
per step: tokens per GPU per step at the rate measured on one node (docs/benchmarks.md): hybrid-7b 10.0k tokens/s
per GPU (FSDP2, 4 x H100), mamba2-1.3b 46.6k (one H100, CUDA graphs). Communication time is the bytes over the
link speed, not what stays exposed: DDP, the distributed optimizer and FSDP2 overlap most of it with the backward.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megassm.config import load_config  # noqa: E402
from megassm.training import memory, traffic  # noqa: E402

GPUS_PER_NODE = 8
INSIDE_GBPS, ACROSS_GBPS = 360.0, 45.0  # per GPU, GB/s (see above)
GPU_GIB = memory.GPU_MEMORY_GIB["H100 80GB"]
# model: (config, global batch in sequences, micro-batch cap, tokens/s per GPU measured on one node)
MODELS = {
    "mamba2-1.3b": ("configs/mamba2-1.3b.yaml", 512, 4, 46.6e3),
    "hybrid-7b": ("configs/hybrid-7b.yaml", 256, 1, 10.0e3),
}
LAYOUTS = {
    "ddp": ["parallel.engine=ddp"],
    "distributed optimizer": ["parallel.engine=ddp", "parallel.zero_stage=1"],
    "fsdp2": ["parallel.engine=fsdp2"],
    "fsdp2, step sync": ["parallel.engine=fsdp2", "parallel.fsdp_grad_sync=step"],
    "hsdp": ["parallel.engine=fsdp2", f"parallel.shard_size={GPUS_PER_NODE}"],
}


def row(model: str, nodes: int, layout: str) -> dict:
    path, global_batch, micro_cap, rate = MODELS[model]
    world = nodes * GPUS_PER_NODE
    micro = min(micro_cap, global_batch // world)
    over = [f"parallel.world_size={world}", f"parallel.gpus_per_node={GPUS_PER_NODE}", "data.builtin=stdlib",
            f"train.global_batch={global_batch}", f"train.micro_batch={micro}", *LAYOUTS[layout]]
    if layout == "hsdp" and nodes == 1:
        return {}
    cfg = load_config(os.path.join(ROOT, path), over)
    est = memory.estimate(cfg)
    flows = traffic.step_flows(cfg)
    tot = traffic.totals(flows)
    reserved = est["peak_per_gpu"] / memory.GiB * memory.reserve_factor(cfg) + 1.0
    tokens = global_batch * cfg.train.seq_len / world
    comm = tot["inside"] / 1e9 / INSIDE_GBPS + tot["across"] / 1e9 / ACROSS_GBPS
    return {"model": model, "nodes": nodes, "gpus": world, "layout": layout, "overrides": LAYOUTS[layout],
            "micro_batch": micro, "accumulation": est["accumulation"],
            "memory_gib": round(est["peak_per_gpu_gib"], 1), "fits_80gb": reserved < GPU_GIB,
            "inside_gb": round(tot["inside"] / 1e9, 2), "across_gb": round(tot["across"] / 1e9, 2),
            "compute_s": round(tokens / rate, 2), "comm_s": round(comm, 2),
            "across_s": round(tot["across"] / 1e9 / ACROSS_GBPS, 2)}


def recommend(rows: list[dict], model: str) -> dict:
    """The layout docs/across-nodes.md recommends, among those that fit: for a model whose weights, gradients and
    AdamW fit a GPU (1.3B), DDP with the distributed optimizer (it takes CUDA graphs, which the one-node
    measurements need; 1x an all-reduce's bytes; AdamW sharded); for 7B, of FSDP2 and HSDP the one that sends
    fewer bytes across nodes (HSDP while a step has several micro-batches per GPU). FSDP2's step sync sends less
    still but holds whole fp32 gradients (table: memory), so it stays the opt-in alternative."""
    fits = [r for r in rows if r and r["fits_80gb"]]
    if model.endswith("1.3b"):
        return next((r for r in fits if r["layout"] == "distributed optimizer"), {})
    pool = [r for r in fits if r["layout"] in ("hsdp", "fsdp2")]
    return min(pool, key=lambda r: (r["across_gb"], r["inside_gb"])) if pool else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--markdown", action="store_true", help="also print the docs' table")
    args = ap.parse_args()
    table = []
    for model in MODELS:
        for nodes in args.nodes:
            rows = [row(model, nodes, name) for name in LAYOUTS]
            for r in rows:
                if r:
                    print(json.dumps(r))
            best = recommend(rows, model)
            alt_name = "ddp" if model.endswith("1.3b") else ("fsdp2" if best["layout"] == "hsdp" else "hsdp")
            alt = next((r for r in rows if r and r["layout"] == alt_name), best)
            table.append((best, alt))
    if args.markdown:
        print("| nodes x 8 | model | recommended layout | memory / GPU | inside / across per GPU per step | "
              "comm. at link speed vs compute | the alternative |")
        print("|---|---|---|---|---|---|---|")
        for best, alt in table:
            other = "" if alt is best else (f"{alt['layout']}: {alt['inside_gb']:.1f} / {alt['across_gb']:.1f} GB, "
                                            f"{alt['comm_s']:.2f} s")
            print(f"| {best['nodes']} | {best['model']} | {best['layout']} (`{' '.join(best['overrides'])}`) | "
                  f"{best['memory_gib']:.1f} GiB | {best['inside_gb']:.1f} / {best['across_gb']:.1f} GB | "
                  f"{best['comm_s']:.2f} s vs {best['compute_s']:.2f} s | {other} |")


if __name__ == "__main__":
    main()
