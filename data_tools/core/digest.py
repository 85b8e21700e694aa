"""sha256 of a file, for the manifest's digests: shared by preprocess.py (the one-writer pipeline) and
group_shards.py (the workers that write and hash their own shards), which preprocess.py drives; in a module of
its own so that group_shards.py needs nothing from preprocess.py (imports run one way)."""
from __future__ import annotations

import hashlib


def sha256_file(path: str) -> str:
    """sha256 of a file, read into one reused 1 MB buffer (it stays in cache: ~8% less CPU than fresh 4 MB
    blocks, which counts when the input hash shares 2 cores with the workers)."""
    h = hashlib.sha256()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()
