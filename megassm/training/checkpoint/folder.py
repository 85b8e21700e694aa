"""The checkpoints folder of a run (RUN_DIR/checkpoints): the step directories' names, which of them are complete,
listing and pruning them, the leftovers of interrupted saves, and whether the folder takes new files; and whether
a run directory holds an earlier run (earlier_run), which a fresh start refuses or moves aside (move_aside). What a
checkpoint holds, and writing and loading one, is save.py and load.py."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time

from megassm.training.failures import RunIOError, describe_os_error

log = logging.getLogger("megassm.checkpoint")

__all__ = ["CHECKPOINTS", "META", "checkpoint_name", "read_meta", "is_complete", "marked_complete",
           "list_checkpoints", "find_latest", "clean_temp_dirs", "check_writable", "METRICS", "PREVIOUS_PREFIX",
           "earlier_run", "move_aside"]

CHECKPOINTS = "checkpoints"
META = "meta.json"  # the completion marker, written last
_NAME_RE = re.compile(r"^step_(\d{8,})$")
_TEMP_PREFIXES = (".tmp-", ".old-")  # an unfinished save's directory, a replaced checkpoint moved aside
METRICS = "metrics.jsonl"
PREVIOUS_PREFIX = "previous-"  # run.dir/previous-<UTC time>/: an earlier run moved aside by run.overwrite=true


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


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


def prune(run_dir: str, keep_last: int, protect: str) -> None:
    if keep_last <= 0:
        return
    complete = list_checkpoints(run_dir)
    keep = {p for _, p in complete[-keep_last:]} | {protect}
    for _, path in complete:
        if path not in keep:
            log.info("removing old checkpoint %s (run.keep_last=%d)", path, keep_last)
            shutil.rmtree(path, ignore_errors=True)


def marked_complete(path: str | os.PathLike) -> bool:
    """Whether the save of this checkpoint finished (meta.json says "complete": true), whatever happened to its
    files since: a checkpoint that is not was interrupted, one that is but fails verification is damaged."""
    meta = read_meta(os.fspath(path))
    return meta is not None and meta.get("complete") is True


def newest_first(run_dir: str) -> list[str]:
    return [p for _, p in reversed(list_checkpoints(run_dir, complete_only=False))]


def clean_temp_dirs(run_dir: str | os.PathLike) -> list[str]:
    """Remove what interrupted saves left under run_dir/checkpoints: `.tmp-*` directories (never complete),
    and `.old-*` ones (a replaced checkpoint, restored to its name when the kill came before its successor's
    rename). Call only while holding the run directory (no save in flight). Returns what was done, in words."""
    root = os.path.join(os.fspath(run_dir), CHECKPOINTS)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    done = []
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(_TEMP_PREFIXES):
            continue
        m = re.match(r"^\.old-(step_\d{8,})-\d+(?:-\d+)?$", name)  # pid, and the writer thread: publish()
        if m and not os.path.exists(os.path.join(root, m.group(1))) and is_complete(path):
            os.rename(path, os.path.join(root, m.group(1)))
            done.append(f"restored {m.group(1)} from {name}, left by a save killed while replacing it")
            continue
        size = _tree_bytes(path)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        done.append(f"removed {name} ({size / 2**20:.1f} MiB), left by an interrupted save")
    return done


def _tree_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def check_writable(run_dir: str | os.PathLike) -> None:
    """run_dir/checkpoints exists and takes a new file; otherwise a RunIOError naming it, before any compute."""
    root = os.path.join(os.fspath(run_dir), CHECKPOINTS)
    probe = os.path.join(root, f".tmp-write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"megassm")
        finally:
            os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise RunIOError(f"cannot write checkpoints to {root}: {describe_os_error(e)}") from None


def _last_logged_step(path: str, tail_bytes: int = 1 << 16) -> int | None:
    """The step of the last line of a metrics.jsonl that parses, read from its tail; None when none does."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included: damaged bytes, or the tail cut a line
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            return rec["step"]
    return None


def earlier_run(run_dir: str | os.PathLike) -> str | None:
    """What shows that run_dir holds an earlier run, in words (None: it holds none). It does when it holds a
    checkpoint whose save completed (checkpoints/step_* whose meta.json says "complete": true, whether or not its
    files still verify) or a non-empty metrics.jsonl: what a fresh start would prune (run.keep_last) or mix its own
    lines into. Nothing else counts (config.yaml, trainer.lock, pids/, last_exit.json, tensorboard/, the SLURM
    launcher's launch/ and logs/, runs moved aside into previous-*/): it describes no training. Reads only."""
    run_dir = os.fspath(run_dir)
    marked = [p for _, p in reversed(list_checkpoints(run_dir, complete_only=False)) if marked_complete(p)]
    metrics = os.path.join(run_dir, METRICS)
    try:
        size = os.path.getsize(metrics)
    except OSError:
        size = 0
    if not marked and not size:
        return None
    parts = [f"newest checkpoint {marked[0]}" if marked else "no complete checkpoint"]
    if size:
        step = _last_logged_step(metrics)
        parts.append(f"{METRICS} up to step {step}" if step is not None else f"{METRICS} of {size} bytes")
    return "; ".join(parts)


def move_aside(run_dir: str | os.PathLike, keep: tuple[str, ...] = ()) -> str:
    """Move everything in run_dir into a new run_dir/previous-<UTC time>/ and return its path; entries whose names
    start with one of `keep` (the held lock) and earlier previous-*/ stay. Renames only, nothing is deleted or
    copied. checkpoints/ and metrics.jsonl go last: a move cut short leaves run_dir still holding an earlier run,
    so the next start refuses it (or moves the rest aside) instead of mixing into it. Call only while holding
    the run directory."""
    run_dir = os.fspath(run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest, n = os.path.join(run_dir, PREVIOUS_PREFIX + stamp), 1
    while os.path.lexists(dest):  # two moves within a second
        n += 1
        dest = os.path.join(run_dir, f"{PREVIOUS_PREFIX}{stamp}-{n}")
    names = [x for x in os.listdir(run_dir) if not x.startswith((PREVIOUS_PREFIX, *keep))]
    os.mkdir(dest)
    for name in sorted(names, key=lambda x: (x == CHECKPOINTS, x == METRICS, x)):
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest
