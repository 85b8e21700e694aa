"""Deterministic orderings: seeded permutations, exact-proportion interleaving, the document split.

Everything here is a pure function of its integer arguments (seed, salts, indices), so a sample's
identity never depends on how many samples were drawn before it, on the number of data-parallel ranks,
or on whether the run was resumed.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

INTERLEAVE_PERIOD = 1 << 17  # weights are quantized to 1/131072; proportions drift by < 1e-5


def rng(seed: int, *keys: int) -> np.random.Generator:
    """An independent generator for (seed, keys...): e.g. rng(seed, dataset, purpose, epoch)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, *map(int, keys)])))


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-mixed 64-bit hash."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class IndexPermutation:
    """A seeded bijection of [0, n) evaluated one index at a time in O(1) memory: a 4-round Feistel
    network on the smallest even-bit domain >= n, with cycle-walking back into [0, n) (< 4 steps on
    average). Used for sample order, where n (samples per epoch) can be hundreds of millions and a
    materialized permutation would cost gigabytes."""

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"permutation size must be >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        state = np.random.SeedSequence([int(k) & _M64 for k in key]).generate_state(4, np.uint64)
        self.keys = [int(k) for k in state]

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} outside [0, {self.n})")
        x, h, mask = int(i), self.half, self.mask
        while True:
            left, right = x >> h, x & mask
            for k in self.keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            x = (left << h) | right
            if x < self.n:
                return x


class LRU:
    """A tiny bounded cache: epochs' permutations are reused by neighbouring samples."""

    def __init__(self, size: int = 2):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key, make):
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        value = make()
        self._d[key] = value
        if len(self._d) > self.size:
            self._d.popitem(last=False)
        return value


def _quota(weights, total: int) -> np.ndarray:
    """Largest-remainder split of `total` slots by weight; every positive weight gets at least 1."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative numbers with a positive sum, got {list(weights)}")
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - counts)))  # biggest remainder first, then index
    counts[order[:rest]] += 1
    for d in np.nonzero((w > 0) & (counts == 0))[0]:
        counts[int(np.argmax(counts))] -= 1
        counts[d] += 1
    return counts


class Interleave:
    """Maps a global index to (source, index within that source) with exact proportions.

    One period of P slots holds each source's quota c_d; inside the period the k-th item of source d
    sits at its ideal time (k + 0.5) / c_d, all items sorted by that time. So every prefix of the
    sequence holds each source within about one item of its exact share, and the mapping of any index
    is O(1) with no history: index g lies in period g // P at slot g % P."""

    def __init__(self, weights, period: int = INTERLEAVE_PERIOD):
        self.counts = _quota(weights, period)
        self.period = period
        src = np.repeat(np.arange(len(self.counts)), self.counts)
        k = np.concatenate([np.arange(c) for c in self.counts])
        t = (k + 0.5) / np.maximum(self.counts[src], 1)
        order = np.lexsort((src, t))
        self.source = src[order].astype(np.int32)
        self.local = k[order].astype(np.int64)

    def __call__(self, g):
        g = np.asarray(g, dtype=np.int64)
        q, r = np.divmod(g, self.period)
        src = self.source[r]
        return src, q * self.counts[src] + self.local[r]


SPLIT_NAMES = ("train", "valid", "test")


def split_documents(num_docs: int, fractions) -> list[np.ndarray]:
    """Document ids of the train/valid/test splits. Documents are dealt out by `Interleave` (not cut into
    contiguous ranges), so each split samples the whole corpus evenly and the split does not depend
    on the training seed."""
    if len(fractions) != 3:
        raise ValueError(f"split must be three numbers train,valid,test, got {list(fractions)}")
    which, _ = Interleave(fractions)(np.arange(num_docs))
    return [np.nonzero(which == s)[0].astype(np.int64) for s in range(3)]
