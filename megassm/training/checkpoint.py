"""Checkpoints: one directory per step, written atomically, resumed exactly.

Layout:
    RUN_DIR/checkpoints/step_00000100/
        model.pt        plain `model.state_dict()` of the unwrapped model (DDP `.module` and torch.compile
                        `._orig_mod` removed), tensors on CPU: the canonical single-device layout
        optim.pt        `optimizer.state_dict()`
        <key>.pt        one file per non-scalar entry of `extra` (scheduler, data, rng, carried_states, ...)
        meta.json       step, time, the scalar entries of `extra` (consumed_tokens, config_hash, ...), the
                        list of files, the integrity record, and "complete": true. Written last: no meta.json,
                        or "complete" not true, means the checkpoint is incomplete and is never resumed from.

A checkpoint is written under `checkpoints/.tmp-step_00000100-<pid>/`, every file fsync'ed, then renamed
to its final name (a rename within one directory is atomic on POSIX file systems) and the parent fsync'ed.
A crash at any point leaves either the previous checkpoints untouched plus a temp directory, or the new
complete checkpoint. Temp directories are ignored by `find_latest`; a save that fails (a full disk, a file-size
limit: `disk_failure` finds the cause behind torch's RuntimeError) removes its own and raises CheckpointWriteError
naming the file and the cause, and `clean_temp_dirs` removes those of killed processes when the next trainer starts.

Integrity: meta.json's "integrity" maps every file (a path relative to the checkpoint, '/' allowed for
formats that write subfolders) to its size and sha256, hashed while it is written. `verify_checkpoint`
compares them with the files on disk; the loaders also refuse unreadable files and non-finite model or
optimizer tensors (CheckpointDamagedError), so a damaged checkpoint is never trained from. Checkpoints
written before the record existed still load (with one warning that they cannot be verified). Every command that
reads a checkpoint (export, model.init_from, generate, eval, convert) picks and verifies it with
`checkpoint_to_read`, by the rules of run.resume: a named checkpoint must verify, a run directory gives its newest
checkpoint that does.

    path = save_checkpoint(run_dir, step, model=model, optimizer=opt,
                           extra={"scheduler": sched.state_dict(), "data": data.state_dict(),
                                  "rng": capture_rng_state(), "consumed_tokens": n, "config_hash": h},
                           keep_last=3)
    extra = load_checkpoint(resolve_resume(run_dir, "auto"), model=model, optimizer=opt)
    restore_rng_state(extra["rng"])

Carried recurrent states (BPTT) go in `extra["carried_states"]` like any other state: any structure of
tensors, lists, dicts and tuples is saved as is.

The checkpoints folder itself (names, listing, completeness, pruning, leftovers of interrupted saves) is
checkpoint_dir.py; its names are re-exported here, as are the errors (checkpoint_errors.py). A sharded checkpoint
is read through sharded_read.py (below sharded.py, which builds on this module).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from megassm.training.checkpoint_dir import (CHECKPOINTS, META, _newest_first, _prune, check_writable,
                                             checkpoint_name, clean_temp_dirs, find_latest, is_complete,
                                             list_checkpoints, marked_complete, read_meta)
from megassm.training.checkpoint_errors import (CheckpointDamagedError, CheckpointError, CheckpointMismatchError,
                                               CheckpointWriteError)
from megassm.training.failures import one_line
from megassm.training.integrity import (INTEGRITY_ALGO, HashingWriter, check_file, file_record,
                                        integrity_record, nonfinite_tensors)
from megassm.training.sharded_read import read_canonical

log = logging.getLogger("megassm.checkpoint")

__all__ = [
    "CheckpointError",
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "file_record",
    "integrity_record",
    "verify_checkpoint",
    "nonfinite_tensors",
    "refuse_nonfinite",
    "resume_candidates",
    "checkpoint_to_read",
    "load_model",
    "disk_failure",
    "clean_temp_dirs",
    "check_writable",
    "marked_complete",
    "save_checkpoint",
    "load_checkpoint",
    "find_latest",
    "list_checkpoints",
    "resolve_resume",
    "is_complete",
    "read_meta",
    "checkpoint_name",
    "capture_rng_state",
    "restore_rng_state",
    "unwrap_model",
    "read_model_and_optim",
]

MODEL = "model.pt"
OPTIM = "optim.pt"
_RESERVED = {"model", "optim", "meta"}
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SCALARS = (str, int, float, bool, type(None))


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The single-device module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or (
            type(model).__name__ in ("DistributedDataParallel", "DataParallel") and hasattr(model, "module")
        ):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
    return model


# ----------------------------------------------------------------------------------------------------
# RNG
# ----------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Python `random`, numpy's global RNG, torch CPU, and torch CUDA of the current device (None without
    CUDA). Only plain types and tensors, so the file loads with torch.load(weights_only=True)."""
    version, internal, gauss = random.getstate()
    npst = np.random.get_state(legacy=False)
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "bit_generator": npst["bit_generator"],
            "key": torch.from_numpy(npst["state"]["key"].astype(np.int64)),
            "pos": int(npst["state"]["pos"]),
            "has_gauss": int(npst["has_gauss"]),
            "gauss": float(npst["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": None,
        "cuda_device": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        state["torch_cuda"] = torch.cuda.get_rng_state(dev)
        state["cuda_device"] = dev
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of capture_rng_state. The CUDA state goes to the current device (each process owns one);
    a checkpoint saved with CUDA and restored without it (or the reverse) restores the rest and warns."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({
        "bit_generator": n["bit_generator"],
        "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
        "has_gauss": int(n["has_gauss"]),
        "gauss": float(n["gauss"]),
    })
    torch.set_rng_state(state["torch_cpu"])
    cuda = state.get("torch_cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(cuda, torch.cuda.current_device())
        else:
            log.warning("checkpoint has a CUDA RNG state but CUDA is not available; not restored")
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        log.warning("checkpoint has no CUDA RNG state (saved without CUDA); the CUDA RNG is not restored")


# ----------------------------------------------------------------------------------------------------
# Integrity (the records themselves: integrity.py)
# ----------------------------------------------------------------------------------------------------

_warned_unverifiable: set = set()


def verify_checkpoint(path: str | os.PathLike, relpaths=None) -> list[str]:
    """The problems of a checkpoint directory in words ("model.pt: expected 1234 bytes sha256 ab12..,
    found 1200 bytes"); an empty list means intact. `relpaths`: only these files (a rank verifying its own
    shards); None: every file of the record, and every file meta.json lists must have one. A checkpoint
    written before integrity records existed cannot be verified: it passes, with one warning."""
    path = os.fspath(path)
    meta = read_meta(path)
    if meta is None:
        return [f"{META}: missing or unreadable"]
    if meta.get("complete") is not True:
        return [f"{META}: not marked complete (the save was interrupted)"]
    listed = [f for f in meta.get("files", []) if isinstance(f, str)]
    integrity = meta.get("integrity")
    if not isinstance(integrity, dict):
        if path not in _warned_unverifiable:
            _warned_unverifiable.add(path)
            log.warning("checkpoint %s has no integrity record (written by an older megassm): its files cannot "
                        "be verified; loading it unverified", path)
        wanted = listed if relpaths is None else list(relpaths)
        return [f"{rel}: listed in {META}, found no file" for rel in wanted if not os.path.isfile(os.path.join(path, rel))]
    if integrity.get("algo") != INTEGRITY_ALGO or not isinstance(integrity.get("files"), dict):
        return [f"{META}: unknown integrity record (algo {integrity.get('algo')!r}; this megassm reads {INTEGRITY_ALGO})"]
    records = integrity["files"]
    problems = []
    if relpaths is None:
        problems += [f"{rel}: listed in {META} without an integrity record" for rel in listed if rel not in records]
        relpaths = sorted(records)
    for rel in relpaths:
        rec = records.get(rel)
        problem = f"{rel}: no integrity record in {META}" if not isinstance(rec, dict) else check_file(path, rel, rec)
        if problem:
            problems.append(problem)
    return problems


def refuse_nonfinite(ckpt_dir: str, rel: str, state: Any) -> None:
    bad = nonfinite_tensors(state)
    if bad:
        more = f" and {len(bad) - 3} more tensors" if len(bad) > 3 else ""
        raise CheckpointDamagedError(f"checkpoint {ckpt_dir}: {rel}: non-finite values in {', '.join(bad[:3])}{more}")


# ----------------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
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


def _torch_save(obj: Any, path: str) -> dict:
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


def _write_json(obj: dict, path: str) -> None:
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


def _torch_load(path: str, map_location: Any) -> Any:
    """torch.load, or CheckpointDamagedError naming the file when its bytes cannot be read back."""
    try:
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            # States written by this program that hold non-tensor objects (e.g. numpy arrays in a data
            # sampler's state). Only load checkpoints you trust: full unpickling can run code.
            log.warning("%s holds objects beyond tensors and plain types; loading it with full unpickling", path)
            return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated or overwritten zip archives fail in many ways
        ckpt_dir, rel = os.path.split(path)
        raise CheckpointDamagedError(f"checkpoint {ckpt_dir}: {rel}: unreadable ({type(e).__name__}: "
                                     f"{one_line(e)})") from None


def _cpu_state_dict(model: torch.nn.Module) -> dict:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, v in unwrap_model(model).state_dict().items()}


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None = None,
    keep_last: int = 0,
    model_state: dict | None = None,
    optim_state: dict | None = None,
) -> str:
    """Write run_dir/checkpoints/step_XXXXXXXX atomically and return its path: write_checkpoint, then publish.

    `extra`: scalar values (str, int, float, bool, None) go into meta.json; every other value is saved as
    `<key>.pt` (keys: letters, digits, '_', '.', '-'; not model/optim/meta). `keep_last` > 0 then removes
    the oldest complete checkpoints beyond that many, never the one just written; 0 keeps all.
    A checkpoint of the same step that already exists is replaced.
    Call on one rank only (rank 0); the model must hold full (unsharded) tensors, or pass `model_state` /
    `optim_state`: already gathered canonical states (tensor parallelism: megassm.parallel.tp), written
    instead of `model.state_dict()` / `optimizer.state_dict()`.
    Every file is hashed while it is written (meta.json's "integrity"). A failed write (full disk, file-size limit,
    unwritable directory; torch's RuntimeError around them too: disk_failure) removes the temp directory and raises
    CheckpointWriteError naming the checkpoint, the file and the cause.
    """
    return write_checkpoint(run_dir, step, model=model, optimizer=optimizer, extra=extra,
                            model_state=model_state, optim_state=optim_state).publish(keep_last)


class PendingCheckpoint:
    """A checkpoint written to its temp directory and not yet visible: `publish()` makes it complete (meta.json,
    the atomic rename, pruning), `discard()` removes it. A multi-rank save publishes only after every rank has
    confirmed its step, so a step whose collectives failed on some rank never becomes a checkpoint."""

    def __init__(self, run_dir: str, tmp: str, final: str, meta: dict, t0: float):
        self.run_dir, self.tmp, self.final, self.meta, self.t0 = run_dir, tmp, final, meta, t0

    def publish(self, keep_last: int = 0) -> str:
        try:
            publish(self.tmp, self.final, self.meta)
        except BaseException as e:
            error = write_error(e, self.final, self.tmp)
            self.discard()
            if error is not None and error is not e:
                raise error from e
            raise
        log.debug("checkpoint %s written in %.2fs", self.final, time.time() - self.t0)
        _prune(self.run_dir, keep_last, self.final)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None = None,
    model_state: dict | None = None,
    optim_state: dict | None = None,
) -> PendingCheckpoint:
    """Every file of the checkpoint of `step` in a temp directory beside its final name (save_checkpoint's
    arguments); nothing is visible until the returned PendingCheckpoint is published. A failed write (disk_failure)
    removes the temp directory and raises CheckpointWriteError naming the checkpoint, the file and the cause."""
    run_dir = os.fspath(run_dir)
    extra = dict(extra or {})
    root = os.path.join(run_dir, CHECKPOINTS)
    name = checkpoint_name(step)
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    t0 = time.time()
    try:
        meta = _write_temp_checkpoint(tmp, step, model, optimizer, extra, model_state, optim_state)
    except BaseException as e:
        error = write_error(e, final, tmp)  # before the removal: it may look at the files and the free space
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save leaves nothing half-written (a full disk stays full)
        if error is not None and error is not e:
            raise error from e
        raise
    return PendingCheckpoint(run_dir, tmp, final, meta, t0)


def _write_temp_checkpoint(tmp: str, step: int, model, optimizer, extra: dict, model_state, optim_state) -> dict:
    """Every file of the checkpoint in `tmp`; returns its meta.json (written by `publish`)."""
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    records = {MODEL: _torch_save(_cpu_state_dict(model) if model_state is None else model_state,
                                  os.path.join(tmp, MODEL))}
    if optimizer is not None or optim_state is not None:
        records[OPTIM] = _torch_save(optimizer.state_dict() if optim_state is None else optim_state,
                                     os.path.join(tmp, OPTIM))
    scalars, states = split_extra(extra, "save_checkpoint")
    for key, value in states.items():
        records[f"{key}.pt"] = _torch_save(value, os.path.join(tmp, f"{key}.pt"))
    return completion_meta(step, scalars, records, list(states))


# meta.json's own keys: an extra state may not take them
_META_KEYS = ("step", "time", "time_utc", "host", "torch", "complete", "files", "extra_files", "integrity", "format")


def split_extra(extra: dict | None, who: str) -> tuple[dict, dict]:
    """A checkpoint's extra states split into meta.json's scalars (str, int, float, bool, None; numpy scalars
    as plain numbers) and {key: value} saved as `<key>.pt`. Raises ValueError, naming `who`, for a reserved
    key or one that cannot name a file."""
    scalars, states = {}, {}
    for key, value in (extra or {}).items():
        if key in _META_KEYS or key in _RESERVED:
            raise ValueError(f"{who}: extra key '{key}' is reserved")
        if isinstance(value, np.generic) and np.ndim(value) == 0:
            value = value.item()
        if isinstance(value, _SCALARS):
            scalars[key] = value
        elif not _KEY_RE.match(key):
            raise ValueError(f"{who}: extra key '{key}' cannot name a file")
        else:
            states[key] = value
    return scalars, states


def completion_meta(step: int, scalars: dict, records: dict, extra_files: list, **more) -> dict:
    """meta.json of a finished checkpoint: the extra scalars, where and when it was written, its files with
    their integrity records (relative path -> {"bytes", "sha256"}), `more` (e.g. the format) and the
    completion marker."""
    return {
        **scalars,
        "step": int(step),
        "time": time.time(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        **more,
        "files": list(records),
        "extra_files": list(extra_files),
        "integrity": {"algo": INTEGRITY_ALGO, "files": {k: v for k, v in records.items() if v is not None}},
        "complete": True,
    }


def publish(tmp: str, final: str, meta: dict) -> None:
    """meta.json last (the completion marker), then the atomic rename of the temp directory to its final name
    (a checkpoint of the same name is replaced; the old one is moved aside first and removed after)."""
    _write_json(meta, os.path.join(tmp, META))
    _fsync_dir(tmp)
    root = os.path.dirname(final)
    old = None
    if os.path.exists(final):
        # pid and thread: an async writer (sharded.py) and the main thread never share a name
        old = os.path.join(root, f".old-{os.path.basename(final)}-{os.getpid()}-{threading.get_ident()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: Any = "cpu",
    strict: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a complete checkpoint into `model` (unwrapped, strict by default) and `optimizer`, and return
    meta.json's fields (step, consumed_tokens, config_hash, time, ...) plus every extra state, by key.
    Values are restored bit for bit. Raises CheckpointError naming the path when it is not a complete
    checkpoint, CheckpointDamagedError when it fails verification (`verify`; callers that verified already
    pass False), a file cannot be read or the model / optimizer state holds non-finite values (checked
    before anything is loaded), and CheckpointMismatchError when it does not fit the model or optimizer."""
    path = os.fspath(path)
    meta = _complete_meta(path)
    if verify:
        _refuse_damaged(path)
    model_state, optim_state = _read_states(path, meta, map_location, model is not None, optimizer is not None)
    if optimizer is not None and optim_state is None:
        raise CheckpointError(f"checkpoint {path} has no optimizer state ({OPTIM})")
    out = dict(meta)
    for key in meta.get("extra_files", []):
        out[key] = _torch_load(os.path.join(path, f"{key}.pt"), map_location)
    if model is not None:
        target = unwrap_model(model)
        if strict:
            _refuse_shapes(path, target.state_dict(), model_state)
        try:
            target.load_state_dict(model_state, strict=strict)
        except RuntimeError as e:  # shapes under strict=False; torch's message spans a line per tensor
            lines = str(e).splitlines()
            raise CheckpointMismatchError(f"checkpoint {path}: {MODEL} does not fit the model: "
                                          f"{one_line(chr(10).join(lines[1:]) or str(e))}") from None
    if optimizer is not None:
        try:
            optimizer.load_state_dict(optim_state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointMismatchError(f"checkpoint {path}: {OPTIM} does not fit this optimizer: {one_line(e)}") from None
    return out


def read_model_and_optim(path: str | os.PathLike, map_location: Any = "cpu", verify: bool = False,
                         ) -> tuple[dict, dict | None]:
    """The canonical model state dict and optimizer state dict (None when absent) of a complete checkpoint,
    for callers that load them into a sharded model themselves (megassm.parallel.tp). A sharded checkpoint
    (run.checkpoint_format=sharded) is assembled from its chunks in this process. Unreadable files and
    non-finite values raise CheckpointDamagedError; `verify` also checks the integrity record first."""
    path = os.fspath(path)
    meta = _complete_meta(path)
    if verify:
        _refuse_damaged(path)
    return _read_states(path, meta, map_location, True, True)


def read_model_state(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """The canonical model state dict of a complete checkpoint, either format, without its optimizer state."""
    path = os.fspath(path)
    return _read_states(path, _complete_meta(path), map_location, True, False)[0]


def load_model(path: str | os.PathLike, model: torch.nn.Module, map_location: Any = "cpu", verify: bool = True) -> dict:
    """Only the weights of a complete checkpoint (either format) into `model` (strict, shapes checked), for readers
    of the weights (generate, eval); returns meta.json. `verify`: check the weights' files against the integrity
    record first (callers that picked the checkpoint with checkpoint_to_read pass False)."""
    path = os.fspath(path)
    meta = _complete_meta(path)
    if verify:
        problems = verify_checkpoint(path, relpaths=_model_files(path))
        if problems:
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    state = _read_states(path, meta, map_location, True, False)[0]
    target = unwrap_model(model)
    _refuse_shapes(path, target.state_dict(), state)
    target.load_state_dict(state, strict=True)
    return dict(meta)


def _read_states(path: str, meta: dict, map_location: Any, model: bool, optim: bool) -> tuple[dict | None, dict | None]:
    """(model state, optimizer state) as asked for, None where not asked for or (optimizer) absent; a sharded
    checkpoint's chunks are assembled in this process (training/sharded_read.py). Non-finite values are refused."""
    if meta.get("format", "canonical") == "sharded":
        model_state, optim_state = read_canonical(path, optim=optim) if model or optim else (None, None)
        model_rel = optim_rel = "the sharded chunks"
    else:
        model_state = _torch_load(os.path.join(path, MODEL), map_location) if model else None
        optim_state = _torch_load(os.path.join(path, OPTIM), map_location) if optim and OPTIM in meta["files"] else None
        model_rel, optim_rel = MODEL, OPTIM
    model_state = model_state if model else None  # read_canonical assembles the model state either way
    if model_state is not None:
        refuse_nonfinite(path, model_rel, model_state)
    if optim_state is not None:
        refuse_nonfinite(path, optim_rel, optim_state)
    return model_state, optim_state


def _complete_meta(path: str) -> dict:
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    meta = read_meta(path)
    if not marked_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no meta.json with \"complete\": true); it was "
                              "probably interrupted while being written")
    missing = [f for f in meta.get("files", []) if not os.path.isfile(os.path.join(path, f))]
    if missing:  # the save completed: files lost since are damage, not an interrupted save
        raise CheckpointDamagedError(f"checkpoint {path} is incomplete or damaged: " + "; ".join(
            f"{f}: listed in {META}, found no file" for f in missing))
    return meta


def _refuse_damaged(path: str) -> None:
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointDamagedError(f"checkpoint {path} is damaged: {'; '.join(problems)}")


def _refuse_shapes(path: str, expected: dict, found: dict) -> None:
    """CheckpointMismatchError naming the first tensors whose names or shapes differ from the model's."""
    diffs = [f"'{k}' is {list(found[k].shape)} in the checkpoint, {list(v.shape)} in the model"
             for k, v in expected.items() if k in found and isinstance(v, torch.Tensor)
             and isinstance(found[k], torch.Tensor) and found[k].shape != v.shape]
    diffs += [f"'{k}' is missing from the checkpoint" for k in expected if k not in found]
    diffs += [f"'{k}' is not in the model" for k in found if k not in expected]
    if diffs:
        more = f" (and {len(diffs) - 2} more differences)" if len(diffs) > 2 else ""
        raise CheckpointMismatchError(f"checkpoint {path}: {MODEL} does not fit the model: {'; '.join(diffs[:2])}{more}")


def resume_candidates(run_dir: str | os.PathLike, resume: str | None, who: str = "run.resume",
                      ) -> tuple[list[str], bool]:
    """(checkpoints to try, preferred first; whether an older one may stand in for a damaged one).

    "none": nothing. "auto": every step_ directory under run_dir/checkpoints, newest first, complete or not
    (the caller reports each one it skips). A run directory: its checkpoints likewise. A checkpoint
    directory: just it, with no stand-in. A path that does not exist raises CheckpointError, its message
    starting with `who`."""
    if resume is None or str(resume).strip().lower() in ("", "none"):
        return [], False
    if str(resume).strip().lower() == "auto":
        return _newest_first(os.fspath(run_dir)), True
    path = os.path.abspath(os.path.expanduser(os.fspath(resume)))
    if not os.path.exists(path):
        raise CheckpointError(f"{who}: checkpoint {path} does not exist")
    if is_run_dir(path):
        found = _newest_first(path)
        if not found:
            raise CheckpointError(f"{who}: run directory {path} has no checkpoint")
        return found, True
    return [path], False


def is_run_dir(path: str) -> bool:
    """A run directory (checkpoints/ inside), not a checkpoint (meta.json)."""
    return os.path.isdir(os.path.join(path, CHECKPOINTS)) and not os.path.exists(os.path.join(path, META))


def _model_files(path: str) -> list[str] | None:
    """The files a reader of the weights needs: all but optim.pt and the extra states (a sharded checkpoint's chunks
    mix model and optimizer states: all of them). None when meta.json is unreadable (verify_checkpoint says so)."""
    meta = read_meta(path)
    if meta is None:
        return None
    integrity = meta.get("integrity")
    files = (integrity.get("files") if isinstance(integrity, dict) else None) or meta.get("files", [])
    if not isinstance(files, (dict, list)):
        return None
    skip = {OPTIM} | {f"{k}.pt" for k in meta.get("extra_files", []) if isinstance(k, str)}
    return [f for f in files if isinstance(f, str) and f not in skip]


def checkpoint_to_read(path: str | os.PathLike, who: str, *, expect: str | None = None, model_only: bool = False,
                       load: Callable[[str], Any] | None = None) -> tuple[str, Any]:
    """(the checkpoint a command reads, what `load` read from it): how every reader of checkpoints picks and
    verifies one (megassm-export, model.init_from, megassm-generate, megassm-eval, megassm-checkpoint convert),
    the same way the trainer's run.resume does (docs/reliability.md).

    `path`, a checkpoint directory: it must be complete and verify; it has no stand-in. A run directory
    (checkpoints/ inside): its checkpoints newest first, the first that is complete and verifies is taken; each one
    skipped is named with its problem in a warning. `expect`: "checkpoint" or "run" refuses the other kind (None
    takes both). `model_only`: verify only the files a reader of the weights needs (not optim.pt, not the extra
    states). `load(checkpoint)`: reads what the caller needs once the checkpoint verified; a CheckpointDamagedError
    from it (a file torch cannot read, NaN / inf values) counts as damage like a failed verification.

    Raises CheckpointError (exit 2) for a path that does not exist or is neither a checkpoint nor a run directory, a
    named checkpoint that is incomplete (its save was interrupted) and a run directory without a complete checkpoint;
    CheckpointDamagedError (exit 6, EXIT_NO_CHECKPOINT) when the named checkpoint, or every complete one of the run,
    is damaged. Messages start with `who` and name each checkpoint, file, and what was expected and found."""
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isdir(full):
        raise CheckpointError(f"{who}: {full} does not exist or is not a directory")
    run = is_run_dir(full)
    if expect == "checkpoint" and run:
        raise CheckpointError(f"{who}: {full} is a run directory, not a checkpoint (step_XXXXXXXX)")
    if expect == "run" and not run:
        raise CheckpointError(f"{who}: {full} is not a run directory (no {CHECKPOINTS}/ inside)")
    if not run and not os.path.exists(os.path.join(full, META)) and not checkpoint_dir_name(full):
        raise CheckpointError(f"{who}: {full} is not a checkpoint (no {META}) nor a run directory (no {CHECKPOINTS}/)")
    candidates, fallback = resume_candidates(None, full, who)
    skipped, damaged = [], []
    for ck in candidates:
        if not marked_complete(ck) and not (os.path.exists(os.path.join(ck, META)) and read_meta(ck) is None):
            if not fallback:
                raise CheckpointError(f"{who}: checkpoint {ck} is incomplete (no {META} with \"complete\": true): its "
                                      "save was interrupted")
            log.warning("%s: skipping checkpoint %s: incomplete (interrupted while being written)", who, ck)
            skipped.append(ck)
            continue
        problems = verify_checkpoint(ck, relpaths=_model_files(ck) if model_only else None)
        result = None
        if not problems and load is not None:
            try:
                result = load(ck)
            except CheckpointDamagedError as e:
                problems = [str(e)]
        if not problems:
            if skipped:
                log.warning("%s: reading %s, the newest intact checkpoint of %s; skipped: %s", who, ck, full,
                            ", ".join(skipped))
            return ck, result
        if not fallback:
            raise CheckpointDamagedError(f"{who}: checkpoint {ck} is damaged: {'; '.join(problems)}. A checkpoint "
                                         "named by path has no stand-in: restore it, or name another (a run directory "
                                         "takes its newest intact one)")
        log.warning("%s: checkpoint %s is damaged and is skipped: %s", who, ck, "; ".join(problems))
        damaged.append(f"{os.path.basename(ck)}: {'; '.join(problems)}")
        skipped.append(ck)
    if damaged:
        raise CheckpointDamagedError(f"{who}: run directory {full} has no intact checkpoint: {' | '.join(damaged)}")
    raise CheckpointError(f"{who}: run directory {full} has no complete checkpoint"
                          + (f" (skipped, incomplete: {', '.join(skipped)})" if skipped else ""))


def checkpoint_dir_name(path: str) -> bool:
    """Whether `path` is named like a checkpoint (step_XXXXXXXX), for a directory without its meta.json."""
    return bool(re.match(r"^step_\d{8,}$", os.path.basename(path.rstrip(os.sep))))


def resolve_resume(run_dir: str | os.PathLike, resume: str | None) -> str | None:
    """Which checkpoint to resume from.

    "none" (or empty/None): None, a fresh start. "auto": the newest complete checkpoint in run_dir, or None
    when there is none. Anything else is a path: a checkpoint directory, or a run directory (its newest
    complete checkpoint); a missing or incomplete one raises CheckpointError naming it.
    """
    if resume is None or str(resume).strip().lower() in ("", "none"):
        return None
    run_dir = os.fspath(run_dir)
    if str(resume).strip().lower() == "auto":
        latest = find_latest(run_dir)
        if latest is None:
            log.info("run.resume=auto: no complete checkpoint in %s; starting from scratch",
                     os.path.join(run_dir, CHECKPOINTS))
        return latest
    path = os.path.abspath(os.path.expanduser(os.fspath(resume)))
    if not os.path.exists(path):
        raise CheckpointError(f"run.resume: checkpoint {path} does not exist")
    if os.path.isdir(os.path.join(path, CHECKPOINTS)) and not os.path.exists(os.path.join(path, META)):
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(f"run.resume: run directory {path} has no complete checkpoint")
        return latest
    if not is_complete(path):
        raise CheckpointError(f"run.resume: checkpoint {path} is incomplete (no meta.json with \"complete\": "
                              "true, or a file it lists is missing)")
    return path
