"""Exit codes of `megassm-train` and the failures a user can cause that are not config mistakes.

docs/reliability.md lists what each code means and what to do after it; launch/core/slurm.py's batch script
requeues on EXIT_PREEMPTED only.
"""
from __future__ import annotations

__all__ = ["EXIT_OK", "EXIT_CONFIG", "EXIT_NONFINITE", "EXIT_IO", "EXIT_LOCKED", "EXIT_NO_CHECKPOINT",
           "EXIT_SPIKE", "EXIT_PREEMPTED", "EXIT_ABORTED", "RunIOError", "describe_os_error", "one_line"]

EXIT_OK = 0
EXIT_CONFIG = 2  # config or input mistake (key, file, line or value named); nothing trained past the last checkpoint
EXIT_NONFINITE = 3  # non-finite loss; the message names the newest checkpoint that verifies
EXIT_IO = 4  # run dir or checkpoint not writable, the disk full, a file-size limit hit; nothing half-written is left
EXIT_LOCKED = 5  # run.dir is in use by another trainer; nothing was written
EXIT_NO_CHECKPOINT = 6  # run.resume (or any reader of checkpoints: export, init_from, ...) found none that verifies
EXIT_SPIKE = 7  # train.spike_action=rollback: spikes went on past train.spike_max_rollbacks (training/guards.py)
EXIT_PREEMPTED = 99  # SIGUSR1 / SIGTERM / Ctrl-C: checkpointed, requeue me (preemption.PREEMPT_EXIT_CODE)
EXIT_ABORTED = 130  # a second Ctrl-C: stopped at once, nothing saved since the last checkpoint


class RunIOError(OSError):
    """The run directory or a checkpoint cannot be written (permissions, a read-only or full file system).
    The message names the path and the system's reason."""


def describe_os_error(e: OSError) -> str:
    """'No space left on device: /path' rather than "[Errno 28] No space left on device: '/path'"."""
    if isinstance(e, RunIOError) or not e.strerror:
        return str(e)
    where = e.filename if e.filename is not None else ""
    return f"{e.strerror}: {where}" if where else e.strerror


def one_line(text: str) -> str:
    """The first line of a message, for the one-line errors the CLI prints (torch's load errors span many)."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return lines[0] if lines else ""
