"""BPTT stream mode: each batch row follows its own stream of documents across steps.

The training documents form one endless sequence (each dataset's documents shuffled per epoch by
(seed, dataset, epoch); several datasets interleaved by weight, per document). With S streams (one per
row of the global batch), stream s takes documents s, s + S, s + 2S, ... of that sequence, concatenated.
Window k of a stream is its tokens [k*L, k*L + L + 1): window k+1 starts exactly where window k ended,
so a recurrent state carried from one step to the next continues the same text. `seq_idx` numbers the
documents inside a window; `reset` is true when the window begins with a new document (the carried
state must be dropped). A stream's position is a pure function of (seed, stream, k), so a checkpoint
only needs k.
"""
from __future__ import annotations

import numpy as np

from .dataset import Sample, TokenDataset
from .sampler import LRU, Interleave, rng

_PURPOSE_STREAM_DOCS = 3


class DocumentSequence:
    """Position i -> (dataset, document) of the endless, shuffled, weight-interleaved document sequence."""

    def __init__(self, parts: list[tuple[TokenDataset, np.ndarray]], weights, seed: int):
        self.parts = [(ds, np.asarray(ids, dtype=np.int64)) for ds, ids in parts]
        for ds, ids in self.parts:
            if len(ids) == 0:
                raise ValueError(f"{ds.prefix}: the training split has no documents")
        self.seed = seed
        self.interleave = Interleave(weights) if len(parts) > 1 else None
        self._perms = [LRU(3) for _ in parts]

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        if self.interleave is None:
            src, local = np.zeros(len(positions), np.int32), positions
        else:
            src, local = self.interleave(positions)
        docs = np.empty(len(positions), dtype=np.int64)
        for d in np.unique(src):
            sel = src == d
            ids = self.parts[d][1]
            epoch, j = np.divmod(local[sel], len(ids))
            out = np.empty(len(j), dtype=np.int64)
            for e in np.unique(epoch):
                perm = self._perms[d].get(
                    int(e), lambda e=int(e): ids[rng(self.seed, int(d), _PURPOSE_STREAM_DOCS, e).permutation(len(ids))]
                )
                m = epoch == e
                out[m] = perm[j[m]]
            docs[sel] = out
        return src.astype(np.int32), docs


class _Stream:
    """The documents of one stream that cover its current window (older ones are dropped)."""

    def __init__(self):
        self.next_m = 0  # index (within this stream) of the next document to fetch
        self.src = np.zeros(0, np.int32)
        self.doc = np.zeros(0, np.int64)
        self.start = np.zeros(0, np.int64)  # token position of each kept document in the stream
        self.end = 0  # token position after the last kept document


class BPTTStreams:
    def __init__(self, sequence: DocumentSequence, num_streams: int, seq_len: int):
        self.seq = sequence
        self.num_streams = int(num_streams)
        self.seq_len = int(seq_len)
        self._streams: dict[int, _Stream] = {}

    def _length(self, src: np.ndarray, doc: np.ndarray) -> np.ndarray:
        out = np.empty(len(doc), dtype=np.int64)
        for d in np.unique(src):
            m = src == d
            out[m] = self.seq.parts[d][0].doc_lengths[doc[m]]
        return out

    def _cover(self, st: _Stream, s: int, upto: int, drop_before: int) -> None:
        """Fetch documents until the stream reaches token `upto`; forget those ending before `drop_before`."""
        chunk = 64
        while st.end < upto:
            m = st.next_m + np.arange(chunk, dtype=np.int64)
            src, doc = self.seq(s + m * self.num_streams)
            lens = self._length(src, doc)
            ends = st.end + np.cumsum(lens)
            # only keep what reaches the window; fast-forwarding (resume) skips the rest cheaply
            keep = ends > drop_before
            starts = ends - lens
            st.src = np.concatenate([st.src, src[keep]])
            st.doc = np.concatenate([st.doc, doc[keep]])
            st.start = np.concatenate([st.start, starts[keep]])
            st.end = int(ends[-1])
            st.next_m += chunk
            chunk = min(chunk * 2, 1 << 20)
        if len(st.start) > 1:
            first = int(np.searchsorted(st.start, drop_before, side="right")) - 1
            if first > 0:
                st.src, st.doc, st.start = st.src[first:], st.doc[first:], st.start[first:]

    def window(self, s: int, k: int) -> Sample:
        """Tokens [k*L, k*L + L + 1) of stream s."""
        st = self._streams.get(s)
        pos = k * self.seq_len
        if st is None or (len(st.start) and pos < st.start[0]):
            st = self._streams[s] = _Stream()
        count = self.seq_len + 1
        self._cover(st, s, pos + count, pos)
        out = np.empty(count, dtype=np.int64)
        doc_of = np.empty(count, dtype=np.int32)
        i = int(np.searchsorted(st.start, pos, side="right")) - 1
        filled, piece, p = 0, 0, pos
        starts = False
        while filled < count:
            ds = self.seq.parts[int(st.src[i])][0]
            doc = int(st.doc[i])
            within = p - int(st.start[i])
            if int(ds.doc_lengths[doc]) == within:  # an empty document (possible in foreign shards)
                i += 1
                continue
            if filled == 0:
                starts = within == 0
            m = min(count - filled, int(ds.doc_lengths[doc]) - within)
            out[filled : filled + m] = ds.read(doc, within, m)
            doc_of[filled : filled + m] = piece
            filled += m
            p += m
            piece += 1
            i += 1
        return Sample(out, doc_of[: count - 1], starts)
