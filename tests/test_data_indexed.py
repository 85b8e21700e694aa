"""Shard format: exact Megatron layout, round trips, validation errors, megatron-core both ways."""
import os
import struct
import warnings

import numpy as np
import pytest

from megassm.data_tools.indexed import (
    MAGIC, IndexedReader, IndexedWriter, ShardFormatError, ShardSet, dtype_for_vocab, shard_prefixes,
)


def write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def random_docs(n=20, vocab=300, seed=0):
    r = np.random.default_rng(seed)
    return [r.integers(0, vocab, size=int(r.integers(0, 50))) for _ in range(n)]


def test_dtype_rule_matches_megatron():
    assert dtype_for_vocab(257) == np.uint16 and dtype_for_vocab(32000) == np.uint16
    assert dtype_for_vocab(65499) == np.uint16 and dtype_for_vocab(65500) == np.int32
    assert dtype_for_vocab(128256) == np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip_and_exact_layout(tmp_path, dtype):
    docs = random_docs(vocab=70000 if dtype == np.int32 else 300)
    prefix = write(tmp_path / "d", docs, dtype)
    raw = open(prefix + ".idx", "rb").read()
    # the header and arrays, parsed by hand from the documented layout
    assert raw[:9] == MAGIC and struct.unpack("<Q", raw[9:17])[0] == 1
    assert raw[17] == (8 if dtype == np.uint16 else 4)
    n_seq, n_doc = struct.unpack("<QQ", raw[18:34])
    assert (n_seq, n_doc) == (len(docs), len(docs) + 1)
    lens = np.frombuffer(raw, "<i4", n_seq, 34)
    ptrs = np.frombuffer(raw, "<i8", n_seq, 34 + 4 * n_seq)
    didx = np.frombuffer(raw, "<i8", n_doc, 34 + 12 * n_seq)
    assert len(raw) == 34 + 12 * n_seq + 8 * n_doc
    assert lens.tolist() == [len(d) for d in docs]
    assert ptrs.tolist() == (np.concatenate([[0], np.cumsum(lens)[:-1]]) * np.dtype(dtype).itemsize).tolist()
    assert didx.tolist() == list(range(len(docs) + 1))
    assert os.path.getsize(prefix + ".bin") == sum(map(len, docs)) * np.dtype(dtype).itemsize

    r = IndexedReader(prefix)
    assert r.num_docs == len(docs) and r.dtype == dtype
    for i, d in enumerate(docs):
        assert np.array_equal(r.document(i), d)
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n or "pending" in n]


def test_writer_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="outside the range"):
        IndexedWriter(str(tmp_path / "y"), np.uint16).add_document([70000])


def _corrupt(prefix, which, fn):
    path = prefix + which
    data = bytearray(open(path, "rb").read())
    open(path, "wb").write(bytes(fn(data)))


@pytest.mark.parametrize(
    "which, fn, message",
    [
        (".bin", lambda b: b[:-2], r"\.bin: truncated: .* bytes, but .*\.idx describes"),
        (".bin", lambda b: b + b"\0\0", r"\.bin: .* describes only .* inconsistent"),
        (".idx", lambda b: b"XXXXXXXXX" + b[9:], r"\.idx: wrong magic"),
        (".idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], r"\.idx: unsupported index version 2"),
        (".idx", lambda b: b[:17] + b"\x63" + b[18:], r"\.idx: unknown dtype code 99"),
        (".idx", lambda b: b[:-8], r"\.idx: .* bytes, but its header .* truncated or corrupt"),
        (".idx", lambda b: b[:20], r"\.idx: truncated header \(20 of 34 bytes\)"),
    ],
)
def test_validation_errors_name_file_and_problem(tmp_path, which, fn, message):
    prefix = write(tmp_path / "d", random_docs(5))
    _corrupt(prefix, which, fn)
    with pytest.raises(ShardFormatError, match=message) as e:
        IndexedReader(prefix)
    assert str(tmp_path / "d") in str(e.value)


def test_inconsistent_pointers_and_doc_indices(tmp_path):
    docs = [np.arange(4), np.arange(3), np.arange(5)]
    prefix = write(tmp_path / "d", docs)

    def bad_pointer(b):
        off = 34 + 4 * 3 + 8  # second pointer
        b[off : off + 8] = struct.pack("<q", 6)
        return b

    _corrupt(prefix, ".idx", bad_pointer)
    with pytest.raises(ShardFormatError, match="sequence 1 starts at byte 6 .* inconsistent"):
        IndexedReader(prefix)

    prefix = write(tmp_path / "e", docs)

    def bad_docidx(b):
        off = 34 + 12 * 3 + 8 * 3  # last document index
        b[off : off + 8] = struct.pack("<q", 2)
        return b

    _corrupt(prefix, ".idx", bad_docidx)
    with pytest.raises(ShardFormatError, match="document indices must run from 0 to the sequence count 3"):
        IndexedReader(prefix)


def test_missing_files_and_numbered_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shards found"):
        shard_prefixes(str(tmp_path / "nothing"))
    a = write(tmp_path / "s-00000", [np.arange(3)])
    b = write(tmp_path / "s-00001", [np.arange(2), np.arange(4)])
    assert shard_prefixes(str(tmp_path / "s")) == [a, b]
    ss = ShardSet([a, b])
    assert ss.num_docs == 3 and ss.num_tokens == 9
    assert ss.document(2).tolist() == [0, 1, 2, 3]
    os.remove(b + ".bin")
    with pytest.raises(FileNotFoundError, match=r"s-00001\.bin: no such shard file"):
        IndexedReader(b)


def _megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_megatron_reads_ours(tmp_path):
    md = _megatron()
    for dtype, vocab in ((np.uint16, 300), (np.int32, 100000)):
        docs = random_docs(30, vocab=vocab, seed=vocab)
        prefix = write(tmp_path / f"ours{vocab}", docs, dtype)
        ds = md.IndexedDataset(prefix)
        assert len(ds) == len(docs)
        assert ds.index.dtype == dtype
        for i, d in enumerate(docs):
            assert np.array_equal(ds[i], d)
        assert ds.document_indices.tolist() == list(range(len(docs) + 1))


def test_we_read_megatron_builder(tmp_path):
    md = _megatron()
    import torch

    b = md.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    b.add_item(torch.tensor([1, 2, 3]))  # a document of two sequences
    b.add_item(torch.tensor([4, 5]))
    b.end_document()
    b.add_document(np.array([7, 8, 9, 10]), [4])
    b.add_document(np.array([11]), [1])
    b.finalize(str(tmp_path / "theirs.idx"))
    r = IndexedReader(str(tmp_path / "theirs"))
    assert r.num_docs == 3
    assert [r.document(i).tolist() for i in range(3)] == [[1, 2, 3, 4, 5], [7, 8, 9, 10], [11]]
