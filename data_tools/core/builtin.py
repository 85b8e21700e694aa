"""The embedded default corpus: the Python standard library's own `.py` sources.

Every machine that runs megassm has them, so `data.builtin: stdlib` trains without downloads. They go
through the same `preprocess()` path as any user corpus (one document per file, byte tokenizer by
default) and are cached under $MEGASSM_CACHE (default ~/.cache/megassm/data), keyed by a hash of the
file list, their sizes, the Python version and the tokenizer, so a different Python gets its own shards.
The cache entry is built in a temporary folder and renamed into place: concurrent or interrupted runs
never see a half-built corpus.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile

from .preprocess import preprocess
from .tokenizers import load_tokenizer

STDLIB_CAP_BYTES = 16_000_000  # a few seconds of preprocessing on 2 cores
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
CACHE_FORMAT = 1


def default_cache_dir() -> str:
    return os.environ.get("MEGASSM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megassm", "data")


def stdlib_files(cap_bytes: int = STDLIB_CAP_BYTES) -> list[tuple[str, int]]:
    """(path, size) of the standard library's .py files, sorted by relative path, up to cap_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                found.append((os.path.relpath(path, root), path, os.path.getsize(path)))
    found.sort()
    out, total = [], 0
    for _, path, size in found:
        if total + size > cap_bytes:
            break
        out.append((path, size))
        total += size
    if not out:
        raise FileNotFoundError(f"{root}: no Python standard library sources found (is this a stripped Python?)")
    return out


def ensure_builtin_corpus(name: str = "stdlib", tokenizer: str = "byte", cache_dir: str | None = None,
                          workers: int = 1, quiet: bool = True) -> str:
    """Shard prefix of the built-in corpus, building it on first use."""
    if name != "stdlib":
        raise ValueError(f"unknown built-in corpus '{name}' (available: stdlib)")
    files = stdlib_files()
    tok = load_tokenizer(tokenizer)
    root = sysconfig.get_paths()["stdlib"]
    key_src = json.dumps({
        "format": CACHE_FORMAT, "python": sys.version, "tokenizer": tok.sha256,
        "files": [[os.path.relpath(p, root), s] for p, s in files],
    }, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    cache = cache_dir or default_cache_dir()
    final_dir = os.path.join(cache, f"{name}-{key}")
    prefix = os.path.join(final_dir, name)
    if os.path.exists(prefix + ".manifest.json"):
        return prefix
    os.makedirs(cache, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{name}-{key}.tmp-", dir=cache)
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private; the cache may be shared
        preprocess([p for p, _ in files], os.path.join(tmp_dir, name), tokenizer=tokenizer, workers=workers,
                   input_format="text", progress=False, quiet=quiet)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            # Another process finished first (the target exists and is not empty): use theirs.
            if not os.path.exists(prefix + ".manifest.json"):
                raise
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return prefix
