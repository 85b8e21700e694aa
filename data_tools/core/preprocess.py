"""megassm-preprocess: corpus files -> Megatron-compatible token shards + a manifest.

    megassm-preprocess --input data/*.jsonl.zst --output-prefix shards/web --tokenizer tokenizer.model --workers 8

prints the shard prefixes it wrote on stdout, one a line (PREFIX, or PREFIX-00000 ... with numbered shards); the
progress bar, the summary and errors go to stderr.

or from Python (what the built-in corpus and the tests use):

    from megassm.data_tools.preprocess import preprocess
    manifest = preprocess(["corpus/"], "shards/corpus", tokenizer="byte", workers=2)

Pipeline: the main process cuts the inputs into tasks (sources.py: byte ranges of uncompressed line
files and Parquet row-group slices, which the workers read themselves; the raw content of other
inputs); N worker processes read, decode and tokenize them (encode.py), writing the tokens of a run of
tasks to a piece file; the main process copies the pieces into the output in task order (shard_writer.py),
taking a single output file's sha256 on the way (another thread hashes the inputs meanwhile). With
--workers 1 everything runs in the calling thread and the tokens go straight from the tokenizer into the
file. Output bytes depend
only on the input and the options, never on N. Everything is written under PREFIX.partial/ and renamed
into place at the end; `--resume` continues an interrupted run from its last checkpoint.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import multiprocessing as mp
import os
import re
import shutil
import sys
import threading
import time
from typing import Iterable, Iterator

import numpy as np

from .digest import sha256_file
from .encode import (STAT_KEYS, EncodeOptions, close_direct, encode_direct, encode_piece, encode_task, init_direct,
                     init_worker)
from .indexed import CODE_OF_DTYPE, bin_path, dtype_for_vocab, idx_path
from .shard_writer import ShardWriter, read_progress, write_json_atomic
from .sources import DataInputError, InputFile, expand_inputs, iter_tasks, runs_of_tasks
from .tokenizers import TokenizerError, load_tokenizer, tokenizer_info

MANIFEST_VERSION = 1
TASK_SCHEME = 4  # how inputs are cut into tasks (3: byte ranges / row-group slices weighted by compressed size;
# 4: --shard-input-size groups end between Parquet row groups); --resume needs the same
CHECKPOINT_SECONDS = 2.0
PIECE = "piece-"  # a worker's tokens of some tasks, in the work folder until the writer copies them into place
PIECE_BYTES = 4 << 20  # input bytes per piece: per-file costs (open, copy call, remove) stay small per byte


def manifest_path(prefix: str) -> str:
    return prefix + ".manifest.json"


def parse_size(text: str | int | None) -> int | None:
    """'500M' -> 500_000_000 tokens; also plain integers, 1e9, K/M/G/T suffixes."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)\s*", str(text))
    if not m:
        raise ValueError(f"--shard-size: cannot read {text!r} (examples: 100000000, 500M, 2G)")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"--shard-size must be at least 1 token, got {text!r}")
    return int(value)


def existing_outputs(prefix: str) -> list[str]:
    """Final-name files a previous run left for PREFIX (single or numbered shards, manifest)."""
    folder = os.path.dirname(prefix) or "."
    base = os.path.basename(prefix)
    pattern = re.compile(re.escape(base) + r"(\.bin|\.idx|\.manifest\.json|-\d{5}\.(bin|idx))$")
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if pattern.match(n))


def _start_method(fork_ok: bool = True) -> str:
    """fork when it is safe (one thread, no CUDA: the command line), else spawn (the caller may be a
    trainer with prefetch threads or CUDA state). fork starts a worker in milliseconds instead of a
    fresh interpreter importing numpy and the tokenizer. fork_ok=False (a Hugging Face datasets input): spawn,
    since datasets' Arrow thread pools are native threads active_count() does not see, and its fsspec I/O
    thread may start after this check; a fork can copy a lock one of them holds."""
    torch = sys.modules.get("torch")
    cuda = torch is not None and getattr(torch, "cuda", None) is not None and torch.cuda.is_initialized()
    if fork_ok and threading.active_count() == 1 and not cuda and "fork" in mp.get_all_start_methods():
        return "fork"
    return "spawn"


def _ordered_map(workers: int, opts: EncodeOptions, tok, tasks: Iterable, direct: dict | None = None,
                 pieces_dir: str | None = None, piece_bytes: int = 0,
                 fork_ok: bool = True) -> Iterator[tuple[int, int, tuple]]:
    """(tasks, input bytes, result) in task order, with at most a few results in flight per worker. In one
    process, one task per result: encode_task(task) = (tokens, lengths, counters), or with `direct`
    (bin_file, offset, hasher) encode_direct(task) = (lengths, counters, offset, nbytes), the tokens already
    written. With workers, a result is (piece path, lengths, counters) for consecutive tasks of about
    piece_bytes of input: the worker writes their tokens to a piece file under pieces_dir, which the writer
    copies into place file to file (ShardWriter.add_piece). Pickling the tokens back instead made the main
    process copy every byte three times, so byte-level runs got slower with more workers; writing the final
    file from the workers would make them wait for each other's offsets."""
    if workers <= 1:
        if direct is None:
            init_worker(opts, tok)
            for t in tasks:
                yield 1, t.nbytes, encode_task(t)
            return
        init_direct(opts, direct["bin_file"], direct["offset"], direct["hasher"], tok)
        try:
            for t in tasks:
                yield 1, t.nbytes, encode_direct(t)
        finally:
            close_direct()
        return

    pool = mp.get_context(_start_method(fork_ok)).Pool(workers, initializer=init_worker, initargs=(opts,))
    try:
        pending: collections.deque = collections.deque()
        # Pieces keep Parquet row groups whole (each worker decodes a whole row group for any slice of it) for
        # byte-level tokens only, whose encoding costs about what that decoding does. Other tokenizers spend
        # ~100x more per byte encoding than decoding, and pieces cut at their size keep the workers even: the
        # benchmark's 12 MB Parquet file (3 row groups) gave 2 workers 4 pieces of 3.3 / 3.3 / 3.8 / 1.7 MB of
        # text with whole row groups (SentencePiece 1.55x), 8 even ones without.
        whole = opts.tokenizer == "byte"
        for i, batch in enumerate(runs_of_tasks(tasks, piece_bytes, whole_row_groups=whole)):
            path = os.path.join(pieces_dir, f"{PIECE}{i:09d}")
            nbytes = sum(t.nbytes for t in batch)
            pending.append((len(batch), nbytes, path, pool.apply_async(encode_piece, ((batch, path),))))
            if len(pending) >= 3 * workers:
                k, n, path, r = pending.popleft()
                yield k, n, (path, *r.get())
        while pending:
            k, n, path, r = pending.popleft()
            yield k, n, (path, *r.get())
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _discard_failed_work(work: str) -> None:
    """In a `finally` after a failed run: the work directory goes, unless an interruption (progress kept for
    --resume). Bad input or a bug leaves nothing worth resuming, so nothing is left behind."""
    if not isinstance(sys.exc_info()[1], KeyboardInterrupt) and os.path.isdir(work):
        shutil.rmtree(work)


def _remove_pieces(work: str) -> None:
    """Piece files that an interrupted run's workers left (their tasks are redone)."""
    for name in os.listdir(work):
        if name.startswith(PIECE):
            os.remove(os.path.join(work, name))


class _InputHashes:
    """sha256 of every input file, in a background thread (workers > 1) or on demand."""

    def __init__(self, paths: list[str], background: bool):
        self.paths, self._out, self._err = paths, {}, None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="megassm-input-sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            for p in self.paths:
                self._out[p] = sha256_file(p)
        except BaseException as e:
            self._err = e

    def get(self) -> dict:
        if self._thread is None:
            self._run()
        else:
            self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out


def _chain(first, rest):
    yield first
    yield from rest


def _hash_prefix(h, path: str, nbytes: int) -> None:
    """Feed bytes [0, nbytes) of `path` to hash h (a resumed run's output written before)."""
    with open(path, "rb") as f:
        left = nbytes
        while left > 0:
            block = f.read(min(left, 1 << 22))
            if not block:
                raise OSError(f"{path}: shorter than the {nbytes} bytes its progress records")
            h.update(block)
            left -= len(block)


def _fingerprint(files: list[InputFile], tok, opts: EncodeOptions, shard_size, text_per_line) -> dict:
    return {
        "inputs": [[f.path, f.size, os.stat(f.path).st_mtime_ns, f.format] if f.source is None else f.source.record
                   for f in files],
        "tokenizer_sha256": tok.sha256,
        "task_cutting": TASK_SCHEME,
        "options": {"text_key": opts.text_key, "append_eos": opts.append_eos, "skip_bad": opts.skip_bad,
                    "shard_size": shard_size, "text_per_line": text_per_line, "dtype": opts.dtype},
    }


def _known(files: list[InputFile], total: int) -> int | None:
    """The progress bar's total: None (a counter) when a streamed dataset's size is unknown."""
    return None if any(f.source is not None and f.source.record["streaming"] for f in files) else total


def _progress_bar(total: int | None, initial: int, enabled: bool):
    from tqdm import tqdm

    class _Bar(tqdm):
        # no tqdm monitor thread: a live thread makes _start_method() pick spawn, and a spawned worker
        # re-imports numpy and the tokenizer (measured: byte-level 2 workers lost ~0.3 s of 0.7 s to it)
        monitor_interval = 0

    return _Bar(total=total, initial=initial, unit="B", unit_scale=True, desc="preprocess",
                disable=not enabled, dynamic_ncols=True, file=sys.stderr)


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer: str = "byte",
    workers: int = 1,
    text_key: str = "text",
    text_per_line: bool = False,
    input_format: str = "auto",
    split: str | None = None,
    dataset_config: str | None = None,
    streaming: bool = False,
    append_eos: bool = True,
    skip_bad: bool = False,
    shard_size: int | str | None = None,
    shard_input_size: int | str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    quiet: bool = False,
    _stop_after_tasks: int | None = None,  # tests: simulate an interruption after this many tasks
) -> dict:
    """Tokenize `inputs` into `output_prefix`.bin/.idx (or numbered shards); returns the manifest.
    shard_size: numbered shards of about that many tokens (one writer). shard_input_size: numbered shards of
    about that many input bytes, each written and hashed by one worker (group_shards.py). split / dataset_config /
    streaming: for Hugging Face datasets inputs (sources.py open_dataset)."""
    t0 = time.perf_counter()
    shard_size = parse_size(shard_size)
    shard_input_size = parse_size(shard_input_size)
    if shard_size is not None and shard_input_size is not None:
        raise ValueError("--shard-size and --shard-input-size exclude each other: shards are cut either by "
                         "tokens (one writer) or by input bytes (one writer per shard)")
    for name, v in (("--shard-size", shard_size), ("--shard-input-size", shard_input_size)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    tok = load_tokenizer(tokenizer)
    if append_eos and tok.eos_id is None:
        raise TokenizerError(f"{tokenizer}: the tokenizer has no end-of-document token; pass --no-eos")
    dtype = dtype_for_vocab(tok.vocab_size)
    opts = EncodeOptions(tokenizer, text_key, append_eos, skip_bad, dtype.name)
    files = expand_inputs(list(inputs), input_format, text_key, split, dataset_config, streaming)
    fingerprint = _fingerprint(files, tok, opts, shard_size, text_per_line)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    work = output_prefix + ".partial"
    old = existing_outputs(output_prefix)
    if old and not overwrite:
        raise FileExistsError(f"{output_prefix}: outputs already exist ({', '.join(old[:3])}...); pass --overwrite")

    if shard_input_size is not None:
        fingerprint["options"]["shard_input_size"] = shard_input_size
        return _preprocess_groups(files, output_prefix, work, tok, opts, fingerprint, shard_input_size, workers,
                                  resume, overwrite, progress, quiet, _stop_after_tasks, t0)
    writer = ShardWriter(work, dtype, shard_size)
    state = read_progress(work) if os.path.isdir(work) else None
    if os.path.isdir(work) and not resume:
        if not overwrite:
            raise FileExistsError(
                f"{work}: an interrupted run left this folder; pass --resume to continue it or --overwrite to start over"
            )
        shutil.rmtree(work)
        state = None
    if state is not None:
        if state.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{work}: cannot resume: the inputs, tokenizer or options differ from the interrupted run "
                "(pass --overwrite to start over)"
            )
        writer.resume(state)
        tasks_done = int(state["tasks_done"])
        stats = dict(state["stats"])
        done_bytes = int(state["input_bytes_done"])
        if not quiet:
            print(f"resuming {work}: {tasks_done} tasks, {stats['documents']} documents already written", file=sys.stderr)
    else:
        if os.path.isdir(work):
            shutil.rmtree(work)
        writer.start()
        tasks_done, stats, done_bytes = 0, dict.fromkeys(STAT_KEYS, 0), 0

    def save_checkpoint():
        writer.checkpoint(tasks_done, {"fingerprint": fingerprint, "stats": stats, "input_bytes_done": done_bytes})

    total_bytes = sum(f.size for f in files)
    bar = _progress_bar(_known(files, total_bytes), done_bytes, progress and not quiet)
    all_tasks = iter_tasks(files, text_key, text_per_line)
    for _ in range(tasks_done):  # deterministic task cutting: skip what the interrupted run wrote
        next(all_tasks)
    # One output file: its sha256 is taken as its bytes are written (by the tokenizing thread in one process,
    # by the main process as it copies the workers' pieces into place). Numbered shards are hashed at the end.
    direct = None
    inline_hash = None
    if shard_size is None:
        inline_hash = hashlib.sha256()
        _hash_prefix(inline_hash, writer.bin_file(), writer.bin_bytes)
        if workers <= 1:
            direct = {"bin_file": writer.bin_file(), "offset": writer.bin_bytes, "hasher": inline_hash}
    input_hashes = None
    succeeded = False
    try:
        save_checkpoint()
        last_ckpt = time.perf_counter()
        t_run = time.perf_counter()
        docs_run = toks_run = 0
        _remove_pieces(work)
        # pieces of PIECE_BYTES, but at least 4 per worker: a small input (or compressed Parquet, whose tasks
        # count compressed bytes) must still spread over the workers
        piece_bytes = (min(PIECE_BYTES, max(1, (total_bytes - done_bytes) // (4 * max(workers, 1))))
                       if _known(files, total_bytes) is not None else PIECE_BYTES)
        results = _ordered_map(workers, opts, tok, all_tasks, direct, pieces_dir=work, piece_bytes=piece_bytes,
                               fork_ok=_fork_ok(files))
        # background input hashing starts after the pool (a fork start needs a single-threaded process)
        first = next(results, None)
        input_hashes = _InputHashes(_hashed(files), background=workers > 1)
        for ntasks, nbytes, res in (_chain(first, results) if first is not None else ()):
            if direct is not None:
                lengths, st, off, nb = res
                writer.add_direct(lengths, nb)
            elif workers > 1:
                piece, lengths, st = res
                writer.add_piece(piece, lengths, inline_hash)
                os.remove(piece)
            else:
                tokens, lengths, st = res
                writer.add(tokens, lengths)
            for k in STAT_KEYS:
                stats[k] += st[k]
            tasks_done += ntasks
            done_bytes += nbytes
            docs_run += st["documents"]
            toks_run += st["tokens"]
            bar.update(nbytes)
            dt = max(time.perf_counter() - t_run, 1e-9)
            bar.set_postfix_str(f"{docs_run / dt:,.0f} docs/s {toks_run / dt:,.0f} tok/s", refresh=False)
            now = time.perf_counter()
            if now - last_ckpt >= CHECKPOINT_SECONDS:
                save_checkpoint()
                last_ckpt = now
            if _stop_after_tasks is not None and tasks_done >= _stop_after_tasks:
                save_checkpoint()
                raise KeyboardInterrupt("test interruption")
        bar.close()
        n_shards = writer.finish()
        succeeded = True
    except KeyboardInterrupt:
        bar.close()
        writer.close_files()
        if not quiet:
            print(f"interrupted: progress kept in {work}; rerun with --resume to continue", file=sys.stderr)
        raise
    finally:
        if not succeeded:
            writer.close_files()
            _discard_failed_work(work)

    # Hash, move into place, then write the manifest last: its presence marks a complete output.
    numbered = shard_size is not None
    bin_digest = inline_hash.hexdigest() if inline_hash is not None else None
    shards = []
    for i in range(n_shards):
        b, x = os.path.join(work, f"shard-{i:05d}.bin"), os.path.join(work, f"shard-{i:05d}.idx")
        final = f"{output_prefix}-{i:05d}" if numbered else output_prefix
        shards.append({
            "prefix": os.path.basename(final),
            "bin": {"file": os.path.basename(bin_path(final)), "bytes": os.path.getsize(b),
                    "sha256": bin_digest if bin_digest is not None else sha256_file(b)},
            "idx": {"file": os.path.basename(idx_path(final)), "bytes": os.path.getsize(x), "sha256": sha256_file(x)},
            "tokens": os.path.getsize(b) // dtype.itemsize,
        })
    in_sha = input_hashes.get()
    for p in existing_outputs(output_prefix):  # --overwrite: stale shards must not be picked up later
        os.remove(p)
    writer.move_into_place(n_shards, output_prefix, numbered)
    manifest = _manifest(tok, dtype, opts, stats, shards, numbered, shard_size, text_per_line, files, in_sha)
    write_json_atomic(manifest_path(output_prefix), manifest)
    shutil.rmtree(work, ignore_errors=True)
    if not quiet:
        _summary(manifest, output_prefix, total_bytes, time.perf_counter() - t0)
    return manifest


def _preprocess_groups(files, output_prefix, work, tok, opts, fingerprint, group_bytes, workers, resume, overwrite,
                       progress, quiet, stop_after, t0) -> dict:
    """--shard-input-size: input tasks grouped by input bytes, one shard per group, each written and hashed
    by the worker that tokenizes it (group_shards.py). Same manifest as the other modes."""
    from . import group_shards as gs

    dtype = np.dtype(opts.dtype)
    done: dict = {}
    if os.path.isdir(work):
        if not resume and not overwrite:
            raise FileExistsError(
                f"{work}: an interrupted run left this folder; pass --resume to continue it or --overwrite to start over")
        if resume and os.path.exists(os.path.join(work, gs.PROGRESS)):
            done, redo = gs.read_done(work, fingerprint)
            if not quiet:
                print(f"resuming {work}: {len(done)} shard groups already written", file=sys.stderr)
                if redo:
                    print(f"  {len(redo)} recorded groups no longer match their sha256 (lost in a crash?) and are "
                          f"redone: {', '.join(map(str, redo[:10]))}{' ...' if len(redo) > 10 else ''}", file=sys.stderr)
        else:
            shutil.rmtree(work)
    os.makedirs(work, exist_ok=True)
    total_bytes = sum(f.size for f in files)
    bar = _progress_bar(_known(files, total_bytes), sum(r["input_bytes"] for r in done.values()), progress and not quiet)
    groups = ((g, tasks) for g, tasks in enumerate(gs.group_tasks(iter_tasks(files, opts.text_key, fingerprint[
        "options"]["text_per_line"]), group_bytes)) if g not in done)
    input_hashes = None
    succeeded = False
    try:
        gs.write_progress(work, fingerprint, done)
        results = gs.run_groups(groups, work, opts, tok, workers, _start_method(_fork_ok(files)))
        first = next(results, None)  # the pool forks before the hashing and recording threads start
        input_hashes = _InputHashes(_hashed(files), background=workers > 1)
        recorder = gs.ProgressRecorder(work, fingerprint, done)
        try:
            for n, r in enumerate(_chain(first, results) if first is not None else (), 1):
                recorder.add(r)
                bar.update(r["input_bytes"])
                if stop_after is not None and n >= stop_after:
                    raise KeyboardInterrupt("test interruption")
        except BaseException:
            recorder.close(reraise=False)  # on an interruption, what finished is recorded before we leave
            raise
        recorder.close()
        bar.close()
        succeeded = True
    except KeyboardInterrupt:
        bar.close()
        if not quiet:
            print(f"interrupted: progress kept in {work}; rerun with --resume to continue", file=sys.stderr)
        raise
    finally:
        if not succeeded:
            _discard_failed_work(work)
    in_sha = input_hashes.get() if input_hashes is not None else _InputHashes(_hashed(files), False).get()
    stats = dict.fromkeys(STAT_KEYS, 0)
    for r in done.values():
        for k in STAT_KEYS:
            stats[k] += r["stats"][k]
    for p in existing_outputs(output_prefix):  # --overwrite: stale outputs must not be picked up later
        os.remove(p)
    placed = gs.move_into_place(work, done, output_prefix)
    shards = [{
        "prefix": os.path.basename(final),
        "bin": {"file": os.path.basename(bin_path(final)), "bytes": done[g]["bin_bytes"], "sha256": done[g]["bin_sha256"]},
        "idx": {"file": os.path.basename(idx_path(final)), "bytes": done[g]["idx_bytes"], "sha256": done[g]["idx_sha256"]},
        "tokens": done[g]["bin_bytes"] // dtype.itemsize,
    } for g, final in placed]
    manifest = _manifest(tok, dtype, opts, stats, shards, True, None, fingerprint["options"]["text_per_line"], files,
                         in_sha)
    manifest["shard_input_size"] = group_bytes
    write_json_atomic(manifest_path(output_prefix), manifest)
    shutil.rmtree(work, ignore_errors=True)
    if not quiet:
        _summary(manifest, output_prefix, total_bytes, time.perf_counter() - t0)
    return manifest


def _manifest(tok, dtype, opts, stats, shards, numbered, shard_size, text_per_line, files, in_sha) -> dict:
    return {
        "format": "megassm-shards",
        "version": MANIFEST_VERSION,
        "tokenizer": tokenizer_info(tok),
        "dtype": dtype.name,
        "dtype_code": CODE_OF_DTYPE[dtype],
        "append_eos": opts.append_eos,
        "num_documents": stats["documents"],
        "num_tokens": stats["tokens"],
        "shards": shards,
        "numbered_shards": numbered,
        "shard_size": shard_size,
        "stats": {k: stats[k] for k in STAT_KEYS if k not in ("documents", "tokens")},
        "options": {"text_key": opts.text_key, "text_per_line": text_per_line, "skip_bad": opts.skip_bad},
        "inputs": [{"path": f.path, "format": f.format, "bytes": f.size, "sha256": in_sha[f.path]} if f.source is None
                   else {**f.source.record, "bytes": f.size} for f in files],
    }


def _fork_ok(files: list[InputFile]) -> bool:
    return all(f.source is None for f in files)  # _start_method: no fork once a dataset is open


def _hashed(files: list[InputFile]) -> list[str]:
    """The input files whose sha256 the manifest records (a dataset input records datasets' fingerprint)."""
    return [f.path for f in files if f.source is None]


def _summary(m: dict, prefix: str, nbytes: int, seconds: float) -> None:
    s = m["stats"]
    where = f"{prefix}.bin/.idx" if not m["numbered_shards"] else f"{prefix}-00000 ... ({len(m['shards'])} shards)"
    print(
        f"wrote {where}: {m['num_documents']:,} documents, {m['num_tokens']:,} tokens ({m['dtype']}), "
        f"tokenizer {m['tokenizer']['name']}\n"
        f"  {seconds:.1f} s: {m['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{nbytes / 1e6 / max(seconds, 1e-9):.1f} MB/s of input\n"
        f"  skipped: {s['empty_skipped']} empty documents, {s['bad_skipped']} bad lines; "
        f"{s['invalid_utf8_replaced']} documents had invalid UTF-8 replaced\n"
        f"  manifest: {manifest_path(prefix)}",
        file=sys.stderr,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megassm-preprocess",
        description="Tokenize JSONL (.gz/.zst), Parquet, Arrow IPC, plain-text corpora or Hugging Face datasets into "
        "Megatron-compatible .bin/.idx shards with a manifest.",
    )
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files, folders or globs")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx, PREFIX.manifest.json")
    p.add_argument("--tokenizer", default="byte", metavar="TOK", help="byte | SentencePiece .model | tokenizer.json (default byte)")
    p.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer worker processes (default 1)")
    p.add_argument("--text-key", default="text", help="JSON key / Parquet or Arrow column holding the text (default text)")
    p.add_argument("--text-per-line", action="store_true", help="plain-text inputs: one document per line, not per file")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "parquet", "arrow", "text", "datasets"],
                   help="input format for every input (default: by file name; a save_to_disk folder is a Hugging Face "
                        "dataset); datasets: each --input is a name or path for datasets.load_dataset")
    p.add_argument("--split", default=None, help="Hugging Face datasets inputs: the split (default: train, or the "
                                                 "only one)")
    p.add_argument("--dataset-config", default=None, metavar="NAME",
                   help="Hugging Face datasets inputs: load_dataset's configuration name (e.g. wikitext-103-raw-v1)")
    p.add_argument("--streaming", action="store_true",
                   help="Hugging Face datasets inputs (--format datasets): read with load_dataset(streaming=True), "
                        "record by record, without downloading the whole dataset first")
    p.add_argument("--no-eos", dest="append_eos", action="store_false", help="do not append EOS to each document")
    p.add_argument("--skip-bad", action="store_true", help="skip and count malformed JSON lines instead of failing")
    p.add_argument("--shard-size", default=None, metavar="TOKENS",
                   help="write numbered shards PREFIX-00000 ... of about this many tokens (e.g. 500M)")
    p.add_argument("--shard-input-size", default=None, metavar="BYTES",
                   help="write numbered shards PREFIX-00000 ... of about this much input each (e.g. 256M), each "
                        "tokenized, written and hashed by one worker: what lets cheap tokenizers (byte) use "
                        "several cores; excludes --shard-size")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from PREFIX.partial/")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary (stdout still lists the shard prefixes)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print("megassm-preprocess: error: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        manifest = preprocess(
            args.input, args.output_prefix, tokenizer=args.tokenizer, workers=args.workers, text_key=args.text_key,
            text_per_line=args.text_per_line, input_format=args.format, split=args.split,
            dataset_config=args.dataset_config, streaming=args.streaming, append_eos=args.append_eos,
            skip_bad=args.skip_bad, shard_size=args.shard_size, shard_input_size=args.shard_input_size,
            resume=args.resume, overwrite=args.overwrite,
            progress=not args.quiet, quiet=args.quiet,
        )
    except KeyboardInterrupt:
        return 130
    except (DataInputError, TokenizerError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"megassm-preprocess: error: {e}", file=sys.stderr)
        return 1
    # the result on stdout, one shard prefix a line (data.paths takes them, or PREFIX for all); logs on stderr
    where = os.path.dirname(args.output_prefix)
    for shard in manifest["shards"]:
        print(os.path.join(where, shard["prefix"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
