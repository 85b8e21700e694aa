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

The package, by module:
    manager.py         the trainer's checkpoint lifecycle: resume (the newest intact checkpoint, fallback past
                       damaged ones, agreed by every rank), when to save, sync or async, prune, publish across
                       ranks, spike rollbacks, the checkpoint a stop names
    save.py            writing the single-file format (temp directory, publish, keep-last pruning)
    disk.py            the files' writes (fsync'ed, hashed) and what failed (a full disk, a file-size limit)
    load.py            reading either format back, verified (verify_checkpoint), damage and misfit refused
    choose.py          which checkpoint a resume or a reader takes (resolve_resume, checkpoint_to_read)
    folder.py          the checkpoints folder (names, listing, completeness, pruning, leftovers, earlier runs)
    integrity.py       the integrity records (size and sha256 of every file)
    state.py           unwrap_model, the RNG states
    errors.py          the checkpoint errors
    sharded.py         the sharded format (run.checkpoint_format=sharded, DCP, async); sharded_chunks.py what
                       each rank holds as chunks, sharded_load.py loading it into a live model, sharded_read.py
                       reading it in one process

The names other code uses are exported here (`from megassm.training import checkpoint as ckpt`); the sharded
format and the manager are imported from their modules.
"""
from megassm.training.checkpoint.choose import (checkpoint_dir_name, checkpoint_to_read, is_run_dir,
                                                resolve_resume, resume_candidates)
from megassm.training.checkpoint.disk import disk_failure, raise_naming, write_error
from megassm.training.checkpoint.errors import (CheckpointDamagedError, CheckpointError, CheckpointMismatchError,
                                                CheckpointWriteError)
from megassm.training.checkpoint.folder import (CHECKPOINTS, META, check_writable, checkpoint_name, clean_temp_dirs,
                                                find_latest, is_complete, list_checkpoints, marked_complete, prune,
                                                read_meta)
from megassm.training.checkpoint.integrity import file_record, integrity_record, nonfinite_tensors
from megassm.training.checkpoint.load import (load_checkpoint, load_model, read_model_and_optim, read_model_state,
                                              refuse_nonfinite, torch_load, verify_checkpoint)
from megassm.training.checkpoint.save import (MODEL, OPTIM, PendingCheckpoint, completion_meta, publish,
                                              save_checkpoint, split_extra, write_checkpoint)
from megassm.training.checkpoint.state import capture_rng_state, restore_rng_state, unwrap_model

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
    "read_model_state",
    "write_checkpoint",
    "PendingCheckpoint",
    "publish",
    "completion_meta",
    "split_extra",
    "raise_naming",
    "write_error",
    "torch_load",
    "prune",
    "is_run_dir",
    "checkpoint_dir_name",
    "CHECKPOINTS",
    "META",
    "MODEL",
    "OPTIM",
]
