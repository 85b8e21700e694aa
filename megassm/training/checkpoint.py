"""Checkpoints: one directory per step, written atomically, resumed exactly.

Layout:
    RUN_DIR/checkpoints/step_00000100/
        model.pt        plain `model.state_dict()` of the unwrapped model (DDP `.module` and torch.compile
                        `._orig_mod` removed), tensors on CPU: the canonical single-device layout
        optim.pt        `optimizer.state_dict()`
        <key>.pt        one file per non-scalar entry of `extra` (scheduler, data, rng, carried_states, ...)
        meta.json       step, time, the scalar entries of `extra` (consumed_tokens, config_hash, ...), the
                        list of files, and "complete": true. Written last: no meta.json, or "complete" not
                        true, means the checkpoint is incomplete and is never resumed from.

A checkpoint is written under `checkpoints/.tmp-step_00000100-<pid>/`, every file fsync'ed, then renamed
to its final name (a rename within one directory is atomic on POSIX file systems) and the parent fsync'ed.
A crash at any point leaves either the previous checkpoints untouched plus a temp directory, or the new
complete checkpoint. Temp directories are ignored by `find_latest` and left on disk for inspection.

    path = save_checkpoint(run_dir, step, model=model, optimizer=opt,
                           extra={"scheduler": sched.state_dict(), "data": data.state_dict(),
                                  "rng": capture_rng_state(), "consumed_tokens": n, "config_hash": h},
                           keep_last=3)
    extra = load_checkpoint(resolve_resume(run_dir, "auto"), model=model, optimizer=opt)
    restore_rng_state(extra["rng"])

Carried recurrent states (BPTT) go in `extra["carried_states"]` like any other state: any structure of
tensors, lists, dicts and tuples is saved as is.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import time
from typing import Any

import numpy as np
import torch

from megassm.config import ConfigError

log = logging.getLogger("megassm.checkpoint")

__all__ = [
    "CheckpointError",
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

CHECKPOINTS = "checkpoints"
META = "meta.json"
MODEL = "model.pt"
OPTIM = "optim.pt"
_RESERVED = {"model", "optim", "meta"}
_NAME_RE = re.compile(r"^step_(\d{8,})$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_SCALARS = (str, int, float, bool, type(None))


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete or unreadable; the message names the path.
    (A ConfigError, so the CLI reports it cleanly: it usually comes from run.resume.)"""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


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


def _torch_save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _torch_load(path: str, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # States written by this program that hold non-tensor objects (e.g. numpy arrays in a data
        # sampler's state). Only load checkpoints you trust: full unpickling can run code.
        log.warning("%s holds objects beyond tensors and plain types; loading it with full unpickling", path)
        return torch.load(path, map_location=map_location, weights_only=False)


def _cpu_state_dict(model: torch.nn.Module) -> dict:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
            for k, v in unwrap_model(model).state_dict().items()}


def read_meta(path: str) -> dict | None:
    """meta.json of a checkpoint directory, or None when absent or unreadable."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def is_complete(path: str) -> bool:
    meta = read_meta(path)
    if meta is None or meta.get("complete") is not True:
        return False
    return all(os.path.isfile(os.path.join(path, f)) for f in meta.get("files", []))


def list_checkpoints(run_dir: str, complete_only: bool = True) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint directories under run_dir/checkpoints, oldest first. Temp
    directories (names starting with '.') are never listed."""
    root = os.path.join(run_dir, CHECKPOINTS)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _NAME_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path) and (not complete_only or is_complete(path)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def find_latest(run_dir: str) -> str | None:
    """The newest (highest step) complete checkpoint under run_dir/checkpoints, or None."""
    cks = list_checkpoints(run_dir)
    return cks[-1][1] if cks else None


def _prune(run_dir: str, keep_last: int, protect: str) -> None:
    if keep_last <= 0:
        return
    complete = list_checkpoints(run_dir)
    keep = {p for _, p in complete[-keep_last:]} | {protect}
    for _, path in complete:
        if path not in keep:
            log.info("removing old checkpoint %s (run.keep_last=%d)", path, keep_last)
            shutil.rmtree(path, ignore_errors=True)


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
    """Write run_dir/checkpoints/step_XXXXXXXX atomically and return its path.

    `extra`: scalar values (str, int, float, bool, None) go into meta.json; every other value is saved as
    `<key>.pt` (keys: letters, digits, '_', '.', '-'; not model/optim/meta). `keep_last` > 0 then removes
    the oldest complete checkpoints beyond that many, never the one just written; 0 keeps all.
    A checkpoint of the same step that already exists is replaced.
    Call on one rank only (rank 0); the model must hold full (unsharded) tensors, or pass `model_state` /
    `optim_state`: already gathered canonical states (tensor parallelism: megassm.parallel.tp), written
    instead of `model.state_dict()` / `optimizer.state_dict()`.
    """
    run_dir = os.fspath(run_dir)
    extra = dict(extra or {})
    root = os.path.join(run_dir, CHECKPOINTS)
    os.makedirs(root, exist_ok=True)
    name = checkpoint_name(step)
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".tmp-{name}-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)

    t0 = time.time()
    files = [MODEL]
    _torch_save(_cpu_state_dict(model) if model_state is None else model_state, os.path.join(tmp, MODEL))
    if optimizer is not None or optim_state is not None:
        _torch_save(optimizer.state_dict() if optim_state is None else optim_state, os.path.join(tmp, OPTIM))
        files.append(OPTIM)
    scalars, extra_files = {}, []
    for key, value in extra.items():
        if key in ("step", "time", "complete", "files", "extra_files") or key in _RESERVED:
            raise ValueError(f"save_checkpoint: extra key '{key}' is reserved")
        if isinstance(value, np.generic) and np.ndim(value) == 0:
            value = value.item()  # numpy scalars: plain numbers in meta.json
        if isinstance(value, _SCALARS):
            scalars[key] = value
            continue
        if not _KEY_RE.match(key):
            raise ValueError(f"save_checkpoint: extra key '{key}' cannot name a file")
        _torch_save(value, os.path.join(tmp, f"{key}.pt"))
        files.append(f"{key}.pt")
        extra_files.append(key)
    meta = {
        **scalars,
        "step": int(step),
        "time": time.time(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "files": files,
        "extra_files": extra_files,
        "complete": True,
    }
    _write_json(meta, os.path.join(tmp, META))  # the completion marker: last
    _fsync_dir(tmp)

    old = None
    if os.path.exists(final):
        old = os.path.join(root, f".old-{name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    log.debug("checkpoint %s written in %.2fs", final, time.time() - t0)
    _prune(run_dir, keep_last, final)
    return final


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    map_location: Any = "cpu",
    strict: bool = True,
) -> dict[str, Any]:
    """Load a complete checkpoint into `model` (unwrapped, strict by default) and `optimizer`, and return
    meta.json's fields (step, consumed_tokens, config_hash, time, ...) plus every extra state, by key.
    Values are restored bit for bit. Raises CheckpointError naming the path when it is not a complete
    checkpoint."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no meta.json with \"complete\": true, or a "
                              "file it lists is missing); it was probably interrupted while being written")
    meta = read_meta(path)
    if meta.get("format", "canonical") == "sharded":  # DCP chunks (training/sharded.py): read whole, here
        from megassm.training.sharded import read_canonical

        if model is not None or optimizer is not None:
            state, optim_state = read_canonical(path, optim=optimizer is not None)
            if model is not None:
                unwrap_model(model).load_state_dict(state, strict=strict)
            if optimizer is not None:
                if optim_state is None:
                    raise CheckpointError(f"checkpoint {path} has no optimizer state")
                optimizer.load_state_dict(optim_state)
        model = optimizer = None
    if model is not None:
        state = _torch_load(os.path.join(path, MODEL), map_location)
        unwrap_model(model).load_state_dict(state, strict=strict)
    if optimizer is not None:
        if OPTIM not in meta["files"]:
            raise CheckpointError(f"checkpoint {path} has no optimizer state ({OPTIM})")
        optimizer.load_state_dict(_torch_load(os.path.join(path, OPTIM), map_location))
    out = dict(meta)
    for key in meta.get("extra_files", []):
        out[key] = _torch_load(os.path.join(path, f"{key}.pt"), map_location)
    return out


def read_model_and_optim(path: str | os.PathLike, map_location: Any = "cpu") -> tuple[dict, dict | None]:
    """The canonical model state dict and optimizer state dict (None when absent) of a complete checkpoint,
    for callers that load them into a sharded model themselves (megassm.parallel.tp). A sharded checkpoint
    (run.checkpoint_format=sharded) is assembled from its chunks in this process."""
    path = os.fspath(path)
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete or missing")
    meta = read_meta(path)
    if meta.get("format", "canonical") == "sharded":  # training/sharded.py: the chunks assembled in this process
        from megassm.training.sharded import read_canonical

        return read_canonical(path)
    model_state = _torch_load(os.path.join(path, MODEL), map_location)
    optim_state = _torch_load(os.path.join(path, OPTIM), map_location) if OPTIM in meta["files"] else None
    return model_state, optim_state


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
