"""Reading a checkpoint of either format back: verified against its integrity record, unreadable files and
non-finite values refused (CheckpointDamagedError), shapes checked against the model (CheckpointMismatchError).
A sharded checkpoint is assembled in this process through sharded_read.py."""
from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import torch

from megassm.training.checkpoint.errors import CheckpointDamagedError, CheckpointError, CheckpointMismatchError
from megassm.training.checkpoint.folder import META, marked_complete, read_meta
from megassm.training.checkpoint.integrity import INTEGRITY_ALGO, check_file, nonfinite_tensors
from megassm.training.checkpoint.save import MODEL, OPTIM
from megassm.training.checkpoint.sharded_read import read_canonical
from megassm.training.checkpoint.state import unwrap_model
from megassm.training.failures import one_line

log = logging.getLogger("megassm.checkpoint")

__all__ = ["verify_checkpoint", "refuse_nonfinite", "torch_load", "load_checkpoint", "read_model_and_optim",
           "read_model_state", "load_model", "model_files"]

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


def torch_load(path: str, map_location: Any) -> Any:
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
        out[key] = torch_load(os.path.join(path, f"{key}.pt"), map_location)
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
        problems = verify_checkpoint(path, relpaths=model_files(path))
        if problems:
            raise CheckpointDamagedError(f"checkpoint {path} is damaged: {'; '.join(problems)}")
    state = _read_states(path, meta, map_location, True, False)[0]
    target = unwrap_model(model)
    _refuse_shapes(path, target.state_dict(), state)
    target.load_state_dict(state, strict=True)
    return dict(meta)


def _read_states(path: str, meta: dict, map_location: Any, model: bool, optim: bool) -> tuple[dict | None, dict | None]:
    """(model state, optimizer state) as asked for, None where not asked for or (optimizer) absent; a sharded
    checkpoint's chunks are assembled in this process (sharded_read.py). Non-finite values are refused."""
    if meta.get("format", "canonical") == "sharded":
        model_state, optim_state = read_canonical(path, optim=optim) if model or optim else (None, None)
        model_rel = optim_rel = "the sharded chunks"
    else:
        model_state = torch_load(os.path.join(path, MODEL), map_location) if model else None
        optim_state = torch_load(os.path.join(path, OPTIM), map_location) if optim and OPTIM in meta["files"] else None
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


def model_files(path: str) -> list[str] | None:
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
