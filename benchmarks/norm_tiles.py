"""Tile sweep for the Triton RMS-norm backward kernels, bf16, the mamba2-1.3b shapes (batch x 2048 tokens):
gated (_gated_bwd_kernel, the Mamba-2 output norm): x [B, L, 4096], z a strided slice of in_proj's output
[B, L, 8512] (as the model reads it), dout contiguous, weight fp32, 1 group, norm_before_gate False; add
(_add_bwd_kernel, fused residual add + RMSNorm): new residual fp32 [B, L, 2048], dout bf16, dres_in fp32, weight
fp32, x bf16 / residual fp32 (so dres is written in fp32 besides dx in bf16).

Prints the bytes-moved floors and the forward kernels' times (for reference), then one JSON line per tile
(ROWS, num_warps, programs, PREFETCH, RELOAD; None = the default of _gated_bwd_tiles / _add_bwd_tiles): median
ms of triton.testing.do_bench and rel_diff, the max over dx, dz / dres, dweight of max|a - b| / max|b| against
the row-at-a-time tile (ROWS 1, the old kernel's warps, 4 programs per SM, neither option). Stage 1 runs every
shape at 4 programs per SM, stage 2 the --top fastest at --mults programs per SM. The shapes are those that
ptxas (benchmarks/kernels_compile_check.py --norm-tiles, sm_90a) builds without spills at these widths: ROWS 8,
and ROWS 4 of the 4096-column gated kernel, spill at any warps; so does ROWS 2 there without RELOAD.

H100, 2026-12 (the defaults come from it): gated 0.214 ms (the row-at-a-time kernel it replaced) -> 0.133
(1, 32 warps, 1 program per SM, PREFETCH), floor 0.112; add 0.146 -> 0.106-0.107 ((1, 8 or 16, 2 per SM,
PREFETCH)), floor 0.090. One wave of persistent programs (as many as fit on an SM at once) wins.

    python benchmarks/norm_tiles.py [--kernels gated add] [--batch 4] [--top 3] [--mults 1 2 8]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from megassm.kernels.norm import triton_norm as tn

# (ROWS, num_warps, PREFETCH, RELOAD); the first is the row-at-a-time baseline
SHAPES = {
    "gated": [(1, 16, 0, 0), (1, 16, 1, 0), (1, 16, 0, 1), (1, 16, 1, 1), (1, 8, 0, 0), (1, 8, 1, 0), (1, 8, 0, 1),
              (1, 8, 1, 1), (1, 32, 0, 0), (1, 32, 1, 0), (1, 32, 0, 1), (1, 32, 1, 1), (2, 16, 0, 1), (2, 32, 0, 1),
              (2, 8, 0, 1), (2, 8, 1, 1)],
    "add": [(1, 8, 0, 0), (1, 8, 1, 0), (1, 8, 0, 1), (1, 8, 1, 1), (1, 16, 0, 0), (1, 16, 1, 0), (1, 16, 0, 1),
            (1, 16, 1, 1), (1, 4, 0, 1), (1, 4, 1, 1), (2, 8, 0, 0), (2, 8, 0, 1), (2, 8, 1, 1), (2, 16, 0, 0),
            (2, 16, 1, 0), (2, 16, 1, 1), (4, 16, 0, 1), (4, 32, 0, 1)],
}


def _rel(out, ref):
    return max((o.float() - r.float()).abs().max().item() / (r.float().abs().max().item() + 1e-30)
               for o, r in zip(out, ref) if o is not None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", nargs="+", default=["gated", "add"], choices=["gated", "add"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--top", type=int, default=3, help="stage 2: this many fastest shapes at --mults programs/SM")
    ap.add_argument("--mults", type=int, nargs="+", default=[1, 2, 8], help="stage 2's programs per SM")
    args = ap.parse_args()
    B, L, dev, bf = args.batch, args.seqlen, "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    dg, da = 4096, 2048
    big = torch.randn(B, L, 2 * 4096 + 2 * 128 + 64, device=dev, dtype=bf)  # in_proj's output: z, xBC, dt
    x, z = torch.randn(B, L, dg, device=dev, dtype=bf), big[..., :dg]  # z strided like the model's slice
    do_g, w_g = torch.randn(B, L, dg, device=dev, dtype=bf), 1.0 + 0.1 * torch.randn(dg, device=dev)
    xa, res = torch.randn(B, L, da, device=dev, dtype=bf), torch.randn(B, L, da, device=dev)
    w_a = 1.0 + 0.1 * torch.randn(da, device=dev)
    newres = tn.add_rmsnorm_fwd(xa, res, w_a, 1e-5)[1]
    do_a, dres_in = torch.randn(B, L, da, device=dev, dtype=bf), torch.randn(B, L, da, device=dev)
    eg, ea = B * L * dg, B * L * da
    floor = lambda nbytes: round(nbytes / 3.0e12 * 1e3, 4)  # noqa: E731  (ms at ~3 TB/s)
    print(json.dumps({"sms": sms, "floor_gated_bwd_ms": floor(5 * 2 * eg),  # read x, z, dout; write dx, dz (bf16)
                      "floor_add_bwd_ms": floor((4 + 2 + 4 + 2 + 4) * ea),  # h, dout, dres_in; dx, dres
                      "floor_gated_fwd_ms": floor(3 * 2 * eg),  # x, z; out
                      "floor_add_fwd_ms": floor((2 + 4 + 2 + 4) * ea)}), flush=True)  # x, res; out, newres

    ms = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")  # noqa: E731
    fwd = {"gated": lambda: tn.gated_rmsnorm_fwd(x, z, w_g, 1, 1e-5, False),
           "add": lambda: tn.add_rmsnorm_fwd(xa, res, w_a, 1e-5)}
    bwd = {"gated": lambda t: tn._gated_bwd(do_g, x, z, w_g, 1, 1e-5, False, 0, tiles=t),
           "add": lambda t: tn.add_rmsnorm_bwd(do_a, dres_in, newres, w_a, 1e-5, bf, torch.float32, tiles=t)}
    defaults = {"gated": tn._gated_bwd_tiles(B * L, dg, x), "add": tn._add_bwd_tiles(B * L, da, xa)}

    def run(k, ref, tiles, times, shape=None):
        try:
            out = bwd[k](tiles)
            t = ms(lambda: bwd[k](tiles))
            if shape is not None:
                times[shape] = t
            row = {"kernel": k, "pass": "bwd", "tiles": tiles, "ms": round(t, 4), "rel_diff": _rel(out, ref),
                   "progs_per_sm": round((tiles or defaults[k])[2] / sms, 2)}
            if tiles is None:
                row["default"] = defaults[k]
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            row = {"kernel": k, "pass": "bwd", "tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(row), flush=True)

    for k in args.kernels:
        print(json.dumps({"kernel": k, "pass": "fwd", "ms": round(ms(fwd[k]), 4)}), flush=True)
        base = SHAPES[k][0]
        ref = bwd[k]((base[0], base[1], 4 * sms, base[2], base[3]))
        times = {}
        run(k, ref, None, times)
        for shape in SHAPES[k]:
            run(k, ref, (shape[0], shape[1], 4 * sms, shape[2], shape[3]), times, shape)
        for shape in sorted(times, key=times.get)[:args.top]:
            for mult in args.mults:
                run(k, ref, (shape[0], shape[1], mult * sms, shape[2], shape[3]), times)

if __name__ == "__main__":
    main()
