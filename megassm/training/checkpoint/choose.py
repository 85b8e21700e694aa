"""Choosing the checkpoint to read: the newest that is complete and verifies, older ones standing in for damaged
ones where a run directory (not a named checkpoint) was given. The trainer's run.resume (manager.py) and every
reader of checkpoints (export, model.init_from, generate, eval, convert: checkpoint_to_read) follow these rules."""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

from megassm.training.checkpoint.errors import CheckpointDamagedError, CheckpointError
from megassm.training.checkpoint.folder import (CHECKPOINTS, META, find_latest, is_complete, marked_complete,
                                                newest_first, read_meta)
from megassm.training.checkpoint.load import model_files, verify_checkpoint

log = logging.getLogger("megassm.checkpoint")

__all__ = ["resume_candidates", "is_run_dir", "checkpoint_to_read", "checkpoint_dir_name", "resolve_resume"]


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
        return newest_first(os.fspath(run_dir)), True
    path = os.path.abspath(os.path.expanduser(os.fspath(resume)))
    if not os.path.exists(path):
        raise CheckpointError(f"{who}: checkpoint {path} does not exist")
    if is_run_dir(path):
        found = newest_first(path)
        if not found:
            raise CheckpointError(f"{who}: run directory {path} has no checkpoint")
        return found, True
    return [path], False


def is_run_dir(path: str) -> bool:
    """A run directory (checkpoints/ inside), not a checkpoint (meta.json)."""
    return os.path.isdir(os.path.join(path, CHECKPOINTS)) and not os.path.exists(os.path.join(path, META))


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
        problems = verify_checkpoint(ck, relpaths=model_files(ck) if model_only else None)
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
