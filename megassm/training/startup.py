"""Start-up without a whole model per GPU: the plans (TP / SP, CP, PP stages, activation checkpointing and, for
FSDP2, the engine's sharding) are applied to the model while it is still on the meta device; then each rank
allocates only what it holds and fills it from the canonical weights.

    model = build_model(cfg.model, vocab_size=V, device="meta")
    model = prt.prepare_model(model, groups, cfg)              # plans on the meta model
    materialize_held(model, device, groups, seed=cfg.train.seed)   # or state=... (model.init_from)

The canonical init (models/init.py) draws every parameter at its full single-device shape from its own
generator (seeded by the seed and the parameter's name); a rank's pieces are slices of those tensors. So each
parameter is drawn once in the job, by the rank it is dealt to (largest first, the least-loaded rank: the draws
of a 7B model spread over every rank, each in a pool of threads), broadcast as one full tensor on the device,
and every rank copies out the boxes it holds (training/checkpoint/sharded_chunks.py `tensor_boxes`: its TP pieces mapped
through their ShardSpecs, its FSDP2 shard's offsets), which are views of its live parameters. A device holds
the pieces it keeps plus one full parameter at a time (the largest: the embedding or the head); a host holds the
draws in flight (at most `_WINDOW_BYTES`). The weights are bit for bit those of
`model.init_weights(seed)` on one device, cut as the layout cuts them.

`collective=False` (pipeline stages: no group holds exactly the ranks of one stage) draws every parameter in
this process. The broadcast sends every rank the whole model once (28 GB at 7B: about 0.1 s over NVLink and a
second or so over a 400 Gb/s link per GPU); a scatter of only the pieces would send less, not needed at start-up.
"""
from __future__ import annotations

import logging
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

import os

from megassm.models.init import draw as draw_rule
from megassm.models.init import param_seed, rule_of
from megassm.training.checkpoint.sharded_chunks import model_context, tensor_boxes

__all__ = ["materialize_held", "held_parameters", "peak_host_bytes", "deal", "draw_threads"]

log = logging.getLogger("megassm.startup")

_WINDOW_BYTES = 2 << 30  # host memory a rank's drawn-but-not-yet-broadcast tensors may hold


def deal(sizes: list[int], n: int) -> list[int]:
    """Owner rank (0..n-1) of each item: largest first, each to the least-loaded rank (ties: lowest rank)."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def draw_threads() -> int:
    """Threads a rank draws with: MEGASSM_INIT_THREADS, else the CPU cores shared by the node's ranks (1-16): the
    canonical init is ~7e9 serial normal draws at 7B, about a minute and a half on one core."""
    env = os.environ.get("MEGASSM_INIT_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"MEGASSM_INIT_THREADS={env!r}: expected a positive integer")
        return int(env)
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(16, cores // local))


def peak_host_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def held_parameters(model: nn.Module) -> list:
    """[(canonical name, canonical shape, [(canonical offsets, view of the live tensor)])] for every parameter
    this rank holds (a tied weight once), in the model's parameter order."""
    inner, tplan, _ = model_context(model)
    tp_rank = tplan.rank if tplan is not None else 0
    out = []
    for name, p in inner.named_parameters():
        spec = tplan.specs.get(name) if tplan is not None else None
        shape, boxes = tensor_boxes(p, spec, tp_rank, None)
        out.append((name, tuple(shape), boxes))
    return out


def _box(full: torch.Tensor, offsets: tuple, view: torch.Tensor) -> torch.Tensor:
    idx = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
    return full[idx] if idx else full


@torch.no_grad()
def materialize_held(model: nn.Module, device, groups, seed: int | None = None, state: dict | None = None,
                     collective: bool = True) -> nn.Module:
    """Allocate the planned meta `model` on `device` (each rank only what it holds) and fill it with the canonical
    weights: drawn for `seed`, or taken from `state` (a canonical state dict every rank holds: model.init_from).
    Collective over every rank of the job when distributed and `collective` (every rank must call it with a
    model whose parameters carry the same canonical names, in the same order)."""
    t0 = time.perf_counter()
    host0 = peak_host_bytes()
    model.to_empty(device=device)
    inner, _, _ = model_context(model)
    held = held_parameters(model)
    distributed = (collective and state is None and dist.is_available() and dist.is_initialized()
                   and dist.get_world_size() > 1)
    n = dist.get_world_size() if distributed else 1
    me = dist.get_rank() if distributed else 0
    sizes = [int(torch.Size(shape).numel()) for _, shape, _ in held]
    owner = deal(sizes, n)

    def canonical(i: int) -> torch.Tensor:
        name, shape, _ = held[i]
        if state is not None:
            return state[name].detach().to(torch.float32)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(seed, name))
        return draw_rule(rule_of(inner, name), shape, gen)

    mine = [i for i in range(len(held)) if owner[i] == me]
    held_elems = 0
    with ThreadPoolExecutor(max_workers=draw_threads(), thread_name_prefix="megassm-init") as pool:
        pending, queued, window = {}, 0, 0

        def fill() -> None:  # keep the pool busy within the host-memory window
            nonlocal queued, window
            while queued < len(mine) and (window < _WINDOW_BYTES or not pending):
                i = mine[queued]
                pending[i] = pool.submit(canonical, i)
                window += sizes[i] * 4
                queued += 1

        fill()
        for i, (name, shape, boxes) in enumerate(held):
            if owner[i] == me:
                full = pending.pop(i).result().to(device)
                window -= sizes[i] * 4
                fill()
            else:
                full = torch.empty(shape, dtype=torch.float32, device=device)
            if distributed:
                dist.broadcast(full, src=owner[i])
            for offsets, view in boxes:
                view.copy_(_box(full, offsets, view))
                held_elems += view.numel()
            del full
    for name, p in inner.named_parameters():
        p._no_weight_decay = rule_of(inner, name).no_wd  # for tools that look for it (models/init.py)
    total = sum(sizes)
    log.info("materialized %d parameters: this rank holds %.1fM of %.1fM elements (%s); %s in %.1fs, peak host "
             "memory %.2f GiB (+%.2f GiB)", len(held), held_elems / 1e6, total / 1e6, device,
             "from model.init_from" if state is not None else
             f"drew {sum(sizes[i] for i in mine) / 1e6:.1f}M with {draw_threads()} thread(s)"
             + (f", broadcast over {n} ranks" if distributed else ""),
             time.perf_counter() - t0, peak_host_bytes() / 2 ** 30, max(0, peak_host_bytes() - host0) / 2 ** 30)
    return model
