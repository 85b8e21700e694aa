"""COFFEE solvers: DEER (parallel Newton) vs the sequential loop, one mixer layer forward + backward.

    python benchmarks/coffee_deer.py                       # GPU if present: d_model 1024, L 512 2048 8192
    python benchmarks/coffee_deer.py --tiny                # CPU smoke test

Prints one JSON object per (seq_len, input scale, solver): ms per forward+backward, peak memory, Newton solves
and steps redone (DEER), relative output difference to the sequential solver. The mixer is the `C` layer
with its default (bounded lam) init, u = the layer input at RMS `scale` (the block's norm gives ~1).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megassm.config import load_config
from megassm.models.coffee import CoffeeMixer


def bench(d_model, d_state, expand, seq_len, batch, scale, solver, device, iters, warmup):
    cfg = load_config(None, ["data.builtin=stdlib", "model.pattern=C", f"model.d_model={d_model}",
                             f"model.coffee.d_state={d_state}", f"model.coffee.expand={expand}",
                             f"model.coffee.solver={solver}"]).model
    torch.manual_seed(0)
    from megassm.models import build_model

    model = build_model(cfg, vocab_size=16)
    model.init_weights(0)
    mixer: CoffeeMixer = model.layers[0].mixer.to(device)
    gen = torch.Generator().manual_seed(1)
    u = (torch.randn(batch, seq_len, d_model, generator=gen) * scale).to(device).requires_grad_()

    def run():
        out, _ = mixer(u)
        out.float().pow(2).mean().backward()
        return out

    for _ in range(warmup):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / iters * 1e3
    rec = dict(seq_len=seq_len, batch=batch, d_model=d_model, channels=mixer.lam.shape[0], d_state=d_state,
               scale=scale, solver=solver, ms_fwd_bwd=round(ms, 2),
               peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.type == "cuda" else None)
    if solver == "deer":
        rec.update({k: mixer.last_info.get(k) for k in ("iters", "rejected", "residual", "converged", "fallback")})
    return rec, out.detach()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU-sized smoke run")
    ap.add_argument("--seq-len", type=int, nargs="*", default=None)
    ap.add_argument("--scale", type=float, nargs="*", default=[1.0, 3.0])
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    d_model, d_state, expand, iters, warmup = (1024, 8, 1, 3, 1) if not args.tiny else (32, 4, 1, 1, 0)
    lens = args.seq_len or ([512, 2048, 8192] if not args.tiny else [64, 256])
    batch = args.batch if not args.tiny else 2
    for L in lens:
        for scale in args.scale:
            ref = None
            for solver in ("sequential", "deer"):
                try:
                    rec, out = bench(d_model, d_state, expand, L, batch, scale, solver, device, iters, warmup)
                except torch.cuda.OutOfMemoryError:
                    rec, out = dict(seq_len=L, scale=scale, solver=solver, error="out of memory"), None
                    torch.cuda.empty_cache()
                if solver == "sequential":
                    ref = out
                elif out is not None and ref is not None:
                    rec["rel_diff_vs_sequential"] = float((out - ref).float().norm() / ref.float().norm())
                print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
