"""A fault on purpose, for the fault-tolerance tests (tests/test_faults.py, tests/test_faults_gpu.py); inert
unless MEGASSM_FAULT is set.

    MEGASSM_FAULT=kill:1:4       rank 1 SIGKILLs itself just before training step 4 (steps 1-3 done)
    MEGASSM_FAULT=hang:1:4       rank 1 stalls there for good; hang:1:4:20 for 20 s, then goes on
    MEGASSM_FAULT=hangsave:1:4   rank 1 stalls for good after step 4, just before that step's checkpoint

Trainer.fit calls at_step(k) before each step k (1-based, the step numbers of metrics.jsonl), after the
preemption check: the other ranks then run step k into its gradient reduction and wait there for the lost rank.
Trainer.save calls at_save(k) first: the other ranks then go on into the save of step k without that rank.
"""
from __future__ import annotations

import functools
import os
import signal
import sys
import time

__all__ = ["ENV", "parse", "at_step", "at_save"]

ENV = "MEGASSM_FAULT"
ACTIONS = ("kill", "hang", "hangsave")


@functools.lru_cache(maxsize=4)
def parse(spec: str) -> tuple[str, int, int, float]:
    """ACTION:RANK:STEP[:SECONDS] -> (action, rank, step, seconds); a malformed value raises ValueError naming it."""
    parts = spec.split(":")
    try:
        action, rank, step = parts[0], int(parts[1]), int(parts[2])
        seconds = float(parts[3]) if len(parts) == 4 else float("inf")
        ok = action in ACTIONS and len(parts) in (3, 4) and rank >= 0 and step >= 1 and seconds > 0
        ok = ok and (action.startswith("hang") or len(parts) == 3)
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{ENV}={spec!r}: expected kill:RANK:STEP, hang:RANK:STEP[:SECONDS] or hangsave:RANK:STEP[:SECONDS]")
    return action, rank, step, seconds


def at_step(step: int) -> None:
    """Kill or stall this process if MEGASSM_FAULT names this rank and `step` (kill / hang)."""
    _fault(step, ("kill", "hang"), "before step")


def at_save(step: int) -> None:
    """Stall this process if MEGASSM_FAULT is hangsave naming this rank and `step`."""
    _fault(step, ("hangsave",), "before the checkpoint of step")


def _fault(step: int, actions: tuple[str, ...], where: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, rank, when, seconds = parse(spec)
    if action not in actions or step != when or rank != int(os.environ.get("RANK", "0")):
        return
    sys.stderr.write(f"[rank {rank}] megassm: {ENV}={spec}: {'killed' if action == 'kill' else 'stalls'} "
                     f"{where} {step}\n")
    sys.stderr.flush()
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # sleep on through signals (torchrun's SIGTERM only sets the preemption flag)
        time.sleep(min(60.0, max(end - time.monotonic(), 0.0)))
