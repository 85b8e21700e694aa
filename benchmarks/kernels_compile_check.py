"""Compile every Triton kernel variant of megassm.kernels for the H100 (sm_90) on any machine, no GPU needed.

Runs the host code of each op on small CPU tensors with kernel launches intercepted (nothing executes),
records each launch's argument types and constexprs, compiles them with triton.compile for
GPUTarget("cuda", 90, 32) (Triton's own ptxas builds the cubin), and prints per variant the registers per
thread, spill bytes and shared memory from ptxas. Catches compile errors before any device time is spent.

    python benchmarks/kernels_compile_check.py            # all variants, first autotune config
    python benchmarks/kernels_compile_check.py --all-configs
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile mode: kernels must be JITFunctions
os.environ["MEGASSM_KERNELS"] = "triton"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CAPTURED = []
ALL_CONFIGS = False


def _fake_jit_run(self, *args, grid, warmup, **kwargs):
    CAPTURED.append((self, args, dict(kwargs)))


def _fake_autotune_run(self, *args, **kwargs):
    configs = self.configs if ALL_CONFIGS else self.configs[:1]
    for cfg in configs:
        kw = dict(kwargs)
        kw.update(cfg.kwargs)
        kw["num_warps"] = cfg.num_warps
        kw["num_stages"] = cfg.num_stages
        CAPTURED.append((self.fn, args, kw))


JITFunction.run = _fake_jit_run
Autotuner.run = _fake_autotune_run

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
       torch.int64: "i64", torch.bool: "i1", torch.float64: "fp64"}


def _signature(fn, args, kwargs):
    names = [p.name for p in fn.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TY[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v is None:
            sig[p.name] = "constexpr"
            consts[p.name] = None
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={v!r}")
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return sig, consts, opts


def _ptxas_info(ptx):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    try:
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    finally:
        os.unlink(path)
    regs = re.findall(r"Used (\d+) registers", out)
    spill = re.findall(r"(\d+) bytes spill stores", out)
    return {"regs": int(regs[-1]) if regs else None, "spill_store_bytes": int(spill[-1]) if spill else None}


def run_cases():
    from megassm.kernels import triton as tk

    g = torch.Generator().manual_seed(0)

    def rn(*s, dtype=torch.float32):
        return torch.randn(*s, generator=g).to(dtype)

    # SSD: (dtype, B, L, H, P, N, G, chunk, D mode, z, init, seq, dt_limit)
    cases = [
        (torch.bfloat16, 1, 512, 4, 64, 128, 1, 256, "head", False, False, False, None),  # anchors-like
        (torch.bfloat16, 1, 600, 8, 64, 128, 8, 128, "head", True, True, True, (0.0, 1e9)),
        (torch.bfloat16, 1, 300, 4, 128, 256, 1, 64, "chan", False, True, True, None),
        (torch.bfloat16, 1, 300, 4, 64, 64, 1, 256, None, False, False, True, None),
        (torch.float32, 1, 100, 4, 64, 128, 2, 64, "head", True, True, True, None),
    ]
    for dtype, B, L, H, P, N, G, chunk, dmode, zz, init, seq, lim in cases:
        x, dt = rn(B, L, H, P, dtype=dtype), rn(B, L, H, dtype=dtype)
        A = -torch.rand(H, generator=g)
        Bm, Cm = rn(B, L, G, N, dtype=dtype), rn(B, L, G, N, dtype=dtype)
        D = None if dmode is None else (rn(H) if dmode == "head" else rn(H, P))
        z = rn(B, L, H, P, dtype=dtype) if zz else None
        h0 = rn(B, H, P, N) if init else None
        sid = torch.zeros(B, L, dtype=torch.int32) if seq else None
        for prec in ("split", "bf16") if dtype == torch.bfloat16 else ("split",):
            os.environ["MEGASSM_SSD_PRECISION"] = prec
            tk.ssd_fwd(x, dt, A, Bm, Cm, D, z, rn(H), True, lim, h0, sid, chunk, True)
            tk.ssd_bwd(rn(B, L, H, P, dtype=dtype), rn(B, H, P, N), x, dt, A, Bm, Cm, D, z, rn(H), True, lim, h0,
                       sid, chunk)
    os.environ.pop("MEGASSM_SSD_PRECISION", None)
    # decode steps
    tk.ssd_step_fwd(rn(2, 64, 64, 128), rn(2, 64, 64, dtype=torch.bfloat16), rn(2, 64, dtype=torch.bfloat16),
                    -torch.rand(64), rn(2, 1, 128, dtype=torch.bfloat16), rn(2, 1, 128, dtype=torch.bfloat16),
                    rn(64), None, rn(64), True, None)
    tk.causal_conv1d_step_fwd(rn(2, 4352, 3), rn(2, 4352, dtype=torch.bfloat16), rn(4352, 4), rn(4352), True)
    # conv
    for dtype, init, seq in ((torch.bfloat16, False, False), (torch.bfloat16, True, True), (torch.float32, True, True)):
        x = rn(2, 300, 4400, dtype=dtype)[..., :4352]
        w, b = rn(4352, 4), rn(4352)
        h0 = rn(2, 4352, 3) if init else None
        sid = torch.zeros(2, 300, dtype=torch.int32) if seq else None
        tk.causal_conv1d_fwd(x, w, b, h0, sid, True, True)
        tk.causal_conv1d_bwd(x, w, b, h0, sid, True, rn(2, 300, 4352, dtype=dtype), rn(2, 4352, 3))
    # selective scan (seed mixers S / L): both decays, N 16 / 64, grouped B/C, every optional input on or off
    for dtype in (torch.bfloat16, torch.float32):
        for decay in ("exp", "longhorn"):
            for N, G, full in ((16, 1, True), (16, 1, False), (64, 2, True)):
                x = rn(2, 300, 1024, dtype=dtype)[..., :512]
                dt = rn(2, 300, 512, dtype=dtype if decay == "exp" else torch.float32)
                A = -torch.rand(512, N) if decay == "exp" else None
                Bm = rn(2, 300, G, N, dtype=dtype) if G > 1 else rn(2, 300, N, dtype=dtype)
                Cm = rn(*Bm.shape, dtype=dtype)
                z, h0, Dv = (rn(2, 300, 512, dtype=dtype), rn(2, 512, N), rn(512)) if full else (None, None, None)
                sid = torch.zeros(2, 300, dtype=torch.int32) if full else None
                bias = rn(512) if decay == "exp" and full else None
                args = (x, dt, A, Bm, Cm, Dv, z, bias, decay == "exp", decay, h0, sid)
                tk.selective_scan_fwd(*args, full)
                tk.selective_scan_bwd(rn(2, 300, 512, dtype=dtype), rn(2, 512, N) if full else None, *args)
                tk.selective_scan_step_fwd(rn(2, 512, N), x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], Dv,
                                           None if z is None else z[:, 0], bias, decay == "exp", decay)
    # norms
    for dtype in (torch.bfloat16, torch.float32):
        x, z, w = rn(64, 4096, dtype=dtype), rn(64, 4096, dtype=dtype), rn(4096)
        for G, nbg, zz in ((1, False, True), (8, False, True), (8, True, True), (1, False, False)):
            zi = z if zz else None
            tk.gated_rmsnorm_fwd(x, zi, w, G, 1e-5, nbg)
            tk.gated_rmsnorm_bwd(x, x, zi, w, G, 1e-5, nbg)
        r = rn(64, 2048)
        tk.add_rmsnorm_fwd(x[:, :2048], r, w[:2048], 1e-5)
        tk.add_rmsnorm_bwd(x[:, :2048], r, r, w[:2048], 1e-5, dtype, torch.float32)


def main():
    global ALL_CONFIGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--all-configs", action="store_true", help="every autotune config, not only the first")
    args = ap.parse_args()
    ALL_CONFIGS = args.all_configs
    run_cases()
    target = GPUTarget("cuda", 90, 32)
    seen, failures = set(), 0
    for fn, a, kw in CAPTURED:
        sig, consts, opts = _signature(fn, a, kw)
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in consts.items())),
               tuple(sorted(opts.items())))
        if key in seen:
            continue
        seen.add(key)
        row = {"kernel": fn.__name__, **opts,
               "constexprs": {k: v for k, v in consts.items() if v is not None and not isinstance(v, torch.Tensor)}}
        try:
            c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
            row.update(_ptxas_info(c.asm["ptx"]))
            row["shared_bytes"] = c.metadata.shared
        except Exception as e:
            failures += 1
            row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        print(json.dumps(row, default=str), flush=True)
    print(f"# {len(seen)} variants compiled for sm_90, {failures} failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
