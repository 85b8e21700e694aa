"""Data-parallel engines on a ~7B hybrid: `megassm-train` itself under torchrun, one run per layout, each
printed as one JSON line (step time, tokens/s per GPU, MFU, peak memory, from the run's metrics.jsonl).

    source benchmarks/device_env.sh
    python benchmarks/engines_7b.py --nproc 2 --layouts "tp=2" "engine=fsdp2" "engine=deepspeed,zero_stage=3"

A layout is comma-separated parallel.* keys. The run: configs/hybrid-7b.yaml, random-free builtin data (the
byte-level stdlib corpus), micro-batch 1 x seq 4096, bf16, Triton kernels, --steps optimizer steps of
--accum micro-batches per GPU; the last --timed steps are timed (the first ones include autotuning).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_layout(layout: str, nproc: int, steps: int, timed: int, accum: int, config: str, extra: list[str]) -> dict:
    keys = [f"parallel.{kv.strip()}" for kv in layout.split(",") if kv.strip()]
    tp = next((int(k.split("=")[1]) for k in keys if k.startswith("parallel.tp=")), 1)
    pp = next((int(k.split("=")[1]) for k in keys if k.startswith("parallel.pp=")), 1)
    dp = nproc // (tp * pp)
    run_dir = tempfile.mkdtemp(prefix="engines7b-")
    args = ["--config", config, "data.builtin=stdlib", "train.micro_batch=1", f"train.global_batch={accum * dp}",
            f"train.steps={steps}", f"train.log_interval={timed}", "train.eval_interval=0", "optim.warmup_steps=2",
            "run.save_final=false", "run.save_interval=0", "run.progress=false", "run.tensorboard=false",
            f"run.dir={run_dir}", *keys, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "megassm.train", *args]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = {"layout": layout, "nproc": nproc, "dp": dp, "accum": accum, "wall_s": round(time.time() - t0, 1)}
    if r.returncode != 0:
        tail = r.stderr[-1500:]
        out["error"] = "out of memory" if "out of memory" in tail.lower() else tail
        return out
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = [d for d in recs if "tokens_per_s" in d][-1]
    tps = last["tokens_per_s"]
    from megassm.config import load_config

    seq = load_config(config, ["data.builtin=stdlib", *extra]).train.seq_len
    out.update(step=last["step"], loss=round(last["loss"], 4), tokens_per_s=round(tps),
               tokens_per_s_per_gpu=round(tps / nproc), step_s=round(accum * dp * seq / tps, 3),
               mfu=round(last.get("mfu", float("nan")), 4),
               peak_gib=round(last.get("memory_max_allocated_gib", float("nan")), 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layouts", nargs="+", required=True)
    ap.add_argument("--config", default="configs/hybrid-7b.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timed", type=int, default=3)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    a = ap.parse_args()
    for layout in a.layouts:
        print(json.dumps(run_layout(layout, a.nproc, a.steps, a.timed, a.accum, a.config, a.extra)), flush=True)


if __name__ == "__main__":
    main()
