"""Checkpoint cost on a ~7B hybrid: the canonical gather (rank 0 writes model.pt / optim.pt) against the sharded
format (every rank writes its DCP chunks) written synchronously and asynchronously; `megassm-train`'s Trainer
itself under torchrun, one run per case, each printed as one JSON line.

    source benchmarks/device_env.sh
    python benchmarks/checkpoint_7b.py --nproc 4 --steps 7 --save-every 3 --dir /tmp/ckbench

Per case: `stall_s` (per save, the most any rank's training loop was blocked in Trainer.save: for canonical the
gather + write, for sharded the write, for async the CPU snapshot), `step_s` (median step without a save) and
`step_s_while_writing` (median step while an async write runs: its interference), `complete_s` (per save, from
the step boundary until the checkpoint is complete, i.e. renamed with meta.json), `bytes` (the last checkpoint's
files), `rss_peak_gib` per rank (peak host RSS of the run, getrusage) and `rss_before_save_gib` (the peak before
the first save: the difference is what saving adds). Checkpoints go under --dir (each case's run directory is
removed after it; about 84 GB per 7B checkpoint, two on disk at the peak with run.keep_last=1).

CPU smoke test (gloo): python benchmarks/checkpoint_7b.py --nproc 2 --config configs/tiny.yaml --steps 5 \
    --save-every 2 --accum 2 train.device=cpu train.seq_len=64
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

from procs import run_or_kill  # benchmarks/procs.py

CASES = {
    "canonical": ["run.checkpoint_format=canonical", "run.async_save=false"],
    "sharded": ["run.checkpoint_format=sharded", "run.async_save=false"],
    "sharded_async": ["run.checkpoint_format=sharded", "run.async_save=true"],
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def worker(a) -> None:
    import torch

    from megassm.config import load_config
    from megassm.training.trainer import Trainer

    ws = int(os.environ.get("WORLD_SIZE", "1"))
    over = ["data.builtin=stdlib", "train.micro_batch=1", f"train.global_batch={a.accum * ws}",
            f"train.steps={a.steps}", "train.log_interval=1", "train.eval_interval=0", "optim.warmup_steps=2",
            "run.save_final=false", f"run.save_interval={a.save_every}", "run.keep_last=1", "run.progress=false",
            "run.tensorboard=false", f"run.dir={a.run_dir}", f"parallel.engine={a.engine}", *CASES[a.case], *a.extra]
    cfg = load_config(a.config, over)
    tr = Trainer(cfg)
    cuda = tr.device.type == "cuda"
    steps, saves = [], []
    orig_step, orig_save = tr.train_step, tr.checkpoints.save

    def pending() -> bool:
        fut = tr.checkpoints.sharded.pending if tr.checkpoints.sharded is not None else None
        return fut is not None and not fut.done()

    def timed_step():
        writing = pending()
        r = orig_step()
        steps.append({"step": tr.step + 1, "s": r.step_time, "writing": writing})
        return r

    def timed_save(step):
        rec = {"step": step, "rss_before_gib": _rss_gib()}
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        path = orig_save(step)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        rec.update(stall_s=t1 - t0, path=path)
        fut = tr.checkpoints.sharded.pending if tr.checkpoints.sharded is not None else None
        if fut is None:
            rec["complete_s"] = t1 - t0
        else:
            fut.add_done_callback(lambda f, rec=rec, t0=t0: rec.update(complete_s=time.perf_counter() - t0))
        saves.append(rec)
        return path

    tr.train_step, tr.checkpoints.save = timed_step, timed_save
    tr.fit()  # waits for the last async save
    out = {"rank": tr.groups.rank, "steps": steps, "saves": saves, "rss_peak_gib": _rss_gib()}
    if tr.groups.rank == 0 and saves:
        last = saves[-1]["path"]
        sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(last) for f in fs]
        out.update(bytes=sum(sizes), files=len(sizes))
    with open(os.path.join(a.out, f"rank{tr.groups.rank}.json"), "w") as f:
        json.dump(out, f)


def run_case(case: str, a) -> dict:
    out_dir = tempfile.mkdtemp(prefix=f"ckbench-{case}-out-")
    run_dir = tempfile.mkdtemp(prefix=f"ckbench-{case}-", dir=a.dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), os.path.abspath(__file__),
           "--worker", "--case", case, "--out", out_dir, "--run-dir", run_dir, "--config", a.config,
           "--steps", str(a.steps), "--save-every", str(a.save_every), "--accum", str(a.accum), "--engine", a.engine,
           *a.extra]
    t0 = time.time()
    code, out, err = run_or_kill(cmd, a.timeout, run_dir)
    log = out + err
    res = {"case": case, "nproc": a.nproc, "engine": a.engine, "config": a.config, "wall_s": round(time.time() - t0, 1)}
    if a.logs:  # the ranks' whole output, kept for diagnosis (the run directory is removed below)
        with open(os.path.join(a.logs, f"{case}.log"), "w") as f:
            f.write(log)
    try:
        if code != 0:
            tail = log[-1500:]
            if code is None:
                res["error"] = f"timed out after {a.timeout}s (every rank killed)"
                res["tail"] = tail
            else:
                res["error"] = "out of memory" if "out of memory" in tail.lower() else tail
            return res
        ranks = [json.load(open(os.path.join(out_dir, f"rank{i}.json"))) for i in range(a.nproc)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    n_saves = len(ranks[0]["saves"])
    normal = [s["s"] for s in ranks[0]["steps"][2:] if not s["writing"]]  # the first steps include autotuning
    writing = [s["s"] for s in ranks[0]["steps"] if s["writing"]]
    res.update(
        saves=[s["step"] for s in ranks[0]["saves"]],
        stall_s=[round(max(rk["saves"][i]["stall_s"] for rk in ranks), 3) for i in range(n_saves)],
        complete_s=[round(max(rk["saves"][i].get("complete_s", float("nan")) for rk in ranks), 3)
                    for i in range(n_saves)],
        step_s=round(statistics.median(normal), 3) if normal else None,
        step_s_while_writing=round(statistics.median(writing), 3) if writing else None,
        bytes=ranks[0].get("bytes"), files=ranks[0].get("files"),
        rss_peak_gib=[round(rk["rss_peak_gib"], 2) for rk in ranks],
        rss_before_save_gib=[round(rk["saves"][0]["rss_before_gib"], 2) if rk["saves"] else None for rk in ranks],
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--config", default="configs/hybrid-7b.yaml")
    ap.add_argument("--engine", default="fsdp2")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per GPU per step")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: the system temp directory)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case; past it the case is killed with all its "
                    "ranks and reported as timed out")
    ap.add_argument("--logs", default=None, help="keep each case's output (all ranks) as LOGS/<case>.log")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    a = ap.parse_args()
    if a.save_every < 1 or a.steps < a.save_every:
        ap.error(f"--save-every ({a.save_every}) must be in 1..--steps ({a.steps})")
    if a.worker:
        worker(a)
        return
    for d in (a.dir, a.logs):
        if d:
            os.makedirs(d, exist_ok=True)
    for case in a.cases:
        print(json.dumps(run_case(case, a)), flush=True)


if __name__ == "__main__":
    main()
