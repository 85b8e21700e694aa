"""FP8 projections (train.fp8, kernels/fp8/op.py) against bf16 at the 1.3B models' Linear shapes: forward + backward
of one projection, and each FP8 cast alone (Triton's two passes against the eager casts), with the bytes-moved
floor of a cast. One JSON line per row, median ms of triton.testing.do_bench.

    python benchmarks/fp8_linear.py [--tokens 8192]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from megassm.kernels import fp8 as K

SHAPES = {"mamba2-1.3b in_proj": (2048, 8512), "mamba2-1.3b out_proj": (4096, 2048),  # (in, out) features
          "hybrid-1.3b in_proj": (1536, 8240), "hybrid-1.3b out_proj": (3072, 1536),
          "hybrid-1.3b mlp up": (1536, 11264), "hybrid-1.3b mlp down": (5632, 1536), "hybrid-1.3b qkv": (1536, 2560)}


def _fwd_bwd(fn, x, w, g):
    def run():
        x.grad = w.grad = None
        fn(x, w).backward(g)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)  # micro-batch 4 x 2048
    args = ap.parse_args()
    M = args.tokens
    torch.manual_seed(0)

    def eager(t, dt):  # the torch casts cast_fp8 falls back to off CUDA: one cast, then the transposing copy
        t8, inv = K.to_fp8(t, dt)
        return t8, t8.t().contiguous(), inv

    for name, (k, n) in SHAPES.items():
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda") * 0.02).requires_grad_(True)
        g = torch.randn(M, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        row = {"shape": name, "tokens": M, "in": k, "out": n}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            row["bf16_ms"] = triton.testing.do_bench(_fwd_bwd(F.linear, x, w, g))
            row["fp8_ms"] = triton.testing.do_bench(_fwd_bwd(K.fp8_linear, x, w, g))
        wq = K.fp8_weight(w.detach())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            row["fp8_cached_w_ms"] = triton.testing.do_bench(
                _fwd_bwd(lambda a, b: K.fp8_linear(a, b, None, wq), x, w, g))
        # the three products alone: bf16 against FP8 (dW written in fp32 for the fp32 master weight, as training does)
        x8, x8t, sx = K.cast_fp8(x.detach(), K.E4M3)
        w8, w8t, sw = wq
        g8, g8t, sg = K.cast_fp8(g, K.E5M2)
        xb, wb = x.detach(), w.detach().bfloat16()
        mm = torch._scaled_mm
        for prod, bf, f8 in (
                ("y", lambda: xb @ wb.t(), lambda: mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16)),
                ("dx", lambda: g @ wb, lambda: mm(g8, w8t.t(), sg, sw, out_dtype=torch.bfloat16)),
                ("dw", lambda: (g.t() @ xb).float(), lambda: mm(g8t, x8t.t(), sg, sx, out_dtype=torch.float32)),
                ("dw_bf16_out", lambda: g.t() @ xb, lambda: mm(g8t, x8t.t(), sg, sx, out_dtype=torch.bfloat16)),
                ("y_fast_accum", lambda: xb @ wb.t(),
                 lambda: mm(x8, w8.t(), sx, sw, out_dtype=torch.bfloat16, use_fast_accum=True))):
            row[f"mm_{prod}_bf16_ms"] = triton.testing.do_bench(bf)
            row[f"mm_{prod}_fp8_ms"] = triton.testing.do_bench(f8)
        for role, t, dt in (("x", x.detach(), K.E4M3), ("grad", g, K.E5M2)):
            row[f"cast_{role}_triton_ms"] = triton.testing.do_bench(lambda: K.cast_fp8(t, dt))
            row[f"cast_{role}_eager_ms"] = triton.testing.do_bench(lambda: eager(t, dt))
            row[f"cast_{role}_floor_ms"] = t.numel() * (2 * 2 + 2) / 3.3e12 * 1e3  # read twice, write 2 x 1 byte
        print(json.dumps({k_: round(v, 4) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
