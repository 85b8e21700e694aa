"""Benchmark of the selective scan of the seed mixers `S` (Mamba-1, decay="exp") and `L` (Longhorn,
decay="longhorn"), and of whole S / L / M layers. Prints one JSON line per measurement.

    python benchmarks/seed_scan.py                  # kernel rows + layer rows
    python benchmarks/seed_scan.py --only kernel    # kernel | layer | tiles
    python benchmarks/seed_scan.py --only tiles     # sweep (BD, T, num_warps) of forward and backward

Kernel rows: bf16 x / delta / B / C / z, fp32 A / D / bias / states, resets in every row, initial state and
final state (as the mixers with carried states use it). Shapes: Mamba-1 / Longhorn 1.3-1.4B layers (d_inner
4096, N 16) at 16K tokens per call (B x L = 8 x 2048, 1 x 16384), a 370M layer (d_inner 2048). Times:
triton.testing.do_bench median (ms); the bytes each pass must move give an effective bandwidth (`GB/s`).
Layer rows: one mixer (S, L, or the Mamba-2 `M` of the same d_model) forward and forward+backward under bf16
autocast, fp32 master weights, as the trainer runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("MEGASSM_KERNELS", "triton")

import torch  # noqa: E402


def emit(row):
    print(json.dumps(row), flush=True)


def bench(fn, warmup=10, rep=50):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def guarded(name, fn, **row):
    try:
        fn(row)
    except Exception as e:  # one failing row must not lose the others
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(file=sys.stderr)
    row.setdefault("bench", name)
    emit(row)
    torch.cuda.empty_cache()


def scan_inputs(B, L, D, N, decay, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16

    def rn(*s, scale=1.0):
        return torch.randn(*s, device="cuda", generator=g) * scale

    inp = dict(x=rn(B, L, D).to(bf), B=rn(B, L, N).to(bf), C=rn(B, L, N).to(bf), z=rn(B, L, D).to(bf),
               D=rn(D), initial_state=rn(B, D, N))
    if decay == "exp":
        inp.update(delta=rn(B, L, D, scale=0.5).to(bf), A=-(torch.rand(D, N, device="cuda", generator=g) * 15 + 1),
                   delta_bias=rn(D, scale=0.5))
    else:
        beta = torch.sigmoid(rn(B, L, D))
        inp.update(delta=beta / (1 + beta * inp["B"].float().pow(2).sum(-1, keepdim=True)), A=None, delta_bias=None)
    sid = torch.zeros(B, L, dtype=torch.int32, device="cuda")
    sid[:, L // 3:] += 1
    sid[:, L // 3 + 1:] += 1
    inp["seq_idx"] = sid
    return inp


def _args(inp, decay):
    return (inp["x"], inp["delta"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["delta_bias"],
            decay == "exp", decay, inp["initial_state"], inp["seq_idx"])


def _bytes(inp, B, L, D, N):
    act = sum(inp[k].numel() * inp[k].element_size() for k in ("x", "delta", "B", "C", "z"))
    return act + B * L * D * 2 + 2 * B * D * N * 4  # + y, states in / out


def kernel_rows(shapes, tiles=None):
    from megassm.kernels.scan import triton_scan as ts

    for decay in ("exp", "longhorn"):
        for B, L, D, N in shapes:
            def run(row, B=B, L=L, D=D, N=N, decay=decay):
                inp = scan_inputs(B, L, D, N, decay)
                args = _args(inp, decay)
                ft = None if tiles is None else tiles[0]
                bt = None if tiles is None else tiles[1]
                y, fin = ts.selective_scan_fwd(*args, True, tiles=ft)
                dy, dfin = torch.randn_like(y), torch.randn_like(fin)
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ts.selective_scan_bwd(dy, dfin, *args, tiles=bt)
                row["bwd_extra_mem_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
                fwd = bench(lambda: ts.selective_scan_fwd(*args, True, tiles=ft))
                bwd = bench(lambda: ts.selective_scan_bwd(dy, dfin, *args, tiles=bt))
                nbytes = _bytes(inp, B, L, D, N)
                row.update(fwd_ms=round(fwd, 3), bwd_ms=round(bwd, 3), fwd_bwd_ms=round(fwd + bwd, 3),
                           fwd_GBps=round(nbytes / fwd / 1e6, 1), tokens=B * L)
            guarded("scan", run, decay=decay, B=B, L=L, D=D, N=N, tiles=tiles)


def tile_sweep(shape):
    """Forward tiles (BD, T, num_warps) with the default backward, then backward tiles (BD, T, num_warps,
    channel blocks per program; None = auto) with the default forward: the passes are timed separately."""
    B, L, D, N = shape
    for fwd in ((16, 16, 4), (8, 16, 4), (16, 8, 4), (32, 8, 4), (8, 32, 4), (16, 16, 8), (32, 16, 8), (4, 32, 4),
                (16, 32, 8)):
        kernel_rows([shape], tiles=(fwd, None))
    for bwd in ((8, 16, 8, None), (8, 16, 4, None), (4, 16, 4, None), (16, 8, 8, None), (8, 8, 4, None),
                (16, 16, 8, None), (8, 16, 8, 1), (8, 16, 8, 2), (4, 16, 4, 1), (4, 32, 4, None), (2, 32, 4, None),
                (16, 8, 4, 1), (4, 8, 4, 1)):
        kernel_rows([shape], tiles=(None, bwd))


def layer_rows(d_model=2048, B=4, L=2048):
    from megassm.config import ModelConfig
    from megassm.models.blocks import MIXERS
    from megassm.models.init import canonical_init

    cfg = ModelConfig(d_model=d_model)
    for letter in ("S", "L", "M"):
        def run(row, letter=letter):
            m = MIXERS[letter](cfg, 48)
            canonical_init(m, 0)
            m.cuda()
            u = torch.randn(B, L, d_model, device="cuda", requires_grad=True)
            sid = torch.zeros(B, L, dtype=torch.int32, device="cuda")

            def fwd():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return m(u, seq_idx=sid)[0]

            def fwd_bwd():
                fwd().float().sum().backward()

            row.update(params_M=round(sum(p.numel() for p in m.parameters()) / 1e6, 2),
                       fwd_ms=round(bench(fwd), 3), fwd_bwd_ms=round(bench(fwd_bwd), 3), tokens=B * L)
        guarded("layer", run, letter=letter, d_model=d_model, B=B, L=L)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("kernel", "layer", "tiles"))
    args = ap.parse_args()
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__})
    shapes = [(8, 2048, 4096, 16), (1, 16384, 4096, 16), (8, 2048, 2048, 16), (2, 2048, 1536, 64)]
    if args.only in (None, "kernel"):
        kernel_rows(shapes)
    if args.only in (None, "layer"):
        layer_rows()
    if args.only == "tiles":
        tile_sweep(shapes[0])


if __name__ == "__main__":
    main()
