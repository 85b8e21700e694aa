"""Start-up: a meta-device model made real on the training device, with the canonical weights, fast.

    model = build_model(cfg.model, vocab_size=V, device="meta")
    materialize(model, device, seed, group=None)     # every rank of the job calls it (group None = WORLD)

The canonical init (models/init.py) draws every parameter on the CPU from its own generator seeded by
(seed, parameter name); at 7B that is ~7e9 serial normal draws, about a minute and a half on one core, and
building the model on the CPU first runs torch's default init as well. Here the model is built on the meta
device (no memory, no default init), the parameters are dealt out to the ranks (largest first, each to the
least-loaded rank), each rank draws its own in a pool of threads and copies them to the device, and every
parameter is then broadcast from the rank that drew it. The values are bit for bit those of
`model.init_weights(seed)`: the same draws, only on another thread or rank.

The whole (TP-unsharded) model exists on every device for a moment (28 GB of fp32 at 7B): the plans
(TP slices, FSDP2 shards) are applied after this, as before.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from megassm.models.init import draw as draw_rule
from megassm.models.init import param_seed, rule_of

__all__ = ["materialize", "materialize_from", "deal", "draw_threads"]

log = logging.getLogger("megassm.parallel.materialize")

_WINDOW_BYTES = 2 << 30  # host memory a rank's drawn-but-not-yet-copied tensors may hold


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
    """Threads a rank draws with: MEGASSM_INIT_THREADS, else the CPU cores shared by the node's ranks (1-16)."""
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


@torch.no_grad()
def materialize(model: nn.Module, device, seed: int, group=None, collective: bool = True) -> nn.Module:
    """Allocate `model` (on the meta device) on `device` and give it its canonical weights. Collective over
    `group` (None: every rank) when torch.distributed is initialized and `collective`: every rank of it must
    hold the same parameters, in the same order. Otherwise this process draws every parameter itself
    (threaded). A pipeline stage's parameters carry their single-device names, so the same draws."""
    t0 = time.perf_counter()
    model.to_empty(device=device)
    params = list(model.named_parameters())  # a tied weight once
    distributed = collective and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    n = dist.get_world_size(group) if distributed else 1
    me = dist.get_rank(group) if distributed else 0
    owner = deal([p.numel() for _, p in params], n)
    src = [dist.get_global_rank(group, r) if group is not None else r for r in range(n)] if distributed else None

    def draw(i: int) -> torch.Tensor:
        name, p = params[i]
        gen = torch.Generator(device="cpu")
        gen.manual_seed(param_seed(seed, name))
        return draw_rule(rule_of(model, name), tuple(p.shape), gen)

    mine = [i for i in range(len(params)) if owner[i] == me]
    threads = draw_threads()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megassm-init") as pool:
        pending, queued, held = {}, 0, 0

        def fill() -> None:  # keep the pool busy within the host-memory window
            nonlocal queued, held
            while queued < len(mine) and (held < _WINDOW_BYTES or not pending):
                i = mine[queued]
                pending[i] = pool.submit(draw, i)
                held += params[i][1].numel() * 4
                queued += 1

        fill()
        for i, (name, p) in enumerate(params):
            if owner[i] == me:
                p.copy_(pending.pop(i).result())
                held -= p.numel() * 4
                fill()
            if distributed:
                dist.broadcast(p.data, src=src[owner[i]], group=group)
            p._no_weight_decay = rule_of(model, name).no_wd
    drawn = sum(params[i][1].numel() for i in mine)
    log.info("materialized %d parameters (%.1fM elements) on %s in %.1fs: this rank drew %.1fM with %d thread(s)%s",
             len(params), sum(p.numel() for _, p in params) / 1e6, device, time.perf_counter() - t0, drawn / 1e6,
             threads, f", broadcast over {n} ranks" if distributed else "")
    return model


@torch.no_grad()
def materialize_from(model: nn.Module, device, state: dict) -> nn.Module:
    """Allocate `model` (on the meta device) on `device` with the weights of `state`, a canonical state dict every
    rank holds (model.init_from, read and checked by megassm.interop.sources): no draws, no collective."""
    t0 = time.perf_counter()
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        p.copy_(state[name])
        p._no_weight_decay = rule_of(model, name).no_wd
    log.info("materialized %d parameters on %s from model.init_from in %.1fs", len(list(model.parameters())), device,
             time.perf_counter() - t0)
    return model
