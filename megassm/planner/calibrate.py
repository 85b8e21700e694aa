"""`megassm-plan calibrate --out FILE`: the planner's compute table, measured on the GPU at hand (docs/planner.md).

What is measured, each as the trainer runs it (bf16 autocast, the Triton kernels, fp32 masters, packed documents:
two per row), on one GPU standing for one rank (torch's "fake" process group: a TP rank's collectives return at
once, so what is timed is exactly its compute):
  - blocks: for each block letter of each config, a model of that one letter 1 and 3 times; the difference is two
    blocks' forward + backward, the rest (embedding, final norm, head, loss) the model's ends. At each TP degree
    (the rank's local widths), with and without SP, at micro-batch x sequence shapes, replayed from a CUDA graph
    (the GPU's time: `graph`) and eager (what the host adds: `eager`); with activation checkpointing (`ac`);
  - the optimizer: clipping + fused AdamW per parameter over a few large fp32 tensors (the GPU's memory-bound
    rate), and per tensor over many small ones (what each tensor adds on the host); the figure over 200 tensors
    of 1M parameters the planner used before, kept for comparison; a gradient accumulation (`grad += new`) per
    parameter, which a step's first micro-batch does not do;
  - FSDP2's own copies (into and out of its communication buffers), per parameter and gather / reduce-scatter, on a
    fake data-parallel group of 4.
Measurements run in a fixed priority order until `--budget-s` is spent; what was not reached is listed in the
file, and the planner names a missing entry instead of guessing it. The collectives are not measured on one GPU:
their link classes come from documented vendor figures, named as such (costs.LINKS).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["block_signature", "head_signature", "calibrate", "median_of", "Measurer", "measure_optimizer", "SHAPES", "DEFAULT_CONFIGS", "FAKE_WORLD"]

FAKE_WORLD = 8  # the fake process group's size: every TP degree measured divides it
DEFAULT_CONFIGS = ["configs/mamba2-1.3b.yaml", "configs/hybrid-1.3b.yaml", "configs/mamba2-2.7b.yaml",
                   "configs/hybrid-7b.yaml", "configs/mamba2-7b.yaml"]
# (micro-batch, sequence) shapes per config, and the TP degrees, in the order they are measured (most used first)
SHAPES = {
    "mamba2-1.3b": {"shapes": [(8, 2048), (4, 2048)], "tp": [1]},
    "hybrid-1.3b": {"shapes": [(8, 2048), (4, 2048)], "tp": [1]},
    "mamba2-2.7b": {"shapes": [(1, 4096), (4, 4096)], "tp": [1, 2, 4]},
    "hybrid-7b": {"shapes": [(1, 4096), (2, 4096)], "tp": [1, 2, 4]},
    "mamba2-7b": {"shapes": [(1, 4096)], "tp": [1]},
}


def _mixer_keys(cfg_model, letter: str) -> dict:
    m = cfg_model
    if letter == "M":
        mc = m.mamba
        return dict(d_state=mc.d_state, headdim=mc.headdim, expand=mc.expand, ngroups=mc.ngroups,
                    chunk=mc.chunk_size, d_conv=mc.d_conv)
    if letter == "*":
        a = m.attn
        return dict(heads=a.n_heads, kv=a.n_kv_heads, head_dim=a.head_dim, rope=bool(a.rope),
                    window=a.sliding_window, doc_mask=bool(a.doc_mask))
    if letter == "-":
        return dict(ffn=m.mlp.ffn_hidden, act=m.mlp.activation)
    return {}


def block_signature(cfg_model, letter: str) -> str:
    """The key of a block kind's row in the table: its letter, d_model and the options that set its shapes."""
    keys = _mixer_keys(cfg_model, letter)
    return f"{letter}|d={cfg_model.d_model}|" + "|".join(f"{k}={v}" for k, v in sorted(keys.items()))


def head_signature(cfg_model, vocab: int) -> str:
    return f"ends|d={cfg_model.d_model}|vocab={vocab}|tied={bool(cfg_model.tie_embeddings)}"


def _init_(model) -> None:
    """Random weights of the right scale on the device (timing needs no canonical init)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.uniform_(1.0, 16.0).log_()
            elif leaf == "dt_bias":
                p.uniform_(-4.0, -2.0)
            elif leaf in ("D",) or p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, 0.02)


def _batch(vocab: int, micro: int, seq: int, device, gen) -> dict:
    tokens = torch.randint(0, vocab, (micro, seq + 1), device=device, generator=gen)
    seq_idx = torch.zeros(micro, seq, dtype=torch.int32, device=device)
    cut = torch.randint(seq // 4, 3 * seq // 4, (micro, 1), device=device, generator=gen)
    seq_idx += (torch.arange(seq, device=device)[None, :] >= cut).to(torch.int32)  # two documents a row
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "seq_idx": seq_idx}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Measurer:
    def __init__(self, device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup

    def model_ms(self, cfg_model, pattern: str, vocab: int, micro: int, seq: int, tp_group, sp: bool,
                 mode: str, ac: bool, cp_group=None) -> float:
        """Milliseconds of one micro-batch's forward + backward (gradients accumulating), steady state."""
        from dataclasses import replace

        from megassm.models import build_model
        from megassm.parallel.checkpointing import apply_activation_checkpointing
        from megassm.parallel.tp import apply_tensor_parallel
        from megassm.training.cuda_graph import GraphedMicroBatch

        dev = self.device
        mcfg = replace(cfg_model, pattern=pattern, vocab_size=vocab)
        model = build_model(mcfg, vocab_size=vocab, device="meta")
        if tp_group is not None:
            apply_tensor_parallel(model, tp_group, sp=sp)
        if cp_group is not None:  # this rank's slice of every row: seq / cp tokens
            from megassm.parallel.cp import apply_context_parallel

            apply_context_parallel(model, cp_group)
            seq //= dist.get_world_size(cp_group)
        if ac:
            apply_activation_checkpointing(model)
        model.to_empty(device=dev)
        _init_(model)
        gen = torch.Generator(device=dev).manual_seed(0)
        batch = _batch(vocab, micro, seq, dev, gen)
        amp = dev.type == "cuda"

        def fwd_bwd(b):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
                loss = model(b["tokens"], seq_idx=b["seq_idx"], labels=b["labels"]).loss
            loss.backward()
            return loss.detach()

        graphed = None
        try:
            if mode == "graph":
                model.capture_safe = True
                graphed = GraphedMicroBatch(list(model.parameters()), fwd_bwd)
                graphed.begin_step()
                graphed(batch)  # captures the first-micro-batch graph
                run = lambda: graphed(batch)  # noqa: E731  (then the accumulating graph, as micro-batches 2..n)
            else:
                run = lambda: fwd_bwd(batch)  # noqa: E731
            return self._timed_ms(run)
        finally:
            if graphed is not None:
                graphed.release()
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    def _timed_ms(self, run, iters: int | None = None) -> float:
        """Milliseconds a call of `run` after `warmup` calls: the median of three timed windows of iters / 3 calls
        each (a slow window, a host hiccup, is dropped)."""
        for _ in range(self.warmup):
            run()
        k = max(1, (iters or self.iters) // 3)
        times = []
        for _ in range(3):
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(k):
                run()
            _sync(self.device)
            times.append(1e3 * (time.perf_counter() - t0) / k)
        return sorted(times)[1]

    def optimizer_ns_per_param(self, shapes: list[tuple], iters: int | None = None) -> float:
        """The trainer's step after the backward, per parameter, over fp32 parameters of `shapes`: the gradients
        attached (under CUDA graphs they are the graph's own tensors), clipping (one multi-tensor norm, a scale),
        AdamW (fused on CUDA), the gradients dropped (zero_grad(set_to_none=True))."""
        from megassm.config import OptimConfig
        from megassm.training.optim import build_optimizer, clip_grad_norm

        dev = self.device
        params = [torch.nn.Parameter(torch.randn(shape, device=dev)) for shape in shapes]
        n = sum(p.numel() for p in params)
        grads = [torch.randn_like(p) for p in params]
        opt = build_optimizer([{"params": params, "weight_decay": 0.1}], OptimConfig(), dev.type)

        def step():
            for p, g in zip(params, grads):
                p.grad = g
            clip_grad_norm(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        ms = self._timed_ms(step, iters)
        del params, grads, opt
        return 1e6 * ms / n

    def accumulate_ns_per_param(self, shapes: list[tuple], iters: int | None = None) -> float:
        """What autograd's AccumulateGrad does to a gradient already held when a micro-batch's arrives
        (`grad += new`, fp32, one tensor at a time), per parameter: what a step's later micro-batches pay and its
        first does not (costs.Calibration.accumulate_s)."""
        dev = self.device
        grads = [torch.randn(shape, device=dev) for shape in shapes]
        news = [torch.randn_like(g) for g in grads]
        n = sum(g.numel() for g in grads)

        def step():
            for g, new in zip(grads, news):
                g.add_(new)

        ms = self._timed_ms(step, iters)
        del grads, news
        return 1e6 * ms / n

    def fsdp2_ms(self, cfg_model, pattern: str, vocab: int, micro: int, seq: int, dp_group, reshard: str) -> float:
        """Eager forward + backward of `pattern` under FSDP2 over the fake DP group (its copies, no transfer)."""
        from dataclasses import replace

        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from megassm.models import build_model
        from megassm.parallel.fsdp2 import sharded_params

        dev = self.device
        mcfg = replace(cfg_model, pattern=pattern, vocab_size=vocab)
        model = build_model(mcfg, vocab_size=vocab, device="meta")
        mesh = DeviceMesh.from_group(dp_group, dev.type)
        low = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dev.type == "cuda" else None,
                                   reduce_dtype=torch.float32, cast_forward_inputs=False)
        sharded = {id(q) for q in sharded_params(model)}
        ignored = {q for q in model.parameters() if id(q) not in sharded}
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=low, ignored_params=ignored,
                        reshard_after_forward=reshard == "block")
        fully_shard(model, mesh=mesh, mp_policy=low, ignored_params=ignored)
        model.to_empty(device=dev)
        _init_(model)
        if reshard == "step":  # the gathered weights stay through the micro-batches; the reduce-scatter runs each
            model.set_reshard_after_backward(False)
        gen = torch.Generator(device=dev).manual_seed(0)
        batch = _batch(vocab, micro, seq, dev, gen)

        def run():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = model(batch["tokens"], seq_idx=batch["seq_idx"], labels=batch["labels"]).loss
            loss.backward()

        try:
            return self._timed_ms(run)
        finally:
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def _name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


@contextlib.contextmanager
def _fake_world(size: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("megassm-plan calibrate: torch.distributed is already initialized; run it alone")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# (tensors, parameters each): the memory-bound rate over large tensors; the per-tensor cost over small ones; the
# synthetic figure of earlier calibration files. Smaller on CPU, where this runs only as a smoke test.
OPTIMIZER_SETS = {"cuda": dict(large=(3, 1 << 26), small=(5000, 4096), synthetic=(200, 1_000_000)),
                  "cpu": dict(large=(3, 1 << 18), small=(200, 256), synthetic=(20, 100_000))}


def measure_optimizer(meas: Measurer, device_type: str, iters: int = 30) -> dict:
    """The optimizer step as the planner models it (costs.Calibration.optimizer_s): the slower of the GPU
    (`large_ns_per_param` x parameters, a few 64M-parameter tensors: memory bound) and the host (`tensor_us` x
    tensors: the small tensors' cost beyond their bytes). 30 steps a figure: a step over 200M parameters is ~3 ms."""
    sets = OPTIMIZER_SETS["cuda" if device_type == "cuda" else "cpu"]
    (nl, sl), (ns_, ss), (n1, s1) = sets["large"], sets["small"], sets["synthetic"]
    large = meas.optimizer_ns_per_param([(sl,)] * nl, iters)
    small = meas.optimizer_ns_per_param([(ss,)] * ns_, iters)
    synthetic = meas.optimizer_ns_per_param([(s1,)] * n1, iters)
    accumulate = meas.accumulate_ns_per_param([(sl,)] * nl, iters)
    return {"large_ns_per_param": round(large, 5), "tensor_us": round(max(0.0, small - large) * ss / 1e3, 3),
            "accumulate_ns_per_param": round(accumulate, 5), "ns_per_param": round(synthetic, 5),
            "sets": {k: dict(tensors=n, params_each=size) for k, (n, size) in sets.items()}}


def calibrate(configs: list[str], device: str = "cuda", budget_s: float = 420.0, iters: int = 12, warmup: int = 3,
              shapes: dict | None = None, log=print) -> dict:
    """Measure the table (module docstring) within `budget_s` seconds; returns the calibration file's content."""
    from megassm.config import load_config

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("megassm-plan calibrate measures on a GPU and none is visible (CUDA_VISIBLE_DEVICES?); "
                           "the planner itself runs anywhere from a committed calibration file")
    shapes = SHAPES if shapes is None else shapes
    modes = ["graph", "eager"] if dev.type == "cuda" else ["eager"]
    meas = Measurer(dev, iters, warmup)
    t_start = time.perf_counter()
    out = {"format": 1, "date": datetime.date.today().isoformat(),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": _triton_version(), "device": dev.type,
           "iters": iters, "warmup": warmup, "blocks": {}, "ends": {}, "optimizer": {}, "fsdp2": {}, "cp": [],
           "not_measured": []}
    cfgs = {}
    for path in configs:
        cfg = load_config(path, ["data.builtin=stdlib", "parallel.world_size=1"], validate_config=False)
        cfgs[_name(path)] = cfg
    # the work list, in priority order: each (config, tp, sp, shape) TP 1 first, graph before eager
    work = []
    for name, cfg in cfgs.items():
        spec = shapes.get(name, {"shapes": [(cfg.train.micro_batch, cfg.train.seq_len)], "tp": [1]})
        letters = sorted(set(c for c in cfg.model.pattern if c != "|"), key=lambda c: ("M*-".find(c), c))
        for tp in spec["tp"]:
            for sp in ([False] if tp == 1 else [False, True]):
                for (micro, seq) in spec["shapes"]:
                    for mode in modes:
                        for ac in ([False, True] if (tp == 1 and mode == modes[0] and (micro, seq) == spec["shapes"][0])
                                   else [False]):
                            work.append((name, tp, sp, micro, seq, mode, ac, letters))
    work.sort(key=lambda w: (w[1] != 1, w[5] != modes[0], w[6], w[2]))
    with _fake_world(FAKE_WORLD):
        from megassm.parallel.state import build_groups  # noqa: F401  (group creation below needs the world)

        groups = {}

        def tp_group(tp):
            if tp == 1:
                return None
            if tp not in groups:
                groups[tp] = dist.new_group(list(range(tp)))
            return groups[tp]

        if time.perf_counter() - t_start < budget_s:
            out["optimizer"] = measure_optimizer(meas, dev.type)
            log("optimizer: {large_ns_per_param:.4f} ns per parameter (large tensors), {tensor_us:.1f} us per "
                "tensor; {ns_per_param:.4f} ns per parameter over 200 x 1M".format(**out["optimizer"]))
        else:
            out["not_measured"].append(dict(what="optimizer"))
        if cfgs:  # FSDP2's copies on the 7B hybrid where it is calibrated (its recipe's engine), else the first
            name = "hybrid-7b" if "hybrid-7b" in cfgs else next(iter(cfgs))
            cfg = cfgs[name]
            vocab = cfg.model.vocab_size or 257
            micro, seq = shapes.get(name, {"shapes": [(1, cfg.train.seq_len)]})["shapes"][0]
            pattern = "M-*-" if "*" in cfg.model.pattern else "M-M-"
            fake_dp = dist.new_group(list(range(4)))
            for reshard in ("none", "step", "block"):
                if time.perf_counter() - t_start > budget_s:
                    out["not_measured"].append(dict(what=f"fsdp2 {reshard}"))
                    continue
                try:
                    if reshard == "none":
                        ms = meas.model_ms(cfg.model, pattern, vocab, micro, seq, None, False, "eager", False)
                    else:
                        ms = meas.fsdp2_ms(cfg.model, pattern, vocab, micro, seq, fake_dp, reshard)
                except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
                    out["not_measured"].append(dict(what=f"fsdp2 {reshard}", why=str(e).splitlines()[0][:200]))
                    continue
                out["fsdp2"][reshard] = dict(ms=round(ms, 4), config=name, pattern=pattern, micro=micro, seq=seq,
                                             dp=4)
                log(f"fsdp2 {reshard}: {ms:.2f} ms")
        for name, tp, sp, micro, seq, mode, ac, letters in work:
            cfg = cfgs[name]
            vocab = cfg.model.vocab_size or 257
            for letter in letters:
                if time.perf_counter() - t_start > budget_s:
                    out["not_measured"].append(dict(config=name, letter=letter, tp=tp, sp=sp, micro=micro, seq=seq,
                                                    mode=mode, ac=ac))
                    continue
                key = block_signature(cfg.model, letter)
                try:
                    t1 = meas.model_ms(cfg.model, letter, vocab, micro, seq, tp_group(tp), sp, mode, ac)
                    t3 = meas.model_ms(cfg.model, letter * 3, vocab, micro, seq, tp_group(tp), sp, mode, ac)
                except torch.OutOfMemoryError:
                    out["not_measured"].append(dict(config=name, letter=letter, tp=tp, sp=sp, micro=micro, seq=seq,
                                                    mode=mode, ac=ac, why="out of memory"))
                    continue
                except (ValueError, RuntimeError) as e:  # a TP degree the block's heads / groups do not take
                    out["not_measured"].append(dict(config=name, letter=letter, tp=tp, sp=sp, micro=micro, seq=seq,
                                                    mode=mode, ac=ac, why=str(e).splitlines()[0][:200]))
                    continue
                block = (t3 - t1) / 2
                row = dict(tp=tp, sp=sp, micro=micro, seq=seq, tokens=micro * seq, mode=mode, ac=ac,
                           block_ms=round(block, 4), model1_ms=round(t1, 4), config=name)
                out["blocks"].setdefault(key, []).append(row)
                ends = head_signature(cfg.model, vocab)
                out["ends"].setdefault(ends, []).append(dict(row, ends_ms=round(max(0.0, t1 - block), 4),
                                                             letter=letter))
                log(f"{name} {letter} tp={tp}{' sp' if sp else ''} {micro}x{seq} {mode}{' ac' if ac else ''}: "
                    f"block {block:.2f} ms, one-block model {t1:.2f} ms "
                    f"({time.perf_counter() - t_start:.0f} s)")
        if "mamba2-1.3b" in cfgs and dev.type == "cuda":  # a CP rank alone: the CP treatment's own work
            cfg = cfgs["mamba2-1.3b"]
            cp_group = dist.new_group(list(range(4)))
            for cp, seq in ((4, 65536), (1, 16384)):
                if time.perf_counter() - t_start > budget_s:
                    out["not_measured"].append(dict(what=f"cp {cp}"))
                    continue
                try:
                    t1 = meas.model_ms(cfg.model, "M", 257, 1, seq, None, False, "graph", False,
                                       cp_group=cp_group if cp > 1 else None)
                    t3 = meas.model_ms(cfg.model, "MMM", 257, 1, seq, None, False, "graph", False,
                                       cp_group=cp_group if cp > 1 else None)
                except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
                    out["not_measured"].append(dict(what=f"cp {cp}", why=str(e).splitlines()[0][:200]))
                    continue
                out["cp"].append(dict(config="mamba2-1.3b", key=block_signature(cfg.model, "M"), cp=cp, seq=seq,
                                      tokens=seq // cp, block_ms=round((t3 - t1) / 2, 4), model1_ms=round(t1, 4)))
                log(f"mamba2-1.3b M cp={cp} seq {seq}: block {(t3 - t1) / 2:.2f} ms")
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    return out


# what identifies one measured entry in each table of a calibration file (the rest of the row is its figures)
_ENTRY_KEYS = {
    "blocks": ("config", "tp", "sp", "micro", "seq", "mode", "ac"),
    "ends": ("config", "letter", "tp", "sp", "micro", "seq", "mode", "ac"),
    "cp": ("config", "key", "cp", "seq"),
}
_FIGURES = {"blocks": ("block_ms", "model1_ms"), "ends": ("block_ms", "model1_ms", "ends_ms"),
            "cp": ("block_ms", "model1_ms")}


def _median_rows(table: str, row_lists: list[list[dict]]) -> list[dict]:
    """The rows of one table entry across files, each figure the median of the files that measured it."""
    keys, figs = _ENTRY_KEYS[table], _FIGURES[table]
    merged: dict = {}
    for rows in row_lists:
        for r in rows:
            merged.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    out = []
    for same in merged.values():
        row = dict(same[0])
        for f in figs:
            row[f] = round(statistics.median(r[f] for r in same), 4)
        row["files"] = len(same)
        out.append(row)
    return out


def median_of(tables: list[dict], names: list[str]) -> dict:
    """One calibration from several of the same GPU kind: every entry's figures the median over the files that
    measured it (an entry's run-to-run spread on one GPU kind is as large as the planner's error goal, so no single
    file is chosen: docs/planner.md "Repeatability"). Refuses files of different GPUs, torch or Triton versions."""
    if len(tables) < 2:
        raise ValueError("megassm-plan calibrate --median: give at least two calibration files")
    for what in ("gpu", "torch", "triton", "device", "format"):
        seen = {t.get(what) for t in tables}
        if len(seen) > 1:
            raise ValueError(f"megassm-plan calibrate --median: the files differ in '{what}' ({sorted(map(str, seen))}); "
                             "a median only makes sense over one GPU kind and software stack")
    first = tables[0]
    out = {k: first[k] for k in ("format", "gpu", "torch", "triton", "device", "iters", "warmup")}
    out["date"] = max(t["date"] for t in tables)
    out["median_of"] = [dict(file=n, date=t["date"], seconds=t.get("seconds")) for n, t in zip(names, tables)]
    for table in ("blocks", "ends"):
        keys = sorted({k for t in tables for k in t.get(table, {})})
        out[table] = {k: _median_rows(table, [t[table][k] for t in tables if k in t.get(table, {})]) for k in keys}
    out["cp"] = _median_rows("cp", [t.get("cp", []) for t in tables])
    out["optimizer"] = {}
    for what in ("large_ns_per_param", "tensor_us", "accumulate_ns_per_param", "ns_per_param"):  # earlier files:
        # the last only, or not the accumulation
        opt = [t["optimizer"][what] for t in tables if what in t.get("optimizer", {})]
        if opt:
            out["optimizer"][what] = round(statistics.median(opt), 5)
            out["optimizer"].setdefault("files", {})[what] = len(opt)
    out["fsdp2"] = {}
    for reshard in sorted({r for t in tables for r in t.get("fsdp2", {})}):
        same = [t["fsdp2"][reshard] for t in tables if reshard in t.get("fsdp2", {})]
        out["fsdp2"][reshard] = dict(same[0], ms=round(statistics.median(x["ms"] for x in same), 4), files=len(same))
    # an entry is missing from the median only where no file measured it
    out["not_measured"] = [m for m in first.get("not_measured", [])
                           if all(m in t.get("not_measured", []) for t in tables[1:])]
    out["seconds"] = round(sum(t.get("seconds") or 0 for t in tables), 1)
    return out


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except Exception:
        return None


def write(table: dict, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)

