"""Time one SSD kernel under chosen launch configs (num_warps / num_stages / maxnreg), one config at a time,
at the anchors shape (H=64, P=64, N=128, G=1, D per head, bf16, chunk 256): for each config the tuner's list
of that kernel is replaced by the config alone, and the kernel's GPU time per forward + backward (torch
profiler, all its launches) and the whole forward + backward (do_bench median) are printed as JSON lines.
The instrument behind the `maxnreg` configs (docs/kernels.md, "Registers per thread"); needs a CUDA GPU.

    python benchmarks/ssd_configs.py --kernel _dx_kernel --configs w4s2,w4s2r168,w4s1r168,w8s2
    python benchmarks/ssd_configs.py --kernel _scan_kernel --configs w4s3r128,w4s2 --batch 4 --seqlen 8192
    MEGASSM_SSD_STATE_SEGMENTS=2 python benchmarks/ssd_configs.py --kernel _states_kernel,_dstates_kernel \
        --configs w4s3,w8s2 --batch 1 --seqlen 32768

A config is wWsS[rR]: W warps, S pipeline stages, R registers per thread at most (maxnreg; none if absent).
With several kernels (comma list) each config is forced on all of them at once, and the row also gives each
one's time (`kernels_ms`, with the segment passes of the chunk walks when they run).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re

os.environ.setdefault("MEGASSM_KERNELS", "triton")

import torch  # noqa: E402
import triton  # noqa: E402

from kernels_ssd import bench, kernel_profile, ssd_inputs  # noqa: E402  (same directory)
from megassm import kernels as K  # noqa: E402
from megassm.kernels import env as kernel_env  # noqa: E402

MODULES = ("triton_ssd", "triton_ssd_bwd", "triton_ssd_states")


def parse_config(text):
    m = re.fullmatch(r"w(\d+)s(\d+)(?:r(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"config {text!r}: expected wWsS or wWsSrR, e.g. w4s2r168")
    return triton.Config({}, num_warps=int(m.group(1)), num_stages=int(m.group(2)),
                         maxnreg=int(m.group(3)) if m.group(3) else None)


def find_kernel(name):
    for mod in MODULES:
        m = importlib.import_module(f"megassm.kernels.mamba2_ssd.{mod}")
        k = getattr(m, name, None)
        if k is not None and hasattr(k, "configs"):
            return k
    raise SystemExit(f"--kernel {name!r}: no autotuned SSD kernel of that name in {', '.join(MODULES)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", required=True,
                    help="e.g. _dx_kernel, _scan_kernel, or a comma list: _states_kernel,_dstates_kernel")
    ap.add_argument("--configs", required=True, help="comma list of wWsS[rR]")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--precision", default=kernel_env.ssd_precision(), choices=kernel_env.SSD_PRECISIONS,
                    help="MEGASSM_SSD_PRECISION for the run (default: the variable as set, else the library's)")
    args = ap.parse_args()
    try:
        configs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    names = [k.strip() for k in args.kernel.split(",") if k.strip()]
    kerns = [find_kernel(k) for k in names]  # a bad name fails here, before any GPU work
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    os.environ["MEGASSM_SSD_PRECISION"] = args.precision
    inp = ssd_inputs(args.batch, args.seqlen, 64, 64, 128, 1)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    ws = list(leaves.values())

    def fwd():
        return K.ssd(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], D=leaves["D"],
                     dt_bias=leaves["dt_bias"], dt_softplus=True, chunk_size=256)

    gy = torch.randn_like(fwd())

    def step():
        return torch.autograd.grad(fwd(), ws, gy)

    for cfg in configs:
        for kern in kerns:
            kern.configs, kern.best = [cfg], {}
        row = {"bench": "ssd_configs", "kernel": args.kernel, "B": args.batch, "L": args.seqlen,
               "precision": args.precision, "segments": os.environ.get("MEGASSM_SSD_STATE_SEGMENTS", "auto"),
               "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg}
        try:
            step()
            torch.cuda.synchronize()
            prof = kernel_profile(step)
            # exact names: "states_kernel" is also a substring of "_dstates_kernel"
            row["kernel_ms"] = round(sum(v for k, v in prof.items() if k in names), 4)
            if len(names) > 1:
                row["kernels_ms"] = {k: round(v, 4) for k, v in prof.items()
                                     if k in names or "_fix_kernel" in k or "_segment_" in k}
            row["fwdbwd_ms"] = round(bench(step), 4)
        except Exception as e:  # e.g. out of shared memory at this many stages: that config's result
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
