"""Corpus readers: input paths -> an ordered stream of work units ("tasks") of raw documents.

The main process only reads and groups raw data; decoding, JSON parsing and tokenization happen in the
worker processes (see preprocess.py). Tasks are cut by content alone (about 256 KB or 4096 documents),
never by timing or worker count, which is what makes the output identical for any number of workers and lets `--resume` skip exactly the tasks already written.

Formats (by file name, after stripping .gz / .zst / .zstd):
    .jsonl .ndjson .json  JSON Lines, one object per line, text under --text-key
    .parquet              Parquet, column --text-key, read a record batch at a time (needs pyarrow: [parquet])
    .arrow .ipc .feather  Arrow IPC (file or stream format), column --text-key, a batch at a time (pyarrow too)
    anything else         plain text: one document per file, or per line with --text-per-line
and Hugging Face datasets (needs the datasets package: [datasets]): a folder written by save_to_disk (found by
its state.json / dataset_dict.json, read with load_from_disk), or with --format datasets any name or path
load_dataset takes (a Hub dataset, a local folder of data files), --split picking the split, --streaming
reading it without the full download.
"""
from __future__ import annotations

import glob
import gzip
import io
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

TASK_BYTES = 1 << 18  # small tasks keep workers evenly loaded to the end
TASK_DOCS = 4096
RECORD_BATCH_ROWS = 2048

COMPRESSED = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
JSONL_EXT = (".jsonl", ".ndjson", ".json")
PARQUET_EXT = (".parquet",)
ARROW_EXT = (".arrow", ".ipc", ".feather")


class DataInputError(ValueError):
    """Bad input data; the message starts with FILE or FILE:LINE."""


@dataclass
class InputFile:
    path: str
    format: str  # jsonl | parquet | arrow | text | datasets
    compression: str | None
    size: int  # bytes; datasets: the text column's Arrow bytes (0 when streamed: unknown)
    source: "DatasetSource | None" = None  # format datasets: the opened dataset


@dataclass
class DatasetSource:
    """A Hugging Face dataset input, opened once in the main process (datasets memory-maps local Arrow files;
    a streamed one is read as it is iterated). `record` is what the manifest and the resume fingerprint keep."""

    dataset: object  # datasets.Dataset | datasets.IterableDataset, one split, the text column checked
    record: dict


@dataclass
class Task:
    """One unit of work. kind: 'json' (raw lines), 'lines' (raw lines), 'files' (raw file contents),
    'strings' (already-decoded column values). `first` is the 1-based line or 0-based row of items[0]."""

    kind: str
    path: str
    first: int
    items: list = field(default_factory=list)
    nbytes: int = 0  # input bytes this task accounts for (progress only)
    firsts: list | None = None  # 'files': one path per item
    # Range tasks (uncompressed JSONL / text lines, Parquet): the worker reads its own input, so the main
    # process moves no document bytes. Lines: bytes [offset, offset + length) of the file (`first` is 0:
    # the line number is counted only when a line is reported bad). Parquet: rows [offset, offset + length)
    # of row group `group`.
    offset: int = -1
    length: int = 0
    group: int = -1

    @property
    def is_range(self) -> bool:
        return self.offset >= 0


def arrow_texts(column) -> list:
    """An Arrow text column as Python values: str (None for nulls), or, when a value is not valid UTF-8
    (writers need not check), the raw bytes of every value, which encode.py decodes with replacement and
    counts as for JSONL."""
    import pyarrow as pa

    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        return column.cast(pa.large_binary()).to_pylist()


def same_row_group(a: Task, b: Task) -> bool:
    """b continues a's Parquet row group: a worker reads (decompresses) a whole row group for any slice of
    it, so a cut between a and b would make two workers decode it."""
    return a.kind == b.kind == "strings" and a.is_range and b.is_range and a.path == b.path and a.group == b.group


def runs_of_tasks(tasks: Iterable[Task], min_bytes: int, whole_row_groups: bool = True) -> Iterator[list[Task]]:
    """Consecutive tasks in runs of at least min_bytes input bytes (the last may be smaller): the work units
    of one worker (a --shard-input-size group, a piece). With whole_row_groups a run ends between Parquet row
    groups, so that no two workers decode the same one, unless it has reached 2 x min_bytes inside one row
    group: a row group much larger than a run is still spread over the workers (a small input cut into a few
    runs per worker must not leave one worker all the work). Without, runs end at min_bytes wherever they are
    (for tokenizers whose encoding costs far more than decoding a row group twice)."""
    run: list[Task] = []
    size = 0
    for t in tasks:
        if size >= min_bytes and (size >= 2 * min_bytes or not whole_row_groups
                                  or not same_row_group(run[-1], t)):
            yield run
            run, size = [], 0
        run.append(t)
        size += t.nbytes
    if run:
        yield run


def detect(path: str, forced: str = "auto") -> InputFile:
    name = os.path.basename(path).lower()
    stem, ext = os.path.splitext(name)
    compression = COMPRESSED.get(ext)
    if compression:
        name = stem
    if forced != "auto":
        fmt = forced
    elif name.endswith(JSONL_EXT):
        fmt = "jsonl"
    elif name.endswith(PARQUET_EXT):
        fmt = "parquet"
    elif name.endswith(ARROW_EXT):
        fmt = "arrow"
    else:
        fmt = "text"
    if compression and fmt in ("parquet", "arrow"):
        raise DataInputError(f"{path}: compressed {fmt} files are not supported (Parquet/Arrow compress internally)")
    return InputFile(path, fmt, compression, os.path.getsize(path))


def _walk(folder: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")  # bytecode is not text
        out.extend(os.path.join(root, f) for f in sorted(files) if not f.startswith("."))
    return out


def is_saved_dataset(folder: str) -> bool:
    """A folder written by datasets' save_to_disk (a Dataset: state.json + dataset_info.json; a DatasetDict:
    dataset_dict.json)."""
    return os.path.isfile(os.path.join(folder, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(os.path.join(folder, "dataset_info.json")))


def _needs_pyarrow(files: list[InputFile]) -> None:
    for f in files:
        if f.format in ("parquet", "arrow"):
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise DataInputError(f"{f.path}: {f.format} input needs pyarrow: pip install 'megassm[parquet]' "
                                     "(or pip install pyarrow)") from None
            return


def expand_inputs(inputs: list[str], forced_format: str = "auto", text_key: str = "text",
                  split: str | None = None, dataset_config: str | None = None,
                  streaming: bool = False) -> list[InputFile]:
    """Paths, folders (walked recursively, hidden entries and __pycache__ skipped) and globs -> files, in a fixed order:
    the order given, and sorted paths inside each folder or glob. A folder written by datasets' save_to_disk, and
    with forced_format "datasets" every input, is one Hugging Face dataset input (opened here: a missing package,
    split or column is refused before any work)."""
    if not inputs:
        raise DataInputError("no inputs given (--input PATH [PATH ...])")
    if forced_format != "datasets" and (split is not None or dataset_config is not None or streaming):
        if not any(os.path.isdir(spec) and is_saved_dataset(spec) for spec in inputs):
            raise DataInputError("--split, --dataset-config and --streaming are for Hugging Face datasets inputs "
                                 "(--format datasets, or a folder written by save_to_disk)")
    out: list[InputFile] = []
    files: list[str] = []
    for spec in inputs:
        if forced_format == "datasets" or (os.path.isdir(spec) and is_saved_dataset(spec)):
            out.extend(detect(f, forced_format) for f in _unique(files))
            files = []
            out.append(open_dataset(spec, text_key, split, dataset_config, streaming))
            continue
        if any(c in spec for c in "*?["):
            matched = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matched:
                raise DataInputError(f"{spec}: no files match this pattern")
            files.extend(matched)
        elif os.path.isdir(spec):
            found = _walk(spec)
            if not found:
                raise DataInputError(f"{spec}: folder has no files")
            files.extend(found)
        elif os.path.isfile(spec):
            files.append(spec)
        else:
            raise DataInputError(f"{spec}: no such file or folder")
    out.extend(detect(f, forced_format) for f in _unique(files))
    seen: set = set()
    kept = []
    for f in out:  # a file (or dataset) named twice, by a folder and a glob say, is read once
        key = os.path.abspath(f.path) if f.source is None else ("datasets", f.path)
        if key not in seen:
            seen.add(key)
            kept.append(f)
    _needs_pyarrow(kept)
    return kept


def _unique(files: list[str]) -> list[str]:
    seen, unique = set(), []
    for f in files:
        key = os.path.abspath(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def open_dataset(spec: str, text_key: str, split: str | None, config: str | None, streaming: bool) -> InputFile:
    """A Hugging Face dataset as an input: load_from_disk for a save_to_disk folder, else load_dataset(spec,
    config, streaming=...) (a Hub name, or a local folder of data files). One split: --split, else 'train' where
    there are several, and the text column must be a string column."""
    try:
        import datasets
    except ImportError:
        raise DataInputError(f"{spec}: Hugging Face datasets input needs the datasets package: "
                             "pip install 'megassm[datasets]' (or pip install datasets)") from None
    saved = os.path.isdir(spec) and is_saved_dataset(spec)
    if saved and (config is not None or streaming):
        raise DataInputError(f"{spec}: a save_to_disk folder is memory-mapped, not downloaded: --dataset-config and "
                             "--streaming do not apply")
    try:
        ds = datasets.load_from_disk(spec) if saved else datasets.load_dataset(spec, config, streaming=streaming)
    except (FileNotFoundError, ValueError, ConnectionError) as e:  # a missing dataset, config, file; no network
        raise DataInputError(f"{spec}: cannot open as a Hugging Face dataset: {e}") from None
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        names = list(ds)
        chosen = split if split is not None else ("train" if "train" in names else names[0] if len(names) == 1 else None)
        if chosen not in names:
            what = f"no split '{split}'" if split is not None else "several splits and none is 'train'"
            raise DataInputError(f"{spec}: {what} (splits: {', '.join(names) or 'none'}); choose one with --split")
        ds = ds[chosen]
    elif split is not None:
        raise DataInputError(f"{spec}: a single dataset without splits; drop --split {split}")
    else:
        chosen = None
    fingerprint = getattr(ds, "_fingerprint", None)  # datasets' hash of the table and how it was made (not streamed)
    features = ds.features  # None for a streamed dataset whose files do not say: checked batch by batch then
    if features is not None:
        if text_key not in features:
            raise DataInputError(f"{spec}: no column '{text_key}' (columns: {', '.join(features) or 'none'}); "
                                 "choose one with --text-key")
        kind = getattr(features[text_key], "dtype", None)
        if kind not in ("string", "large_string"):
            raise DataInputError(f"{spec}: column '{text_key}' is {features[text_key]}, expected a string column")
        ds = ds.select_columns([text_key])  # the other columns are never decoded
    streamed = isinstance(ds, datasets.IterableDataset)
    size = 0 if streamed else int(ds.data.column(text_key).nbytes)
    record = {"path": spec, "format": "datasets", "loader": "load_from_disk" if saved else "load_dataset",
              "config": config, "split": chosen, "streaming": streamed,
              # what identifies the content: datasets' fingerprint of the table (not of a streamed dataset)
              "fingerprint": None if streamed else fingerprint, "rows": None if streamed else ds.num_rows,
              "datasets_version": datasets.__version__}
    return InputFile(spec, "datasets", None, size, DatasetSource(ds, record))


# --- opening --------------------------------------------------------------------------------------


class _Counting(io.RawIOBase):
    """Wraps a raw file to report how many (compressed) bytes were consumed, for the progress bar."""

    def __init__(self, f):
        self.f = f
        self.pos = 0

    def readable(self):
        return True

    def readinto(self, b):
        n = self.f.readinto(b)
        self.pos += n or 0
        return n

    def close(self):
        self.f.close()
        super().close()


def open_binary(inp: InputFile):
    """(binary stream of the decompressed content, counter of raw bytes consumed)."""
    raw = _Counting(open(inp.path, "rb"))
    if inp.compression == "gzip":
        return io.BufferedReader(gzip.GzipFile(fileobj=io.BufferedReader(raw), mode="rb"), 1 << 20), raw
    if inp.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise DataInputError(f"{inp.path}: .zst input needs the zstandard package (pip install zstandard)") from None
        reader = zstandard.ZstdDecompressor().stream_reader(io.BufferedReader(raw), read_across_frames=True)
        return io.BufferedReader(reader, 1 << 20), raw
    return io.BufferedReader(raw, 1 << 20), raw


# --- task streams per format ----------------------------------------------------------------------


def _line_tasks(inp: InputFile, kind: str) -> Iterator[Task]:
    stream, raw = open_binary(inp)
    with stream:
        task = Task(kind, inp.path, 1)
        size, reported, lineno = 0, 0, 0
        try:
            for lineno, line in enumerate(stream, start=1):
                if not task.items:
                    task.first = lineno
                task.items.append(line)
                size += len(line)
                if size >= TASK_BYTES or len(task.items) >= TASK_DOCS:
                    task.nbytes, reported = raw.pos - reported, raw.pos
                    yield task
                    task, size = Task(kind, inp.path, lineno + 1), 0
        except (OSError, EOFError) as e:  # corrupt or truncated .gz / .zst
            raise DataInputError(f"{inp.path}:{lineno + 1}: cannot decompress: {e}") from None
        except Exception as e:
            if type(e).__module__.startswith("zstd"):
                raise DataInputError(f"{inp.path}:{lineno + 1}: cannot decompress: {e}") from None
            raise
        task.nbytes = inp.size - reported
        if task.items or task.nbytes:
            yield task


def _range_tasks(inp: InputFile, kind: str) -> Iterator[Task]:
    """An uncompressed line file cut into byte ranges of about TASK_BYTES ending at a line end. Only the
    bytes around each cut are read here (the workers read the rest), and the cuts depend on the content
    alone."""
    size, o = inp.size, 0
    with open(inp.path, "rb") as f:
        while o < size:
            end = min(o + TASK_BYTES, size)
            if end < size:  # extend to the end of the line holding byte end - 1
                f.seek(end - 1)
                while True:
                    block = f.read(1 << 16)
                    if not block:
                        end = size
                        break
                    j = block.find(b"\n")
                    if j >= 0:
                        end = f.tell() - len(block) + j + 1
                        break
            yield Task(kind, inp.path, 0, [], end - o, offset=o, length=end - o)
            o = end


def _file_tasks(files: list[InputFile]) -> Iterator[Task]:
    """Plain-text files, one document each, grouped until about TASK_BYTES."""
    task = Task("files", "", 0, [], 0, [])
    size = 0
    for inp in files:
        if inp.compression:
            stream, _ = open_binary(inp)
            with stream:
                try:
                    data = stream.read()
                except (OSError, EOFError) as e:
                    raise DataInputError(f"{inp.path}: cannot decompress: {e}") from None
        else:
            with open(inp.path, "rb") as f:
                data = f.read()
        task.items.append(data)
        task.firsts.append(inp.path)
        task.nbytes += inp.size
        size += len(data)
        if size >= TASK_BYTES or len(task.items) >= TASK_DOCS:
            yield task
            task, size = Task("files", "", 0, [], 0, []), 0
    if task.items:
        yield task


def _column(schema, inp: InputFile, key: str) -> None:
    import pyarrow as pa

    names = schema.names
    if key not in names:
        raise DataInputError(
            f"{inp.path}: no column '{key}' (columns: {', '.join(names) or 'none'}); choose one with --text-key"
        )
    t = schema.field(key).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or is_view(t)):
        raise DataInputError(f"{inp.path}: column '{key}' has type {t}, expected a string column")


def _text_tasks(inp: InputFile, values: list, row: int, nbytes: int) -> Iterator[Task]:
    """The texts `values` (rows from `row` on), cut into tasks of about TASK_BYTES or TASK_DOCS documents; their
    share of the input's bytes, `nbytes`, goes with the last task (progress, --shard-input-size)."""
    start, size = 0, 0
    for j, v in enumerate(values):
        size += len(v) if v else 0
        if size >= TASK_BYTES or j + 1 - start >= TASK_DOCS:
            yield Task("strings", inp.path, row + start, values[start : j + 1], 0)
            start, size = j + 1, 0
    yield Task("strings", inp.path, row + start, values[start:], nbytes)


def _batch_tasks(inp: InputFile, batch, key: str, row: int, nbytes: int) -> Iterator[Task]:
    """A record batch's text column, cut into tasks."""
    yield from _text_tasks(inp, arrow_texts(batch.column(batch.schema.get_field_index(key))), row, nbytes)


def _parquet_range_tasks(inp: InputFile, key: str) -> Iterator[Task]:
    """Row-group slices of about TASK_BYTES (by the file's metadata, at most TASK_DOCS rows): the workers
    read the column themselves. A task accounts for the file's bytes in proportion to its share of the text
    column's compressed size (row groups by their column chunk, rows within a group evenly), so groups of
    tasks cut by input size (--shard-input-size) hold similar amounts of text even when document sizes
    vary by orders of magnitude between row groups."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(inp.path, memory_map=True)
    except Exception as e:
        raise DataInputError(f"{inp.path}: not a readable Parquet file: {e}") from None
    _column(pf.schema_arrow, inp, key)
    meta = pf.metadata
    col = pf.schema_arrow.get_field_index(key)
    weights = []
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        w = rg.column(col).total_compressed_size if col < rg.num_columns else 0
        weights.append(max(int(w), 0))
    if sum(weights) == 0:  # no size statistics: fall back to row counts
        weights = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    total = max(sum(weights), 1)
    row, before, done = 0, 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        n, w = rg.num_rows, weights[g]
        parts = max(1, -(-rg.total_byte_size // TASK_BYTES), -(-n // TASK_DOCS))
        for k in range(parts):
            lo, hi = n * k // parts, n * (k + 1) // parts
            end = inp.size * (before * parts + w * (k + 1)) // (total * parts)  # exact integers: deterministic
            nb, done = end - done, end
            yield Task("strings", inp.path, row + lo, [], nb, offset=lo, length=hi - lo, group=g)
        row += n
        before += w
    if meta.num_row_groups == 0:
        yield Task("strings", inp.path, 0, [], inp.size)


def _arrow_tasks(inp: InputFile, key: str) -> Iterator[Task]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    source = pa.memory_map(inp.path, "r")
    try:
        reader = ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        schema = reader.schema
    except pa.ArrowInvalid:
        try:
            source.seek(0)
            reader = ipc.open_stream(source)
            batches, schema = iter(reader), reader.schema
        except pa.ArrowInvalid as e:
            raise DataInputError(f"{inp.path}: not an Arrow IPC file or stream: {e}") from None
    _column(schema, inp, key)
    row = 0
    for i, batch in enumerate(batches):
        # Big IPC batches are cut so one task stays small; slicing is zero-copy.
        for start in range(0, batch.num_rows, RECORD_BATCH_ROWS):
            part = batch.slice(start, RECORD_BATCH_ROWS)
            yield from _batch_tasks(inp, part, key, row, inp.size if (i == 0 and start == 0) else 0)
            row += part.num_rows
    if row == 0:
        yield Task("strings", inp.path, 0, [], inp.size)


def _dataset_tasks(inp: InputFile, key: str) -> Iterator[Task]:
    """A dataset's text column in batches of RECORD_BATCH_ROWS rows (datasets' own iteration: the table's order,
    or the stream's), cut into tasks of about TASK_BYTES; a batch accounts for its Arrow bytes (progress, and
    --shard-input-size groups)."""
    row = 0
    for batch in inp.source.dataset.iter(batch_size=RECORD_BATCH_ROWS):
        if key not in batch:  # a streamed dataset without a schema: its first batch says what it holds
            raise DataInputError(f"{inp.path}: no column '{key}' (columns: {', '.join(batch) or 'none'}); "
                                 "choose one with --text-key")
        values = batch[key]
        bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise DataInputError(f"{inp.path}: row {row + values.index(bad)}: column '{key}' holds a "
                                 f"{type(bad).__name__}, expected a string")
        # a streamed dataset has no size: its batches count their texts' bytes
        share = sum(len(v) for v in values if v) if inp.size == 0 else _arrow_share(inp, row, len(values))
        yield from _text_tasks(inp, values, row, share)
        row += len(values)


def _arrow_share(inp: InputFile, row: int, n: int) -> int:
    """Rows [row, row + n)'s part of the input's bytes, in exact integers (deterministic task cutting)."""
    rows = max(inp.source.record["rows"], 1)
    return inp.size * (row + n) // rows - inp.size * row // rows


def iter_tasks(files: list[InputFile], text_key: str = "text", text_per_line: bool = False) -> Iterator[Task]:
    """Every input's tasks, in input order. Consecutive plain-text files share tasks."""
    pending_text: list[InputFile] = []
    for inp in files:
        if inp.format == "text" and not text_per_line:
            pending_text.append(inp)
            continue
        if pending_text:
            yield from _file_tasks(pending_text)
            pending_text = []
        if inp.format in ("jsonl", "text"):
            kind = "json" if inp.format == "jsonl" else "lines"
            yield from (_line_tasks(inp, kind) if inp.compression else _range_tasks(inp, kind))
        elif inp.format == "parquet":
            yield from _parquet_range_tasks(inp, text_key)
        elif inp.format == "arrow":
            yield from _arrow_tasks(inp, text_key)
        elif inp.format == "datasets":
            yield from _dataset_tasks(inp, text_key)
        else:
            raise DataInputError(f"{inp.path}: unknown format '{inp.format}'")
    if pending_text:
        yield from _file_tasks(pending_text)
