"""What one tensor-parallel rank runs beyond its share: the aten ops (each one a host dispatch, most of them a
kernel launch on the GPU) and the bytes they write, by family, per mixer forward and backward, at TP 1 / 2 / 4
with and without sequence parallelism; the collectives; and every host read (item, bool(t), nonzero, ...) of a
training step (forward, backward, TP gradient sync, clipping), with the line that made it. JSON lines on
stdout (one per configuration and mixer; `--table` adds a markdown table on stderr).

    python benchmarks/tp_ops.py --table                          # CPU, gloo: TP 1/2/4, SP off/on, "MM*-"
    python benchmarks/tp_ops.py --patterns M --tp 1 2 --sp off   # one Mamba-2 layer
    python benchmarks/tp_ops.py --device cuda --tp 1 2 4 --d-model 2560 --seq-len 4096   # NCCL, 1 process per GPU

Families: matmul, kernel (a megassm.kernels call: SSD, conv, norms; on the CPU the reference runs inside it and
is counted as one op, as the Triton kernel is on the GPU), comm (c10d collectives), copy (copy_, clone, cat,
stack, same-dtype _to_copy), cast (dtype-changing _to_copy), fill (zeros, fill_, ...), alloc (empty: no
bytes), view (aliases: host work only), elementwise (everything else). Bytes: what the op writes (its fresh
outputs, or the tensors it mutates). The model is built from the flags (defaults: ngroups 1, headdim 64,
d_state 128 like mamba2-2.7b, at d_model 256); bf16 autocast; micro-batch 1.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "nonzero", "nonzero_static", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "masked_select", "equal", "repeat_interleave")
SYNC_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
          "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
          "_scaled_dot_product_cudnn_attention_backward", "_efficient_attention_forward", "_flash_attention_forward",
          "_efficient_attention_backward", "_flash_attention_backward"}
COPY = {"copy_", "clone", "cat", "stack", "_to_copy", "contiguous", "_copy_from", "index_copy", "_unsafe_index"}
FILL = {"zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full", "full_like", "new_full", "ones", "ones_like",
        "new_ones", "scalar_tensor"}
ALLOC = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"}
COPY_LIKE = ("copy", "cast", "fill")  # what tests/test_parallel_tp.py pins per layer


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _family(func, args, out) -> str:
    ns = func.namespace
    name = func.overloadpacket.__name__
    if ns == "c10d" or ns == "_c10d_functional":
        return "comm"
    if name in MATMUL:
        return "matmul"
    if name == "_to_copy":
        src = args[0]
        dst = next(_tensors(out), None)
        return "cast" if dst is not None and dst.dtype != src.dtype else "copy"
    if name in COPY:
        return "copy"
    if name in FILL:
        return "fill"
    if name in ALLOC:
        return "alloc"
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return "elementwise"  # in place (mul_, add_, ...)
    outs = list(_tensors(out))
    if not outs:
        return "host"  # no tensor written (promote_types, sizes): no kernel
    rets = func._schema.returns
    if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        return "view"
    ins = {t.untyped_storage().data_ptr() for t in _tensors(list(args)) if t.device.type != "meta"}
    if all(o.untyped_storage().data_ptr() in ins for o in outs if o.numel()):
        return "view"  # _unsafe_view and friends: an alias the schema does not declare
    return "elementwise"


def _written(func, args, kwargs, out, fam: str) -> int:
    """Bytes the op writes: its mutated arguments, or its fresh outputs (views write nothing)."""
    total = 0
    mutated = False
    for a, v in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]):
        if a.alias_info is not None and a.alias_info.is_write:
            mutated = True
            total += sum(t.numel() * t.element_size() for t in _tensors(v))
    if mutated:
        return total
    if fam == "view":
        return 0
    rets = func._schema.returns
    outs = out if isinstance(out, (list, tuple)) else (out,)
    for r, o in zip(rets, outs):
        if r.alias_info is None:
            total += sum(t.numel() * t.element_size() for t in _tensors(o))
    return total


class Recorder(TorchDispatchMode):
    """Counts every aten op under the mode by (phase, where) -> {op: [count, bytes]}; `where` is set by the
    mixer hooks (forward) and markers (backward); ops inside a megassm kernel call count as that kernel."""

    def __init__(self):
        super().__init__()
        self.ops = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.phase = "fwd"
        self.where = "outside"
        self.paused = 0
        self.kernel = None  # name of the kernel call being run
        self.syncs = Counter()
        self.in_method = 0
        self.sites = False  # --sites: key every op by the megassm line that issued it too

    def add(self, key, nbytes):
        rec = self.ops[(self.phase, self.where)][key]
        rec[0] += 1
        rec[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in SYNC_OPS and not self.in_method and not (name == "repeat_interleave" and "output_size" in kwargs):
            self.syncs[(f"aten.{name}", _caller())] += 1
        if self.kernel is not None:
            return out
        fam = _family(func, args, out)
        key = f"{func.namespace}.{name}"
        if self.sites and fam not in ("view", "alloc", "host"):
            key += " @ " + _caller(autograd=True)
        self.add((fam, key), _written(func, args, kwargs, out, fam))
        return out


REC: Recorder | None = None


def _caller(autograd: bool = False) -> str:
    """The innermost frame of megassm (or its kernels) that led here; "autograd" for a backward op that no
    Python code of ours issued (autograd's own formulas)."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        f = fr.filename.replace(os.sep, "/")
        for top in ("/megassm/", "/kernels/"):  # the checkout, or a copy laid out as the installed package
            if top in f and "site-packages/torch" not in f:
                return f"{top[1:]}{f.rsplit(top, 1)[1]}:{fr.lineno} {fr.name}"
    return "autograd" if autograd else "?"


def _patch_sync_methods():
    for name in SYNC_METHODS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, __orig=orig, __name=name, **k):
            if REC is not None and not REC.paused:
                REC.syncs[(f"Tensor.{__name}", _caller())] += 1
                REC.in_method += 1
                try:
                    return __orig(self, *a, **k)
                finally:
                    REC.in_method -= 1
            return __orig(self, *a, **k)

        setattr(torch.Tensor, name, wrapped)


def _bracket(name, fn):
    """fn as one `kernel` op: the aten ops inside are not counted one by one."""

    def wrapped(*a, **k):
        if REC is None or REC.kernel is not None or REC.paused:
            return fn(*a, **k)
        REC.kernel = name
        try:
            out = fn(*a, **k)
        finally:
            REC.kernel = None
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(out))
        REC.add(("kernel", f"megassm.{name}"), nbytes)
        return out

    return wrapped


def _opaque_kernels(device: str) -> None:
    """Every megassm.kernels call runs as on the GPU: one op forward (<op>.op.*_call), one backward."""
    import importlib

    from megassm import kernels
    from megassm.kernels import dispatch

    op_modules = [importlib.import_module(f"megassm.kernels.{op}.op")
                  for op in ("act", "coffee", "conv1d", "loss", "mamba2_ssd", "norm", "scan")]
    if device == "cpu":
        kernels._eager_reference = lambda x: False  # through the ops' *_call (the reference inside)
        orig_bwd = dispatch.reference_backward

        def bracketed_bwd(full_ref, ctx, args, grads):
            name = full_ref.__name__.strip("_").replace("_ref_full", "").replace("_ref", "") + "_bwd"
            return _bracket(name, orig_bwd)(full_ref, ctx, args, grads)

        for ops in op_modules:
            ops.reference_backward = bracketed_bwd
    else:
        for ops in op_modules:  # each op's Triton modules, through its getters (dispatch.triton_module)
            getters = [g for g in dir(ops) if g.startswith("triton_") and g != "triton_module"]
            for tk in [getattr(ops, g)() for g in getters]:
                for n in dir(tk):
                    if n.endswith("_fwd") or n.endswith("_bwd"):
                        setattr(tk, n, _bracket(n, getattr(tk, n)))
    for ops in op_modules:
        for n in dir(ops):
            if n.endswith("_call") and callable(getattr(ops, n)):
                setattr(ops, n, _bracket(n[:-5] if device == "cpu" else n, getattr(ops, n)))
    for n in kernels.__all__:  # the rest (the norm stages parallel/tp.py calls; decode steps)
        fn = getattr(kernels, n)
        if callable(fn) and n != "backend":
            setattr(kernels, n, _bracket(n, fn))


class _Mark(torch.autograd.Function):
    """Identity; its backward sets where the recorder's backward ops go."""

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if REC is not None:
            REC.where = ctx.tag
        return g, None


def _hooks(model):
    hs = []
    for i, layer in model.layers.items():
        tag = f"{i}:{layer.kind}"

        def pre(mod, args, tag=tag):
            REC.where = tag
            REC.paused += 1
            try:
                x = _Mark.apply(args[0], "outside") if torch.is_grad_enabled() and args[0].requires_grad else args[0]
            finally:
                REC.paused -= 1
            return (x,) + tuple(args[1:])

        def post(mod, args, out, tag=tag):
            REC.paused += 1
            try:
                if isinstance(out, tuple):
                    o = _Mark.apply(out[0], tag) if out[0].requires_grad else out[0]
                    out = (o,) + tuple(out[1:])
                elif out.requires_grad:
                    out = _Mark.apply(out, tag)
            finally:
                REC.paused -= 1
            REC.where = "outside"
            return out

        hs.append(layer.mixer.register_forward_pre_hook(pre, prepend=True))
        hs.append(layer.mixer.register_forward_hook(post))
    return hs


def model_config(a, pattern):
    from megassm.config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig

    return ModelConfig(pattern=pattern, d_model=a.d_model, vocab_size=a.vocab, pad_vocab_multiple=64,
                       tie_embeddings=True,
                       mamba=MambaConfig(d_state=a.d_state, headdim=a.headdim, expand=2, ngroups=a.ngroups,
                                         chunk_size=a.chunk_size),
                       attn=AttentionConfig(n_heads=a.n_heads, n_kv_heads=a.n_kv_heads),
                       mlp=MLPConfig(ffn_hidden=a.ffn_hidden))


def measure(a, pattern: str, tp: int, sp: bool, dev: torch.device) -> list[dict]:
    """One forward + backward + TP grad sync + clip under the recorder; rows per mixer (rank 0's view)."""
    global REC
    from megassm.models import build_model
    from megassm.parallel.state import build_groups
    from megassm.parallel.tp import apply_tensor_parallel, clip_grad_norm_tp, sync_tp_grads
    from megassm.training.optim import clip_grad_norm

    groups = build_groups(tp=tp)
    model = build_model(model_config(a, pattern), device="cpu")
    model.init_weights(0)
    model = model.to(dev)
    if tp > 1:
        apply_tensor_parallel(model, groups.tp_group, sp=sp)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g).to(dev)
    labels = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g).to(dev)
    seq_idx = torch.zeros(a.batch, a.seq_len, dtype=torch.int32, device=dev)
    seq_idx[:, a.seq_len // 2:] = 1  # two documents per row, as packed training batches have
    model.capture_safe = a.capture_safe
    amp = dict(device_type=dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")

    def phase(name):
        if REC is not None:
            REC.phase, REC.where = name, "outside" if name != "bwd" else REC.where

    def step():
        with torch.autocast(**amp):
            loss = model(tokens, seq_idx=seq_idx, labels=labels).loss
        phase("bwd")
        loss.backward()
        phase("grad_sync")
        if tp > 1:
            sync_tp_grads(model)
        phase("clip")
        if tp > 1:
            clip_grad_norm_tp(model, 1.0)
        else:
            clip_grad_norm(model.parameters(), 1.0)
        model.zero_grad(set_to_none=True)
        phase("fwd")

    REC = Recorder()
    hs = _hooks(model)
    step()  # warm-up (the first call of a kernel may do one-time work)
    REC = Recorder()
    REC.sites = a.sites
    with REC:
        step()
    for h in hs:
        h.remove()
    rec, REC = REC, None
    timing = None
    if a.time_steps:  # the same step, unobserved: wall time per step (the host's time included)
        for _ in range(2):
            step()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(a.time_steps):
            step()
        _sync(dev)
        timing = dict(pattern=pattern, tp=tp, sp=sp, phase="step", where="time",
                      ms_per_step=1e3 * (time.perf_counter() - t0) / a.time_steps, steps=a.time_steps,
                      tokens=a.batch * a.seq_len, device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    rows = []
    kinds = {f"{i}:{layer.kind}": layer.kind for i, layer in model.layers.items()}
    for (ph, where), ops in sorted(rec.ops.items()):
        fam = defaultdict(lambda: [0, 0])
        for (f, _), (n, b) in ops.items():
            fam[f][0] += n
            fam[f][1] += b
        launches = sum(n for f, (n, _) in fam.items() if f not in ("view", "alloc", "host"))
        rows.append(dict(pattern=pattern, tp=tp, sp=sp, phase=ph, where=where, kind=kinds.get(where),
                         aten_ops=sum(n for n, _ in fam.values()), launches=launches,
                         families={f: v for f, v in sorted(fam.items())},
                         ops={f"{f}:{n}": v for (f, n), v in sorted(ops.items())}))
    rows.append(dict(pattern=pattern, tp=tp, sp=sp, phase="step", where="host_reads",
                     host_reads=[dict(op=o, at=w, n=n) for (o, w), n in sorted(rec.syncs.items())]))
    if timing is not None:
        rows.append(timing)
    return rows


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if dist.is_initialized():
        dist.barrier()


def _worker(rank, world, a, jobs, out_path, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), MEGASSM_PROCESS_GROUPS="torch")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # torch.distributed's deprecation notices
    _patch_sync_methods()
    _opaque_kernels(a.device)
    if a.device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=rank, world_size=world)
    rows = []
    for pattern, sp in jobs:
        rows += measure(a, pattern, world, sp, dev)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    if world > 1:
        dist.destroy_process_group()


def run(a, tp: int, jobs) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rows.json")
        if tp == 1:
            _worker(0, 1, a, jobs, out, port)
        else:
            mp.start_processes(_worker, args=(tp, a, jobs, out, port), nprocs=tp, start_method="spawn")
        with open(out) as f:
            return json.load(f)


def per_layer(rows: list[dict], kind: str, phase: str) -> dict | None:
    """The row of the last mixer of `kind` in `phase` (the first one's backward also ends the model's)."""
    got = [r for r in rows if r.get("kind") == kind and r["phase"] == phase]
    return got[-1] if got else None


def table(all_rows: list[dict]) -> str:
    out = ["| mixer | tp | sp | phase | aten ops | launches | copy-like ops / MB | elementwise ops / MB | "
           "comm ops / MB |", "|---|---|---|---|---|---|---|---|---|"]
    seen = []
    for r in all_rows:
        key = (r["pattern"], r["tp"], r["sp"])
        if key not in seen:
            seen.append(key)
    for pattern, tp, sp in seen:
        rows = [r for r in all_rows if (r["pattern"], r["tp"], r["sp"]) == (pattern, tp, sp)]
        for kind in dict.fromkeys(pattern):
            for phase in ("fwd", "bwd"):
                r = per_layer(rows, kind, phase)
                if r is None:
                    continue
                fam = r["families"]
                cl = [sum(fam.get(f, [0, 0])[i] for f in COPY_LIKE) for i in (0, 1)]
                el, cm = fam.get("elementwise", [0, 0]), fam.get("comm", [0, 0])
                out.append(f"| {kind} | {tp} | {'on' if sp else 'off'} | {phase} | {r['aten_ops']} | {r['launches']} "
                           f"| {cl[0]} / {cl[1] / 1e6:.2f} | {el[0]} / {el[1] / 1e6:.2f} | {cm[0]} / {cm[1] / 1e6:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patterns", nargs="+", default=["MM*-"],
                    help="the table reads each kind's last mixer (the first one's input is the fp32 embedding)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sp", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-state", type=int, default=128)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--ngroups", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-kv-heads", type=int, default=4)
    ap.add_argument("--ffn-hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--capture-safe", action="store_true", help="model.capture_safe (no single-document host read)")
    ap.add_argument("--time-steps", type=int, default=0, help="then time this many steps, unobserved (ms per step)")
    ap.add_argument("--sites", action="store_true", help="key each op by the source line that issued it")
    ap.add_argument("--table", action="store_true", help="a markdown table of the per-layer rows on stderr")
    a = ap.parse_args()
    all_rows = []
    for tp in a.tp:
        sps = [False] if tp == 1 else [s == "on" for s in a.sp]
        rows = run(a, tp, [(p, sp) for p in a.patterns for sp in sps])
        for r in rows:
            print(json.dumps(r))
        all_rows += rows
    if a.table:
        print(table(all_rows), file=sys.stderr)


if __name__ == "__main__":
    main()
