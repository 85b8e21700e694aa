"""Does a matmul's row width decide which cuBLAS kernels run? F.linear forward + backward (dgrad, wgrad) in bf16
for output widths N (the rank-local in_proj widths of mamba2-2.7b: TP 4 2,836, padded 2,840; TP 2 5,416; TP 1
10,576); a width that is not a multiple of 8 also into rows padded to one (parallel/layers.py AlignedLinear), with
the backward over views of the padded rows or over the whole rows. Prints one JSON line per (N, mode): ms for the
three matmuls (CUDA events, after warm-up) and the kernels' names.

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


def row(m: int, k: int, n: int, mode: str, iters: int) -> dict:
    """mode "plain": rows n wide; "view": the output and its gradient as the first n of n + pad wide rows (the
    backward multiplies the [M, n] views); "full": the backward multiplies the whole padded rows, their padding
    zeros (parallel/layers.py _padded_grad, what AlignedLinear runs)."""
    from megassm.parallel.layers import out_pad

    pad = out_pad(n) if mode != "plain" else 0
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n + pad, k, device="cuda", dtype=torch.bfloat16)
    w[n:] = 0
    y = torch.empty(m, n + pad, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, n + pad, device="cuda", dtype=torch.bfloat16)
    g[:, n:] = 0
    gb, wb = (g, w) if mode == "full" else (g[:, :n], w[:n])
    fwd = lambda: torch.mm(x, w.t(), out=y)  # noqa: E731  (padded rows written whole, as AlignedLinear does)
    dgrad = lambda: gb.mm(wb)  # noqa: E731
    wgrad = lambda: gb.t().mm(x)  # noqa: E731
    res = {"m": m, "k": k, "n": n, "row": n + pad, "mode": mode}
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
        for mode in ("plain", "view", "full") if n % 8 else ("plain",):
            print(json.dumps(row(a.m, a.k, n, mode, a.iters)), flush=True)


if __name__ == "__main__":
    main()
