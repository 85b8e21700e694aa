"""Shared pieces of the Triton SSD (ssd.py forward, ssd_states.py chunk walks, ssd_bwd.py backward): the
per-shape autotuner, the precision-aware matrix products and the stored-state operand format (device helpers),
and the host-side tile table, precision mode and buffers."""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime.errors import OutOfResources

from .. import env

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


_AUTOTUNE = env.triton_autotune()  # MEGASSM_TRITON_AUTOTUNE (kernels.autotune), read at import


class _Tuned:
    """`kernel[grid](...)` with num_warps / num_stages picked per shape: on the first call for a key (the named
    arguments' values and the tensor dtypes, as triton.autotune keys, and the compile-time switches passed by
    keyword) every config is timed once and the fastest kept; later calls launch the kernel directly. triton.autotune does the same but costs ~85 us of
    Python per launch on an H100 host (benchmarks/host_overhead.py): ~35 ms per mamba2-1.3b training step."""

    def __init__(self, fn, configs, key):
        self.fn, self.configs, self.key = fn, configs, key
        self.arg_names = fn.arg_names
        self.best: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._run(grid, args, kwargs)

    def _time(self, grid, cfg, args, kwargs):
        """Median ms of one config; inf when it needs more shared memory than the GPU has (large tiles fit
        only with fewer pipeline stages)."""
        try:
            return triton.testing.do_bench(lambda: self._launch(grid, cfg, args, kwargs), warmup=5, rep=20,
                                           return_mode="median")
        except OutOfResources:
            return float("inf")

    def _launch(self, grid, cfg, args, kwargs):
        # maxnreg caps the registers per thread so that more programs share a multiprocessor (ptxas otherwise
        # takes up to 255 at 4 warps): 168 at 4 warps = 3 programs per multiprocessor, 128 = 4
        extra = {"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}
        return self.fn[grid](*args, **kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)

    def _log(self, key, times, cfg):
        """One JSON line on stderr per tuning decision (MEGASSM_TRITON_TUNE_LOG=1): a process whose pick differs
        from another's shows up here (a 15-30% slower run was seen at 64 x 512 and 2 x 16K)."""
        name = getattr(getattr(self.fn, "fn", None), "__name__", str(self.fn))
        print(json.dumps({"tune": name, "key": [str(v) for v in key],
                          "ms": {_cfg_name(c): round(t, 4) for c, t in zip(self.configs, times)},
                          "pick": _cfg_name(cfg)}), file=sys.stderr, flush=True)

    def _run(self, grid, args, kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        # every compile-time switch passed by name (PREC, HAS_SEQ, ...) is part of the key too: each variant is a
        # different kernel, and a config tuned for one can be far off for another
        k = (tuple(named[n] for n in self.key) + tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
             + tuple(sorted((n, v) for n, v in kwargs.items() if isinstance(v, (bool, int, str)))))
        cfg = self.best.get(k)
        if cfg is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # a capture cannot time configs (train.cuda_graph warms up first, so only a variant the warm-up
            # never ran lands here): the first config, not remembered, so an eager call still tunes
            return self._launch(grid, self.configs[0], args, kwargs)
        if cfg is None:
            cfg = self.configs[0]
            if len(self.configs) > 1:
                times = [self._time(grid, c, args, kwargs) for c in self.configs]
                if min(times) == float("inf"):  # none fits: launch the first again to raise its error
                    return self._launch(grid, cfg, args, kwargs)
                cfg = self.configs[min(range(len(times)), key=times.__getitem__)]
                if env.triton_tune_log():
                    self._log(k, times, cfg)
            self.best[k] = cfg
        return self._launch(grid, cfg, args, kwargs)


def _cfg_name(cfg):
    """w{warps}s{stages}, r{maxnreg} appended when capped: as benchmarks/ssd_configs.py names them."""
    return f"w{cfg.num_warps}s{cfg.num_stages}" + (f"r{cfg.maxnreg}" if cfg.maxnreg else "")


def _autotune(configs, key):
    """Autotune num_warps / num_stages per shape (_Tuned); off (first config only) under the interpreter and
    with MEGASSM_TRITON_AUTOTUNE=0 (the GPU tests: compiling every config of every variant costs minutes)."""
    if _INTERPRET or not _AUTOTUNE:
        configs = configs[:1]
    return lambda fn: _Tuned(fn, configs, key)


# --------------------------------------------------------------------------------------------------------
# device helpers

# Triton 3.6's CPU interpreter computes tl.dot on bf16/fp16 operands wrongly; there the operands are upcast
# first (bf16 x bf16 products are exact in fp32, so this matches the GPU's fp32-accumulating tensor cores).
_UPCAST_DOT = tl.constexpr(_INTERPRET)


@triton.jit
def _dot_lp(a, b):
    """Both operands bf16 (exact products, fp32 accumulation)."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_lp_acc(a, b, acc):
    """acc + a @ b, both bf16, accumulated in the product's own accumulator (no separate fp32 tile)."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# The interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest even): operands rounded once then
# carried twice the GPU's error, biased, and the CPU tests of those products measured the interpreter.
_ROUND_EMU = tl.constexpr(_INTERPRET)


@triton.jit
def _bf16(a):
    """fp32 a rounded to the nearest bf16 (ties to even), on the GPU and in the interpreter alike."""
    if _ROUND_EMU:
        u = a.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        a = u.to(tl.float32, bitcast=True)
    return a.to(tl.bfloat16)


@triton.jit
def _split(a):
    hi = _bf16(a)
    return hi, _bf16(a - hi.to(tl.float32))


@triton.jit
def _split3(a):
    """fp32 a as bf16 hi + mid + lo (about 24 mantissa bits: fp32's own)."""
    hi = _bf16(a)
    mid, lo = _split(a - hi.to(tl.float32))
    return hi, mid, lo


# Matrix products. PREC "bf16": the inputs are bf16; a raw input operand goes to the tensor cores as is, a
# derived fp32 operand (decay-weighted, states, ...) as a bf16 hi + lo pair (about 16 mantissa bits: two bf16
# products instead of one rounding to 8 bits). PREC "ieee": fp32 / fp16 inputs, fp32 products.
@triton.jit
def _mm_raw(a, b, PREC: tl.constexpr):
    if PREC == "bf16" or PREC == "bf16fast":
        return _dot_lp(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _mm_af(a, b, PREC: tl.constexpr):
    """a fp32 (derived), b raw input."""
    if PREC == "bf16fast":
        return _dot_lp(_bf16(a), b)
    elif PREC == "bf16":
        hi, lo = _split(a)
        return _dot_lp(hi, b) + _dot_lp(lo, b)
    else:
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")


@triton.jit
def _mma_af(acc, a, b, PREC: tl.constexpr):
    """acc + _mm_af(a, b), the products accumulated into acc."""
    if PREC == "bf16fast":
        return _dot_lp_acc(_bf16(a), b, acc)
    elif PREC == "bf16":
        hi, lo = _split(a)
        return _dot_lp_acc(lo, b, _dot_lp_acc(hi, b, acc))
    else:
        return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _mm_ff(a, b, PREC: tl.constexpr):
    """Both fp32 (derived)."""
    if PREC == "bf16fast":
        return _dot_lp(_bf16(a), _bf16(b))
    elif PREC == "bf16":
        ahi, alo = _split(a)
        bhi, blo = _split(b)
        return _dot_lp(ahi, bhi) + (_dot_lp(ahi, blo) + _dot_lp(alo, bhi))
    else:
        return tl.dot(a, b, input_precision="ieee")


# Chunk states (entering states S and their gradients dS) are stored as they are used: as dot operands. PREC
# "ieee": one fp32 array. "bf16": a bf16 hi array and a bf16 lo array (hi + lo = the fp32 value to ~16 bits; the
# same bytes as fp32, and consumers load ready tensor-core operands instead of splitting in every program).
# "bf16fast": the hi array only (the products round the state to bf16 once anyway, as mamba_ssm stores them).
@triton.jit
def _st_store(HI, LO, off, v, mask, PREC: tl.constexpr):
    if PREC == "ieee":
        tl.store(HI + off, v, mask=mask)
    else:
        hi = _bf16(v)
        tl.store(HI + off, hi, mask=mask)
        if PREC == "bf16":
            tl.store(LO + off, _bf16(v - hi.to(tl.float32)), mask=mask)


@triton.jit
def _st_load(HI, LO, off, mask, PREC: tl.constexpr):
    """A stored state tile as fp32 (for elementwise use)."""
    v = tl.load(HI + off, mask=mask, other=0.0).to(tl.float32)
    if PREC == "bf16":
        v += tl.load(LO + off, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _mm_a_st(a, HI, LO, off, mask, A_F32: tl.constexpr, PREC: tl.constexpr):
    """a @ (stored state tile at HI/LO + off). a: a raw input, or with A_F32 a derived fp32 operand."""
    if PREC == "ieee":
        return tl.dot(a.to(tl.float32), tl.load(HI + off, mask=mask, other=0.0), input_precision="ieee")
    else:
        hi = tl.load(HI + off, mask=mask, other=0.0)
        if A_F32:
            if PREC == "bf16":
                ahi, alo = _split(a)
                lo = tl.load(LO + off, mask=mask, other=0.0)
                return _dot_lp(ahi, hi) + (_dot_lp(ahi, lo) + _dot_lp(alo, hi))
            else:
                return _dot_lp(_bf16(a), hi)
        else:
            r = _dot_lp(a, hi)
            if PREC == "bf16":
                r += _dot_lp(a, tl.load(LO + off, mask=mask, other=0.0))
            return r


@triton.jit
def _mma_a_st(acc, a, HI, LO, off, mask, PREC: tl.constexpr):
    """acc + a @ (stored state tile at HI/LO + off), a a raw input: the products accumulated into acc."""
    if PREC == "ieee":
        return tl.dot(a.to(tl.float32), tl.load(HI + off, mask=mask, other=0.0), acc, input_precision="ieee")
    else:
        acc = _dot_lp_acc(a, tl.load(HI + off, mask=mask, other=0.0), acc)
        if PREC == "bf16":
            acc = _dot_lp_acc(a, tl.load(LO + off, mask=mask, other=0.0), acc)
        return acc


@triton.jit
def _dt_biased(DT, DT_BIAS, b, pos, h, m, mh, sdb, sdl, sdh, HAS_BIAS: tl.constexpr):
    """dt + dt_bias in fp32, a [positions, heads] tile (0 outside m): the argument of the softplus, read by the
    forward's _dt_kernel and the backward's _dt_grad_kernel alike."""
    v = tl.load(DT + b * sdb + pos[:, None] * sdl + h[None, :] * sdh, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(DT_BIAS + h, mask=mh, other=0.0).to(tl.float32)[None, :]
    return v


@triton.jit
def _seq_at(SEQ, b, pos, L, ssb, ssl):
    p = tl.minimum(tl.maximum(pos, 0), L - 1)
    return tl.load(SEQ + b * ssb + p * ssl)


# --------------------------------------------------------------------------------------------------------
# host helpers

def _pow2_block(n, cap):
    return max(16, min(cap, triton.next_power_of_2(n)))


# Tile sizes (powers of two; each is capped by the chunk length or the state size at the call). The defaults
# come from benchmarks/ssd_tiles.py on an H100 (docs/benchmarks.md); num_warps / num_stages are tuned per shape
# by _Tuned. The table is module state so that benchmark can sweep it; MEGASSM_SSD_TILES overrides entries.
TILES = {
    "cb_bt": 64,       # _cb_kernel: C B^T block
    "states_bs": 64,   # _states_kernel: positions per step of the chunk walk
    "states_bn": 128,  # _states_kernel: state columns per program (all N: x is read once)
    "scan_bt": 64,     # _scan_kernel: target positions per program
    "scan_bs": 32,     # _scan_kernel: source positions per step
    "scan_bk": 64,     # _scan_kernel: state columns per step of the read-out
    "dstates_bt": 64,  # _dstates_kernel: positions per step of the reverse walk
    "dstates_bn": 128, # _dstates_kernel: state columns per program (all N: dy is read once)
    "dx_bs": 64,       # _dx_kernel: source positions per program (and target positions per step)
    "dx_bk": 64,       # _dx_kernel: state columns per step
    "dcb_bs": 64,      # _dcb_kernel: square block of the chunk's dCB (and of the cs_t partials)
    "dbc_bs": 128,     # _dbc_kernel: positions per program and per step
    "dbc_bn": 128,     # _dbc_kernel: state columns per program
}


TILES.update(env.ssd_tiles())  # MEGASSM_SSD_TILES (kernels.ssd_tiles), checked by env.py; read at import


def _tile(name, limit):
    """TILES[name] capped by limit (the chunk length or the padded state size), at least 16."""
    return max(16, min(TILES[name], triton.next_power_of_2(limit)))


def _prec(x):
    """Product precision. bf16 inputs: "bf16" (default; derived fp32 operands as bf16 hi + lo pairs) or, with
    MEGASSM_SSD_PRECISION=bf16, "bf16fast" (derived operands rounded once to bf16, as mamba_ssm does: fewer
    tensor-core products, about mamba_ssm's error on y, dx, dB, dC; the backward keeps _dx_kernel's intra-chunk
    products split, see ssd_bwd._intra_prec). Other dtypes: fp32 products."""
    if x.dtype != torch.bfloat16:
        return "ieee"
    return "bf16fast" if env.ssd_precision() == "bf16" else "bf16"


def _out_prec(x):
    """The precision of the products whose result goes into one bf16 output and nowhere else: _scan_kernel's
    (y; with the gate, dz) and the dB pass of _dbc_kernel. Their derived operands are rounded to bf16 once in
    either mode: the output's own rounding is of the same size (y 1.2x, dB 1.4x the reference's bf16 error at
    the anchors shape). The products that feed dA / ddt_bias (the chunk walks, _dx, the dC pass with its cs
    read-out) keep the mode's precision: rounding any of them once multiplies dA's error 5-9x
    (docs/history/kernels.md, precision)."""
    prec = _prec(x)
    return "ieee" if prec == "ieee" else "bf16fast"


def _seq_args(seq_idx, x):
    if seq_idx is None:
        return x, 0, 0
    return seq_idx, seq_idx.stride(0), seq_idx.stride(1)


def _state_buffer(x, shape, prec=None):
    """(hi, lo) arrays for chunk states or their gradients, stored as _st_store writes them at `prec` (default
    _prec(x)): fp32 (both names one array) for fp32 inputs, bf16 hi + lo arrays by default for bf16 inputs, a
    bf16 hi array alone with MEGASSM_SSD_PRECISION=bf16 (or for states only _scan reads, _out_prec). Both views
    share one allocation (_state_base)."""
    return _state_views(torch.empty(_state_buffer_shape(x, shape, prec), dtype=_state_buffer_dtype(x),
                                    device=x.device))


def _state_buffer_shape(x, shape, prec=None):
    prec = prec or _prec(x)
    return tuple(shape) if prec == "ieee" else (2 if prec == "bf16" else 1,) + tuple(shape)


def _state_buffer_dtype(x):
    return torch.float32 if _prec(x) == "ieee" else torch.bfloat16


def _state_views(buf):
    """The (hi, lo) arrays of a state buffer: the fp32 array under both names, or its bf16 planes (one plane:
    hi alone, under both names)."""
    return (buf, buf) if buf.dtype == torch.float32 else (buf[0], buf[-1])


def _state_base(arrays):
    """The one allocation behind _state_buffer's (hi, lo) arrays (kept for the backward when the forward's
    states are saved)."""
    hi = arrays[0]
    return hi if hi._base is None else hi._base


_SIDE_STREAMS: dict = {}


class _Side:
    """A second CUDA stream for kernels that do not depend on the chunk walks (C B^T; the backward's dCB): the
    walks are sequential over chunks and leave SM time idle that these fill (MEGASSM_SSD_STREAMS, default on).
    `run(fn)` queues fn's kernels on the side stream after all the current stream's work so far and returns a
    marker; `wait(marker)` makes the current stream wait for them. Without a side stream (CPU, the interpreter,
    the switch off) run calls fn in place. Every tensor the side kernels touch is allocated on the current
    stream before the fork, and the caller waits for every marker before returning, so the caching allocator
    never hands out memory a side kernel still uses (also under CUDA graph capture: fork and join are graph
    edges)."""

    def __init__(self, x):
        self.stream = None
        if x.is_cuda and not _INTERPRET and env.ssd_streams():
            dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
            self.stream = _SIDE_STREAMS.get(dev)
            if self.stream is None:
                self.stream = _SIDE_STREAMS[dev] = torch.cuda.Stream(device=dev)

    def run(self, fn):
        if self.stream is None:
            fn()
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            fn()
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def wait(self, marker):
        if marker is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(marker)


def _contig_last(t):
    return None if t is None else (t if t.stride(-1) == 1 else t.contiguous())
