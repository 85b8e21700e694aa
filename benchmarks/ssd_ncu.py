"""One SSD forward + backward under the CUDA profiler range, for Nsight Compute (hardware counters per kernel).

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --csv --page details \
        python3 benchmarks/ssd_ncu.py [--impl megassm|mamba_ssm] [--precision split|bf16] [--chunk 256]

Shape of one Mamba-2 1.3B layer (H=64, P=64, N=128, G=1, 16 x 2048) unless told otherwise. Warm-up calls run first (our
per-shape autotuning and Triton compiles happen there), so only the measured call is inside the range.
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("MEGASSM_KERNELS", "triton")

import torch  # noqa: E402

from megassm.kernels import env as kernel_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="megassm", choices=["megassm", "mamba_ssm"])
    ap.add_argument("--precision", default=kernel_env.ssd_precision(), choices=kernel_env.SSD_PRECISIONS,
                    help="MEGASSM_SSD_PRECISION for the run (default: the variable as set, else the library's)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    args = ap.parse_args()
    os.environ["MEGASSM_SSD_PRECISION"] = args.precision
    from kernels_ssd import ssd_inputs  # same directory

    inp = ssd_inputs(args.batch, args.seqlen, 64, 64, 128, 1)
    lv = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    if args.impl == "megassm":
        from megassm import kernels as K

        def f():
            return K.ssd(lv["x"], lv["dt"], lv["A"], lv["B"], lv["C"], D=lv["D"], dt_bias=lv["dt_bias"],
                         dt_softplus=True, chunk_size=args.chunk)
    else:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as mcs

        def f():
            return mcs(lv["x"], lv["dt"], lv["A"], lv["B"], lv["C"], chunk_size=args.chunk, D=lv["D"],
                       dt_bias=lv["dt_bias"], dt_softplus=True)

    gy = torch.randn_like(f())
    for _ in range(3):
        torch.autograd.grad(f(), list(lv.values()), gy)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.autograd.grad(f(), list(lv.values()), gy)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
