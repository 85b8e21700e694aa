"""Where one training step's GPU time goes (`run.profile_step=N`): step N runs under torch.profiler and each
rank writes RUN_DIR/profile/step_XXXXXXXX_rank_RRRR.json:

    step_ms            wall time of the step on the host
    gpu_busy_ms        union of every kernel's time span on this rank's GPU
    comm_ms            union of the collective (NCCL kernel) spans
    comm_exposed_ms    the part of comm_ms during which no other kernel runs (not overlapped with compute)
    comm_share, comm_exposed_share, idle_share    the same over step_ms (idle: no kernel at all)
    families           GPU ms per kernel family (matmul, ssd, attention, norm, conv, nccl, optimizer,
                       fsdp / foreach copies, elementwise / copy / other), for docs/benchmarks.md's
                       profiles
    top                the 25 kernels taking the most GPU time: name, family, ms, launches

and, with run.profile_trace=true, the Chrome trace beside it. The numbers are one step of one rank: run a
few steps before it (warm-up, autotuning) and compare ranks when they differ.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

__all__ = ["StepProfiler", "summarize_kernels", "family_of"]

log = logging.getLogger("megassm.profile")

_FAMILIES = (  # first match wins; names of cuBLAS / cuDNN / Triton / NCCL / torch kernels, lower-cased
    ("nccl", ("nccl",)),
    ("conv", ("_conv_", "conv")),  # before the SSD's "_dx_kernel": the conv backward's pass 2 is _conv_dx_kernel
    ("ssd / scan", ("_cb_kernel", "_dbc_kernel", "_dcb_kernel", "_dstates", "_dt_grad_kernel", "_dt_kernel",
                    "_dx_kernel", "_scan", "_segment_ends", "_states_fix", "_states_kernel", "_ssd")),
    ("norm", ("_add_fwd_kernel", "_add_bwd_kernel", "_gated_fwd_kernel", "_gated_bwd_kernel", "norm")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "wgmma", "matmul", "splitk", "sm90_", "sm80_", "ampere_")),
    ("optimizer", ("adam",)),
    ("fsdp / foreach copies", ("chunk_cat", "split_with_sizes", "multi_tensor")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "softmax")),
)


TOP_KERNELS = 25  # summarize_kernels' "top" list


def family_of(kernel_name: str) -> str:
    n = kernel_name.lower()
    for fam, keys in _FAMILIES:
        if any(k in n for k in keys):
            return fam
    return "elementwise / copy / other"


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def _intersect(x, y) -> list[tuple[float, float]]:
    """Intersection of two sorted, disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def summarize_kernels(kernels: list[tuple[str, float, float]], step_ms: float, top: int = TOP_KERNELS) -> dict:
    """kernels: (name, start_us, end_us) of every GPU kernel of the step -> the summary (module docstring), with
    the `top` kernels by GPU time."""
    comm = _union([(a, b) for n, a, b in kernels if family_of(n) == "nccl"])
    compute = _union([(a, b) for n, a, b in kernels if family_of(n) != "nccl"])
    busy = _union(comm + compute)
    fam: dict[str, float] = {}
    per_name: dict[str, list] = {}
    for n, a, b in kernels:
        f = family_of(n)
        fam[f] = fam.get(f, 0.0) + (b - a) / 1e3
        rec = per_name.setdefault(n, [0.0, 0])
        rec[0] += (b - a) / 1e3
        rec[1] += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    comm_ms = _length(comm) / 1e3
    exposed_ms = comm_ms - _length(_intersect(comm, compute)) / 1e3
    busy_ms = _length(busy) / 1e3
    step = max(step_ms, 1e-9)
    return {
        "step_ms": round(step_ms, 2), "gpu_busy_ms": round(busy_ms, 2), "comm_ms": round(comm_ms, 2),
        "comm_exposed_ms": round(exposed_ms, 2), "comm_share": round(comm_ms / step, 4),
        "comm_exposed_share": round(exposed_ms / step, 4), "idle_share": round(max(0.0, 1 - busy_ms / step), 4),
        "families": {k: round(v, 2) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
        "kernels": len(kernels),
        # the kernels taking the most GPU time: [name (cut to 120 characters), family, ms, launches]
        "top": [[n[:120], family_of(n), round(ms, 2), c] for n, (ms, c) in top],
    }


class StepProfiler:
    """Profile one optimizer step: `with StepProfiler(run_dir, step, rank, trace) as sp: ...`, then
    `sp.write(step_seconds)` (or `sp.summary()` alone, as benchmarks/tp_scaling.py takes it). CUDA runs only
    (on CPU it records nothing and writes nothing)."""

    def __init__(self, run_dir: str, step: int, rank: int, trace: bool = False):
        self.run_dir, self.step, self.rank, self.trace = run_dir, step, rank, trace
        self.prof = None

    def __enter__(self):
        if not torch.cuda.is_available():
            return self
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()
        self.t_enter = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.prof is not None:
            torch.cuda.synchronize()
            self.span_s = time.perf_counter() - self.t_enter  # the whole step, its optimizer kernels included
            self.prof.__exit__(*exc)
        return False

    def summary(self, step_s: float | None = None, top: int = TOP_KERNELS) -> dict | None:
        """summarize_kernels of the profiled step (None off CUDA); `step_s` defaults to the profiled span (from
        the synchronize before the step to the one after it: the trainer's own step time leaves the optimizer's
        kernels to the next step)."""
        if self.prof is None:
            return None
        step_s = self.span_s if step_s is None else step_s
        from torch.autograd import DeviceType

        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in self.prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
        return {"step": self.step, "rank": self.rank, **summarize_kernels(kernels, step_s * 1e3, top)}

    def write(self, step_s: float | None = None) -> dict | None:
        """The summary (see `summary`) written to run_dir/profile/, and returned."""
        summary = self.summary(step_s)
        if summary is None:
            return None
        out = os.path.join(self.run_dir, "profile")
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, f"step_{self.step:08d}_rank_{self.rank:04d}")
        with open(base + ".json", "w") as f:
            json.dump(summary, f, indent=1)
        if self.trace:
            self.prof.export_chrome_trace(base + ".trace.json")
        log.info("profiled step %d: %.1f ms, GPU busy %.1f ms, communication %.1f ms (%.1f ms exposed); %s",
                 self.step, summary["step_ms"], summary["gpu_busy_ms"], summary["comm_ms"],
                 summary["comm_exposed_ms"], base + ".json")
        return summary
