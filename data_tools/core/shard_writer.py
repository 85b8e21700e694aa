"""Resumable writer of (numbered) shards inside a work folder, moved into place only when complete.

Layout while a run is in progress (PREFIX.partial/):
    shard-00000.bin      tokens written so far
    shard-00000.lengths  int64 document lengths so far (the .idx is written when the shard closes)
    shard-00000.idx      present once the shard is closed
    progress.json        the last consistent point: tasks done, open shard, its byte and document counts

`checkpoint()` flushes and records that point; a resumed run truncates the open shard's files back to
it and re-reads the input from the next task, so no document is dropped or written twice.
"""
from __future__ import annotations

import errno
import json
import os

import numpy as np

from .indexed import bin_path, idx_path, write_index

PROGRESS = "progress.json"


def _write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ShardWriter:
    def __init__(self, work_dir: str, dtype, shard_size: int | None):
        self.work_dir = work_dir
        self.dtype = np.dtype(dtype)
        self.shard_size = shard_size  # tokens per shard (a shard closes once it reaches this), None = one
        self.shard = 0
        self._lengths: list[np.ndarray] = []
        self._shard_tokens = 0
        self._bin = self._len = None

    def _paths(self, i: int) -> tuple[str, str, str]:
        base = os.path.join(self.work_dir, f"shard-{i:05d}")
        return base + ".bin", base + ".lengths", base + ".idx"

    def _open(self, i: int, bin_bytes: int = 0, num_docs: int = 0) -> None:
        b, l, _ = self._paths(i)
        for path in (b, l):
            if not os.path.exists(path):
                open(path, "wb").close()
        self._bin = open(b, "r+b")
        self._bin.truncate(bin_bytes)
        self._bin.seek(bin_bytes)
        self.bin_bytes = bin_bytes  # bytes of this shard's .bin that are final (written in task order)
        self._len = open(l, "r+b")
        self._len.truncate(8 * num_docs)
        self._len.seek(0)
        lengths = np.frombuffer(self._len.read(8 * num_docs), dtype="<i8").astype(np.int64)
        if len(lengths) != num_docs:
            raise RuntimeError(f"{l}: holds {len(lengths)} document lengths, progress says {num_docs}")
        if int(lengths.sum()) * self.dtype.itemsize != bin_bytes:
            raise RuntimeError(f"{b}: {bin_bytes} bytes recorded but lengths sum to {int(lengths.sum())} tokens")
        self._len.seek(8 * num_docs)
        self._lengths = [lengths]
        self._shard_tokens = int(lengths.sum())
        self.shard = i

    def start(self) -> None:
        os.makedirs(self.work_dir, exist_ok=True)
        self._open(0)

    def resume(self, progress: dict) -> None:
        i = int(progress["shard"])
        # Anything past the recorded point (a shard closed or opened after the last checkpoint) goes.
        for name in os.listdir(self.work_dir):
            if name.startswith("shard-"):
                n = int(name[6:11])
                if n > i or (n == i and name.endswith(".idx")):
                    os.remove(os.path.join(self.work_dir, name))
        for n in range(i):  # closed shards: trim anything written after their index was made
            b, l, x = self._paths(n)
            want = int(np.fromfile(l, dtype="<i8").sum()) * self.dtype.itemsize
            if not os.path.exists(x) or os.path.getsize(b) < want:
                raise RuntimeError(f"{b}: cannot resume, the closed shard is incomplete (pass --overwrite)")
            with open(b, "r+b") as f:
                f.truncate(want)
        self._open(i, int(progress["bin_bytes"]), int(progress["num_docs"]))

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append whole documents; a shard closes after the document that makes it reach shard_size."""
        self._add(lengths, lambda a, b: self._write_bin(np.ascontiguousarray(tokens[a:b], dtype=self.dtype)))

    def add_piece(self, path: str, lengths: np.ndarray, hasher=None) -> None:
        """As add(), for documents whose tokens (this writer's dtype, in order) a worker wrote to the file
        `path` (preprocess.py: one writer fed by several workers). Without `hasher` the bytes go file to
        file inside the kernel (os.copy_file_range); with it (the single output's sha256) they pass through
        one reused buffer, hashed on the way, so they are read from memory once."""
        size = self.dtype.itemsize
        with open(path, "rb", buffering=0) as src:
            have, want = os.fstat(src.fileno()).st_size, int(lengths.sum()) * size
            if have != want:
                raise RuntimeError(f"{path}: {have} bytes, expected {want} for its {len(lengths)} documents")
            self._add(lengths, lambda a, b: self._copy_bin(src.fileno(), a * size, (b - a) * size, hasher))

    def _add(self, lengths: np.ndarray, put) -> None:
        """Split whole documents over the shards: put(a, b) appends tokens [a, b) of the batch to the open
        shard's .bin; the lengths are recorded here."""
        if self.shard_size is None:
            put(0, int(lengths.sum()))
            self._record(lengths)
            return
        pos, start = 0, 0
        ends = np.cumsum(lengths)
        for k in range(len(lengths)):
            if self._shard_tokens + (ends[k] - pos) >= self.shard_size:
                put(pos, int(ends[k]))
                self._record(lengths[start : k + 1])
                pos, start = int(ends[k]), k + 1
                self._close_shard()
                self._open(self.shard + 1)
        if start < len(lengths):
            put(pos, int(ends[-1]))
            self._record(lengths[start:])

    def add_direct(self, lengths: np.ndarray, nbytes: int) -> None:
        """Record whole documents whose tokens a worker already wrote into this (only) shard's .bin, right
        after the previous ones (preprocess.py: direct output, no shard_size)."""
        if self.shard_size is not None:
            raise RuntimeError("direct output is for a single shard (no shard_size)")
        self._record(lengths)
        self.bin_bytes += int(nbytes)

    def bin_file(self) -> str:
        return self._paths(self.shard)[0]

    def _write_bin(self, data: np.ndarray) -> None:
        self._bin.write(memoryview(data).cast("B"))
        self.bin_bytes += data.nbytes

    def _copy_bin(self, src_fd: int, offset: int, nbytes: int, hasher=None) -> None:
        """Bytes [offset, offset + nbytes) of src_fd to the end of the open .bin (fed to hasher if given)."""
        self._bin.flush()
        dst_fd, done = self._bin.fileno(), 0
        kernel_copy = hasher is None
        buf = view = None
        while done < nbytes:
            n = 0
            if kernel_copy:
                try:
                    n = os.copy_file_range(src_fd, dst_fd, nbytes - done, offset + done, self.bin_bytes + done)
                except OSError as e:  # file systems or kernels without it: the same bytes through user space
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    kernel_copy = False
            if not kernel_copy:
                if buf is None:
                    buf = bytearray(min(nbytes, 1 << 20))  # reused: stays in cache between read, hash, write
                    view = memoryview(buf)
                n = os.preadv(src_fd, [view[: min(len(buf), nbytes - done)]], offset + done)
                if n > 0:
                    if hasher is not None:
                        hasher.update(view[:n])
                    w = 0
                    while w < n:
                        w += os.pwrite(dst_fd, view[w:n], self.bin_bytes + done + w)
            if n <= 0:
                raise RuntimeError(f"fd {src_fd}: ended {nbytes - done} bytes early while copying tokens")
            done += n
        self.bin_bytes += nbytes
        self._bin.seek(self.bin_bytes)

    def _record(self, lengths: np.ndarray) -> None:
        self._len.write(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._shard_tokens += int(lengths.sum())

    def _close_shard(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._len.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        write_index(self._paths(self.shard)[2], self.dtype, lengths, np.arange(len(lengths) + 1))

    def checkpoint(self, tasks_done: int, extra: dict) -> None:
        self._bin.flush()
        self._len.flush()
        os.fsync(self._bin.fileno())
        os.fsync(self._len.fileno())
        num_docs = sum(len(a) for a in self._lengths)
        _write_json_atomic(os.path.join(self.work_dir, PROGRESS), {
            **extra,
            "tasks_done": tasks_done,
            "shard": self.shard,
            "bin_bytes": self.bin_bytes,
            "num_docs": num_docs,
        })

    def finish(self) -> int:
        """Close the last shard; returns the number of shards. (An empty last shard of a sharded run is
        dropped unless it is the only one.)"""
        last_empty = self._shard_tokens == 0 and self.shard > 0
        self._close_shard()
        if last_empty:
            for p in self._paths(self.shard):
                if os.path.exists(p):
                    os.remove(p)
            return self.shard
        return self.shard + 1

    def close_files(self) -> None:
        for f in (self._bin, self._len):
            if f is not None and not f.closed:
                f.close()

    def move_into_place(self, n_shards: int, output_prefix: str, numbered: bool) -> list[str]:
        """Rename finished shards to their final names; returns the final prefixes."""
        finals = []
        for i in range(n_shards):
            final = f"{output_prefix}-{i:05d}" if numbered else output_prefix
            b, _, x = self._paths(i)
            os.replace(b, bin_path(final))
            os.replace(x, idx_path(final))
            finals.append(final)
        return finals


def read_progress(work_dir: str) -> dict | None:
    p = os.path.join(work_dir, PROGRESS)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return json.load(f)


def write_json_atomic(path: str, obj) -> None:
    _write_json_atomic(path, obj)
