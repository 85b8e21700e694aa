"""Kernel benchmark: megassm's Triton SSD vs mamba_ssm's mamba_chunk_scan_combined and causal SDPA,
plus the conv / norm kernels vs their torch equivalents, and the decode step latency. Prints one JSON line per
measurement, then a short table.

    PYTHONPATH=.peers python benchmarks/kernels_ssd.py            # everything
    PYTHONPATH=.peers python benchmarks/kernels_ssd.py --only ssd  # ssd | conv | norm | step | sdpa
    python benchmarks/kernels_ssd.py --quick                       # only the 2K row of the anchors shape
    PYTHONPATH=.peers python benchmarks/kernels_ssd.py --only ssd --repeat 3 --graph  # rounds; CUDA-graph replays
    python benchmarks/kernels_ssd.py --only ssd --lens 2048 --tokens 8192 --docs 2 --graph --profile
                                                                   # the trainer's call: 4 x 2048, packed rows

mamba_ssm is imported from PYTHONPATH when present (peer code: measured, never copied); absent, its rows say
so. Timings: triton.testing.do_bench, median, bf16, one GPU. Shapes of one Mamba-2 1.3B layer: H=64 heads, P=64,
N=128, G=1, 32K tokens per call at L = 512, 2K, 8K, 32K (B = 32K / L); extra rows N=64/256, H=128, G=8 at 2K.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

os.environ.setdefault("MEGASSM_KERNELS", "triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROWS = []


def emit(row):
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def bench(fn, warmup=25, rep=100):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep=100):
    """Median ms per call of fn replayed from a CUDA graph (triton's do_bench_cudagraph, on its own stream): the
    host's launch time and its jitter left out. fn runs once first, so that autotuners pick their configs outside
    the capture. No L2 flush between calls (do_bench's): at 32K tokens per call the inputs are 5x the L2."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def guarded(name, fn, **row):
    try:
        fn(row)
    except Exception as e:  # keep going: one failing row must not lose the others
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        traceback.print_exc(file=sys.stderr)
    row.setdefault("bench", name)
    emit(row)
    torch.cuda.empty_cache()


def _mamba():
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        return mamba_chunk_scan_combined, None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------------------------
# SSD


def ssd_inputs(B, L, H, P, N, G, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16

    def rn(*s, scale=1.0):
        return (torch.randn(*s, device=dev, generator=g) * scale).to(bf)

    return dict(
        x=rn(B, L, H, P),
        dt=rn(B, L, H, scale=0.5),
        A=-(torch.rand(H, device=dev, generator=g) * 4 + 1),
        B=rn(B, L, G, N),
        C=rn(B, L, G, N),
        D=torch.ones(H, device=dev),
        dt_bias=torch.rand(H, device=dev, generator=g) - 4.0,  # softplus(dt + bias) ~ 0.02 .. 0.1
    )


def doc_ids(B, L, docs, seed=0):
    """seq_idx [B, L] int32: each row packs `docs` documents split at random positions (as the trainer's packed
    corpus rows are)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, L, dtype=torch.int32)
    for b in range(B):
        cuts = torch.randperm(L - 1, generator=g)[: docs - 1] + 1
        ids[b, cuts] = 1
    return ids.cumsum(1, dtype=torch.int32).cuda()


def kernel_profile(fn, reps=5):
    """GPU time per call of each kernel fn launches (torch.profiler), largest first: {name: ms}."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.key[:60], e.device_time_total / 1e3 / reps) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    return {k: round(v, 4) for k, v in rows}


PROFILE = False
DOCS = 1  # documents per row of the SSD rows (--docs): > 1 passes seq_idx
SEGMENTS = []  # MEGASSM_SSD_STATE_SEGMENTS values of the megassm_seg<k> rows (--segments)
REPEAT = 1  # rounds over the impls (--repeat)
GRAPH = False  # time CUDA-graph replays instead of eager calls (--graph)
DEFAULT_PRECISION = "bf16"  # the megassm rows' precision mode: resolved in main, before the rows set the env


def other_precision():
    """The precision mode of the megassm_<mode> rows: the one the megassm rows do not use."""
    from megassm.kernels.env import SSD_PRECISIONS

    return next(m for m in SSD_PRECISIONS if m != DEFAULT_PRECISION)


def ssd_impl_names():
    """The --impls names this run accepts (the default mode has no megassm_<mode> name of its own)."""
    other = other_precision()
    return {"megassm", "megassm_keep", "megassm_seg", f"megassm_{other}", f"megassm_{other}_keep",
            f"megassm_{other}_seg", "mamba_ssm"}


def bench_ssd(row, B, L, H, P, N, G, chunk, impls):
    from megassm import kernels as K

    inp = ssd_inputs(B, L, H, P, N, G)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    names = list(leaves)
    seq_idx = doc_ids(B, L, DOCS) if DOCS > 1 else None
    row["docs_per_row"] = DOCS

    def ours():
        return K.ssd(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], D=leaves["D"],
                     dt_bias=leaves["dt_bias"], dt_softplus=True, chunk_size=chunk, seq_idx=seq_idx)

    def with_precision(mode, segments=None, keep="0"):
        def f():  # the env switches are read per call (forward and backward), so set them per call
            os.environ["MEGASSM_SSD_PRECISION"] = mode
            os.environ["MEGASSM_SSD_SAVE_STATES"] = keep
            if segments is None:  # the library's default (auto)
                os.environ.pop("MEGASSM_SSD_STATE_SEGMENTS", None)
            else:
                os.environ["MEGASSM_SSD_STATE_SEGMENTS"] = segments
            return ours()

        return f

    # megassm: the library's defaults (DEFAULT_PRECISION: MEGASSM_SSD_PRECISION as given, else bf16 mode; auto
    # segments); megassm_<other>: the other precision mode (split: bf16 hi+lo products for the derived operands);
    # *_keep: the forward's states kept for the backward (MEGASSM_SSD_SAVE_STATES); *_seg<k>: the chunk walks in k
    # segments (the --segments sweep)
    mode, other = DEFAULT_PRECISION, other_precision()
    fns = {"megassm": with_precision(mode), f"megassm_{other}": with_precision(other),
           "megassm_keep": with_precision(mode, keep="1"), f"megassm_{other}_keep": with_precision(other, keep="1")}
    for k in SEGMENTS:  # one process for the whole sweep: same autotuned configs, same peer timing
        fns[f"megassm_seg{k}"] = with_precision(mode, k)
        fns[f"megassm_{other}_seg{k}"] = with_precision(other, k)
    row["precision"] = mode
    mcs, why = _mamba()
    if mcs is not None:
        def peer():
            return mcs(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size=chunk,
                       D=leaves["D"], dt_bias=leaves["dt_bias"], dt_softplus=True, seq_idx=seq_idx)

        fns["mamba_ssm"] = peer
    else:
        row["mamba_ssm"] = f"absent ({why})"
    outs, timed = {}, {}
    for name, f in fns.items():
        sweep = name.rstrip("0123456789") if "_seg" in name else None  # megassm_seg / megassm_split_seg
        if impls and name not in impls and sweep not in impls:
            continue
        with torch.no_grad():
            y = f()
        outs[name] = y
        gy = torch.randn_like(y)
        timed[name] = (f, (lambda f=f, gy=gy: torch.autograd.grad(f(), [leaves[k] for k in names], gy)))
    # REPEAT rounds, each timing every impl in turn: where eager timings drift for seconds at a time (seen on H100:
    # the same impl 3.2 then 4.3 ms in one process, the GPU clock steady: host-side launch jitter; --graph removes
    # it) the rounds' minimum is the comparable figure; every round's median is kept in *_rounds
    rounds = {name: ([], []) for name in timed}
    timer = bench_graph if GRAPH else bench
    row["timing"] = "cuda_graph" if GRAPH else "eager"
    for _ in range(REPEAT):
        for name, (fwd, fwdbwd) in timed.items():
            if f"{name}_error" in row:
                continue
            try:
                rounds[name][0].append(round(timer(fwd), 4))
                rounds[name][1].append(round(timer(fwdbwd), 4))
            except Exception as e:  # e.g. an impl a CUDA graph cannot capture: the others' figures still count
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                traceback.print_exc(file=sys.stderr)
    for name, (fwd, fwdbwd) in rounds.items():
        if not fwd or not fwdbwd:
            continue
        row[f"{name}_fwd_ms"], row[f"{name}_fwdbwd_ms"] = min(fwd), min(fwdbwd)
        if REPEAT > 1:
            row[f"{name}_fwdbwd_rounds"] = fwdbwd
        if PROFILE:
            row[f"{name}_kernels_fwdbwd"] = kernel_profile(timed[name][1])
    if "megassm" in outs and "mamba_ssm" in outs:
        row["rel_diff_y_vs_mamba"] = rel(outs["megassm"], outs["mamba_ssm"])
        # gradients side by side (an independent check of our backward at the real shape)
        gy = torch.randn_like(outs["megassm"])
        g_ours = torch.autograd.grad(fns["megassm"](), [leaves[k] for k in names], gy)
        g_peer = torch.autograd.grad(fns["mamba_ssm"](), [leaves[k] for k in names], gy)
        row["rel_diff_grads_vs_mamba"] = {k: round(rel(a, b), 6) for k, a, b in zip(names, g_ours, g_peer)}
        for ours_name in (n for n in fns if n.startswith("megassm")):
            if row.get("mamba_ssm_fwdbwd_ms") and row.get(f"{ours_name}_fwdbwd_ms"):
                row[f"speedup_fwdbwd_{ours_name}"] = round(row["mamba_ssm_fwdbwd_ms"] / row[f"{ours_name}_fwdbwd_ms"], 3)
                row[f"speedup_fwd_{ours_name}"] = round(row["mamba_ssm_fwd_ms"] / row[f"{ours_name}_fwd_ms"], 3)


def bench_sdpa(row, B, L):
    q = torch.randn(B, 16, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    v = torch.randn_like(q, requires_grad=True)

    def f():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    go = torch.randn_like(f())
    row["sdpa_fwd_ms"] = round(bench(f), 4)
    row["sdpa_fwdbwd_ms"] = round(bench(lambda: torch.autograd.grad(f(), (q, k, v), go)), 4)


# --------------------------------------------------------------------------------------------------------
# conv and norms vs torch


def bench_conv(row, B, L, Cdim, W, with_seq):
    from megassm import kernels as K

    base = torch.randn(B, L, Cdim + 64, device="cuda", dtype=torch.bfloat16)
    x = base[..., :Cdim].detach().requires_grad_(True)  # strided, as split from the in_proj output
    w = (torch.randn(Cdim, W, device="cuda") * 0.3).requires_grad_(True)
    b = torch.randn(Cdim, device="cuda").requires_grad_(True)
    sid = None
    if with_seq:
        sid = (torch.arange(L, device="cuda") // 700).int().expand(B, L).contiguous()

    def ours():
        return K.causal_conv1d(x, w, b, seq_idx=sid)

    def torch_eq():  # the usual eager implementation: channels-first depthwise conv1d, then SiLU
        y = F.conv1d(x.transpose(1, 2), w.to(x.dtype)[:, None, :], b.to(x.dtype), padding=W - 1, groups=Cdim)
        return F.silu(y[..., :L]).transpose(1, 2)

    for name, f in (("megassm", ours), ("torch", torch_eq)):
        gy = torch.randn_like(f())
        row[f"{name}_fwd_ms"] = round(bench(f), 4)
        row[f"{name}_fwdbwd_ms"] = round(bench(lambda: torch.autograd.grad(f(), (x, w, b), gy)), 4)
    if not with_seq:
        row["rel_diff_vs_torch"] = rel(ours(), torch_eq())


def bench_gated_norm(row, M, D, G):
    from megassm import kernels as K
    from megassm.kernels.norm import reference as R

    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True)
    fns = {"megassm": lambda: K.gated_rmsnorm(x, z, w, ngroups=G),
           "torch": lambda: R.gated_rmsnorm(x, z, w, ngroups=G)}
    try:
        fns["torch_compile"] = torch.compile(lambda: R.gated_rmsnorm(x, z, w, ngroups=G))
    except Exception:
        pass
    for name, f in fns.items():
        try:
            gy = torch.randn_like(f())
            row[f"{name}_fwd_ms"] = round(bench(f), 4)
            row[f"{name}_fwdbwd_ms"] = round(bench(lambda: torch.autograd.grad(f(), (x, z, w), gy)), 4)
        except Exception as e:
            row[f"{name}_error"] = str(e)[:200]


def bench_add_norm(row, M, D):
    from megassm import kernels as K

    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(M, D, device="cuda", requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True)

    def torch_eq():
        h = r + x.float()
        return F.rms_norm(h, (D,), w, 1e-5).to(x.dtype), h

    fns = {"megassm": lambda: K.add_rmsnorm(x, r, w), "torch": torch_eq}
    for name, f in fns.items():
        o, h = f()
        go, gh = torch.randn_like(o), torch.randn_like(h)
        row[f"{name}_fwd_ms"] = round(bench(f), 4)
        row[f"{name}_fwdbwd_ms"] = round(bench(lambda: torch.autograd.grad(f(), (x, r, w), (go, gh))), 4)


# --------------------------------------------------------------------------------------------------------
# decode step


def bench_step(row, B, H, P, N, G):
    from megassm import kernels as K

    dev = "cuda"
    state = torch.randn(B, H, P, N, device=dev)
    x = torch.randn(B, H, P, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(B, H, device=dev, dtype=torch.bfloat16)
    A = -torch.rand(H, device=dev) - 0.5
    Bm = torch.randn(B, G, N, device=dev, dtype=torch.bfloat16)
    Cm = torch.randn(B, G, N, device=dev, dtype=torch.bfloat16)
    D = torch.ones(H, device=dev)
    dtb = torch.zeros(H, device=dev)
    with torch.no_grad():
        row["megassm_ssd_step_ms"] = round(bench(lambda: K.ssd_step(state, x, dt, A, Bm, Cm, D=D, dt_bias=dtb)), 4)
        cw = torch.randn(H * P + 2 * G * N, 4, device=dev)
        cs = torch.randn(B, H * P + 2 * G * N, 3, device=dev)
        xc = torch.randn(B, H * P + 2 * G * N, device=dev, dtype=torch.bfloat16)
        row["megassm_conv_step_ms"] = round(bench(lambda: K.causal_conv1d_step(cs, xc, cw)), 4)
        try:
            from mamba_ssm.ops.triton.selective_state_update import selective_state_update

            st = state.clone()
            xs = x
            dts = dt[..., None].expand(B, H, P)
            As = A[:, None, None].expand(H, P, N)
            Ds = D[:, None].expand(H, P)
            dtbs = dtb[:, None].expand(H, P)
            row["mamba_ssm_step_ms"] = round(bench(lambda: selective_state_update(
                st, xs, dts, As, Bm, Cm, D=Ds, dt_bias=dtbs, dt_softplus=True)), 4)
        except Exception as e:
            row["mamba_ssm_step"] = f"absent ({type(e).__name__}: {str(e)[:120]})"


# --------------------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma list of: ssd, sdpa, conv, norm, step")
    ap.add_argument("--quick", action="store_true", help="only the 2K row of the anchors shape")
    ap.add_argument("--variants", action="store_true",
                    help="only the SSD's other shapes (N 64 / 256, H 128, G 8, chunk 64 / 128 at 16 x 2K), no anchors rows")
    ap.add_argument("--lens", default="", help="comma list of sequence lengths: only those anchors-shape rows "
                    "(32K tokens each), no other shapes; e.g. 8192,32768 for the --segments sweep")
    ap.add_argument("--impls", default="",
                    help="comma list restricting SSD impls: megassm (the default precision mode), megassm_keep, "
                    "megassm_seg, their megassm_<mode>* twins in the other mode (megassm_split* by default, "
                    "megassm_bf16* under MEGASSM_SSD_PRECISION=split), mamba_ssm")
    ap.add_argument("--chunks", default="256",
                    help="comma list of chunk sizes for the anchors-shape rows (each impl at each; the SSD's result "
                    "does not depend on the chunk size, only its speed), e.g. 128,256")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, each timing every SSD impl in turn; the figures are the rounds' minimum (the "
                    "medians of every round in *_fwdbwd_rounds): for machines whose eager timings drift")
    ap.add_argument("--graph", action="store_true",
                    help="time the SSD impls as CUDA-graph replays (no host launch time or host jitter); the "
                    "default times eager calls, as a training step without train.cuda_graph runs them")
    ap.add_argument("--profile", action="store_true", help="SSD rows also list each kernel's GPU ms per fwd+bwd")
    ap.add_argument("--tokens", type=int, default=32768,
                    help="tokens per SSD call of the anchors-shape rows (B = tokens / L); the trainer's 1.3B rows "
                    "call it with 4 x 2048 = 8192")
    ap.add_argument("--docs", type=int, default=1,
                    help="documents per row in the SSD rows (> 1: seq_idx with random boundaries, as packed rows)")
    ap.add_argument("--segments", default="",
                    help="comma list of MEGASSM_SSD_STATE_SEGMENTS values, one megassm_seg<k> row (default mode) and "
                    "one megassm_<other mode>_seg<k> row each in every SSD shape, as --impls selects; e.g. 1,2,4,8,16 "
                    "(the megassm row is the default, auto)")
    args = ap.parse_args()
    global PROFILE, SEGMENTS, DEFAULT_PRECISION, REPEAT, GRAPH, DOCS
    PROFILE = args.profile
    DOCS = args.docs
    if DOCS < 1:
        ap.error(f"--docs {DOCS}: expected a positive integer")
    REPEAT = args.repeat
    GRAPH = args.graph
    if REPEAT < 1:
        ap.error(f"--repeat {REPEAT}: expected a positive integer")
    from megassm.kernels import env as kernel_env

    try:
        DEFAULT_PRECISION = kernel_env.ssd_precision()
    except ValueError as e:
        ap.error(str(e))
    SEGMENTS = [v.strip().lower() for v in args.segments.split(",") if v.strip()]
    if any(v != "auto" and not (v.isdigit() and int(v) >= 1) for v in SEGMENTS):
        ap.error(f"--segments {args.segments!r}: expected a comma list of positive integers or auto")
    only = set(filter(None, args.only.split(",")))
    impls = set(filter(None, args.impls.split(",")))
    if impls - ssd_impl_names():
        ap.error(f"--impls: unknown {sorted(impls - ssd_impl_names())} (the megassm rows are in the "
                 f"{DEFAULT_PRECISION} precision mode here); expected names among {sorted(ssd_impl_names())}")
    want = (lambda k: not only or k in only)
    tokens = args.tokens
    try:
        lens = [int(v) for v in args.lens.split(",") if v.strip()]
    except ValueError:
        lens = [0]
    if any(v <= 0 or tokens % v for v in lens):
        ap.error(f"--lens {args.lens!r}: each length must be a positive divisor of {tokens}")
    try:
        chunks = [int(v) for v in args.chunks.split(",") if v.strip()]
    except ValueError:
        chunks = [0]
    if not chunks or any(v < 16 or v & (v - 1) for v in chunks):
        ap.error(f"--chunks {args.chunks!r}: expected a comma list of powers of two >= 16")
    if args.variants and (args.quick or lens):
        ap.error("--variants runs the other shapes only: it takes neither --quick nor --lens")
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    emit({"bench": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": __import__("triton").__version__, "MEGASSM_KERNELS": os.environ.get("MEGASSM_KERNELS"),
          "mamba_ssm": "present" if _mamba()[0] is not None else f"absent ({_mamba()[1]})"})
    Ls = [] if args.variants else (lens or ([2048] if args.quick else [512, 2048, 8192, 32768]))
    if want("ssd") or want("sdpa"):
        for L in Ls:
            B = tokens // L
            if want("ssd"):
                for chunk in chunks:
                    guarded("ssd", lambda r, B=B, L=L, c=chunk: bench_ssd(r, B, L, 64, 64, 128, 1, c, impls),
                            shape="anchors H64 P64 N128 G1", L=L, B=B, chunk=chunk)
            if want("sdpa"):
                guarded("sdpa", lambda r, B=B, L=L: bench_sdpa(r, B, L), shape="16 heads x 128", L=L, B=B)
        if want("ssd") and not args.quick and not lens:
            for (H, P, N, G, label) in [(64, 64, 64, 1, "N64"), (64, 64, 256, 1, "N256"), (128, 64, 128, 1, "H128"),
                                        (64, 64, 128, 8, "G8")]:
                guarded("ssd", lambda r, H=H, P=P, N=N, G=G: bench_ssd(r, 16, 2048, H, P, N, G, 256, impls),
                        shape=f"{label}: H{H} P{P} N{N} G{G}", L=2048, B=16, chunk=256)
            for chunk in (64, 128):
                guarded("ssd", lambda r, c=chunk: bench_ssd(r, 16, 2048, 64, 64, 128, 1, c, impls),
                        shape=f"anchors, chunk {chunk}", L=2048, B=16, chunk=chunk)
    if want("conv"):
        for with_seq in (False, True):
            guarded("conv", lambda r, s=with_seq: bench_conv(r, 16, 2048, 4096 + 2 * 128, 4, s),
                    shape="B16 L2048 C4352 W4", seq_idx=with_seq)
    if want("norm"):
        for G in (1, 8):
            guarded("gated_rmsnorm", lambda r, G=G: bench_gated_norm(r, 32768, 4096, G), shape=f"32768x4096 G{G}")
        guarded("add_rmsnorm", lambda r: bench_add_norm(r, 32768, 2048), shape="32768x2048")
    if want("step"):
        for B in (1, 16):
            guarded("decode_step", lambda r, B=B: bench_step(r, B, 64, 64, 128, 1), shape="H64 P64 N128 G1", B=B)

    print("\n# summary (ms, median)")
    for r in ROWS:
        if r.get("bench") == "env":
            continue
        keys = [k for k in r if k.endswith("_ms") or k.startswith("speedup") or k == "error"]
        print(f"{r['bench']:14s} {r.get('shape', ''):28s} L={r.get('L', '-')!s:6s} chunk={r.get('chunk', '-')!s:4s} "
              + " ".join(f"{k}={r[k]}" for k in keys))


if __name__ == "__main__":
    main()
