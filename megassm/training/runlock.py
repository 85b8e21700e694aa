"""One trainer per run directory: RUN_DIR/trainer.lock.

    lock = acquire(run_dir, stale_after_s=300)   # rank 0, before anything is written; RunLockedError if held
    ...
    release(run_dir)                             # at exit, after last_exit.json

The lock file holds its owner (host, PID and the PID's start time, SLURM job, a random token) and appears
in one step: written under a private name, then hard-linked to `trainer.lock`, which fails when the name
exists (atomic on local and network file systems). While it is held, a thread touches the file every
HEARTBEAT_S seconds. A lock someone else holds is stale, and is taken over with a warning naming the old
owner, when
- its owner ran on this host and that process is gone (or its PID now belongs to another process);
- its owner was an earlier run of this SLURM job (a requeued job restarts only after the old one ended);
- its owner ran on another host and its heartbeat is older than `stale_after_s` (run.lock_stale_s).
Otherwise the second trainer refuses to start, naming the owner. The ranks of one job share the lock that
their rank 0 took (megassm.training.trainer tells them the outcome).
"""
from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid

from megassm.training.failures import RunIOError, describe_os_error

__all__ = ["LOCK_NAME", "HEARTBEAT_S", "RunLockedError", "RunLock", "acquire", "release", "holds", "read_lock",
           "refuse_if_held"]

log = logging.getLogger("megassm.train")

LOCK_NAME = "trainer.lock"
HEARTBEAT_S = 30.0
_WRITING_GRACE_S = 5.0  # an unreadable lock this young may still be being written (no hard links)
_held: dict[str, "RunLock"] = {}


class RunLockedError(RuntimeError):
    """Another live trainer holds the run directory; the message names it and what to do."""


def _proc_start(pid: int) -> str | None:
    """The start time of a process in clock ticks since boot (Linux), to tell a reused PID apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _identity() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_start": _proc_start(os.getpid()),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


def read_lock(path: str) -> tuple[dict | None, float | None]:
    """(owner record or None when unreadable, mtime) of a lock file; (None, None) when there is none."""
    try:
        mtime = os.stat(path).st_mtime
        with open(path) as f:
            rec = json.load(f)
        return (rec if isinstance(rec, dict) else None), mtime
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError):
        try:
            return None, os.stat(path).st_mtime
        except OSError:
            return None, None


def _alive_here(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    start = owner.get("pid_start")
    return start is None or _proc_start(pid) in (None, start)


def _stale_reason(owner: dict | None, mtime: float, stale_after_s: float) -> str | None:
    """Why a lock held by `owner` may be taken over, or None when its owner may be alive."""
    age = time.time() - mtime
    if owner is None:
        return None if age < _WRITING_GRACE_S else "its lock file is unreadable"
    if owner.get("host") == socket.gethostname():
        if owner.get("pid") == os.getpid():
            return "it was taken earlier by this process"
        if not _alive_here(owner):
            return f"its process {owner.get('pid')} on this host is gone"
        return None
    job = os.environ.get("SLURM_JOB_ID")
    if job and owner.get("slurm_job_id") == job:
        return f"it was taken by an earlier run of this SLURM job {job} (a requeue)"
    if age > stale_after_s:
        return f"its heartbeat stopped {age:.0f} s ago (run.lock_stale_s={stale_after_s:g})"
    return None


def _refusal(run_dir: str, path: str, owner: dict | None, mtime: float, stale_after_s: float) -> str:
    if owner is None:
        who = "a trainer that is writing its lock file now"
    else:
        job = f", SLURM job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
        who = f"pid {owner.get('pid')} on {owner.get('host')}{job}, started {owner.get('started')}"
    return (f"run.dir {run_dir} is in use by another trainer ({who}; lock heartbeat {time.time() - mtime:.0f} s ago): "
            f"stop it or choose another run.dir. If it is gone, its lock {path} counts as stale after "
            f"{stale_after_s:g} s without a heartbeat (run.lock_stale_s), or delete that file")


def _try_create(path: str, owner: dict) -> bool:
    """Create the lock file with its full content in one step; False when it exists."""
    tmp = f"{path}.{owner['host']}.{owner['pid']}.{owner['token'][:8]}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    try:
        os.write(fd, (json.dumps(owner, indent=1) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:  # a file system without hard links: exclusive create (briefly empty)
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV):
            raise
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, (json.dumps(owner, indent=1) + "\n").encode())
        finally:
            os.close(fd)
        return True
    finally:
        os.remove(tmp)


def _break(path: str, owner: dict | None) -> None:
    """Remove the stale lock `owner` held, unless another trainer replaced it in the meantime."""
    aside = f"{path}.stale-{socket.gethostname()}-{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # someone else removed it first
    moved, _ = read_lock(aside)
    if owner is not None and (moved or {}).get("token") != owner.get("token"):
        try:  # a fresh lock taken since we looked: put it back
            os.link(aside, path)
        except OSError:
            pass
    os.remove(aside)


class RunLock:
    """A held lock: its heartbeat thread touches the file; release() removes it if it is still ours."""

    def __init__(self, run_dir: str, path: str, owner: dict):
        self.run_dir, self.path, self.owner = run_dir, path, owner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="megassm-lock-heartbeat", daemon=True)
        self._thread.start()

    def _ours(self) -> bool:
        rec, _ = read_lock(self.path)
        return rec is not None and rec.get("token") == self.owner["token"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self._ours():
                    rec, _ = read_lock(self.path)
                    log.error("the lock %s is no longer this trainer's (now: %s); another trainer may be writing "
                              "to %s", self.path, rec, self.run_dir)
                    return
                os.utime(self.path)
            except OSError as e:
                log.warning("lock heartbeat: cannot touch %s: %s", self.path, describe_os_error(e))

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            if self._ours():
                os.remove(self.path)
        except OSError as e:
            log.warning("could not remove the lock %s: %s", self.path, describe_os_error(e))


def acquire(run_dir: str, stale_after_s: float = 300.0) -> RunLock:
    """Take run_dir's lock (creating run_dir), taking over a stale one with a warning. Raises
    RunLockedError when a live trainer holds it and RunIOError when run_dir cannot be written."""
    key = os.path.abspath(run_dir)
    if key in _held:  # this process takes the directory again (a Trainer built twice in one process)
        _held.pop(key).release()
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        os.makedirs(run_dir, exist_ok=True)
        for _ in range(20):
            owner = _identity()
            if _try_create(path, owner):
                lock = RunLock(run_dir, path, owner)
                _held[key] = lock
                return lock
            held_by, mtime = read_lock(path)
            if mtime is None:
                continue  # released between our attempt and the look
            reason = _stale_reason(held_by, mtime, stale_after_s)
            if reason is None and held_by is None:
                time.sleep(0.2)  # its owner is still writing it
                continue
            if reason is None:
                raise RunLockedError(_refusal(run_dir, path, held_by, mtime, stale_after_s))
            log.warning("run.dir %s: taking over the lock of %s: %s", run_dir,
                        f"pid {held_by.get('pid')} on {held_by.get('host')}" if held_by else "an unknown trainer", reason)
            _break(path, held_by)
    except OSError as e:
        raise RunIOError(f"cannot lock run.dir {run_dir}: {describe_os_error(e)}") from None
    raise RunLockedError(f"run.dir {run_dir}: could not take its lock {path}: other trainers keep taking it")


def refuse_if_held(run_dir: str, stale_after_s: float = 300.0) -> None:
    """RunLockedError when a live trainer holds run_dir's lock, found by reading only (the checks made before
    acquire() must change nothing in run_dir). acquire() still decides atomically; a lock being written now, or
    held by this process, is left to it."""
    path = os.path.join(run_dir, LOCK_NAME)
    owner, mtime = read_lock(path)
    if owner is None or mtime is None or os.path.abspath(run_dir) in _held:
        return
    if _stale_reason(owner, mtime, stale_after_s) is None:
        raise RunLockedError(_refusal(run_dir, path, owner, mtime, stale_after_s))


def holds(run_dir: str) -> bool:
    """Whether this process holds run_dir's lock."""
    return os.path.abspath(run_dir) in _held


def release(run_dir: str) -> None:
    """Release run_dir's lock if this process holds it."""
    lock = _held.pop(os.path.abspath(run_dir), None)
    if lock is not None:
        lock.release()
