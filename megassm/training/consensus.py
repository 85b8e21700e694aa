"""Decisions every rank must share (resume from which checkpoint, whether a save or the start-up checks
failed), made over the default process group; a single process decides alone.

    outcomes = gather(local)           # every rank's value, in rank order (all_gather_object)
    err = agree_error(local_err)       # the lowest rank's exception, on every rank, or None

Call them on every rank at the same point: they are collectives.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["active", "gather", "agree_error"]


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(value) -> list:
    """Every rank's `value` (picklable), in rank order."""
    if not active():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)  # NCCL: through the current CUDA device, set by parallel.runtime.setup
    return out


def agree_error(error: BaseException | None) -> BaseException | None:
    """The exception of the lowest rank that has one, on every rank (None when no rank has one)."""
    return next((e for e in gather(error) if e is not None), None)
