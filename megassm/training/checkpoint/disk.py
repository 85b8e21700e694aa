"""Writing a checkpoint's files to disk (fsync'ed, hashed on the way out) and naming what failed: a full disk or a
file-size limit behind torch's RuntimeError (disk_failure) becomes a CheckpointWriteError naming the checkpoint,
the file and the cause (write_error). Both formats write through these (save.py, sharded.py)."""
from __future__ import annotations

import errno
import json
import os
from typing import Any

import torch

from megassm.training.checkpoint.errors import CheckpointWriteError
from megassm.training.checkpoint.integrity import HashingWriter
from megassm.training.failures import one_line

__all__ = ["fsync_dir", "torch_save", "write_json", "raise_naming", "disk_failure", "write_error"]


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


def torch_save(obj: Any, path: str) -> dict:
    """Write `obj` to `path` (fsync'ed) and return its integrity record, hashed on the way out. A failed write
    raises the OSError behind it, naming `path` (torch reports it as a RuntimeError, see disk_failure)."""
    try:
        with open(path, "wb") as f:
            writer = HashingWriter(f)
            torch.save(obj, writer)
            f.flush()
            os.fsync(f.fileno())
    except Exception as e:
        raise_naming(e, path)
        raise
    return writer.record()


def write_json(obj: dict, path: str) -> None:
    try:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise_naming(e, path)
        raise


def raise_naming(e: BaseException, path: str) -> None:
    """Raise the OSError in `e`'s chain again with `path` as its file name (a write() through a Python file object
    fails without one), if there is one."""
    found = _chained_os_error(e)
    if found is not None and found.errno is not None and found.filename is None:
        raise OSError(found.errno, found.strerror, path) from e
    if found is not None and found is not e:
        raise found from e


# Free space below this, re-read after a write failed without an errno, means the file system is full: a write()
# that hits a full disk stops within a block of the end, a block is at most a few MiB on any file system.
_FULL_BYTES = 4 << 20


def _chained_os_error(e: BaseException | None) -> OSError | None:
    """The first OSError among `e`, its causes and contexts, and the per-rank failures of a torch.distributed
    checkpoint error (CheckpointException.failures: {rank: (exception, traceback)})."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                todo.append(v if isinstance(v, BaseException) else
                            v[0] if isinstance(v, tuple) and v and isinstance(v[0], BaseException) else None)
    return None


def _torch_write_error(e: BaseException) -> bool:
    """A RuntimeError (torch's writer), or a DCP CheckpointException (a BaseException) whose every rank failed so."""
    if isinstance(e, RuntimeError):
        return True
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return False
    return all(isinstance(v[0] if isinstance(v, tuple) and v else v, RuntimeError) for v in failures.values())


def _files_under(where: str) -> list[str]:
    if os.path.isfile(where):
        return [where]
    return [os.path.join(d, f) for d, _, files in os.walk(where) for f in files]


def disk_failure(e: BaseException, where: str) -> OSError | None:
    """The OSError behind a failed write of the files under `where` (a checkpoint's temp directory), or None when
    the failure is not one of writing (a bug: the caller re-raises it).

    torch reports a full disk or a file-size limit as `RuntimeError: [enforce fail at inline_container.cc:...]
    unexpected pos`. When the failed write() went through a Python file object (save_checkpoint, the DCP writer of
    this process) its OSError is chained to that error: its errno decides. A DCP error gathered from another rank
    arrives pickled, without the chain; then the state of the disk decides, read again now: free space on the file
    system of `where` below a few MiB is ENOSPC, a file under `where` as large as the process's file-size limit
    (RLIMIT_FSIZE, `ulimit -f`) is EFBIG. Call before removing the files."""
    found = _chained_os_error(e)
    if found is not None:
        return found
    if not _torch_write_error(e):
        return None
    limit = _file_size_limit()
    if limit is not None:
        for path in _files_under(where):
            try:
                if os.path.getsize(path) >= limit:
                    return OSError(errno.EFBIG, f"{os.strerror(errno.EFBIG)} (the process's file-size limit, "
                                   f"RLIMIT_FSIZE / ulimit -f, is {limit} bytes; {type(e).__name__}: {one_line(e)})",
                                   path)
            except OSError:
                continue
    free = _free_bytes(where)
    if free is not None and free < _FULL_BYTES:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free on its file system after the "
                       f"write failed; {type(e).__name__}: {one_line(e)})", where)
    return None


def _file_size_limit() -> int | None:
    """The process's file-size limit (RLIMIT_FSIZE) in bytes, None when unlimited or unknown."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, ValueError, OSError):
        return None
    return None if limit == resource.RLIM_INFINITY else int(limit)


def _free_bytes(where: str) -> int | None:
    while where and not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        st = os.statvfs(where)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def write_error(e: BaseException, final: str, tmp: str) -> CheckpointWriteError | None:
    """CheckpointWriteError naming the checkpoint, the file (relative to the checkpoint) and the cause of a failed
    write under `tmp`, or None when `e` is not an I/O failure. Call before removing `tmp`."""
    if isinstance(e, CheckpointWriteError):
        return e
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # not the disk's, whatever they interrupted
        return None
    cause = disk_failure(e, tmp)
    if cause is None:
        return None
    where = cause.filename
    if isinstance(where, str) and os.path.abspath(where).startswith(os.path.abspath(tmp) + os.sep):
        where = os.path.relpath(where, tmp)
    elif isinstance(where, str) and os.path.abspath(where) == os.path.abspath(tmp):
        where = None
    what = cause.strerror or str(cause)
    if cause.errno == errno.EFBIG and "RLIMIT_FSIZE" not in what and _file_size_limit() is not None:
        what += f" (the process's file-size limit, RLIMIT_FSIZE / ulimit -f, is {_file_size_limit()} bytes)"
    elif cause.errno in (errno.ENOSPC, errno.EDQUOT) and "free" not in what and _free_bytes(tmp) is not None:
        what += f" ({_free_bytes(tmp)} bytes free on its file system)"
    return CheckpointWriteError(f"cannot write checkpoint {final}: {f'{where}: ' if where else ''}{what}; the "
                                "partial checkpoint was removed (the earlier checkpoints are intact)")
