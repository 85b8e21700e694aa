"""The nearest layouts that fit a GPU: what `megassm-train --dry-run` (and through it `megassm-launch`) prints when
a layout does not fit the card the job runs on (docs/launch.md "A layout that does not fit").

    found = nearest_layouts(cfg, "H100 80GB", vocab=257)   # [Layout(overrides, changes, peak_gib, needed_gib), ...]

A candidate changes some of these keys of the config, each key it sets counting as one change:

  the engine          ddp's distributed optimizer (parallel.zero_stage=1); FSDP2 (parallel.engine=fsdp2), also with
                      its weights freed after every block (parallel.fsdp_reshard=block); HSDP inside a node
                      (parallel.shard_size = parallel.gpus_per_node) when the job spans nodes; back to plain ddp.
                      DeepSpeed's stages only for a config that already uses DeepSpeed (an optional package)
  tensor parallelism  parallel.tp 1 / 2 / 4 / 8 that divides the world size, within a node
  activations         train.activation_checkpointing=true (every block); train.micro_batch halved, down to 1 (the
                      global batch stays: more accumulation)

Only when nothing fits at the config's world size does the world size change too (doubled, up to 8 times). Each
candidate must pass config.validate and the trainer's own layout checks (training/checks.py check_supported, as
the launched job sees them on GPUs), so only layouts the trainer accepts are offered. Candidates are visited by
number of changes; once one fits, no candidate that makes the same changes and more is looked at (it is never
nearer), and the search ends with the level that brings the `limit`-th fit. Ranked by changes, then by the memory
needed (most room first). "Fits": memory.fits, the dry run's estimate times the allocator's reserve factor plus
the CUDA context under the card's memory. Bounded: at most `max_estimates` estimates (a 7B estimate takes ~0.05
s on a meta model).
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
from dataclasses import dataclass, field

from megassm.config import Config, ConfigError, validate, world_size
from megassm.training import memory

__all__ = ["Layout", "nearest_layouts", "candidate_config"]

# the order keys are printed in
_KEYS = ["parallel.world_size", "parallel.engine", "parallel.zero_stage", "parallel.shard_size",
         "parallel.fsdp_reshard", "parallel.tp", "parallel.sp", "train.activation_checkpointing",
         "train.activation_checkpointing_blocks", "train.micro_batch"]


@dataclass
class Layout:
    changes: dict = field(default_factory=dict)  # key -> value, only those that differ from the config
    world_size: int = 1
    peak_gib: float = 0.0
    needed_gib: float = 0.0

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={_text(v)}" for k, v in sorted(self.changes.items(), key=lambda kv: _KEYS.index(kv[0]))]

    def to_dict(self) -> dict:
        return {"overrides": self.overrides, "changes": len(self.changes), "world_size": self.world_size,
                "peak_gib": round(self.peak_gib, 2), "needed_gib": round(self.needed_gib, 2)}


def _text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


@contextlib.contextmanager
def _world_env(n: int):
    """WORLD_SIZE as the launched job has it (check_supported compares it with parallel.world_size)."""
    old = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = old


def candidate_config(cfg: Config, changes: dict, world: int) -> Config | None:
    """`cfg` with `changes` applied, or None when config.validate or the trainer's layout checks refuse it (for
    the job on GPUs: train.device and train.precision auto, as the dry run checks)."""
    import torch

    from megassm.training.checks import check_supported

    c = copy.deepcopy(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(c, section), name, value)
    target = copy.deepcopy(c)
    target.train.device, target.train.precision = "auto", "auto"
    try:
        with _world_env(world):
            validate(c)
            check_supported(target, device=torch.device("cuda"))
    except ConfigError:
        return None
    return c


def _axes(cfg: Config, world: int) -> list[list[dict]]:
    """The alternatives of each thing a candidate may change; the first of each is the config's own."""
    p, t = cfg.parallel, cfg.train
    g = p.gpus_per_node
    rest = world // (p.cp * p.pp)  # tp x dp
    engine = [{}]
    if rest > 1 or p.cp > 1:  # one data-parallel rank builds no engine (but the distributed optimizer shards over cp)
        engine += [{"parallel.engine": "ddp", "parallel.zero_stage": 0, "parallel.shard_size": 0},
                   {"parallel.engine": "ddp", "parallel.zero_stage": 1, "parallel.shard_size": 0}]
    if rest > 1:
        for shard in [0] + ([g] if g and world > g else []):
            fsdp = {"parallel.engine": "fsdp2", "parallel.zero_stage": 0, "parallel.shard_size": shard}
            engine += [fsdp, {**fsdp, "parallel.fsdp_reshard": "block"}]
        if p.engine == "deepspeed":
            engine += [{"parallel.engine": "deepspeed", "parallel.zero_stage": s} for s in (1, 2, 3)]
    tp = [{}] + [{"parallel.tp": v, **({"parallel.sp": False} if v == 1 else {})}
                 for v in (1, 2, 4, 8) if v <= (g or 8) and rest % v == 0]
    act = [{}]
    if not t.activation_checkpointing:
        act.append({"train.activation_checkpointing": True, "train.activation_checkpointing_blocks": 0})
    elif t.activation_checkpointing_blocks:
        act.append({"train.activation_checkpointing_blocks": 0})
    mb, v = [{}], t.micro_batch // 2
    while v >= 1:
        mb.append({"train.micro_batch": v})
        v //= 2
    return [engine, tp, act, mb]


# keys whose values are ordered: a value nearer the config's (by factors of two) is the nearer change
_ORDERED = ("parallel.world_size", "parallel.tp", "train.micro_batch")


def _distance(cfg: Config, world: int, key: str, value) -> float:
    if key not in _ORDERED:
        return 0.0
    own = world if key == "parallel.world_size" else _get(cfg, key)
    return abs(math.log2(value / own))


def _nearer(cfg: Config, world: int, a: dict, b: dict) -> bool:
    """Whether changes `a` are no farther than `b` on every key `a` changes, and `b` changes each of them: a layout
    `a` that fits makes `b` pointless (b = a and more, or the same keys pushed farther: a smaller micro-batch, a
    larger tp or world size). HSDP is not "FSDP2 and more": it is offered beside FSDP2 over every GPU, whose
    all-gathers and reduce-scatters it keeps inside nodes (docs/across-nodes.md)."""
    if b.get("parallel.shard_size") and "parallel.shard_size" not in a:
        return False
    return all(k in b and (a[k] == b[k] or (k in _ORDERED and _distance(cfg, world, k, a[k])
                                             <= _distance(cfg, world, k, b[k]))) for k in a)


def _candidates(cfg: Config, world: int, fixed: dict) -> list[dict]:
    """Every distinct set of changes from the axes at `world` GPUs (with `fixed` changes in each)."""
    seen, out = set(), []
    for combo in itertools.product(*_axes(cfg, world)):
        merged = dict(fixed)
        for option in combo:
            merged.update(option)
        changes = {k: v for k, v in merged.items() if _get(cfg, k) != v}
        key = frozenset(changes.items())
        if changes and key not in seen:
            seen.add(key)
            out.append(changes)
    return out


def _search(cfg: Config, card: str, vocab: int, world: int, candidates: list[tuple[dict, int]], limit: int,
            budget: list) -> list[Layout]:
    """Visit `candidates` ((changes, world size) pairs) by number of changes, nearest first; the fits."""
    candidates = sorted(candidates, key=lambda cw: (len(cw[0]), sum(_distance(cfg, world, k, v) for k, v in
                                                                    cw[0].items()), sorted(map(str, cw[0].items()))))
    found: list[Layout] = []
    level = None
    for changes, n in candidates:
        if len(changes) != level:
            if len(found) >= limit:
                break
            level = len(changes)
        if any(_nearer(cfg, world, f.changes, changes) for f in found):
            continue
        c = candidate_config(cfg, changes, n)
        if c is None:
            continue
        if budget[0] <= 0:
            break
        budget[0] -= 1
        est = memory.estimate(c, vocab=vocab)
        if memory.fits(c, est, card):
            found.append(Layout(changes, n, est["peak_per_gpu"] / memory.GiB, memory.needed_gib(c, est)))
    found.sort(key=lambda f: (len(f.changes), f.needed_gib))
    return found[:limit]


def nearest_layouts(cfg: Config, card: str, vocab: int, limit: int = 4, max_estimates: int = 60) -> list[Layout]:
    """The layouts nearest to `cfg` that fit `card` (a memory.GPU_MEMORY_GIB key) and that the trainer accepts,
    fewest changes first, then the most room. At the config's world size; when none fits there, at 2, 4 and 8
    times it (their changes then include parallel.world_size). Empty when none is found within the bound."""
    budget = [max_estimates]
    world = world_size(cfg)
    found = _search(cfg, card, vocab, world, [(ch, world) for ch in _candidates(cfg, world, {})], limit, budget)
    if not found:
        more = [(ch, n) for n in (2 * world, 4 * world, 8 * world)
                for ch in _candidates(cfg, n, {"parallel.world_size": n})]
        found = _search(cfg, card, vocab, world, more, limit, budget)
    return found
