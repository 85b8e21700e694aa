"""Megatron-compatible token shards: `PREFIX.bin` (raw tokens) + `PREFIX.idx` (index).

The `.idx` layout is Megatron-LM's `MMIDIDX` format, byte for byte, so shards move freely between
megassm, Megatron-LM, NeMo and GPT-NeoX:

    offset 0   9 bytes   magic b"MMIDIDX\\x00\\x00"
           9   uint64    version (1)
          17   uint8     dtype code of the tokens in .bin (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                         6 float64, 7 float32, 8 uint16)
          18   uint64    S = sequence count
          26   uint64    D = document-index count (documents + 1)
          34   int32[S]  sequence lengths (tokens)
               int64[S]  sequence byte offsets into .bin
               int64[D]  document indices: document d is sequences [doc_idx[d], doc_idx[d+1])
               (int8[S]  sequence modes; only in Megatron's multimodal variant, ignored here)

All integers little-endian. megassm writes one sequence per document; it reads any number.
Every write goes to a temporary name first and is renamed into place, so a crash never leaves a
half-written file under a final name.
"""
from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # 9 magic + 8 version + 1 dtype + 8 sequence count + 8 document count

DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}

# Megatron's DType.optimal_dtype uses uint16 below this cardinality; match it so both tools agree.
UINT16_VOCAB_LIMIT = 65500


class ShardFormatError(ValueError):
    """A .bin/.idx pair that cannot be read; the message names the file and the problem."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (Megatron's rule), else int32."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def _tmp(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


def write_index(path: str, dtype, sequence_lengths, document_indices) -> None:
    """Write an .idx file atomically (temporary name, fsync, rename).

    `document_indices` has one entry more than there are documents, starting at 0 and ending at the
    sequence count, exactly as Megatron stores it."""
    dtype = np.dtype(dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"{path}: token dtype {dtype} has no Megatron dtype code")
    lengths = np.ascontiguousarray(sequence_lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{path}: sequence lengths must fit in int32")
    doc_idx = np.ascontiguousarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    tmp = _tmp(path)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


class IndexedWriter:
    """Write documents to `PREFIX.bin` / `PREFIX.idx` (one sequence per document).

        with IndexedWriter(prefix, dtype_for_vocab(257)) as w:
            w.add_document(np.array([...]))
    On a clean exit both files are renamed into place; on an exception nothing is left behind."""

    def __init__(self, prefix: str, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"{prefix}: token dtype {self.dtype} has no Megatron dtype code")
        self._bin_tmp = _tmp(bin_path(prefix))
        self._file = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def add_document(self, tokens) -> None:
        arr = np.asarray(tokens)
        if self._info is not None and arr.size and (arr.min() < self._info.min or arr.max() > self._info.max):
            raise ValueError(f"{self.prefix}: token ids outside the range of {self.dtype}")
        self._file.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(arr.size))

    def finalize(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        write_index(idx_path(self.prefix) + ".pending", self.dtype, self._lengths, range(len(self._lengths) + 1))
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_path(self.prefix) + ".pending", idx_path(self.prefix))

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        for p in (self._bin_tmp, idx_path(self.prefix) + ".pending"):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedReader:
    """Memory-mapped reader of one `.bin/.idx` pair, validated on open.

    Documents are exposed as contiguous token ranges (all sequences of a document, which Megatron's
    writers always store back to back): `doc_lengths[d]` tokens starting at element `doc_offsets[d]`."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.idx_path, self.bin_path = idx_path(prefix), bin_path(prefix)
        for p in (self.idx_path, self.bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: no such shard file (expected {prefix}.bin and {prefix}.idx)")
        self._read_index()
        self._open_bin()

    # --- index -------------------------------------------------------------------------------------
    def _read_index(self) -> None:
        p = self.idx_path
        size = os.path.getsize(p)
        with open(p, "rb") as f:
            head = f.read(HEADER_SIZE)
        if len(head) < 9 or head[:9] != MAGIC:
            raise ShardFormatError(f"{p}: wrong magic {head[:9]!r}, expected {MAGIC!r}: not a Megatron .idx file")
        if len(head) < HEADER_SIZE:
            raise ShardFormatError(f"{p}: truncated header ({len(head)} of {HEADER_SIZE} bytes)")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            raise ShardFormatError(f"{p}: unsupported index version {version} (megassm reads version {VERSION})")
        code = head[17]
        if code not in DTYPE_CODES:
            raise ShardFormatError(f"{p}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc_idx = struct.unpack_from("<QQ", head, 18)
        expected = HEADER_SIZE + 4 * n_seq + 8 * n_seq + 8 * n_doc_idx
        if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal sequence modes
            raise ShardFormatError(
                f"{p}: {size} bytes, but its header ({n_seq} sequences, {n_doc_idx} document indices) needs "
                f"{expected}: the index is truncated or corrupt"
            )
        mm = np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=n_doc_idx, offset=off)
        self._idx_mmap = mm

        di, lens, ptrs = self.document_indices, self.sequence_lengths, self.sequence_pointers
        if n_doc_idx < 1 or di[0] != 0 or di[-1] != n_seq:
            first = int(di[0]) if n_doc_idx else None
            last = int(di[-1]) if n_doc_idx else None
            raise ShardFormatError(
                f"{p}: document indices must run from 0 to the sequence count {n_seq}, got {first}..{last}"
            )
        if n_doc_idx > 1 and np.any(np.diff(di) < 0):
            raise ShardFormatError(f"{p}: document indices decrease at document {int(np.argmax(np.diff(di) < 0))}")
        if n_seq and lens.min() < 0:
            raise ShardFormatError(f"{p}: negative sequence length at sequence {int(np.argmax(lens < 0))}")
        # Pointers must be the running sum of lengths: this is what every Megatron writer produces, and
        # it is what lets a document's sequences be read as one contiguous range.
        expect_ptr = np.zeros(n_seq, dtype=np.int64)
        if n_seq > 1:
            np.cumsum(lens[:-1].astype(np.int64) * self.dtype.itemsize, out=expect_ptr[1:])
        if n_seq and not np.array_equal(ptrs, expect_ptr):
            bad = int(np.argmax(ptrs != expect_ptr))
            raise ShardFormatError(
                f"{p}: sequence {bad} starts at byte {int(ptrs[bad])} but the lengths before it end at byte "
                f"{int(expect_ptr[bad])}: the index is inconsistent"
            )
        self.num_tokens = int(lens.astype(np.int64).sum()) if n_seq else 0
        self.num_docs = int(n_doc_idx - 1)
        # Per document: first token (element offset) and token count.
        starts = di[:-1]
        ends = di[1:]
        tok_start = np.zeros(n_seq + 1, dtype=np.int64)
        if n_seq:
            np.cumsum(lens, out=tok_start[1:])
        self.doc_offsets = tok_start[starts]
        self.doc_lengths = tok_start[ends] - tok_start[starts]

    # --- tokens ------------------------------------------------------------------------------------
    def _open_bin(self) -> None:
        p = self.bin_path
        size = os.path.getsize(p)
        need = self.num_tokens * self.dtype.itemsize
        if size < need:
            raise ShardFormatError(
                f"{p}: truncated: {size} bytes, but {self.idx_path} describes {self.num_tokens} tokens "
                f"of {self.dtype} = {need} bytes"
            )
        if size > need:
            raise ShardFormatError(
                f"{p}: {size} bytes, but {self.idx_path} describes only {need} bytes ({self.num_tokens} tokens "
                f"of {self.dtype}): the index is inconsistent with the data (wrong .idx for this .bin?)"
            )
        self.tokens = np.memmap(p, dtype=self.dtype, mode="r") if need else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return self.num_docs

    def document(self, d: int) -> np.ndarray:
        """Tokens of document `d` (a read-only view into the memory map)."""
        o = int(self.doc_offsets[d])
        return self.tokens[o : o + int(self.doc_lengths[d])]

    def read(self, offset: int, count: int) -> np.ndarray:
        """`count` tokens starting at element `offset` of the .bin file."""
        return self.tokens[offset : offset + count]

    def close(self) -> None:
        for name in ("tokens", "_idx_mmap", "sequence_lengths", "sequence_pointers", "document_indices"):
            if hasattr(self, name):
                delattr(self, name)


def shard_prefixes(prefix: str) -> list[str]:
    """`prefix` itself when PREFIX.idx exists, else its numbered shards PREFIX-00000 ... in order."""
    if os.path.isfile(idx_path(prefix)) or os.path.isfile(bin_path(prefix)):
        return [prefix]
    found = []
    i = 0
    while os.path.isfile(idx_path(f"{prefix}-{i:05d}")):
        found.append(f"{prefix}-{i:05d}")
        i += 1
    if not found:
        raise FileNotFoundError(
            f"{prefix}: no shards found (looked for {prefix}.idx and {prefix}-00000.idx); "
            "create them with megassm-preprocess"
        )
    return found


class ShardSet:
    """Several shards read as one dataset: documents are numbered across shards in order."""

    def __init__(self, prefixes: Sequence[str]):
        self.readers = [IndexedReader(p) for p in prefixes]
        dtypes = {r.dtype for r in self.readers}
        if len(dtypes) > 1:
            raise ShardFormatError(f"shards {list(prefixes)} mix token dtypes {sorted(map(str, dtypes))}")
        self.dtype = self.readers[0].dtype
        self.doc_lengths = np.concatenate([r.doc_lengths for r in self.readers]) if self.readers else np.zeros(0, np.int64)
        self._doc_offsets = np.concatenate([r.doc_offsets for r in self.readers])
        counts = [r.num_docs for r in self.readers]
        self._shard_of_doc_start = np.cumsum([0] + counts)
        self.num_docs = int(self._shard_of_doc_start[-1])
        self.num_tokens = int(sum(r.num_tokens for r in self.readers))

    def locate(self, d: int) -> tuple[IndexedReader, int]:
        """(reader, element offset) of document d's first token."""
        s = int(np.searchsorted(self._shard_of_doc_start, d, side="right")) - 1
        return self.readers[s], int(self._doc_offsets[d])

    def document(self, d: int) -> np.ndarray:
        r, o = self.locate(d)
        return r.tokens[o : o + int(self.doc_lengths[d])]

    def close(self) -> None:
        for r in self.readers:
            r.close()
