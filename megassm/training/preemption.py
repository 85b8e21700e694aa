"""Preemption: a SIGUSR1 / SIGTERM / SIGINT (Ctrl-C) asks the trainer to checkpoint at the next step boundary
and exit with `PREEMPT_EXIT_CODE` (99, "checkpointed, requeue me"). A second Ctrl-C aborts at once
(KeyboardInterrupt: nothing saved since the last checkpoint); one that comes within INTERRUPT_GRACE_S of the
first is the same Ctrl-C forwarded by a launcher (torchrun passes its own SIGINT on to the workers) and is
ignored.

    install()                        # megassm.train, before anything slow: the handlers only set a flag
    stop = agreed_stop(device)       # Trainer.fit, at every step boundary: the flag, agreed by every rank

A signal reaches the ranks at different moments (or only some of them: a scheduler may signal one node
first), so the flag is all-reduced (MAX over the world group) at each step boundary: every rank stops after
the same step, and the checkpoint they save together is consistent. The handler does nothing but set the
flag, so a signal in the middle of a step (or of a collective) never interrupts it. The SLURM batch script
that docs/launch.md describes sends SIGUSR1 before the time limit and requeues the job when the run
directory's `last_exit.json` says 99; the requeued job resumes with run.resume=auto.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["PREEMPT_EXIT_CODE", "SIGNALS", "INTERRUPT_GRACE_S", "install", "uninstall", "requested", "reason", "reset",
           "agreed_stop", "write_pid_file", "clear_pid_files"]

log = logging.getLogger("megassm.train")

PREEMPT_EXIT_CODE = 99
SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
INTERRUPT_GRACE_S = 2.0

_state = {"signum": None, "sigint_at": None}
_previous: dict = {}


def _handler(signum, frame) -> None:  # noqa: ARG001
    # logging from a signal handler may deadlock on the handler lock; plain writes are safe enough
    if signum == signal.SIGINT:
        now, first = time.monotonic(), _state["sigint_at"]
        if first is not None and now - first > INTERRUPT_GRACE_S:
            sys.stderr.write("megassm: second Ctrl-C: aborting now, without a checkpoint\n")
            raise KeyboardInterrupt
        if first is None:
            _state["sigint_at"] = now
    if _state["signum"] is None:
        _state["signum"] = signum
        # logging from a signal handler may deadlock on the handler lock; a plain write is safe enough
        tag = f"[rank {os.environ.get('RANK', '0')}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        again = "; press Ctrl-C again to abort without saving" if signum == signal.SIGINT else ""
        sys.stderr.write(f"{tag}megassm: received {signal.Signals(signum).name}: will checkpoint and exit "
                         f"({PREEMPT_EXIT_CODE}) at the next step boundary{again}\n")


def install() -> bool:
    """Route SIGUSR1, SIGTERM and SIGINT to the flag. Only the main thread can install handlers; returns whether
    they were installed."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption: not on the main thread, SIGUSR1/SIGTERM handlers not installed")
        return False
    for sig in SIGNALS:
        if sig not in _previous:
            _previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _handler)
    return True


STACKS_SIGNAL = signal.SIGUSR2


def install_stack_dump() -> bool:
    """`kill -USR2 PID` prints every thread's Python stack of that process to stderr and training goes on: how to
    see where a hung rank waits (a collective, the data loader, a checkpoint write) without a debugger. The dump
    is faulthandler's, written from C, so it works while the main thread is blocked inside NCCL or I/O."""
    import faulthandler

    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a descriptor (captured)
        fd = 2  # the process's own stderr
    try:
        faulthandler.register(STACKS_SIGNAL, file=fd, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("SIGUSR2 stack dumps not installed: %s", e)
        return False
    return True


def uninstall_stack_dump() -> None:
    import faulthandler

    if threading.current_thread() is threading.main_thread():
        faulthandler.unregister(STACKS_SIGNAL)


def uninstall() -> None:
    """Restore the handlers that install() replaced."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, old in list(_previous.items()):
        signal.signal(sig, old if old is not None else signal.SIG_DFL)
        del _previous[sig]


def requested() -> bool:
    """Whether this process received one of SIGNALS."""
    return _state["signum"] is not None


def reason() -> str | None:
    s = _state["signum"]
    return None if s is None else signal.Signals(s).name


def reset() -> None:
    _state["signum"] = None
    _state["sigint_at"] = None


def agreed_stop(device: torch.device) -> bool:
    """True on every rank when any rank has received a preemption signal (a collective over the default
    group when torch.distributed is initialized with more than one rank: call it on every rank, at the
    same point of the loop)."""
    local = requested()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    # NCCL reduces device tensors only; gloo takes CPU tensors
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def write_pid_file(run_dir: str) -> str:
    """RUN_DIR/pids/<host>-<rank>.pid: how the SLURM batch script (launch/core/slurm.py) finds the training
    processes on each node to forward its SIGUSR1 to them, and to them only (the launcher between would die
    of the signal). Rank 0 clears the folder (clear_pid_files) once it holds the run directory's lock, before
    any rank writes its file."""
    folder = os.path.join(run_dir, "pids")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{socket.gethostname()}-{os.environ.get('RANK', '0')}.pid")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(tmp, path)
    return path


def clear_pid_files(run_dir: str) -> None:
    """Remove RUN_DIR/pids: the files of an earlier run name processes that are gone (or PIDs reused since)."""
    shutil.rmtree(os.path.join(run_dir, "pids"), ignore_errors=True)
