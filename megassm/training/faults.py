"""A fault on purpose, for the fault-tolerance tests (tests/test_faults.py, tests/test_faults_gpu.py) and the
long-run guards' (tests/test_guards.py); inert unless MEGASSM_FAULT is set.

    MEGASSM_FAULT=kill:1:4       rank 1 SIGKILLs itself just before training step 4 (steps 1-3 done)
    MEGASSM_FAULT=hang:1:4       rank 1 stalls there for good; hang:1:4:20 for 20 s, then goes on
    MEGASSM_FAULT=hangsave:1:4   rank 1 stalls for good after step 4, just before that step's checkpoint
    MEGASSM_FAULT=spike:1:5      rank 1's losses of the data of step 5 multiplied by 1000 before the backward
                                 (spike:1:5:50 by 50): a real loss and gradient-norm spike (the spike guard's tests)
    MEGASSM_FAULT=slow:1:0.3     rank 1 sleeps 0.3 s inside every forward (a straggler)

Several faults: comma-separated (kill:0:6,spike:0:7).

Trainer.fit calls at_step(k) before each step k (1-based, the step numbers of metrics.jsonl), after the
preemption check: the other ranks then run step k into its gradient reduction and wait there for the lost rank.
Trainer.save calls at_save(k) first: the other ranks then go on into the save of step k without that rank.
Trainer.train_step asks loss_scale(data, global_batch) for the factor of its micro-batches' losses: `spike`
names a step of the data stream (consumed samples / global batch + 1 when the step starts), which is the step
number until a rollback moves the data ahead of the steps, so a rollback that replayed the data would meet the
bad batches again. The eager micro-batch path only (not pipeline schedules, BPTT windows or CUDA graphs).
Trainer._forward_backward calls in_forward() inside the timed forward (`slow`).
"""
from __future__ import annotations

import functools
import math
import os
import signal
import sys
import time

__all__ = ["ENV", "parse", "specs", "at_step", "at_save", "loss_scale", "in_forward"]

ENV = "MEGASSM_FAULT"
ACTIONS = ("kill", "hang", "hangsave", "spike", "slow")
_FORMS = ("kill:RANK:STEP, hang:RANK:STEP[:SECONDS], hangsave:RANK:STEP[:SECONDS], spike:RANK:STEP[:FACTOR] or "
          "slow:RANK:SECONDS, comma-separated")


@functools.lru_cache(maxsize=16)
def parse(spec: str) -> tuple[str, int, int, float]:
    """ACTION:RANK:STEP[:VALUE] -> (action, rank, step, value): value is the stall's seconds (hang, hangsave; inf
    by default), the loss factor (spike; 1000 by default) or the sleep (slow:RANK:SECONDS, step 0). A malformed
    value raises ValueError naming it."""
    parts = spec.split(":")
    try:
        action, rank = parts[0], int(parts[1])
        if action == "slow":
            step, value = 0, float(parts[2])
            ok = len(parts) == 3
        else:
            step = int(parts[2])
            value = float(parts[3]) if len(parts) == 4 else (1000.0 if action == "spike" else float("inf"))
            ok = len(parts) in (3, 4) and step >= 1 and (action != "kill" or len(parts) == 3)
        ok = ok and action in ACTIONS and rank >= 0 and value > 0
        ok = ok and (action in ("kill", "hang", "hangsave") or math.isfinite(value))  # a stall may last for good
    except (IndexError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{ENV}={spec!r}: expected {_FORMS}")
    return action, rank, step, value


def specs() -> list[tuple[str, int, int, float]]:
    """The faults MEGASSM_FAULT names that concern this rank (RANK from the launcher's environment)."""
    value = os.environ.get(ENV)
    if not value:
        return []
    me = int(os.environ.get("RANK", "0"))
    return [f for f in (parse(s.strip()) for s in value.split(",")) if f[1] == me]


def at_step(step: int) -> None:
    """Kill or stall this process if MEGASSM_FAULT names this rank and `step` (kill / hang)."""
    _fault(step, ("kill", "hang"), "before step")


def at_save(step: int) -> None:
    """Stall this process if MEGASSM_FAULT is hangsave naming this rank and `step`."""
    _fault(step, ("hangsave",), "before the checkpoint of step")


def loss_scale(data, global_batch: int) -> float:
    """The factor for this rank's micro-batch losses of the step about to read `data` (a DataPipeline):
    MEGASSM_FAULT's spike factor when it names this rank and the data's step, else 1.0."""
    spikes = [f for f in specs() if f[0] == "spike"]
    if not spikes:
        return 1.0
    data_step = int(data.state_dict().get("consumed_samples", -global_batch)) // global_batch + 1
    for action, rank, step, factor in spikes:
        if step == data_step:
            _say(rank, f"losses x{factor:g} on the batches of data step {step}")
            return factor
    return 1.0


_slow_said = False


def in_forward() -> None:
    """Sleep inside the forward if MEGASSM_FAULT has slow naming this rank (every micro-batch)."""
    global _slow_said
    for action, rank, _, seconds in specs():
        if action == "slow":
            if not _slow_said:
                _slow_said = True
                _say(rank, f"sleeps {seconds:g} s in every forward")
            time.sleep(seconds)


def _say(rank: int, what: str) -> None:
    sys.stderr.write(f"[rank {rank}] megassm: {ENV}={os.environ.get(ENV)}: {what}\n")
    sys.stderr.flush()


def _fault(step: int, actions: tuple[str, ...], where: str) -> None:
    for action, rank, when, seconds in specs():
        if action not in actions or step != when:
            continue
        _say(rank, f"{'killed' if action == 'kill' else 'stalls'} {where} {step}")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # sleep on through signals (torchrun's SIGTERM only sets the preemption flag)
            time.sleep(min(60.0, max(end - time.monotonic(), 0.0)))
