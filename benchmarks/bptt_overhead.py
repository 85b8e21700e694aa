"""BPTT state-carrying overhead and the longest context one GPU trains on, as JSON.

    python benchmarks/bptt_overhead.py --config configs/mamba2-1.3b.yaml --seq-len 2048 --micro-batch 4 \
        --windows 1 2 --probe --out $OUT/bptt_overhead.json

Same step as the trainer (fp32 masters, bf16 autocast on GPU, fused AdamW, clipping, seq_idx passed),
random tokens, one document per row (no resets after the first window). Modes, each timed per window:
  no_carry   model(tokens, labels) as in packed training (train.bptt=false)
  carry_K1   train.bptt=true: states in, final states out (return_states), reset mask, detach (bptt.py)
  carry_KK   train.bptt_windows=K: K windows with the graph kept, one backward, one optimizer step
overhead_pct = (per-window time of the mode / per-window time of no_carry - 1) * 100.

--probe: the longest context that trains (forward + backward, optimizer states allocated) at micro-batch 1:
  full_seq:     one window of L = seq_len, 2*seq_len, ... (full backprop, no carry) until out of memory
  bptt_windows: K windows of seq_len with backprop through all K (train.bptt_windows=K), K = 1, 2, 4, ...
  With truncated BPTT (K=1) the context a state carries is unbounded; memory is one window's.
Stops at --probe-max tokens or when --time-budget seconds have passed. Prints the JSON and writes --out.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from megassm.config import load_config
from megassm.models import build_model
from megassm.training.bptt import StateCarrier
from megassm.training.optim import build_optimizer, clip_grad_norm


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(dev):
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None


def _reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


class Bench:
    def __init__(self, cfg, dev):
        self.cfg, self.dev = cfg, dev
        torch.manual_seed(0)
        self.vocab = cfg.model.vocab_size or 257
        model = build_model(cfg.model, vocab_size=self.vocab, device="cpu")
        model.init_weights(0)
        self.model = model.to(dev)
        self.opt = build_optimizer(self.model.param_groups(cfg.optim.weight_decay), cfg.optim, dev.type)
        self.gen = torch.Generator(device="cpu").manual_seed(0)
        self.amp = dev.type == "cuda"

    def autocast(self):
        return torch.autocast(self.dev.type, dtype=torch.bfloat16, enabled=self.amp)

    def batch(self, mb, L, first):
        toks = torch.randint(0, self.vocab, (mb, L + 1), generator=self.gen)
        return {
            "tokens": toks[:, :-1].to(self.dev), "labels": toks[:, 1:].to(self.dev),
            "seq_idx": torch.zeros(mb, L, dtype=torch.int32, device=self.dev),
            "reset": torch.full((mb,), first, dtype=torch.bool, device=self.dev),
        }

    def opt_step(self):
        clip_grad_norm(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step_no_carry(self, mb, L, optimizer=True):
        b = self.batch(mb, L, True)
        with self.autocast():
            out = self.model(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"])
        out.loss.backward()
        if optimizer:
            self.opt_step()
        else:
            self.opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    def step_carry(self, carrier, mb, L, K, first, optimizer=True):
        batches = [self.batch(mb, L, first and w == 0) for w in range(K)]
        loss = carrier.run_windows(self.model, 0, batches, self.autocast)
        if optimizer:
            self.opt_step()
        else:
            self.opt.zero_grad(set_to_none=True)
        return loss

    def timed(self, mode, mb, L, K, steps, warmup):
        _reset_peak(self.dev)
        carrier = StateCarrier(self.model, micro_batch=mb, windows=K, device=self.dev) if mode != "no_carry" else None
        first = True

        def one():
            nonlocal first
            if carrier is None:
                r = self.step_no_carry(mb, L)
            else:
                r = self.step_carry(carrier, mb, L, K, first)
            first = False
            return r

        for _ in range(warmup):
            one()
        _sync(self.dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = one()
        loss = float(loss)
        _sync(self.dev)
        dt = (time.perf_counter() - t0) / steps
        windows = 1 if carrier is None else K
        return {
            "mode": mode, "micro_batch": mb, "seq_len": L, "windows_per_step": windows,
            "step_ms": round(dt * 1e3, 2), "ms_per_window": round(dt * 1e3 / windows, 2),
            "tokens_per_s": round(mb * L * windows / dt, 1), "loss": round(loss, 4), "peak_mem_gib": _peak_gib(self.dev),
        }


def probe(bench, L, max_tokens, deadline):
    """Longest trainable context at micro-batch 1 (see the module docstring)."""
    out = {"full_seq": [], "bptt_windows": []}

    def attempt(fn):
        _reset_peak(bench.dev)
        t0 = time.perf_counter()
        try:
            fn()
            _sync(bench.dev)
            return {"ok": True, "s": round(time.perf_counter() - t0, 2), "peak_mem_gib": _peak_gib(bench.dev)}
        except torch.OutOfMemoryError:
            bench.opt.zero_grad(set_to_none=True)
            return {"ok": False, "error": "out of memory"}
        finally:
            if bench.dev.type == "cuda":
                torch.cuda.empty_cache()

    n = L
    while n <= max_tokens and time.time() < deadline:
        r = attempt(lambda: bench.step_no_carry(1, n, optimizer=False))
        out["full_seq"].append({"context": n, **r})
        if not r["ok"]:
            break
        n *= 2
    K = 1
    while K * L <= max_tokens and time.time() < deadline:
        carrier = StateCarrier(bench.model, micro_batch=1, windows=K, device=bench.dev)
        r = attempt(lambda: bench.step_carry(carrier, 1, L, K, True, optimizer=False))
        out["bptt_windows"].append({"windows": K, "context": K * L, **r})
        del carrier
        if not r["ok"]:
            break
        K *= 2
    ok_full = [r["context"] for r in out["full_seq"] if r["ok"]]
    ok_bptt = [r["context"] for r in out["bptt_windows"] if r["ok"]]
    out["longest_full_seq"] = max(ok_full, default=None)
    out["longest_bptt_backprop_span"] = max(ok_bptt, default=None)
    out["truncated_bptt_context"] = "unbounded (state carried forward; memory of one window)"
    out["stopped"] = "time budget" if time.time() >= deadline else "out of memory or probe-max"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/mamba2-1.3b.yaml")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 2], help="K values of the carry modes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--probe", action="store_true", help="also probe the longest trainable context")
    ap.add_argument("--probe-max", type=int, default=1 << 20, help="largest context probed (tokens)")
    ap.add_argument("--time-budget", type=float, default=480.0, help="seconds; the probe stops after it")
    ap.add_argument("--out", default=None, help="JSON file (default: $OUT/bptt_overhead.json when $OUT is set)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    start = time.time()
    cfg = load_config(args.config, ["data.builtin=stdlib", *args.overrides])
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from megassm import kernels

    bench = Bench(cfg, dev)
    res = {
        "bench": "bptt_overhead", "config": args.config, "overrides": args.overrides,
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "kernels": kernels.backend(), "torch": torch.__version__,
        "params": bench.model.num_parameters(), "precision": "bf16 autocast" if bench.amp else "fp32",
        "runs": [],
    }
    modes = [("no_carry", 1)] + [(f"carry_K{k}", k) for k in args.windows]
    for mode, K in modes:
        try:
            row = bench.timed(mode, args.micro_batch, args.seq_len, K, args.steps, args.warmup)
        except torch.OutOfMemoryError:
            bench.opt.zero_grad(set_to_none=True)
            row = {"mode": mode, "micro_batch": args.micro_batch, "seq_len": args.seq_len, "windows_per_step": K,
                   "error": "out of memory"}
        res["runs"].append(row)
        print(json.dumps(row), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in res["runs"] if r["mode"] == "no_carry" and "ms_per_window" in r), None)
    if base:
        for r in res["runs"]:
            if "ms_per_window" in r:
                r["overhead_pct"] = round((r["ms_per_window"] / base["ms_per_window"] - 1) * 100, 2)
    if args.probe:
        res["probe"] = probe(bench, args.seq_len, args.probe_max, start + args.time_budget)
    res["wall_s"] = round(time.time() - start, 1)
    text = json.dumps(res, indent=2)
    print(text)
    out = args.out or (os.path.join(os.environ["OUT"], "bptt_overhead.json") if os.environ.get("OUT") else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
