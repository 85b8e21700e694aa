"""Worker side of preprocessing: a Task of raw documents -> tokens + document lengths + counters.

Runs in every worker process (or in-process with --workers 1). Bad input is reported as
`FILE:LINE: problem`; with `skip_bad` a malformed line is skipped and counted instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from .sources import DataInputError, Task
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


def _documents(task: Task, opts: EncodeOptions, stats: dict) -> list[str]:
    """The task's non-empty document texts, in order."""
    docs: list[str] = []
    if task.kind == "json":
        key = opts.text_key
        for i, line in enumerate(task.items):
            where = f"{task.path}:{task.first + i}"
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
    elif task.kind == "strings":
        docs.extend("" if v is None else v for v in task.items)
    else:
        raise ValueError(f"unknown task kind {task.kind!r}")
    kept = [d for d in docs if d]
    stats["empty_skipped"] += len(docs) - len(kept)
    return kept


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


def encode_task(task: Task) -> tuple[np.ndarray, np.ndarray, dict]:
    """(tokens in the output dtype, int64 document lengths incl. EOS, counters) for one task."""
    opts: EncodeOptions = _state["opts"]
    tok: Tokenizer = _state["tok"]
    stats = dict.fromkeys(STAT_KEYS, 0)
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
