"""Data pipeline speed, printed as JSON.

    python benchmarks/data_throughput.py [--tokenizers byte,mistral] [--workers 1,2] [--max-mb 16]
                                         [--source stdlib|site-packages] [--repeats N]
                                         [--shard-input-size 32M]   # one shard per 32 MB of input, per worker
                                         [--fresh-process]          # each run in its own interpreter

Corpus: the Python standard library's sources (one document per file), written once as JSONL and as
Parquet. For each tokenizer x format x worker count: end-to-end `preprocess()` tokens/s (reading,
tokenizing, writing, hashing), and the speedup of the largest worker count over one worker. Then random
packed-sample reads (tokens/s in one process) from the byte-level shards at several sequence lengths.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np


def _site_packages_files(cap_bytes: int) -> list[tuple[str, int]]:
    """The installed packages' .py sources (sorted by path, up to cap_bytes): a bigger real code corpus than
    the standard library (12 MB), so fixed costs such as starting workers do not dominate."""
    import sysconfig

    root = sysconfig.get_paths()["purelib"]
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        found += [os.path.join(dirpath, n) for n in sorted(files) if n.endswith(".py")]
    out, total = [], 0
    for path in sorted(found):
        size = os.path.getsize(path)
        if total + size > cap_bytes:
            break
        out.append((path, size))
        total += size
    return out


def _corpus(tmp: str, max_mb: float, source: str = "stdlib") -> tuple[str, str, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megassm.data_tools.builtin import stdlib_files

    texts = []
    files = stdlib_files(int(max_mb * 1e6)) if source == "stdlib" else _site_packages_files(int(max_mb * 1e6))
    for path, _ in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    jsonl = os.path.join(tmp, "stdlib.jsonl")
    with open(jsonl, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    parquet = os.path.join(tmp, "stdlib.parquet")
    pq.write_table(pa.table({"text": texts}), parquet, row_group_size=256)
    return jsonl, parquet, sum(len(t.encode()) for t in texts)


def _mistral_model() -> str | None:
    try:
        import mistral_common
        import sentencepiece  # noqa: F401
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1")
    return path if os.path.exists(path) else None


# One preprocess() call in a fresh interpreter, timed inside it after the imports (pyarrow included): what one
# `megassm-preprocess` run costs beyond starting Python, with nothing warmed by an earlier call.
_FRESH = """
import json, sys, time
import numpy, pyarrow, pyarrow.parquet  # noqa: F401  (imports are not the tool's work)
from megassm.data_tools.preprocess import preprocess
inp, out, tok, w, shard = sys.argv[1:6]
t0 = time.perf_counter()
m = preprocess([inp], out, tokenizer=tok, workers=int(w), overwrite=True, quiet=True, progress=False,
               shard_input_size=shard or None)
print(json.dumps({"seconds": time.perf_counter() - t0, "num_tokens": m["num_tokens"],
                  "num_documents": m["num_documents"]}))
"""


def _preprocess_fresh(inp, out, tok, w, shard_input_size):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FRESH, inp, out, tok, str(w), shard_input_size or ""],
                          capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return r["seconds"], r


def bench_preprocess(inp: str, tok: str, workers: list[int], tmp: str, repeats: int = 1,
                     shard_input_size=None, fresh=False) -> dict[int, dict]:
    """Per worker count: best and median seconds over `repeats` runs. The worker counts alternate within
    each repeat (1, 2, 1, 2, ...), so a drift in the machine's speed (a 2-core VM's timings move by 20% from
    minute to minute) falls on every count alike instead of on whichever ran last. `fresh`: every run in its
    own interpreter (_FRESH), as a command-line run; otherwise all runs in this process, where one worker runs
    in it warmed by the earlier runs (its allocators' memory already mapped) and more workers are new processes
    every time."""
    from megassm.data_tools.preprocess import preprocess

    times: dict[int, list[float]] = {w: [] for w in workers}
    for _ in range(repeats):
        for w in workers:
            out = os.path.join(tmp, "out", "o")
            if fresh:
                sec, m = _preprocess_fresh(inp, out, tok, w, shard_input_size)
            else:
                t0 = time.perf_counter()
                m = preprocess([inp], out, tokenizer=tok, workers=w, overwrite=True, quiet=True, progress=False,
                               shard_input_size=shard_input_size)
                sec = time.perf_counter() - t0
            times[w].append(sec)
            shutil.rmtree(os.path.dirname(out))
    runs = {}
    for w, ts in times.items():
        best, med = min(ts), float(np.median(ts))
        runs[w] = {"seconds": round(best, 3), "median_seconds": round(med, 3), "tokens": m["num_tokens"],
                   "documents": m["num_documents"], "tokens_per_s": round(m["num_tokens"] / best),
                   "input_mb_per_s": round(os.path.getsize(inp) / 1e6 / best, 2)}
    return runs


def bench_reads(prefix: str, seq_lens=(512, 2048, 8192), seconds: float = 2.0) -> list[dict]:
    from megassm.data_tools.dataset import PackedSamples, TokenDataset

    ds = TokenDataset(prefix)
    out = []
    for L in seq_lens:
        ps = PackedSamples(ds, np.arange(ds.num_docs), L, seed=0, salt=0)
        r = np.random.default_rng(0)
        idx = r.integers(0, 50 * len(ps), size=1_000_000)  # random samples over ~50 epochs
        n = tokens = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            tokens += len(ps.sample(int(idx[n])).tokens)
            n += 1
        dt = time.perf_counter() - t0
        out.append({"seq_len": L, "samples": n, "tokens_per_s": round(tokens / dt)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizers", default="byte,mistral")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--max-mb", type=float, default=16.0, help="cap on the stdlib text used")
    ap.add_argument("--repeats", type=int, default=1,
                    help="N preprocessing runs per worker count, the counts alternating; best and median")
    ap.add_argument("--source", choices=("stdlib", "site-packages"), default="stdlib",
                    help="corpus: the standard library's sources (12 MB) or the installed packages' (larger)")
    ap.add_argument("--shard-input-size", default=None,
                    help="preprocess into numbered shards cut by input size, each written by one worker")
    ap.add_argument("--fresh-process", action="store_true",
                    help="each preprocessing run in a fresh interpreter (timed after its imports), as one "
                         "command-line run; default: all in this process")
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    tmp = tempfile.mkdtemp(prefix="megassm-bench-")
    try:
        jsonl, parquet, nbytes = _corpus(tmp, args.max_mb, args.source)
        result = {
            "benchmark": "data_throughput",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "corpus": {"name": f"python {args.source} sources", "text_mb": round(nbytes / 1e6, 2)},
            "preprocess": [],
        }
        toks = {"byte": "byte", "mistral": _mistral_model()}
        for name in args.tokenizers.split(","):
            tok = toks.get(name, name)
            if tok is None:
                result["preprocess"].append({"tokenizer": name, "skipped": "mistral-common / sentencepiece not installed"})
                continue
            for fmt, inp in (("jsonl", jsonl), ("parquet", parquet)):
                runs = bench_preprocess(inp, tok, workers, tmp, args.repeats, args.shard_input_size,
                                        fresh=args.fresh_process)
                entry = {"tokenizer": name, "format": fmt, "shard_input_size": args.shard_input_size,
                         "fresh_process": args.fresh_process,
                         "runs": {str(w): r for w, r in runs.items()}}
                if 1 in runs and len(runs) > 1:  # on the best runs, and on the medians
                    top = max(workers)
                    entry[f"speedup_{top}_vs_1"] = round(runs[1]["seconds"] / runs[top]["seconds"], 2)
                    entry[f"speedup_{top}_vs_1_median"] = round(runs[1]["median_seconds"] / runs[top]["median_seconds"], 2)
                result["preprocess"].append(entry)
        from megassm.data_tools.preprocess import preprocess

        prefix = os.path.join(tmp, "reads", "byte")
        preprocess([jsonl], prefix, tokenizer="byte", quiet=True, progress=False)
        result["random_sample_reads"] = bench_reads(prefix)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
