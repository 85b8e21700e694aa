"""Writing a checkpoint in the single-file (canonical) format: every file into a temp directory beside its final
name, then published (meta.json last, the atomic rename, keep-last pruning). The sharded format (sharded.py) builds
its meta.json and publishes through the same functions (completion_meta, publish)."""
from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import threading
import time
from typing import Any

import numpy as np
import torch

from megassm.training.checkpoint import disk
from megassm.training.checkpoint.folder import CHECKPOINTS, META, checkpoint_name, prune
from megassm.training.checkpoint.integrity import INTEGRITY_ALGO
from megassm.training.checkpoint.state import unwrap_model

log = logging.getLogger("megassm.checkpoint")

__all__ = ["MODEL", "OPTIM", "save_checkpoint", "PendingCheckpoint", "write_checkpoint", "split_extra",
           "completion_meta", "publish"]

MODEL = "model.pt"
OPTIM = "optim.pt"
_RESERVED = {"model", "optim", "meta"}
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SCALARS = (str, int, float, bool, type(None))


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
            error = disk.write_error(e, self.final, self.tmp)
            self.discard()
            if error is not None and error is not e:
                raise error from e
            raise
        log.debug("checkpoint %s written in %.2fs", self.final, time.time() - self.t0)
        prune(self.run_dir, keep_last, self.final)
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
        error = disk.write_error(e, final, tmp)  # before the removal: it may look at the files and the free space
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
    records = {MODEL: disk.torch_save(_cpu_state_dict(model) if model_state is None else model_state,
                                  os.path.join(tmp, MODEL))}
    if optimizer is not None or optim_state is not None:
        records[OPTIM] = disk.torch_save(optimizer.state_dict() if optim_state is None else optim_state,
                                     os.path.join(tmp, OPTIM))
    scalars, states = split_extra(extra, "save_checkpoint")
    for key, value in states.items():
        records[f"{key}.pt"] = disk.torch_save(value, os.path.join(tmp, f"{key}.pt"))
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
    disk.write_json(meta, os.path.join(tmp, META))
    disk.fsync_dir(tmp)
    root = os.path.dirname(final)
    old = None
    if os.path.exists(final):
        # pid and thread: an async writer (sharded.py) and the main thread never share a name
        old = os.path.join(root, f".old-{os.path.basename(final)}-{os.getpid()}-{threading.get_ident()}")
        os.rename(final, old)
    os.rename(tmp, final)
    disk.fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
