"""Memory-mapped datasets: shards + manifest, packed samples, blends.

Packing (Megatron/GPT style): per epoch, a split's documents are concatenated in an order shuffled by
(seed, dataset, epoch); epochs follow each other into one endless token stream. Sample s is the
seq_len + 1 tokens starting at token s * seq_len (sample s's last label is sample s+1's first input).
Sample indices are then shuffled inside blocks of one epoch's worth of samples, so a global sample
index maps to its tokens with no history.

For each sample: tokens[0:L] are inputs, tokens[1:L+1] labels, and `seq_idx` numbers the documents of
the inputs 0, 0, ..., 1, 1, 2, ... so models reset their state at document starts. A label may cross a
document boundary (the EOS position predicts the next document's first token): standard GPT packing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import numpy as np

from .indexed import ShardFormatError, ShardSet, shard_prefixes
from .sampler import LRU, IndexPermutation, Interleave, rng

log = logging.getLogger("megassm.data")

_PURPOSE_DOC_ORDER = 1
_PURPOSE_SAMPLE_ORDER = 2
SCAN_TOKENS = 1 << 28  # datasets up to this many tokens have their ids checked at start (a fast pass)


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary; the message names the shard file, document and id."""


@dataclass
class Sample:
    tokens: np.ndarray  # int64 [L+1]
    seq_idx: np.ndarray  # int32 [L]
    starts_document: bool  # tokens[0] is the first token of a document


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def check_shard_records(prefixes: list[str], manifest: dict, mpath: str) -> None:
    """Each shard's files against the manifest's record of them (its "shards" list, in shard order): the .idx by
    size and sha256 (it is small: ~20 bytes a document), the .bin by size only (it can be terabytes; with the .idx
    verified, the .idx's own checks then tie the .bin to it: the pointers are the running sum of the lengths, which
    add up to the .bin's size). ShardFormatError naming the file, the recorded and the found value. A manifest
    without shard records (written by hand, or by an older megassm) checks nothing here, logged."""
    records = manifest.get("shards")
    if not isinstance(records, list) or not records:
        log.info("%s records no shard files (sizes, sha256): the shards' files are not checked against it", mpath)
        return
    if len(records) != len(prefixes):
        names = ", ".join(str(r.get("prefix")) for r in records if isinstance(r, dict))
        raise ShardFormatError(f"{mpath}: records {len(records)} shards ({names}), found {len(prefixes)} "
                               f"({', '.join(os.path.basename(p) for p in prefixes)}): shards and manifest differ")
    for prefix, rec in zip(prefixes, records):
        rec = rec if isinstance(rec, dict) else {}
        idx, bin_ = (rec.get(k) if isinstance(rec.get(k), dict) else {} for k in ("idx", "bin"))
        for path, want in ((prefix + ".bin", bin_), (prefix + ".idx", idx)):  # sizes first: no hashing to find these
            if want.get("bytes") is not None and os.path.isfile(path) and os.path.getsize(path) != want["bytes"]:
                size = os.path.getsize(path)
                raise ShardFormatError(f"{path}: {size} bytes, but {mpath} records {want['bytes']} for it: not the "
                                       "file the shards were written with (replaced, truncated or swapped with another "
                                       "shard's?)")
        path = prefix + ".idx"
        if idx.get("sha256") and os.path.isfile(path):
            got = _sha256(path)
            if got != idx["sha256"]:
                raise ShardFormatError(f"{path}: sha256 {got[:12]}.., but {mpath} records {str(idx['sha256'])[:12]}.. "
                                       f"(both {os.path.getsize(path)} bytes): not the index the shards were written "
                                       "with (swapped with another shard's .idx?)")


class TokenDataset:
    """One dataset path (a shard prefix, or all its numbered shards) with its manifest, whose record of each shard's
    files is checked before they are opened (check_shard_records)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.manifest = None
        mpath = prefix + ".manifest.json"
        if os.path.exists(mpath):
            with open(mpath) as f:
                try:
                    self.manifest = json.load(f)
                except json.JSONDecodeError as e:
                    raise ShardFormatError(f"{mpath}: invalid JSON: {e}") from None
            if not isinstance(self.manifest, dict):
                raise ShardFormatError(f"{mpath}: not a JSON object")
        prefixes = shard_prefixes(prefix)
        if self.manifest is not None:  # before the files are opened: their own checks cannot see a swapped .idx
            check_shard_records(prefixes, self.manifest, mpath)
        self.shards = ShardSet(prefixes)
        self.doc_lengths = self.shards.doc_lengths
        self.num_docs = self.shards.num_docs
        self.num_tokens = self.shards.num_tokens
        self.vocab_limit: int | None = None  # ids must be < this (set_vocab_limit); every read is checked
        if self.manifest is not None:
            want = self.manifest.get("num_tokens")
            if want is not None and want != self.num_tokens:
                raise ShardFormatError(
                    f"{mpath}: records {want} tokens but the shards hold {self.num_tokens}: shards and manifest differ"
                )

    @property
    def tokenizer(self) -> dict | None:
        return self.manifest.get("tokenizer") if self.manifest else None

    def max_token_id(self) -> int:
        """Scan for the largest id: the vocabulary of shards made without a manifest (e.g. by Megatron)."""
        return max((int(r.tokens.max()) for r in self.shards.readers if r.num_tokens), default=0)

    def read(self, doc: int, start: int, count: int) -> np.ndarray:
        out = self.shards.document(doc)[start : start + count]
        if self.vocab_limit is not None and len(out) and (out.max() >= self.vocab_limit or out.min() < 0):
            bad = int(np.argmax((out >= self.vocab_limit) | (out < 0)))
            raise TokenIdError(self._bad_id_message(doc, start + bad, int(out[bad])))
        return out

    def set_vocab_limit(self, vocab: int, scan_tokens: int | None = None) -> None:
        """Check every token id against the model's vocabulary from now on, whatever the manifest says. A
        dataset of at most `scan_tokens` tokens is scanned whole now, so a bad id fails before any compute;
        in a larger one the read that meets it fails."""
        self.vocab_limit = int(vocab)
        if self.num_tokens > (SCAN_TOKENS if scan_tokens is None else scan_tokens):
            return
        for r in self.shards.readers:
            if not r.num_tokens:
                continue
            toks = r.tokens
            if toks.max() < vocab and toks.min() >= 0:
                continue
            at = int(np.argmax((toks >= vocab) | (toks < 0)))
            first_doc = int(self.shards._shard_of_doc_start[self.shards.readers.index(r)])
            local = int(np.searchsorted(r.doc_offsets, at, side="right")) - 1
            raise TokenIdError(self._bad_id_message(first_doc + local, at - int(r.doc_offsets[local]), int(toks[at])))

    def _bad_id_message(self, doc: int, pos: int, token: int) -> str:
        reader, _ = self.shards.locate(doc)
        local = doc - int(self.shards._shard_of_doc_start[self.shards.readers.index(reader)])
        said = ""
        if self.tokenizer and self.tokenizer.get("vocab_size") is not None:
            said = f"; {self.prefix}.manifest.json says vocabulary {self.tokenizer['vocab_size']}"
        return (f"{reader.bin_path}: token id {token} in document {local} (token {pos}) is outside the model's "
                f"vocabulary of {self.vocab_limit} (ids 0..{self.vocab_limit - 1}){said}: were these shards made "
                "with another tokenizer? (model.vocab_size sets the model's vocabulary)")


class PackedSamples:
    """An endless stream of packed samples over a subset of a dataset's documents."""

    def __init__(self, data: TokenDataset, doc_ids: np.ndarray, seq_len: int, seed: int, salt: int, name: str = ""):
        self.data, self.seq_len, self.seed, self.salt = data, int(seq_len), int(seed), int(salt)
        self.doc_ids = np.asarray(doc_ids, dtype=np.int64)
        self.lengths = data.doc_lengths[self.doc_ids]
        self.tokens_per_epoch = int(self.lengths.sum())
        if self.tokens_per_epoch == 0:
            raise ValueError(f"{data.prefix}: {name or 'this split'} has no tokens ({len(self.doc_ids)} documents)")
        # One shuffle block = one epoch's worth of whole samples (at least 1).
        self.block = max(1, self.tokens_per_epoch // self.seq_len)
        self._epochs = LRU(2)  # a sample can straddle two epochs
        self._blocks = LRU(2)

    def __len__(self) -> int:
        """Samples per epoch."""
        return self.block

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        def make():
            perm = rng(self.seed, self.salt, _PURPOSE_DOC_ORDER, e).permutation(len(self.doc_ids))
            return self.doc_ids[perm], np.cumsum(self.lengths[perm])
        return self._epochs.get(e, make)

    def _sample_start(self, g: int) -> int:
        q, r = divmod(int(g), self.block)
        perm = self._blocks.get(q, lambda: IndexPermutation(self.block, self.seed, self.salt, _PURPOSE_SAMPLE_ORDER, q))
        return (q * self.block + perm(r)) * self.seq_len

    def read_stream(self, pos: int, count: int) -> Sample:
        """`count` tokens of the endless stream from token `pos`; seq_idx covers the first count - 1."""
        out = np.empty(count, dtype=np.int64)
        doc_of = np.empty(count, dtype=np.int32)
        filled, piece, starts = 0, 0, False
        T = self.tokens_per_epoch
        while filled < count:
            e, off = divmod(pos, T)
            order, ends = self._epoch(e)
            k = int(np.searchsorted(ends, off, side="right"))
            length = int(self.lengths_of(order[k]))
            within = off - (int(ends[k]) - length)
            if filled == 0:
                starts = within == 0
            m = min(count - filled, length - within)
            out[filled : filled + m] = self.data.read(int(order[k]), within, m)
            doc_of[filled : filled + m] = piece
            filled += m
            pos += m
            piece += 1
        return Sample(out, doc_of[: count - 1], starts)

    def lengths_of(self, doc: int) -> int:
        return int(self.data.doc_lengths[doc])

    def sample(self, g: int) -> Sample:
        return self.read_stream(self._sample_start(g), self.seq_len + 1)


class BlendedSamples:
    """Samples drawn from several PackedSamples with exact proportions (see sampler.Interleave).
    Each source keeps its own epochs: a small source with a large weight simply repeats more often."""

    def __init__(self, sources: list, weights):
        self.sources = sources
        self.interleave = Interleave(weights)

    def sample(self, g: int) -> Sample:
        src, local = self.interleave(g)
        return self.sources[int(src)].sample(int(local))

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)


def stack_samples(samples: list[Sample], reset_all: bool = False):
    """Samples -> the batch dict the trainer consumes (torch tensors). `reset_all`: every row is an
    independent sample (packed mode), so no recurrent state may be carried into any row."""
    import torch

    toks = np.stack([s.tokens for s in samples])
    return {
        "tokens": torch.from_numpy(np.ascontiguousarray(toks[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(toks[:, 1:])),
        "seq_idx": torch.from_numpy(np.stack([s.seq_idx for s in samples])),
        "reset": torch.tensor([reset_all or s.starts_document for s in samples], dtype=torch.bool),
    }
