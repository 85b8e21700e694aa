"""Host-side (Python) cost of the SSD, conv and norm custom ops, forward + backward, at the mamba2-1.3b layer
shape: cProfile over repeated calls while the GPU is kept busy, printing the functions with the largest own
time per call as JSON lines. Finds what makes the training step host-bound (docs/benchmarks.md).

    python benchmarks/host_overhead.py [--calls 50]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats

import torch

from megassm import kernels as K


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    dev = "cuda"
    Bz, L, H, P, N = 4, 2048, 64, 64, 128
    bf = torch.bfloat16
    x = torch.randn(Bz, L, H, P, device=dev, dtype=bf, requires_grad=True)
    dt = torch.randn(Bz, L, H, device=dev, dtype=bf, requires_grad=True)
    A = (-torch.rand(H, device=dev) * 8 - 1).requires_grad_()
    B = torch.randn(Bz, L, 1, N, device=dev, dtype=bf, requires_grad=True)
    C = torch.randn(Bz, L, 1, N, device=dev, dtype=bf, requires_grad=True)
    D = torch.ones(H, device=dev, requires_grad=True)
    dtb = torch.zeros(H, device=dev, requires_grad=True)
    z = torch.randn(Bz, L, H, P, device=dev, dtype=bf, requires_grad=True)

    def one():
        y = K.ssd(x, dt, A, B, C, D=D, z=z, dt_bias=dtb, chunk_size=256)
        y.float().sum().backward()

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        one()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{fn.split('/')[-1]}:{line}:{name}", "own_us_per_call": round(tt / args.calls * 1e6, 1),
                     "cum_us_per_call": round(ct / args.calls * 1e6, 1), "n_per_call": nc // args.calls})
    total = sum(r["own_us_per_call"] for r in rows)
    print(json.dumps({"host_us_per_ssd_fwd_bwd": round(total, 1)}))
    for r in sorted(rows, key=lambda r: -r["own_us_per_call"])[: args.top]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
