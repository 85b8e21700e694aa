"""Checkpoint integrity: the size and sha256 of every file of a checkpoint (meta.json's "integrity"), taken
while the file is written (`HashingWriter`) or from the disk (`file_record`), checked file by file
(`check_file`), and the non-finite values a loaded state must not hold. load.py reads meta.json and
decides; the sharded format (sharded.py) records its ranks' files through the same functions."""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from megassm.training.failures import describe_os_error

__all__ = ["INTEGRITY_ALGO", "HashingWriter", "file_record", "integrity_record", "check_file", "inside",
           "nonfinite_tensors"]

INTEGRITY_ALGO = "sha256"
_HASH_CHUNK = 4 << 20  # bytes read at a time when verifying: constant memory for any file size


class HashingWriter:
    """A write-only file object that hashes and counts what passes through, so a checkpoint file is hashed
    while it is written instead of being read back."""

    def __init__(self, f):
        self._f = f
        self._hash = hashlib.sha256()
        self.bytes = 0

    def write(self, data) -> int:
        self._hash.update(data)
        n = self._f.write(data)
        self.bytes += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._f.flush()

    def record(self) -> dict:
        return {"bytes": self.bytes, "sha256": self._hash.hexdigest()}


def file_record(path: str | os.PathLike) -> dict:
    """{"bytes": N, "sha256": hex} of a file, read in chunks of a few MB (memory stays constant)."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_HASH_CHUNK)
            if not block:
                break
            h.update(block)
            n += len(block)
    return {"bytes": n, "sha256": h.hexdigest()}


def inside(ckpt_dir: str, relpath: str) -> str:
    """ckpt_dir/relpath, refusing paths that leave the checkpoint directory."""
    if os.path.isabs(relpath) or ".." in relpath.replace("\\", "/").split("/"):
        raise ValueError(f"checkpoint file {relpath!r} must be a path inside the checkpoint directory")
    return os.path.join(ckpt_dir, relpath)


def integrity_record(ckpt_dir: str | os.PathLike, relpaths) -> dict:
    """{"algo": "sha256", "files": {relpath: {"bytes", "sha256"}}} of files already on disk, for meta.json's
    "integrity" (formats whose files are not written through save_checkpoint, e.g. one per rank)."""
    ckpt_dir = os.fspath(ckpt_dir)
    return {"algo": INTEGRITY_ALGO, "files": {rel: file_record(inside(ckpt_dir, rel)) for rel in relpaths}}


def _expected(rec: dict) -> str:
    return f"expected {rec.get('bytes')} bytes sha256 {str(rec.get('sha256'))[:12]}.."


def check_file(ckpt_dir: str, rel: str, rec: dict) -> str | None:
    """None when the file matches its record, else the problem in words (the size is compared first:
    a truncated file costs no hashing)."""
    path = inside(ckpt_dir, rel)
    try:
        size = os.path.getsize(path)
    except OSError:
        return f"{rel}: {_expected(rec)}, found no file"
    if size != rec.get("bytes"):
        return f"{rel}: {_expected(rec)}, found {size} bytes"
    try:
        got = file_record(path)["sha256"]
    except OSError as e:
        return f"{rel}: {_expected(rec)}, found an unreadable file ({describe_os_error(e)})"
    if got != rec.get("sha256"):
        return f"{rel}: {_expected(rec)}, found sha256 {got[:12]}.. (same size, other bytes)"
    return None


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a (nested) state dict that hold NaN or inf, with counts."""
    out = []
    if isinstance(state, torch.Tensor):
        if (state.is_floating_point() or state.is_complex()) and not bool(torch.isfinite(state).all()):
            bad = int((~torch.isfinite(state)).sum())
            out.append(f"'{prefix}' ({bad} of {state.numel()} values)")
    elif isinstance(state, dict):
        for k, v in state.items():
            out += nonfinite_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out += nonfinite_tensors(v, f"{prefix}.{i}" if prefix else str(i))
    return out
