"""Training layouts of a ~7B model side by side: `megassm-train` itself under torchrun, one run per layout, each
printed as one JSON line (tokens/s per GPU, MFU from counted FLOPs and from 6PT, steady-state peak memory
allocated and reserved, headroom, share of the step in communication and exposed communication, start-up).

    source benchmarks/device_env.sh
    python benchmarks/engines_7b.py --nproc 4 --accum 8 --layouts "engine=fsdp2" "tp=2,zero_stage=1" "tp=4" \
        "pp=2" "engine=deepspeed,zero_stage=1" fsdp2_tp2 --out /tmp/layouts.jsonl

A layout is comma-separated keys: `tp=2` means parallel.tp=2; a dotted key (`train.micro_batch=2`) is passed as
it is. A name of NAMED stands for its keys (fsdp2_tp2: FSDP2 x TP 2, "engine=fsdp2,tp=2"). The run: --config (configs/hybrid-7b.yaml), the byte-level stdlib corpus, micro-batch 1 x seq 4096 unless
the layout says otherwise, bf16, Triton kernels, --steps optimizer steps of --accum micro-batches per
data-parallel rank. The figures: tokens/s over the last --timed steps (the first ones include autotuning),
memory peaks after the first optimizer step (the trainer resets the peak there: AdamW states exist), the
communication shares from `run.profile_step` (rank 0's GPU kernels of one profiled step; rank 0 and the
largest over ranks). Start-up: process start to a ready model (`time/startup_s`), and the first step.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

from procs import run_or_kill  # benchmarks/procs.py

H100_BF16_PEAK = 989.4e12  # dense bf16 FLOP/s per H100 / H200 SXM (training/flops.py peak_flops_for)


# named layouts: the keys each stands for (the JSON line's "layout" keeps the name)
NAMED = {
    "fsdp2": "engine=fsdp2",
    "fsdp2_tp2": "engine=fsdp2,tp=2",  # FSDP2 x TP: TP 2, FSDP2 over the remaining ranks (DP = nproc / 2)
    "fsdp2_tp2_sp": "engine=fsdp2,tp=2,sp=true",
    "tp2_zero1": "tp=2,zero_stage=1",
}


def layout_args(layout: str) -> list[str]:
    layout = NAMED.get(layout.strip(), layout)
    out = []
    for kv in layout.split(","):
        kv = kv.strip()
        if kv:
            key = kv.split("=", 1)[0]
            out.append(kv if "." in key else f"parallel.{kv}")
    return out


def _steps_done(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    return max((json.loads(line).get("step", 0) for line in open(path) if '"loss"' in line), default=0)


def run_layout(layout: str, nproc: int, steps: int, timed: int, accum: int, config: str, extra: list[str],
               profile_step: int, timeout: int) -> dict:
    from megassm.config import data_parallel_size, load_config
    from megassm.models import build_model
    from megassm.training.flops import flops_per_sequence

    keys = layout_args(layout)
    probe = load_config(config, ["data.builtin=stdlib", f"parallel.world_size={nproc}", *keys, *extra],
                        validate_config=False)
    dp = nproc // (probe.parallel.tp * probe.parallel.pp * probe.parallel.cp)
    micro = probe.train.micro_batch
    run_dir = tempfile.mkdtemp(prefix="engines7b-")
    args = ["--config", config, "data.builtin=stdlib", f"train.global_batch={accum * dp * micro}",
            f"train.steps={steps}", f"train.log_interval={timed}", "train.eval_interval=0", "optim.warmup_steps=2",
            "run.save_final=false", "run.save_interval=0", "run.progress=false", "run.tensorboard=false",
            f"run.profile_step={profile_step}", f"run.dir={run_dir}", *keys, *extra]
    cfg = load_config(config, ["data.builtin=stdlib", f"parallel.world_size={nproc}", *args[2:]])
    assert data_parallel_size(cfg) == dp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "megassm.train", *args]
    t0 = time.time()
    out = {"layout": layout, "nproc": nproc, "dp": dp, "micro_batch": micro, "accum": accum,
           "global_batch_tokens": accum * dp * micro * cfg.train.seq_len}
    # a layout that runs out of time is killed with all its ranks (a surviving rank would hold its GPU's memory
    # through the next layouts)
    code, _, stderr = run_or_kill(cmd, timeout, f"run.dir={run_dir}",
                                  env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")})
    if code is None:
        out.update(wall_s=round(time.time() - t0, 1), error=f"timed out after {timeout}s", tail=stderr[-800:],
                   steps_done=_steps_done(run_dir))
        return out
    out["wall_s"] = round(time.time() - t0, 1)
    recs = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    if code != 0:
        err = stderr
        out["error"] = "out of memory" if "out of memory" in err.lower() else f"exit {code}"
        # the exception lines of the ranks' tracebacks (the tail is torchrun's summary)
        raised = [ln for ln in err.splitlines() if "Error" in ln and ":" in ln and "elastic" not in ln]
        out["raised"] = list(dict.fromkeys(raised))[:6]
        out["tail"] = err[-600:]
        out["steps_done"] = _steps_done(run_dir)
        return out
    last = [d for d in recs if "tokens_per_s" in d][-1]
    start = next((d for d in recs if "time_startup_s" in d), {})
    model = build_model(cfg.model, vocab_size=cfg.model.vocab_size or 257, device="meta")
    n_params = model.num_parameters()
    fl = flops_per_sequence(cfg.model, model.vocab_size_padded, cfg.train.seq_len)
    tps = last["tokens_per_s"]
    out.update(step=last["step"], loss=round(last["loss"], 4), tokens_per_s=round(tps),
               losses=[round(d["loss"], 4) for d in recs if "loss" in d and "step" in d],  # every step's
               tokens_per_s_per_gpu=round(tps / nproc), step_s=round(out["global_batch_tokens"] / tps, 3),
               mfu=round(last.get("mfu", float("nan")), 4),
               mfu_6pt=round(6 * n_params * tps / (H100_BF16_PEAK * nproc), 4),
               train_flops_per_token=round(3 * fl["total"] / cfg.train.seq_len),
               peak_allocated_gib=round(last.get("memory_max_allocated_gib", float("nan")), 2),
               peak_reserved_gib=round(last.get("memory_max_reserved_gib", float("nan")), 2),
               startup_s=round(start.get("time_startup_s") or float("nan"), 1),
               first_step_s=round(start.get("time_first_step_s") or float("nan"), 1))
    profs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(run_dir, "profile", "*.json")))]
    if profs:
        r0 = next((p for p in profs if p["rank"] == 0), profs[0])
        out.update(profiled_step_ms=r0["step_ms"], comm_share=r0["comm_share"],
                   comm_exposed_share=r0["comm_exposed_share"], idle_share=r0["idle_share"],
                   comm_exposed_share_max=max(p["comm_exposed_share"] for p in profs), families_ms=r0["families"],
                   top_kernels=r0.get("top"), gpu_busy_ms=r0["gpu_busy_ms"], kernels=r0["kernels"])
    import torch

    if torch.cuda.is_available():  # CPU smoke runs have no headroom to report
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        out["headroom_gib"] = round(total - out["peak_reserved_gib"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", required=True)
    ap.add_argument("--config", default="configs/hybrid-7b.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timed", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8, help="micro-batches per data-parallel rank per step")
    ap.add_argument("--profile-step", type=int, default=0, help="profile this step (0: none; steps - timed is "
                    "a good one: after warm-up, before the timed window)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per layout")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run; put them before --layouts "
                    "or after `--` (right after --layouts they would be read as layouts)")
    a = ap.parse_args()
    for layout in a.layouts:
        res = run_layout(layout, a.nproc, a.steps, a.timed, a.accum, a.config, a.extra, a.profile_step, a.timeout)
        line = json.dumps(res)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
