"""Packed samples, seq_idx, splits, DP invariance, exact resume, prefetch, blending, BPTT streams, shards checked
against their manifest."""
import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from megassm.data_tools.indexed import IndexedWriter
from megassm.data_tools.loader import build_data
from megassm.data_tools.sampler import Interleave, split_documents

EOS = 999


@dataclass
class Cfg:  # the fields of megassm.config.DataConfig
    builtin: str | None = None
    paths: list = field(default_factory=list)
    weights: list | None = None
    tokenizer: str = "byte"
    split: list = field(default_factory=lambda: [98.0, 1.0, 1.0])
    prefetch: int = 0
    cache_dir: str | None = None


def make_dataset(prefix, n_docs=200, base=0, seed=0, max_len=40):
    """Documents whose tokens encode (dataset base + document number) and end with EOS."""
    r = np.random.default_rng(seed)
    docs = []
    with IndexedWriter(str(prefix), np.uint16) as w:
        for i in range(n_docs):
            body = np.full(int(r.integers(1, max_len)), base + i % 900, dtype=np.int64)
            doc = np.concatenate([body, [EOS]])
            w.add_document(doc)
            docs.append(doc)
    manifest = {"tokenizer": {"name": "test", "sha256": "t", "vocab_size": 1000, "eos_id": EOS},
                "num_tokens": int(sum(map(len, docs)))}
    with open(str(prefix) + ".manifest.json", "w") as f:
        json.dump(manifest, f)
    return str(prefix), docs


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("d") / "a")


def batches(data, n):
    return [data.next_batch() for _ in range(n)]


def test_batch_shapes_types_and_labels(ds):
    data = build_data(Cfg(paths=[ds[0]]), seq_len=32, micro_batch=3, global_batch=6, seed=1)
    assert data.vocab_size == 1000 and data.eos_id == EOS
    b = data.next_batch()
    assert b["tokens"].shape == (3, 32) and b["tokens"].dtype == torch.int64
    assert b["labels"].dtype == torch.int64 and b["seq_idx"].dtype == torch.int32 and b["reset"].dtype == torch.bool
    assert b["reset"].all()  # packed rows are independent samples
    b2 = data.next_batch()
    # labels are the next tokens of the same seq_len + 1 sample
    s = data._train.sample(0)
    assert torch.equal(b["tokens"][0], torch.from_numpy(s.tokens[:-1]))
    assert torch.equal(b["labels"][0], torch.from_numpy(s.tokens[1:]))
    assert not torch.equal(b["tokens"], b2["tokens"])
    data.close()


def test_seq_idx_marks_document_starts(ds):
    data = build_data(Cfg(paths=[ds[0]]), seq_len=64, micro_batch=4, global_batch=4, seed=3)
    for b in batches(data, 20):
        tok, sid = b["tokens"].numpy(), b["seq_idx"].numpy()
        for row in range(4):
            assert sid[row, 0] == 0
            step = np.diff(sid[row])
            assert set(np.unique(step)) <= {0, 1}
            # a new document starts exactly after each EOS
            assert np.array_equal(step == 1, tok[row, :-1] == EOS)
            # all tokens of one segment come from one document (same body value)
            for k in np.unique(sid[row]):
                body = tok[row][(sid[row] == k) & (tok[row] != EOS)]
                assert len(np.unique(body)) <= 1


def test_epoch_covers_every_token_once(ds):
    prefix, docs = ds
    data = build_data(Cfg(paths=[prefix], split=[1, 0, 0]), seq_len=16, micro_batch=1, global_batch=1, seed=5)
    train = data._train
    n = len(train)  # samples per epoch
    starts = sorted(train._sample_start(g) for g in range(n))
    assert starts == [i * 16 for i in range(n)]
    by_start = np.argsort([train._sample_start(g) for g in range(n)])
    stream = np.concatenate([train.sample(int(g)).tokens[:-1] for g in by_start])
    order, _ = train._epoch(0)
    assert sorted(order.tolist()) == list(range(len(docs)))  # every document once per epoch
    epoch0 = np.concatenate([docs[d] for d in order])
    assert len(epoch0) - 16 < len(stream) <= len(epoch0)
    assert np.array_equal(stream, epoch0[: len(stream)])


def test_split_by_document():
    parts = split_documents(1000, [98, 1, 1])
    assert [len(p) for p in parts] == [980, 10, 10]
    allp = np.concatenate(parts)
    assert len(np.unique(allp)) == 1000
    assert split_documents(1000, [98, 1, 1])[1].tolist() == parts[1].tolist()  # seed-independent, stable
    assert [len(p) for p in split_documents(10, [1, 0, 0])] == [10, 0, 0]


def test_valid_batches_deterministic_and_disjoint(ds):
    prefix, docs = ds
    data = build_data(Cfg(paths=[prefix], split=[80, 20, 0]), seq_len=32, micro_batch=2, global_batch=2, seed=9)
    v1 = [b["tokens"] for b in data.valid_batches(3)]
    batches(data, 2)
    v2 = [b["tokens"] for b in data.valid_batches(3)]
    assert len(v1) == 3 and all(torch.equal(a, b) for a, b in zip(v1, v2))
    valid_docs = set(split_documents(len(docs), [80, 20, 0])[1].tolist())
    valid_vals = {i % 900 for i in valid_docs}
    train_vals = set()
    for b in batches(data, 30):
        train_vals |= set(b["tokens"].unique().tolist())
    seen_valid = set(torch.cat(v1).unique().tolist()) - {EOS}
    assert seen_valid <= valid_vals
    assert not (train_vals - {EOS}) & valid_vals


def test_same_seed_same_stream_other_seed_differs(ds):
    a = build_data(Cfg(paths=[ds[0]]), seq_len=32, micro_batch=2, global_batch=4, seed=7)
    b = build_data(Cfg(paths=[ds[0]]), seq_len=32, micro_batch=2, global_batch=4, seed=7)
    c = build_data(Cfg(paths=[ds[0]]), seq_len=32, micro_batch=2, global_batch=4, seed=8)
    ba, bb, bc = batches(a, 6), batches(b, 6), batches(c, 6)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(ba, bb))
    assert not all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(ba, bc))


def global_batches(prefix, dp, steps, bptt=False, mb=2, gb=8, seq_len=24, **kw):
    """Concatenate every rank's micro-batches of each step into that step's global batch."""
    ranks = [build_data(Cfg(paths=[prefix], **kw), seq_len=seq_len, micro_batch=mb, global_batch=gb,
                        dp_rank=r, dp_size=dp, seed=11, bptt=bptt) for r in range(dp)]
    accum = gb // (mb * dp)
    out = []
    for _ in range(steps):
        parts = {k: [] for k in ("tokens", "labels", "seq_idx", "reset")}
        for data in ranks:
            for _ in range(accum):
                b = data.next_batch()
                for k in parts:
                    parts[k].append(b[k])
        out.append({k: torch.cat(v) for k, v in parts.items()})
    for d in ranks:
        d.close()
    return out


@pytest.mark.parametrize("bptt", [False, True])
def test_dp_1_2_4_see_identical_global_batches(ds, bptt):
    ref = global_batches(ds[0], 1, 4, bptt)
    for dp in (2, 4):
        got = global_batches(ds[0], dp, 4, bptt)
        for a, b in zip(ref, got):
            for k in a:
                assert torch.equal(a[k], b[k]), (dp, k)


@pytest.mark.parametrize("bptt", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_continues_exact_stream(ds, bptt, prefetch):
    kw = dict(seq_len=20, micro_batch=2, global_batch=4, seed=4, bptt=bptt)
    full = build_data(Cfg(paths=[ds[0]], prefetch=prefetch), **kw)
    expected = batches(full, 12)
    full.close()
    first = build_data(Cfg(paths=[ds[0]], prefetch=prefetch), **kw)
    batches(first, 6)  # 3 steps of accumulation 2
    state = first.state_dict()
    first.close()
    assert json.loads(json.dumps(state)) == state  # small and serializable
    resumed = build_data(Cfg(paths=[ds[0]], prefetch=prefetch), **kw)
    resumed.load_state_dict(state)
    got = batches(resumed, 6)
    resumed.close()
    for a, b in zip(expected[6:], got):
        for k in a:
            assert torch.equal(a[k], b[k])


def test_resume_mid_step_and_prefetch_matches_sync(ds):
    kw = dict(seq_len=20, micro_batch=1, global_batch=4, seed=2)
    sync = batches(build_data(Cfg(paths=[ds[0]], prefetch=0), **kw), 10)
    pre = build_data(Cfg(paths=[ds[0]], prefetch=3), **kw)
    got = batches(pre, 5)
    state = pre.state_dict()
    assert state["micro_in_step"] == 1
    pre.load_state_dict(state)
    got += batches(pre, 5)
    pre.close()
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(sync, got))


def test_state_dict_mismatch_errors(ds):
    a = build_data(Cfg(paths=[ds[0]]), seq_len=20, micro_batch=2, global_batch=4, seed=1)
    b = build_data(Cfg(paths=[ds[0]]), seq_len=24, micro_batch=2, global_batch=4, seed=1)
    with pytest.raises(ValueError, match="seq_len=20, now 24"):
        b.load_state_dict(a.state_dict())
    c = build_data(Cfg(paths=[ds[0]]), seq_len=20, micro_batch=2, global_batch=4, seed=1, bptt=True)
    with pytest.raises(ValueError, match="bptt mode"):
        c.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="multiple of micro_batch x dp_size"):
        build_data(Cfg(paths=[ds[0]]), seq_len=20, micro_batch=3, global_batch=4)


def test_interleave_exact_proportions():
    for w in ([0.7, 0.3], [0.5, 0.3, 0.2], [98, 1, 1], [1, 1, 1]):
        il = Interleave(w)
        p = np.asarray(w, float) / sum(w)
        src, _ = il(np.arange(100_000))
        for start in range(0, 100_000, 1000):
            counts = np.bincount(src[start : start + 1000], minlength=len(w))
            assert np.abs(counts - 1000 * p).max() <= 1.0, (w, start, counts)
        # each source's local indices are 0, 1, 2, ... in order: no sample skipped or repeated
        src, local = il(np.arange(3 * il.period + 17))
        for d in range(len(w)):
            assert np.array_equal(local[src == d], np.arange((src == d).sum()))


def test_blending_proportions_and_per_dataset_epochs(tmp_path):
    big, _ = make_dataset(tmp_path / "big", n_docs=300, base=0, seed=1)
    small, _ = make_dataset(tmp_path / "small", n_docs=8, base=900 - 8 - 1, seed=2, max_len=10)
    data = build_data(Cfg(paths=[big, small], weights=[0.25, 0.75], split=[1, 0, 0]),
                      seq_len=8, micro_batch=50, global_batch=1000, seed=3)
    b = data.next_batch()
    # where each of the first 1000 samples comes from: the blend is exact within one sample
    src, _ = data._train.interleave(np.arange(1000))
    assert abs(int((src == 1).sum()) - 750) <= 1
    # samples from the small dataset contain only its tokens (dataset identity is preserved)
    rows = np.nonzero(src[:50] == 1)[0]
    small_vals = set(range(900 - 9, 900 - 1)) | {EOS}
    assert set(b["tokens"][rows].unique().tolist()) <= small_vals
    # the small dataset has far fewer samples than it is asked for: it loops over its own epochs
    small_ds = data._train.sources[1]
    assert 750 > 3 * len(small_ds)
    data.close()


def test_bptt_windows_continue_across_steps(ds):
    prefix, docs = ds
    L, G = 16, 4
    data = build_data(Cfg(paths=[prefix], split=[1, 0, 0]), seq_len=L, micro_batch=G, global_batch=G, seed=6, bptt=True)
    steps = batches(data, 30)
    for k in range(1, len(steps)):
        prev, cur = steps[k - 1], steps[k]
        # window k+1 starts exactly where window k ended
        assert torch.equal(cur["tokens"][:, 0], prev["labels"][:, -1])
        for row in range(G):
            starts_doc = prev["tokens"][row, -1].item() == EOS
            assert cur["reset"][row].item() == starts_doc
    assert steps[0]["reset"].all()
    # each row's stream is whole documents back to back, each one EOS-terminated
    for row in range(G):
        stream = torch.cat([steps[0]["tokens"][row, :1]] + [s["labels"][row] for s in steps]).numpy()
        cut = np.nonzero(stream == EOS)[0]
        pieces = np.split(stream[: cut[-1] + 1], cut[:-1] + 1)
        for p in pieces:
            assert p[-1] == EOS and len(np.unique(p[:-1])) == 1
        # seq_idx numbers documents inside each window
        for s in steps:
            sid, tok = s["seq_idx"][row].numpy(), s["tokens"][row].numpy()
            assert sid[0] == 0 and np.array_equal(np.diff(sid) == 1, tok[:-1] == EOS)
    # streams take disjoint documents
    firsts = [steps[0]["tokens"][row, 0].item() for row in range(G)]
    assert len(set(firsts)) == G
    data.close()


def test_builtin_stdlib_end_to_end():
    from megassm.config import DataConfig

    data = build_data(DataConfig(builtin="stdlib", prefetch=2), seq_len=128, micro_batch=2, global_batch=4, seed=0)
    assert data.vocab_size == 257 and data.eos_id == 256
    b = data.next_batch()
    assert b["tokens"].max() < 257
    assert len(list(data.valid_batches(2))) == 2
    data.close()


def test_shards_without_manifest_and_mixed_tokenizers(tmp_path):
    with IndexedWriter(str(tmp_path / "m"), np.uint16) as w:  # e.g. made by Megatron: no manifest
        for i in range(50):
            w.add_document(np.arange(i % 7 + 2) + 10)
    data = build_data(Cfg(paths=[str(tmp_path / "m")], split=[1, 0, 0]), seq_len=8, micro_batch=1, global_batch=1)
    assert data.vocab_size == 18 and data.eos_id is None
    assert data.next_batch()["tokens"].shape == (1, 8)
    assert list(data.valid_batches(3)) == []  # no validation split: evaluation yields nothing
    a, _ = make_dataset(tmp_path / "a", n_docs=20)
    m = json.load(open(a + ".manifest.json"))
    m["tokenizer"].update(sha256="other", name="other-tok")
    b, _ = make_dataset(tmp_path / "b", n_docs=20)
    json.dump(m, open(b + ".manifest.json", "w"))
    with pytest.raises(ValueError, match="mix tokenizers: .*a uses test and .*b uses other-tok"):
        build_data(Cfg(paths=[a, b]), seq_len=8, micro_batch=1, global_batch=1)
    with pytest.raises(ValueError, match="data.weights has 1 entries but there are 2"):
        build_data(Cfg(paths=[a, a], weights=[1.0]), seq_len=8, micro_batch=1, global_batch=1)


def _equal_size_corpora(tmp_path):
    """Two shards made by megassm-preprocess whose .bin (and .idx) have the same size but whose documents end at
    other places: 40 documents of 10 and 30 bytes, and 40 of 20 and 20."""
    from megassm.data_tools.preprocess import preprocess

    prefixes = []
    for name, lens in (("a", (10, 30)), ("b", (20, 20))):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": name * lens[i % 2]}) + "\n" for i in range(40)))
        preprocess([str(src)], str(tmp_path / name), quiet=True, progress=False)
        prefixes.append(str(tmp_path / name))
    return prefixes


def test_a_shard_paired_with_another_shards_idx_is_refused(tmp_path, caplog):
    """The .idx files of two shards of equal size swapped: every check of the files themselves passes (their sizes
    and the token count agree), only the manifest's record of the .idx tells."""
    import os
    import shutil

    from megassm.data_tools.indexed import ShardFormatError

    a, b = _equal_size_corpora(tmp_path)
    assert os.path.getsize(a + ".bin") == os.path.getsize(b + ".bin")
    recorded = json.load(open(a + ".manifest.json"))["shards"][0]["idx"]
    build_data(Cfg(paths=[a]), seq_len=8, micro_batch=1, global_batch=1).close()  # intact: accepted
    os.rename(a + ".idx", tmp_path / "swap")
    os.rename(b + ".idx", a + ".idx")
    os.rename(tmp_path / "swap", b + ".idx")
    found = hashlib.sha256(open(a + ".idx", "rb").read()).hexdigest()
    with pytest.raises(ShardFormatError) as e:
        build_data(Cfg(paths=[a]), seq_len=8, micro_batch=1, global_batch=1)
    assert str(e.value) == (
        f"{a}.idx: sha256 {found[:12]}.., but {a}.manifest.json records {recorded['sha256'][:12]}.. (both "
        f"{recorded['bytes']} bytes): not the index the shards were written with (swapped with another shard's .idx?)")
    # shards without a manifest (Megatron's own) are read, with a warning that they are not checked
    shutil.copy(a + ".bin", tmp_path / "m.bin")
    shutil.copy(b + ".idx", tmp_path / "m.idx")  # a's own index
    with caplog.at_level("WARNING", logger="megassm.data"):
        build_data(Cfg(paths=[str(tmp_path / "m")]), seq_len=8, micro_batch=1, global_batch=1).close()
    assert "no manifest (shards made by Megatron?): the .bin / .idx are not checked against a record" in caplog.text
    # a .bin of another size than recorded is named with both sizes, before any hashing
    with open(b + ".bin", "ab") as f:
        f.write(b"\0\0")
    size = os.path.getsize(b + ".bin")
    with pytest.raises(ShardFormatError, match=rf"^{b}.bin: {size} bytes, but {b}.manifest.json records {size - 2} "):
        build_data(Cfg(paths=[b]), seq_len=8, micro_batch=1, global_batch=1)
