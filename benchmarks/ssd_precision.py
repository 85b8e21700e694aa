"""SSD precision at real shapes: each implementation's bf16 error against an fp64 oracle, beside the error of
megassm's PyTorch reference run on the same bf16 inputs (fp32 math, outputs rounded: the yardstick of the kernels'
precision goal, "within 2x of the reference's own bf16 error"). Prints one JSON line per implementation.

    PYTHONPATH=.peers python benchmarks/ssd_precision.py [--batch 2 --seqlen 2048 --heads 64 --dstate 128]
    python benchmarks/ssd_precision.py --scales tests --same-gradient   # each implementation's own error at
        # the tests' input scales (the oracle takes the same bf16 output gradient; adds megassm_fp32)
    TRITON_INTERPRET=1 python benchmarks/ssd_precision.py --device cpu --batch 1 --seqlen 256 --heads 4 \
        --headdim 16 --dstate 16 --chunk 64   # the Triton kernels on the CPU interpreter (small shapes only)

Implementations: megassm in MEGASSM_SSD_PRECISION=split (bf16 hi + lo products for derived operands), megassm
in the default MEGASSM_SSD_PRECISION=bf16 (one bf16 rounding, as mamba_ssm), and mamba_ssm's mamba_chunk_scan_combined when it
imports (peer code from PYTHONPATH, measured, never copied). Errors are ||ours - oracle|| / ||oracle|| per output
and per input gradient; `ratio` divides by the reference's error.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("MEGASSM_KERNELS", "triton")

import torch  # noqa: E402

GRAD_KEYS = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_inputs(bsz, seqlen, nheads, hdim, dstate, ngroups, seed, device="cuda", scales="bench"):
    """bf16 activations and fp32 parameters. scales "bench": as benchmarks/kernels_ssd.py (dt ~ 0.02 .. 0.1,
    A in [-5, -1]); "tests": as tests/kernel_cases.ssd_inputs (dt = softplus of N(0, 1) + N(0, 0.5) bias, ~0.1 .. 3,
    A in [-2.1, -0.1]: decays of hundreds in the exponent across one chunk)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rn(*s, scale=1.0):
        return (torch.randn(*s, device=device, generator=g) * scale).to(torch.bfloat16)

    if scales == "tests":
        return dict(x=rn(bsz, seqlen, nheads, hdim), dt=rn(bsz, seqlen, nheads),
                    A=-(torch.rand(nheads, device=device, generator=g) * 2 + 0.1),
                    B=rn(bsz, seqlen, ngroups, dstate), C=rn(bsz, seqlen, ngroups, dstate),
                    D=torch.randn(nheads, device=device, generator=g),
                    dt_bias=torch.randn(nheads, device=device, generator=g) * 0.5)
    return dict(x=rn(bsz, seqlen, nheads, hdim), dt=rn(bsz, seqlen, nheads, scale=0.5),
                A=-(torch.rand(nheads, device=device, generator=g) * 4 + 1),
                B=rn(bsz, seqlen, ngroups, dstate), C=rn(bsz, seqlen, ngroups, dstate),
                D=torch.randn(nheads, device=device, generator=g),
                dt_bias=torch.rand(nheads, device=device, generator=g) - 4.0)


def run(fn, inp, gy, cast=None):
    """y and the gradients of <y, gy> with respect to every input, through fn(**leaves)."""
    leaves = {k: (v.to(cast) if cast is not None else v).detach().clone().requires_grad_(True) for k, v in inp.items()}
    y = fn(**leaves)
    keys = [k for k in GRAD_KEYS + ("z",) if k in leaves]
    grads = torch.autograd.grad(y, [leaves[k] for k in keys], gy.to(y.dtype))
    return {"y": y.detach(), **{"d" + k: gr for k, gr in zip(keys, grads)}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--dstate", type=int, default=128)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: the Triton kernels under TRITON_INTERPRET=1 (set it), for small shapes")
    ap.add_argument("--scales", default="bench", choices=("bench", "tests"),
                    help="input scales: the speed benchmark's (default) or the tests' (make_inputs)")
    ap.add_argument("--gate", action="store_true", help="with the gate z (bf16, N(0, 1)); the model calls without")
    ap.add_argument("--same-gradient", action="store_true",
                    help="the oracle takes the output gradient rounded to bf16, as the implementations do: each "
                         "error is then the implementation's own arithmetic, without the gradient's rounding; "
                         "adds megassm_fp32 (our kernels on the same values in fp32, fp32 products)")
    args = ap.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("ssd_precision.py: --device cpu runs the Triton kernels on the interpreter: set TRITON_INTERPRET=1")
    from megassm import kernels as K
    from megassm.kernels.mamba2_ssd import reference as R

    dev = args.device
    inp = make_inputs(args.batch, args.seqlen, args.heads, args.headdim, args.dstate, args.ngroups, args.seed, dev,
                      args.scales)
    if args.gate:
        inp["z"] = torch.randn(inp["x"].shape, device=dev,
                               generator=torch.Generator(device=dev).manual_seed(args.seed + 2)).to(torch.bfloat16)
    gy = torch.randn(args.batch, args.seqlen, args.heads, args.headdim, device=dev,
                     generator=torch.Generator(device=dev).manual_seed(args.seed + 1)).to(torch.bfloat16)
    kw = dict(dt_softplus=True, chunk_size=args.chunk)
    shape = {k: getattr(args, k) for k in ("batch", "seqlen", "heads", "headdim", "dstate", "ngroups", "chunk",
                                           "seed", "scales", "gate", "same_gradient")}

    def ours(mode):
        def f(**t):
            os.environ["MEGASSM_SSD_PRECISION"] = mode
            return K.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t.get("z"), dt_bias=t["dt_bias"], **kw)
        return f

    def reference(**t):
        return R.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], z=t.get("z"), dt_bias=t["dt_bias"], **kw)

    # the output gradient: bf16 for the implementations; the oracle's is it unrounded (the default: the
    # rounding is part of each implementation's bf16 error), or the same bf16 values (--same-gradient)
    gy_oracle = gy if args.same_gradient else torch.randn(
        gy.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(args.seed + 1))
    oracle = run(reference, inp, gy_oracle.double(), cast=torch.float64)
    impls = {"reference_bf16": reference, "megassm_split": ours("split"), "megassm_bf16": ours("bf16")}
    if args.same_gradient:
        impls["megassm_fp32"] = lambda **t: ours("split")(**{k: v.float() for k, v in t.items()})
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as mcs

        impls["mamba_ssm"] = lambda **t: mcs(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=args.chunk,
                                             D=t["D"], z=t.get("z"), dt_bias=t["dt_bias"], dt_softplus=True)
    except Exception as e:  # the peer is optional: say so
        print(json.dumps({"impl": "mamba_ssm", "absent": f"{type(e).__name__}: {e}"}), flush=True)
    ref_err = None
    for name, fn in impls.items():
        res = run(fn, inp, gy)
        err = {k: rel(res[k], oracle[k]) for k in oracle}
        ref_err = ref_err or err
        row = {"impl": name, **shape, "rel_err": {k: float(f"{v:.3g}") for k, v in err.items()},
               "ratio_to_reference": {k: round(err[k] / max(ref_err[k], 1e-12), 2) for k in err},
               "worst_ratio": round(max(err[k] / max(ref_err[k], 1e-12) for k in err), 2)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
