"""Start-up memory of one rank: the model built on the meta device, planned (FSDP2 over --dp ranks), allocated and
filled with its canonical pieces (training/startup.py), against the plain start that allocates the whole model on
the device, draws its init there and only then shards it. One process stands for rank 0 of --dp (torch's fake
process group: the collectives are no-ops, so the pieces hold undefined values; only the memory counts). Prints
one JSON line per path: peak device memory allocated (CUDA), peak host memory (resident), seconds.

    python benchmarks/startup_memory.py --config configs/hybrid-7b.yaml --dp 4 [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(config: str, dp: int, device: str, path: str, overrides: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megassm.config import load_config
    from megassm.models import build_model
    from megassm.parallel import runtime as prt
    from megassm.parallel.engines import build_engine
    from megassm.parallel.state import build_groups
    from megassm.training.startup import materialize_held

    os.environ["MEGASSM_PROCESS_GROUPS"] = "torch"
    cfg = load_config(os.path.join(ROOT, config), ["data.builtin=stdlib", f"parallel.world_size={dp}",
                                                   "parallel.engine=fsdp2", "train.micro_batch=1",
                                                   f"train.global_batch={dp}", *overrides])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    dev = torch.device(device)
    groups = build_groups()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model = build_model(cfg.model, vocab_size=cfg.model.vocab_size or 257, device="meta")
    if path == "sharded":  # the trainer's order: plans and FSDP2 on the meta model, then each rank's pieces
        model = prt.prepare_model(model, groups, cfg)
        build_engine(cfg, model, groups, dev, bf16=dev.type == "cuda")
        materialize_held(model, dev, groups, seed=cfg.train.seed)
    else:  # the whole model on the device and its init drawn there, then FSDP2 shards it
        model.to_empty(device=dev)
        model.init_weights(cfg.train.seed)
        build_engine(cfg, model, groups, dev, bf16=dev.type == "cuda")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    out = {"config": config, "dp": dp, "path": path, "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
           "params": sum(p.numel() for p in build_model(cfg.model, vocab_size=cfg.model.vocab_size or 257,
                                                        device="meta").parameters()),
           "seconds": round(time.perf_counter() - t0, 1),
           "peak_host_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)}
    if dev.type == "cuda":
        out["peak_device_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2 ** 30, 2)
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/hybrid-7b.yaml")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--path", choices=["sharded", "whole"], help="one path in this process (default: each in its own)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.path:
        print(json.dumps(run(args.config, args.dp, args.device, args.path, args.overrides)), flush=True)
        return
    import subprocess

    for path in ("sharded", "whole"):  # a fresh process each: peaks are per process
        subprocess.run([sys.executable, __file__, "--config", args.config, "--dp", str(args.dp), "--device",
                        args.device, "--path", path, *args.overrides], check=True)


if __name__ == "__main__":
    main()
