"""Synthetic recall tasks of the seed papers, as seeded batch generators.

Every generator takes a numpy Generator and returns {"tokens": int64 [B, L], "labels": int64 [B, L]} with
labels = -100 wherever nothing is scored, so a language model's ordinary next-token loss trains on the
scored positions only, and accuracy is argmax == label over them. `labels[t]` is the answer the model
must give after reading tokens[: t + 1] (the LM's own convention: logits at t predict labels at t).

    induction_heads      Mamba (Gu & Dao, sec. 4.1.2): vocab 16, trained at 256, tested up to 1M.
    coffee_induction     COFFEE (App. E, eq. 19): noise1 | trigger | target | noise2 | trigger, L = 16.
    selective_copying    Mamba (Table 1, App. E.1): 16 data tokens among noise, copied in order.
    mqar                 Zoology multi-query associative recall (Arora et al.), as Longhorn / B'MOJO use it.
"""
from __future__ import annotations

import numpy as np

IGNORE = -100

__all__ = ["IGNORE", "TASKS", "induction_heads", "coffee_induction", "selective_copying", "mqar", "task_vocab",
           "make_batch"]


def induction_heads(rng: np.random.Generator, batch: int, seq_len: int, vocab: int = 16) -> dict:
    """Random tokens from 0..vocab-2; the trigger (vocab - 1) appears once at a random position p in the
    first half followed by a target token, and again as the last token; the label at the last position is
    the target (the token that followed the first trigger). Only that position is scored."""
    if seq_len < 4:
        raise ValueError(f"induction_heads: seq_len must be >= 4, got {seq_len}")
    if vocab < 3:
        raise ValueError(f"induction_heads: vocab must be >= 3, got {vocab}")
    trigger = vocab - 1
    tokens = rng.integers(0, vocab - 1, size=(batch, seq_len))
    pos = rng.integers(0, max(seq_len // 2, 1), size=batch)
    pos = np.minimum(pos, seq_len - 3)
    rows = np.arange(batch)
    target = tokens[rows, pos + 1]
    tokens[rows, pos] = trigger
    tokens[:, -1] = trigger
    labels = np.full((batch, seq_len), IGNORE, dtype=np.int64)
    labels[:, -1] = target
    return {"tokens": tokens.astype(np.int64), "labels": labels}


def coffee_induction(rng: np.random.Generator, batch: int, seq_len: int = 16, n_symbols: int = 8,
                     trigger: int = 1) -> dict:
    """COFFEE's format (App. E, eq. 19, L_tri = L_tar = 1): noise1 | trigger | target | noise2 | trigger, with
    symbols 1..n_symbols-1 (0 is the pad symbol and never appears), positions uniform, noise and target never
    the trigger (noise may hold the target). The label at the last position (the second trigger) is the
    target; chance is 1 / (n_symbols - 2)."""
    if seq_len < 4:
        raise ValueError(f"coffee_induction: seq_len must be >= 4, got {seq_len}")
    if not 1 <= trigger < n_symbols or n_symbols < 4:
        raise ValueError(f"coffee_induction: need 1 <= trigger < n_symbols and n_symbols >= 4, got trigger "
                         f"{trigger}, n_symbols {n_symbols}")
    choices = np.array([s for s in range(1, n_symbols) if s != trigger])
    tokens = choices[rng.integers(0, len(choices), size=(batch, seq_len))]
    # first trigger at p in [0, L - 3] (target at p + 1, noise2 of length >= 0 before the last trigger)
    pos = rng.integers(0, seq_len - 2, size=batch)
    rows = np.arange(batch)
    tokens[rows, pos] = trigger
    tokens[:, -1] = trigger
    labels = np.full((batch, seq_len), IGNORE, dtype=np.int64)
    labels[:, -1] = tokens[rows, pos + 1]
    return {"tokens": tokens.astype(np.int64), "labels": labels}


def selective_copying(rng: np.random.Generator, batch: int, seq_len: int = 4096, n_data: int = 16,
                      vocab: int = 16) -> dict:
    """`n_data` data tokens (1..vocab-2) at random sorted positions among noise (0) in the first
    seq_len - n_data positions, then n_data copy markers (vocab - 1): at marker j the label is data token j.
    Vocab includes the noise token and the marker, as in the Mamba paper's vocab 16."""
    ctx = seq_len - n_data
    if ctx < n_data or n_data < 1:
        raise ValueError(f"selective_copying: need seq_len >= 2 x n_data and n_data >= 1, got seq_len "
                         f"{seq_len}, n_data {n_data}")
    if vocab < 3:
        raise ValueError(f"selective_copying: vocab must be >= 3, got {vocab}")
    data = rng.integers(1, vocab - 1, size=(batch, n_data))
    tokens = np.zeros((batch, seq_len), dtype=np.int64)
    labels = np.full((batch, seq_len), IGNORE, dtype=np.int64)
    for b in range(batch):
        pos = np.sort(rng.choice(ctx, size=n_data, replace=False))
        tokens[b, pos] = data[b]
    tokens[:, ctx:] = vocab - 1
    # the marker at ctx + j answers data token j (labels[t] is predicted from tokens[: t + 1])
    labels[:, ctx:] = data
    return {"tokens": tokens, "labels": labels}


def mqar(rng: np.random.Generator, batch: int, seq_len: int, n_kv: int = 8, vocab: int = 8192,
         power_a: float = 0.01) -> dict:
    """Zoology's multi-query associative recall: n_kv (key, value) pairs first (keys from 1..vocab/2 - 1,
    distinct per row; values from vocab/2..vocab-1), then the rest of the sequence is 0 except that every
    key appears once more as a query, at gaps drawn from the power law p(gap) ~ gap^(power_a - 1). At a
    query the label is that key's value. Scored: the n_kv query positions."""
    half = vocab // 2
    if n_kv < 1 or half - 1 < n_kv:
        raise ValueError(f"mqar: need 1 <= n_kv <= vocab/2 - 1, got n_kv {n_kv}, vocab {vocab}")
    ctx = 2 * n_kv
    free = seq_len - ctx
    if free < n_kv:
        raise ValueError(f"mqar: seq_len {seq_len} leaves {free} positions for {n_kv} queries after the "
                         f"{n_kv} pairs (need seq_len >= 3 x n_kv)")
    gaps = np.arange(1, free + 1, dtype=np.float64)
    p = gaps ** (power_a - 1.0)
    p /= p.sum()
    tokens = np.zeros((batch, seq_len), dtype=np.int64)
    labels = np.full((batch, seq_len), IGNORE, dtype=np.int64)
    for b in range(batch):
        keys = rng.choice(np.arange(1, half), size=n_kv, replace=False)
        values = rng.integers(half, vocab, size=n_kv)
        tokens[b, 0:ctx:2], tokens[b, 1:ctx:2] = keys, values
        slots = ctx + rng.choice(free, size=n_kv, replace=False, p=p) if free > n_kv else ctx + np.arange(free)
        order = rng.permutation(n_kv)
        tokens[b, slots] = keys[order]
        labels[b, slots] = values[order]
    return {"tokens": tokens, "labels": labels}


TASKS = {
    "induction_heads": induction_heads,
    "coffee_induction": coffee_induction,
    "selective_copying": selective_copying,
    "mqar": mqar,
}


def task_vocab(name: str, params: dict) -> int:
    """The vocabulary a model of this task needs."""
    if name == "coffee_induction":
        return int(params.get("n_symbols", 8))
    if name == "mqar":
        return int(params.get("vocab", 8192))
    return int(params.get("vocab", 16))


def make_batch(name: str, rng: np.random.Generator, batch: int, seq_len: int, params: dict) -> dict:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task '{name}' (choose from {', '.join(TASKS)})")
    return TASKS[name](rng, batch, seq_len, **params)
