"""Does a matmul's row width decide which cuBLAS kernels run? F.linear forward + backward (dgrad, wgrad) in bf16
for output widths N (the rank-local in_proj widths of mamba2-2.7b: TP 4 2,836, padded 2,840; TP 2 5,416; TP 1
10,576), each also computed into rows padded to a multiple of 8 (parallel/layers.py AlignedLinear). Prints one
JSON line per (N, padded): ms for the three matmuls (CUDA events, after warm-up) and the kernels' names.

    python3 benchmarks/matmul_align.py                       # M 4096, K 2560
    python3 benchmarks/matmul_align.py --m 16384 --widths 2836 2840
"""
from __future__ import annotations

import argparse
import json

import torch


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _kernels(fn) -> list[str]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == DeviceType.CUDA})


def row(m: int, k: int, n: int, padded: bool, iters: int) -> dict:
    from megassm.parallel.layers import out_pad

    pad = out_pad(n) if padded else 0
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n + pad, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n + pad, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n + pad, device="cuda", dtype=torch.bfloat16)[:, :n]  # the gradient, rows as y's
    wn = w[:n]
    fwd = lambda: torch.mm(x, w.t(), out=y)  # noqa: E731  (padded rows written whole, as AlignedLinear does)
    dgrad = lambda: g.mm(wn)  # noqa: E731
    wgrad = lambda: g.t().mm(x)  # noqa: E731
    res = {"m": m, "k": k, "n": n, "row": n + pad, "padded": padded}
    for name, fn in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad)):
        res[name + "_ms"] = round(_time(fn, iters), 4)
        res[name + "_kernels"] = _kernels(fn)
    res["tflops"] = round(3 * 2 * m * k * n / (sum(res[f"{p}_ms"] for p in ("fwd", "dgrad", "wgrad")) * 1e9), 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=4096, help="tokens (rows of x)")
    ap.add_argument("--k", type=int, default=2560, help="input features (d_model)")
    ap.add_argument("--widths", type=int, nargs="+", default=[2836, 2840, 5416, 10576])
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    for n in a.widths:
        for padded in (False, True):
            print(json.dumps(row(a.m, a.k, n, padded, a.iters)), flush=True)


if __name__ == "__main__":
    main()
