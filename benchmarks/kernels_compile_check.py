"""Compile every Triton kernel variant of megassm.kernels for the H100 (sm_90a) on any machine, no GPU needed.

Runs the host code of each op on small CPU tensors with Triton's driver replaced by a stand-in that reports an
sm_90 target, so every launch goes through Triton's own argument binder (the same specializations as on the
GPU: dtypes, strides equal to 1, 16-byte alignment) and is compiled, not run (Triton's ptxas builds the
cubin). Prints per variant the registers per thread, spill bytes and shared memory from ptxas. Catches compile
errors and register blow-ups (e.g. a reduction that costs 70 registers) before any device time is spent.
Autotuned kernels (ssd_common._Tuned; no kernel here uses triton.autotune) are compiled at their first
config, or at every config with --all-configs (maxnreg included).

    python benchmarks/kernels_compile_check.py                     # all variants, first autotune config
    python benchmarks/kernels_compile_check.py --all-configs --only _dx_kernel,_scan_kernel
    python benchmarks/kernels_compile_check.py --norm-tiles --only _gated_bwd_kernel,_add_bwd_kernel
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
os.environ["MEGASSM_SSD_STREAMS"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

ROWS = {}  # variant key -> result row
ALL_CONFIGS = False
NORM_TILES = False
ONLY: set = set()


class _Sm90Driver:
    """Triton's driver interface as far as compiling needs it: device 0, stream 0, an sm_90 target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


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


_jit_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    """JITFunction.run, compiling (warmup) instead of launching; one row per distinct variant."""
    name = self.__name__
    if ONLY and name not in ONLY:
        return None
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if kwargs.get(k) is not None}
    consts = {k: v for k, v in kwargs.items() if k not in opts and isinstance(v, (bool, int, float, str))}
    dtypes = tuple(str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor))
    key = (name, tuple(sorted(opts.items())), tuple(sorted(consts.items())), dtypes)
    if key in ROWS:
        return None
    row = {"kernel": name, **opts, "constexprs": consts, "dtypes": list(dtypes)}
    try:
        k = _jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        row.update(_ptxas_info(k.asm["ptx"]))
        row["shared_bytes"] = k.metadata.shared
    except Exception as e:  # a compile error is this variant's result, the other variants still compile
        row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    ROWS[key] = row
    print(json.dumps(row, default=str), flush=True)
    return None


def _tuned_run(self, grid, args, kwargs):
    """ssd_common._Tuned: compile its first config (or every config), never time."""
    for cfg in self.configs if ALL_CONFIGS else self.configs[:1]:
        self._launch(grid, cfg, args, kwargs)


def _install():
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    from megassm.kernels.mamba2_ssd import triton_ssd_common as ssd_common
    ssd_common._Tuned._run = _tuned_run


def run_cases():
    from megassm.kernels.conv1d import triton_conv
    from megassm.kernels.mamba2_ssd import triton_readout, triton_ssd, triton_ssd_bwd, triton_step
    from megassm.kernels.scan import triton_scan

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
            triton_ssd.ssd_fwd(x, dt, A, Bm, Cm, D, z, rn(H), True, lim, h0, sid, chunk, True)
            triton_ssd_bwd.ssd_bwd(rn(B, L, H, P, dtype=dtype), rn(B, H, P, N), x, dt, A, Bm, Cm, D, z, rn(H), True,
                                   lim, h0, sid, chunk)
    os.environ.pop("MEGASSM_SSD_PRECISION", None)
    # _dbc_kernel with its head loop split over 4 programs (MEGASSM_SSD_DBC_SPLIT, the mamba2-1.3b shape)
    os.environ["MEGASSM_SSD_DBC_SPLIT"] = "4"
    x, dt, Bm, Cm = (rn(1, 512, 64, 64, dtype=torch.bfloat16), rn(1, 512, 64, dtype=torch.bfloat16),
                     rn(1, 512, 1, 128, dtype=torch.bfloat16), rn(1, 512, 1, 128, dtype=torch.bfloat16))
    triton_ssd_bwd.ssd_bwd(rn(1, 512, 64, 64, dtype=torch.bfloat16), None, x, dt, -torch.rand(64, generator=g), Bm, Cm,
                           rn(64), None, rn(64), True, None, None, torch.zeros(1, 512, dtype=torch.int32), 256)
    os.environ.pop("MEGASSM_SSD_DBC_SPLIT", None)
    # CP state read-out (mamba2-1.3b's shape: 64 heads of 64, one group of 128; and 2 groups in fp32)
    for dtype, H, G in ((torch.bfloat16, 64, 1), (torch.float32, 8, 2)):
        xbc = rn(1, 300, 4352, dtype=dtype)
        C = xbc[..., 4096 + 128 * (G - 1) // G:][..., :G * 128].unflatten(-1, (G, 128)) if G == 1 else \
            rn(1, 300, G, 128, dtype=dtype)
        y, h, w = rn(1, 300, H, 64, dtype=dtype), rn(1, H, 64, 128), rn(1, 300, H)
        triton_readout.readout_fwd(y, C, h, w)
        triton_readout.readout_bwd(rn(1, 300, H, 64, dtype=dtype), C, h, w)
    # decode steps
    triton_step.ssd_step_fwd(rn(2, 64, 64, 128), rn(2, 64, 64, dtype=torch.bfloat16), rn(2, 64, dtype=torch.bfloat16),
                             -torch.rand(64), rn(2, 1, 128, dtype=torch.bfloat16), rn(2, 1, 128, dtype=torch.bfloat16),
                             rn(64), None, rn(64), True, None)
    triton_conv.causal_conv1d_step_fwd(rn(2, 4352, 3), rn(2, 4352, dtype=torch.bfloat16), rn(4352, 4), rn(4352), True)
    # conv
    for dtype, init, seq in ((torch.bfloat16, False, False), (torch.bfloat16, True, True), (torch.float32, True, True)):
        x = rn(2, 300, 4400, dtype=dtype)[..., :4352]
        w, b = rn(4352, 4), rn(4352)
        h0 = rn(2, 4352, 3) if init else None
        sid = torch.zeros(2, 300, dtype=torch.int32) if seq else None
        triton_conv.causal_conv1d_fwd(x, w, b, h0, sid, True, True)
        for mode in ("two_pass_defer", "two_pass", "fused"):  # MEGASSM_CONV_BWD: the default, then the baselines
            triton_conv.causal_conv1d_bwd(x, w, b, h0, sid, True, rn(2, 300, 4352, dtype=dtype), rn(2, 4352, 3),
                                          mode=mode)
            if not init:  # without SiLU (pass 2 reads dy in place)
                triton_conv.causal_conv1d_bwd(x, w, b, None, None, False, rn(2, 300, 4352, dtype=dtype), None,
                                              mode=mode)
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
                triton_scan.selective_scan_fwd(*args, full)
                triton_scan.selective_scan_bwd(rn(2, 300, 512, dtype=dtype), rn(2, 512, N) if full else None, *args)
                triton_scan.selective_scan_step_fwd(rn(2, 512, N), x[:, 0], dt[:, 0], A, Bm[:, 0], Cm[:, 0], Dv,
                                                    None if z is None else z[:, 0], bias, decay == "exp", decay)
    # norms (z a strided slice, as Mamba-2's of in_proj's output); the backward at its default tiles, the staged
    # modes (TP with a group over several ranks), the add kernel with and without dres_in / dres
    from megassm.kernels.norm import triton_norm as tn

    for dtype in (torch.bfloat16, torch.float32):
        x, z, w = rn(64, 4096, dtype=dtype), rn(64, 8512, dtype=dtype)[:, :4096], rn(4096)
        for G, nbg, zz in ((1, False, True), (8, False, True), (8, True, True), (1, False, False)):
            zi = z if zz else None
            tn.gated_rmsnorm_fwd(x, zi, w, G, 1e-5, nbg)
            tn.gated_rmsnorm_bwd(x, x, zi, w, G, 1e-5, nbg)
        ss = rn(64, 1).abs()
        tn.gated_rmsnorm_bwd_dot(x, x, z, w, ss, 8192, 1e-5, False)
        tn.gated_rmsnorm_bwd_apply(x, x, z, w, ss, rn(64, 1), 8192, 1e-5, False)
        r = rn(64, 2048)
        tn.add_rmsnorm_fwd(x[:, :2048], r, w[:2048], 1e-5)
        tn.add_rmsnorm_bwd(x[:, :2048], r, r, w[:2048], 1e-5, dtype, torch.float32)
        tn.add_rmsnorm_bwd(x[:, :2048], None, r, w[:2048], 1e-5, dtype, None)
        if NORM_TILES and dtype == torch.bfloat16:  # every tile benchmarks/norm_tiles.py sweeps, at its dtypes
            from norm_tiles import SHAPES

            for rows, warps, pf, rl in SHAPES["gated"]:
                tn._gated_bwd(x, x, z, w, 1, 1e-5, False, 0, tiles=(rows, warps, 64, pf, rl))
            for rows, warps, pf, rl in SHAPES["add"]:
                tn.add_rmsnorm_bwd(x[:, :2048], r, r, w[:2048], 1e-5, dtype, torch.float32,
                                   tiles=(rows, warps, 64, pf, rl))


def main():
    global ALL_CONFIGS, NORM_TILES, ONLY
    ap = argparse.ArgumentParser()
    ap.add_argument("--all-configs", action="store_true", help="every autotune config, not only the first")
    ap.add_argument("--only", default="", help="comma list of kernel names (e.g. _dx_kernel,_scan_kernel)")
    ap.add_argument("--norm-tiles", action="store_true", help="also every norm backward tile of norm_tiles.py")
    args = ap.parse_args()
    ALL_CONFIGS = args.all_configs
    NORM_TILES = args.norm_tiles
    ONLY = set(filter(None, args.only.split(",")))
    _install()
    run_cases()
    failures = sum("error" in r for r in ROWS.values())
    print(f"# {len(ROWS)} variants compiled for sm_90a, {failures} failed", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
