"""Worker side of preprocessing: a Task of raw documents -> tokens + document lengths + counters.

Runs in every worker process (or in-process with --workers 1). Bad input is reported as
`FILE:LINE: problem`; with `skip_bad` a malformed line is skipped and counted instead.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from .sources import DataInputError, Task, arrow_texts
from .tokenizers import ByteTokenizer, Tokenizer, load_tokenizer

STAT_KEYS = ("documents", "tokens", "empty_skipped", "bad_skipped", "invalid_utf8_replaced", "blank_lines")


@dataclass(frozen=True)
class EncodeOptions:
    tokenizer: str = "byte"
    text_key: str = "text"
    append_eos: bool = True
    skip_bad: bool = False
    dtype: str = "uint16"


_state: dict = {}


def init_worker(opts: EncodeOptions, tok: Tokenizer | None = None) -> None:
    _state["opts"] = opts
    _state["tok"] = tok if tok is not None else load_tokenizer(opts.tokenizer)


def _decode(raw: bytes, stats: dict) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        stats["invalid_utf8_replaced"] += 1
        return raw.decode("utf-8", errors="replace")


def _line_number(task: Task, i: int) -> int:
    """1-based line number of item i of a line task. Range tasks count the newlines before their offset
    (only when a line is reported, so the fast path never pays for it)."""
    if not task.is_range:
        return task.first + i
    n, left = 0, task.offset
    with open(task.path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n + 1 + i


def _parquet_column(path: str, group: int, key: str):
    """The text column (Arrow) of one row group; the last group read is kept, since a big row group is cut
    into several consecutive tasks (only a task's own slice becomes Python strings)."""
    cached = _state.get("pq_group")
    if cached is not None and cached[0] == (path, group):
        return cached[1]
    import pyarrow.parquet as pq

    files = _state.setdefault("pq_files", {})
    if path not in files:
        files[path] = pq.ParquetFile(path, memory_map=True)
    # one thread: the workers are the parallelism (pyarrow's pool in each would oversubscribe the cores)
    column = files[path].read_row_group(group, columns=[key], use_threads=False).column(0)
    _state["pq_group"] = ((path, group), column)
    return column


def load_range(task: Task, opts: EncodeOptions) -> None:
    """Fill a range task's items from its input (in the worker): raw lines (each with its newline, like a
    file iterator gives them) or Parquet column values."""
    if not task.is_range or task.items:
        return
    if task.kind == "strings":
        column = _parquet_column(task.path, task.group, opts.text_key)
        task.items = arrow_texts(column.slice(task.offset, task.length))
        return
    with open(task.path, "rb") as f:
        f.seek(task.offset)
        data = f.read(task.length)
    if len(data) != task.length:
        raise DataInputError(f"{task.path}: the file changed while it was read ({len(data)} of {task.length} "
                             f"bytes at offset {task.offset})")
    parts = data.split(b"\n")
    last = parts.pop()
    task.items = [p + b"\n" for p in parts]
    if last:
        task.items.append(last)


def _documents(task: Task, opts: EncodeOptions, stats: dict) -> list[str]:
    """The task's non-empty document texts, in order."""
    docs: list[str] = []
    if task.kind == "json":
        key = opts.text_key
        for i, line in enumerate(task.items):
            where = _Where(task, i)
            if not line.strip():
                stats["blank_lines"] += 1
                continue
            before = stats["invalid_utf8_replaced"]
            text_line = _decode(line, stats)
            try:
                obj = json.loads(text_line)
            except json.JSONDecodeError as e:
                stats["invalid_utf8_replaced"] = before  # the line is dropped, not repaired
                if opts.skip_bad:
                    stats["bad_skipped"] += 1
                    continue
                raise DataInputError(f"{where}: invalid JSON: {e} (use --skip-bad to skip such lines)") from None
            if not isinstance(obj, dict):
                if opts.skip_bad:
                    stats["bad_skipped"] += 1
                    continue
                raise DataInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if key not in obj:
                if opts.skip_bad:
                    stats["bad_skipped"] += 1
                    continue
                keys = ", ".join(repr(k) for k in obj) or "none"
                raise DataInputError(f"{where}: no key '{key}' (keys present: {keys}); choose one with --text-key")
            value = obj[key]
            if value is None:
                value = ""
            if not isinstance(value, str):
                if opts.skip_bad:
                    stats["bad_skipped"] += 1
                    continue
                raise DataInputError(f"{where}: key '{key}' holds a {type(value).__name__}, expected a string")
            docs.append(value)
    elif task.kind == "lines":
        for line in task.items:
            docs.append(_decode(line.rstrip(b"\r\n") if line.endswith(b"\n") else line, stats))
    elif task.kind == "files":
        docs.extend(_decode(raw, stats) for raw in task.items)
    elif task.kind == "strings":  # str, None, or raw bytes when the column held invalid UTF-8 (arrow_texts)
        docs.extend("" if v is None else _decode(v, stats) if isinstance(v, bytes) else v for v in task.items)
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")
    kept = [d for d in docs if d]
    stats["empty_skipped"] += len(docs) - len(kept)
    return kept


class _Where:
    """`FILE:LINE` of item i, formatted only when a message needs it."""

    __slots__ = ("task", "i")

    def __init__(self, task: Task, i: int):
        self.task, self.i = task, i

    def __str__(self) -> str:
        return f"{self.task.path}:{_line_number(self.task, self.i)}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _utf8(texts: list[str], stats: dict) -> list[bytes]:
    """UTF-8 bytes of each text; lone surrogates (from JSON escapes such as \\ud800) become '?'."""
    out = []
    for t in texts:
        try:
            out.append(t.encode("utf-8"))
        except UnicodeEncodeError:
            stats["invalid_utf8_replaced"] += 1
            out.append(t.encode("utf-8", errors="replace"))
    return out


def _byte_arrow_task(task: Task, opts: EncodeOptions, eos: int):
    """Byte-level tokens of a Parquet slice straight from the Arrow string buffers (UTF-8 bytes are the
    byte tokenizer's ids), with no Python string per document: (tokens, lengths, counters), or None where
    the general path must decide (nulls, other string types, invalid UTF-8, which it replaces and counts).
    Same bytes as the general path: a valid UTF-8 string encodes back to its own bytes."""
    import pyarrow as pa

    column = _parquet_column(task.path, task.group, opts.text_key).slice(task.offset, task.length)
    pieces, lengths = [], []
    for arr in column.chunks:
        if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)) or arr.null_count:
            return None
        try:
            arr.validate(full=True)  # checks the UTF-8
        except pa.ArrowInvalid:
            return None
        off_type = np.int64 if pa.types.is_large_string(arr.type) else np.int32
        _, obuf, dbuf = arr.buffers()
        offs = np.frombuffer(obuf, dtype=off_type, count=arr.offset + len(arr) + 1)[arr.offset:].astype(np.int64)
        data = np.frombuffer(dbuf, dtype=np.uint8) if dbuf is not None else np.zeros(0, np.uint8)
        pieces.append((data, offs))
        lengths.append(np.diff(offs))
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    keep = lens > 0
    extra = 1 if opts.append_eos else 0
    out_lens = lens[keep] + extra
    out = np.empty(int(out_lens.sum()), dtype=np.dtype(opts.dtype))
    pos = 0
    for data, offs in pieces:
        for a, b in zip(offs[:-1].tolist(), offs[1:].tolist()):
            if b > a:
                out[pos : pos + b - a] = data[a:b]
                pos += b - a
                if extra:
                    out[pos] = eos
                    pos += 1
    stats = dict.fromkeys(STAT_KEYS, 0)
    stats["documents"] = int(keep.sum())
    stats["tokens"] = int(out_lens.sum())
    stats["empty_skipped"] = int((~keep).sum())
    return out, out_lens, stats


def encode_task(task: Task) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens in the output dtype, int64 document lengths incl. EOS, counters) for one task."""
    opts: EncodeOptions = _state["opts"]
    tok: Tokenizer = _state["tok"]
    if isinstance(tok, ByteTokenizer) and task.kind == "strings" and task.is_range and not task.items:
        fast = _byte_arrow_task(task, opts, tok.eos_id)
        if fast is not None:
            return fast
    stats = dict.fromkeys(STAT_KEYS, 0)
    load_range(task, opts)
    texts = _documents(task, opts, stats)
    raw = _utf8(texts, stats)
    if isinstance(tok, ByteTokenizer):
        ids = [np.frombuffer(b, dtype=np.uint8) for b in raw]
    else:
        ids = tok.encode_batch([b.decode("utf-8") for b in raw] if stats["invalid_utf8_replaced"] else texts)
    extra = 1 if opts.append_eos else 0
    lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
    nonempty = lengths > 0
    if not nonempty.all():  # text that tokenizes to nothing is an empty document too
        stats["empty_skipped"] += int((~nonempty).sum())
        ids = [a for a, keep in zip(ids, nonempty) if keep]
        lengths = lengths[nonempty]
    lengths = lengths + extra
    out = np.empty(int(lengths.sum()), dtype=np.dtype(opts.dtype))
    pos = 0
    for a in ids:
        out[pos : pos + len(a)] = a
        pos += len(a)
        if extra:
            out[pos] = tok.eos_id
            pos += 1
    if len(ids) and not isinstance(tok, ByteTokenizer):
        top = max(int(a.max()) for a in ids if len(a))
        if top >= tok.vocab_size:
            raise DataInputError(f"{task.path}: tokenizer {tok.name} produced id {top} >= its vocab size {tok.vocab_size}")
    stats["documents"] = len(ids)
    stats["tokens"] = int(lengths.sum())
    return out, lengths, stats


# --- pieces (several workers, one writer): each task's tokens go to a file of their own --------------------
def encode_piece(job: tuple) -> tuple[np.ndarray, dict]:
    """Worker: encode consecutive tasks and write their tokens to the file `path` (the writer copies them
    into place file to file and removes the piece). Returns (document lengths, counters): only these cross
    the process pipe."""
    tasks, path = job
    lengths, stats = [], dict.fromkeys(STAT_KEYS, 0)
    with open(path, "wb") as f:
        for t in tasks:
            tokens, lens, st = encode_task(t)
            f.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
            lengths.append(lens)
            for k in STAT_KEYS:
                stats[k] += st[k]
    return (np.concatenate(lengths) if lengths else np.zeros(0, np.int64)), stats


# --- direct output (single .bin, one process): tokens go straight into the file, hashed as they go ------
def init_direct(opts: EncodeOptions, bin_file: str, offset: int, hasher=None, tok: Tokenizer | None = None) -> None:
    """In-process init for direct output: task tokens are written at `offset` onwards, in task order, and
    fed to `hasher` (the .bin's sha256) as they are written."""
    init_worker(opts, tok)
    _state["fd"] = os.open(bin_file, os.O_WRONLY)
    _state["offset"], _state["hasher"] = offset, hasher


def encode_direct(task: Task) -> tuple[np.ndarray, dict, int, int]:
    """Encode a task and append its tokens to the .bin. Returns (document lengths, counters, byte offset,
    byte count): the tokens are never copied into a result."""
    tokens, lengths, stats = encode_task(task)
    off, nbytes = _state["offset"], tokens.nbytes
    view = memoryview(np.ascontiguousarray(tokens)).cast("B")
    done = 0
    while done < nbytes:
        done += os.pwrite(_state["fd"], view[done:], off + done)
    _state["offset"] = off + nbytes
    if _state["hasher"] is not None:
        _state["hasher"].update(view)
    return lengths, stats, off, nbytes


def close_direct() -> None:
    fd = _state.pop("fd", None)
    if fd is not None:
        os.close(fd)
