"""Numbered shards cut by input size, each tokenized, written and hashed by one worker
(`megassm-preprocess --shard-input-size SIZE`).

The default pipeline (preprocess.py) has one writer: the workers write their tokens to piece files, and the
main process copies them into the output and hashes it. That scales for real tokenizers, but byte-level
tokenizing runs at ~100-200M tokens/s per core, as fast as the copy and the sha256 of the output, so one
writer caps two workers near 1.5x (docs/data.md "Speed"). Here the input tasks are grouped, in order, into
groups of at least SIZE input bytes (cut only between Parquet row groups); group g becomes shard g, and the
worker that takes the group writes its .bin/.idx and their sha256 itself. Nothing but counters and digests
crosses a pipe.

Output depends only on the inputs and the options, never on the number of workers: the groups are cut from
the deterministic task sequence. A group whose documents are all empty makes no shard; shards are numbered
in input order over the non-empty groups. The work folder (PREFIX.partial/) holds one finished
`group-GGGGG.{bin,idx}` per completed group (renamed from temporary names when complete) and progress.json
with their results (sizes and sha256), so `--resume` redoes only unfinished groups and recorded groups whose
files no longer match their digests.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import queue
import threading
from collections.abc import Iterable, Iterator

import numpy as np

from .digest import sha256_file
from .encode import STAT_KEYS, EncodeOptions, encode_task, init_worker
from .indexed import write_index
from .sources import runs_of_tasks

PROGRESS = "progress.json"


def group_tasks(tasks: Iterable, group_bytes: int) -> Iterator[list]:
    """Consecutive tasks in groups of at least group_bytes input bytes (the last one may be smaller), never
    splitting a Parquet row group between two groups (sources.runs_of_tasks)."""
    return runs_of_tasks(tasks, group_bytes)


def _paths(work_dir: str, g: int) -> tuple[str, str]:
    base = os.path.join(work_dir, f"group-{g:05d}")
    return base + ".bin", base + ".idx"


def encode_group(job: tuple) -> dict:
    """Worker: tokenize group `g`'s tasks into work_dir/group-g.{bin,idx} (temporary names, then rename),
    hashing the .bin as it is written. Returns the group's counters, sizes and digests."""
    g, tasks, work_dir, dtype_name = job
    dtype = np.dtype(dtype_name)
    final_bin, final_idx = _paths(work_dir, g)
    tmp_bin, tmp_idx = final_bin + f".tmp-{os.getpid()}", final_idx + f".tmp-{os.getpid()}"
    stats = dict.fromkeys(STAT_KEYS, 0)
    lengths, h, nbytes_in = [], hashlib.sha256(), 0
    try:
        with open(tmp_bin, "wb") as f:
            for t in tasks:
                tokens, lens, st = encode_task(t)
                data = memoryview(np.ascontiguousarray(tokens, dtype=dtype)).cast("B")
                f.write(data)
                h.update(data)
                lengths.append(lens)
                nbytes_in += t.nbytes
                for k in STAT_KEYS:
                    stats[k] += st[k]
        # no fsync: resuming checks every recorded shard against its sha256 instead (ProgressRecorder)
        lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        result = {"group": g, "stats": stats, "input_bytes": nbytes_in, "tokens": int(lens.sum())}
        if len(lens) == 0:  # nothing but empty documents: no shard
            os.remove(tmp_bin)
            return {**result, "empty": True}
        write_index(tmp_idx, dtype, lens, np.arange(len(lens) + 1))
        result.update(empty=False, bin_bytes=os.path.getsize(tmp_bin), bin_sha256=h.hexdigest(),
                      idx_bytes=os.path.getsize(tmp_idx), idx_sha256=sha256_file(tmp_idx))
        os.replace(tmp_idx, final_idx)  # .bin last: a final .bin means the group is complete
        os.replace(tmp_bin, final_bin)
        return result
    except BaseException:
        for p in (tmp_bin, tmp_idx):
            if os.path.exists(p):
                os.remove(p)
        raise


def _file_matches(path: str, nbytes: int, digest: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) == nbytes and sha256_file(path) == digest


def read_done(work_dir: str, fingerprint: dict) -> tuple[dict[int, dict], list[int]]:
    """The completed groups of an interrupted run (results by group) after checking the fingerprint, and
    the groups to redo. Each recorded group's files are checked against the sizes and sha256 that
    progress.json holds for them: the files are not fsynced while the run goes (see ProgressRecorder), so
    after a machine crash a recorded shard may have lost its last pages; such a group is redone, never
    trusted. Files of unfinished groups are removed."""
    with open(os.path.join(work_dir, PROGRESS)) as f:
        state = json.load(f)
    if state.get("fingerprint") != fingerprint:
        raise ValueError(f"{work_dir}: cannot resume: the inputs, tokenizer or options differ from the interrupted "
                         "run (pass --overwrite to start over)")
    done = {int(g): r for g, r in state["groups"].items()}
    redo = []
    for g, r in sorted(done.items()):
        if r["empty"]:
            continue
        b, x = _paths(work_dir, g)
        if not (_file_matches(x, r["idx_bytes"], r["idx_sha256"]) and _file_matches(b, r["bin_bytes"], r["bin_sha256"])):
            redo.append(g)
    for g in redo:
        del done[g]
    for name in os.listdir(work_dir):
        if name.startswith("group-"):
            g = int(name[6:11])
            if g not in done or ".tmp-" in name:
                os.remove(os.path.join(work_dir, name))
    return done, redo


def write_progress(work_dir: str, fingerprint: dict, done: dict[int, dict]) -> None:
    """progress.json, atomically (temporary name, fsync, rename): a few KB, so the fsync is cheap."""
    path = os.path.join(work_dir, PROGRESS)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint, "groups": {str(g): r for g, r in sorted(done.items())}}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ProgressRecorder:
    """Records finished groups in progress.json, from a background thread so the main loop never waits on
    the disk.

    The shards themselves are not fsynced (nor are the final outputs, as with Megatron's
    preprocess_data.py): forcing 400 MB of byte-level shards out per 200 MB of input took CPU from the
    workers on a 2-core machine (docs/data.md "Speed"). Resuming does not need it: a process killed at any
    point leaves complete files in the page cache, and after a machine crash `read_done` re-hashes every
    recorded shard against its sha256 in progress.json and redoes the ones that lost data."""

    def __init__(self, work_dir: str, fingerprint: dict, done: dict[int, dict]):
        self.work_dir, self.fingerprint, self.done = work_dir, fingerprint, done
        self._q: queue.Queue = queue.Queue()
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megassm-progress", daemon=True)
        self._thread.start()

    def add(self, result: dict) -> None:
        if self._err is not None:
            raise self._err
        self._q.put(result)

    def _run(self) -> None:
        while (r := self._q.get()) is not None:
            if self._err is not None:
                continue
            try:
                batch = [r]
                while True:  # record every result that is already waiting with one write
                    try:
                        nxt = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._q.put(None)
                        break
                    batch.append(nxt)
                missing = None
                for b in batch:
                    if not b["empty"]:
                        missing = next((p for p in _paths(self.work_dir, b["group"]) if not os.path.exists(p)), None)
                        if missing:
                            break
                    self.done[b["group"]] = b
                write_progress(self.work_dir, self.fingerprint, self.done)  # the groups before a failure count
                if missing:
                    raise FileNotFoundError(f"{missing}: a finished group's file is missing")
            except BaseException as e:
                self._err = e

    def close(self, reraise: bool = True) -> None:
        """Wait until every added group is recorded; re-raise a failure of the recording thread (not while
        another exception is already on its way out)."""
        self._q.put(None)
        self._thread.join()
        if self._err is not None and reraise:
            raise self._err


def run_groups(groups: Iterable[tuple[int, list]], work_dir: str, opts: EncodeOptions, tok, workers: int,
               start_method: str) -> Iterator[dict]:
    """Encode the (g, tasks) groups, in this process (workers <= 1) or over a pool; yields each group's
    result as it completes (any order with workers)."""
    jobs = ((g, tasks, work_dir, opts.dtype) for g, tasks in groups)
    if workers <= 1:
        init_worker(opts, tok)
        for job in jobs:
            yield encode_group(job)
        return
    pool = mp.get_context(start_method).Pool(workers, initializer=init_worker, initargs=(opts,))
    try:
        # a few groups queued per worker: inputs are read by the workers, a group pickles only byte ranges
        # (or the raw content of compressed / non-line inputs)
        yield from pool.imap_unordered(encode_group, jobs, chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def move_into_place(work_dir: str, done: dict[int, dict], output_prefix: str) -> list[tuple[int, str]]:
    """Rename the non-empty groups' files to PREFIX-00000 ... in group order; returns (group, final prefix)."""
    from .indexed import bin_path, idx_path

    out = []
    for g in sorted(done):
        if done[g]["empty"]:
            continue
        final = f"{output_prefix}-{len(out):05d}"
        b, x = _paths(work_dir, g)
        os.replace(x, idx_path(final))
        os.replace(b, bin_path(final))
        out.append((g, final))
    return out
