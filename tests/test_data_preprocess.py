"""megassm-preprocess: formats, determinism across worker counts, manifest, bad input, shards, resume."""
import errno
import glob
import gzip
import hashlib
import json
import os

import numpy as np
import pytest

from megassm.data_tools import preprocess as preprocess_mod
from megassm.data_tools import sources
from megassm.data_tools.builtin import ensure_builtin_corpus, stdlib_files
from megassm.data_tools.indexed import IndexedReader, ShardSet, shard_prefixes
from megassm.data_tools.preprocess import main, preprocess
from megassm.data_tools.sources import DataInputError
from megassm.data_tools.tokenizers import load_tokenizer

TEXTS = ["hello world", "ünïcödé ☃ text", "def f(x):\n    return x\n", "", "last one"]


def write_jsonl(path, texts, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i}) + "\n")
    return str(path)


def docs_of(prefix):
    r = ShardSet(shard_prefixes(prefix))
    return [bytes(r.document(i)[:-1].astype(np.uint8)).decode() for i in range(r.num_docs)]


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_jsonl_round_trip_and_manifest(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    m = preprocess([src], str(tmp_path / "out"), quiet=True)
    assert docs_of(str(tmp_path / "out")) == [t for t in TEXTS if t]
    r = IndexedReader(str(tmp_path / "out"))
    assert all(r.document(i)[-1] == 256 for i in range(r.num_docs))  # EOS per document
    on_disk = json.load(open(tmp_path / "out.manifest.json"))
    assert on_disk == m
    assert m["tokenizer"]["name"] == "byte" and m["tokenizer"]["vocab_size"] == 257
    assert m["tokenizer"]["sha256"] == load_tokenizer("byte").sha256
    assert m["dtype"] == "uint16" and m["num_documents"] == 4 and m["stats"]["empty_skipped"] == 1
    assert m["num_tokens"] == sum(len(t.encode()) + 1 for t in TEXTS if t)
    assert m["shards"][0]["bin"]["sha256"] == sha(tmp_path / "out.bin")
    assert m["shards"][0]["idx"]["sha256"] == sha(tmp_path / "out.idx")
    assert m["inputs"][0]["sha256"] == sha(src)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "out.bin", "out.idx", "out.manifest.json"]


def test_same_bytes_for_1_and_2_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TASK_DOCS", 7)  # many tasks, so ordering across workers matters
    monkeypatch.setattr(sources, "TASK_BYTES", 150)  # (uncompressed JSONL is cut by bytes)
    monkeypatch.setattr(preprocess_mod, "PIECE_BYTES", 400)  # several tasks per worker piece, many pieces
    texts = [f"document {i} " + "x" * (i % 13) for i in range(200)]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    m1 = preprocess([src], str(tmp_path / "w1"), workers=1, quiet=True)
    m2 = preprocess([src], str(tmp_path / "w2"), workers=2, quiet=True)
    for ext in (".bin", ".idx"):
        assert sha(str(tmp_path / "w1") + ext) == sha(str(tmp_path / "w2") + ext)
    assert m1["shards"][0]["bin"]["sha256"] == m2["shards"][0]["bin"]["sha256"] == sha(str(tmp_path / "w2") + ".bin")
    assert docs_of(str(tmp_path / "w2")) == texts


@pytest.mark.parametrize("first,second", [(1, 2), (2, 1)])
def test_resume_with_other_worker_count_hashes_the_whole_file(tmp_path, monkeypatch, first, second):
    """The .bin hash is taken while writing (inline with 1 worker, a thread behind the writes with 2); a
    resumed run must still hash what the interrupted one wrote."""
    monkeypatch.setattr(sources, "TASK_BYTES", 120)
    monkeypatch.setattr(preprocess_mod, "PIECE_BYTES", 250)  # pieces of ~2 tasks: the stop lands mid-run
    texts = [f"resumed document {i} " + "y" * (i % 11) for i in range(80)]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    ref = preprocess([src], str(tmp_path / "ref"), quiet=True)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], str(tmp_path / "o"), workers=first, quiet=True, _stop_after_tasks=5)
    m = preprocess([src], str(tmp_path / "o"), workers=second, resume=True, quiet=True)
    assert sha(str(tmp_path / "o") + ".bin") == sha(str(tmp_path / "ref") + ".bin") == m["shards"][0]["bin"]["sha256"]
    assert m["shards"][0]["bin"]["sha256"] == ref["shards"][0]["bin"]["sha256"]
    assert docs_of(str(tmp_path / "o")) == texts


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_workers_pieces_split_over_token_shards(tmp_path, monkeypatch, kernel_copy):
    """With workers, each piece (a worker's tokens of some tasks) is copied into place by the writer, split
    over numbered shards where they close; without os.copy_file_range (some file systems) the bytes go
    through user space. Either way: the bytes of one process."""
    monkeypatch.setattr(sources, "TASK_BYTES", 200)
    monkeypatch.setattr(preprocess_mod, "PIECE_BYTES", 700)
    if not kernel_copy:
        def no_copy_file_range(*args, **kwargs):
            raise OSError(errno.EXDEV, "cross-device copy")
        monkeypatch.setattr(os, "copy_file_range", no_copy_file_range)
    texts = [f"piece document {i} " + "z" * (i % 17) for i in range(150)]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    one = preprocess([src], str(tmp_path / "one"), shard_size=300, quiet=True)
    two = preprocess([src], str(tmp_path / "two"), shard_size=300, workers=2, quiet=True)
    assert len(two["shards"]) == len(one["shards"]) > 3
    assert [s["bin"]["sha256"] for s in two["shards"]] == [s["bin"]["sha256"] for s in one["shards"]]
    assert [s["idx"]["sha256"] for s in two["shards"]] == [s["idx"]["sha256"] for s in one["shards"]]
    assert docs_of(str(tmp_path / "two")) == texts
    assert not os.path.exists(tmp_path / "two.partial")


def test_piece_of_the_wrong_size_is_refused(tmp_path):
    from megassm.data_tools.shard_writer import ShardWriter

    w = ShardWriter(str(tmp_path / "work"), np.uint16, None)
    w.start()
    piece = tmp_path / "work" / "piece-000000000"
    piece.write_bytes(np.arange(5, dtype=np.uint16).tobytes())
    with pytest.raises(RuntimeError, match="piece-000000000: 10 bytes, expected 12 for its 2 documents"):
        w.add_piece(str(piece), np.array([3, 3]))
    w.add_piece(str(piece), np.array([2, 3]))
    assert w.bin_bytes == 10 and w.finish() == 1
    assert np.fromfile(tmp_path / "work" / "shard-00000.bin", dtype=np.uint16).tolist() == [0, 1, 2, 3, 4]


def test_formats_compressed_parquet_arrow_text_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = [f"doc {i}" for i in range(10)]
    write_jsonl(tmp_path / "a.jsonl.gz", texts[:3], opener=gzip.open)
    with open(tmp_path / "b.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in texts[3:5]).encode()))
    pq.write_table(pa.table({"text": texts[5:7], "n": [1, 2]}), tmp_path / "c.parquet", row_group_size=1)
    table = pa.table({"text": texts[7:9]})
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    with pa.OSFile(str(tmp_path / "e.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(pa.table({"text": texts[9:]}))
    m = preprocess([str(tmp_path / "*.*")], str(tmp_path / "out" / "o"), quiet=True)
    assert docs_of(str(tmp_path / "out" / "o")) == texts
    assert [i["format"] for i in m["inputs"]] == ["jsonl", "jsonl", "parquet", "arrow", "arrow"]

    folder = tmp_path / "txt"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("second file\n")
    (folder / "sub" / "a.py").write_text("print(1)\n")
    (folder / ".hidden").write_text("skipped")
    preprocess([str(folder)], str(tmp_path / "t"), quiet=True)
    assert docs_of(str(tmp_path / "t")) == ["second file\n", "print(1)\n"]
    preprocess([str(folder / "b.txt")], str(tmp_path / "lines"), text_per_line=True, quiet=True)
    (folder / "c.txt").write_text("one\n\ntwo\r\nthree")
    m = preprocess([str(folder / "c.txt")], str(tmp_path / "lines2"), text_per_line=True, quiet=True)
    assert docs_of(str(tmp_path / "lines2")) == ["one", "two", "three"] and m["stats"]["empty_skipped"] == 1


def test_bad_json_line_fails_with_file_and_line_or_is_skipped(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n\n{"text": "broken"\n{"text": "fine"}\n')
    with pytest.raises(DataInputError, match=r"bad\.jsonl:3: invalid JSON: Expecting ',' delimiter"):
        preprocess([str(src)], str(tmp_path / "o"), quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # a failed run leaves nothing behind
    m = preprocess([str(src)], str(tmp_path / "o"), skip_bad=True, quiet=True)
    assert m["stats"]["bad_skipped"] == 1 and m["stats"]["blank_lines"] == 1
    assert docs_of(str(tmp_path / "o")) == ["ok", "fine"]


def test_missing_key_lists_keys_and_invalid_utf8_is_counted(tmp_path):
    src = write_jsonl(tmp_path / "k.jsonl", ["a", "b"], key="content")
    with pytest.raises(DataInputError, match=r"k\.jsonl:1: no key 'text' \(keys present: 'content', 'id'\)"):
        preprocess([src], str(tmp_path / "o"), quiet=True)
    m = preprocess([src], str(tmp_path / "o"), text_key="content", quiet=True)
    assert m["num_documents"] == 2

    raw = tmp_path / "u.jsonl"
    raw.write_bytes(b'{"text": "caf\xe9 ok"}\n{"text": "fine"}\n{"text": "lone \\ud800 surrogate"}\n')
    m = preprocess([str(raw)], str(tmp_path / "u"), quiet=True)
    assert m["stats"]["invalid_utf8_replaced"] == 2
    assert docs_of(str(tmp_path / "u")) == ["caf\ufffd ok", "fine", "lone ? surrogate"]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "bin.txt").write_bytes(b"\xff\xfebinary")
    m = preprocess([str(tmp_path / "p")], str(tmp_path / "pp"), quiet=True)
    assert m["stats"]["invalid_utf8_replaced"] == 1


def test_parquet_missing_column_and_missing_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"], "url": ["u"]}), tmp_path / "c.parquet")
    with pytest.raises(DataInputError, match=r"c\.parquet: no column 'text' \(columns: body, url\)"):
        preprocess([str(tmp_path / "c.parquet")], str(tmp_path / "o"), quiet=True)
    with pytest.raises(DataInputError, match="no files match"):
        preprocess([str(tmp_path / "*.nothing")], str(tmp_path / "o"), quiet=True)
    with pytest.raises(DataInputError, match="no such file or folder"):
        preprocess([str(tmp_path / "absent.jsonl")], str(tmp_path / "o"), quiet=True)


def test_numbered_shards(tmp_path):
    texts = [f"document number {i}" for i in range(50)]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    m = preprocess([src], str(tmp_path / "s"), shard_size=200, quiet=True)
    n = len(m["shards"])
    assert n > 3 and [s["prefix"] for s in m["shards"]] == [f"s-{i:05d}" for i in range(n)]
    assert docs_of(str(tmp_path / "s")) == texts
    assert all(s["tokens"] >= 200 for s in m["shards"][:-1])
    assert not os.path.exists(tmp_path / "s.bin")


@pytest.mark.parametrize("shard_size", [None, 150])
def test_resume_after_interruption(tmp_path, monkeypatch, shard_size):
    monkeypatch.setattr(sources, "TASK_DOCS", 5)
    monkeypatch.setattr(sources, "TASK_BYTES", 100)  # range tasks (uncompressed JSONL) are cut by bytes
    texts = [f"resumable doc {i}" for i in range(60)]
    src = write_jsonl(tmp_path / "a.jsonl", texts)
    ref = preprocess([src], str(tmp_path / "ref"), shard_size=shard_size, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], str(tmp_path / "o"), shard_size=shard_size, quiet=True, _stop_after_tasks=4)
    assert not [p for p in glob.glob(str(tmp_path / "o[.-]*")) if not p.endswith(".partial")]  # nothing final
    assert os.path.isdir(tmp_path / "o.partial")
    # simulate a crash after the checkpoint: extra garbage beyond the recorded point is discarded
    with open(tmp_path / "o.partial" / "shard-00000.bin", "ab") as f:
        f.write(b"garbage")
    with pytest.raises(FileExistsError, match="--resume"):
        preprocess([src], str(tmp_path / "o"), quiet=True, shard_size=shard_size)
    m = preprocess([src], str(tmp_path / "o"), shard_size=shard_size, resume=True, quiet=True)
    assert docs_of(str(tmp_path / "o")) == texts
    assert [s["bin"]["sha256"] for s in m["shards"]] == [s["bin"]["sha256"] for s in ref["shards"]]
    assert m["num_documents"] == 60 and not os.path.exists(tmp_path / "o.partial")


def test_existing_outputs_need_overwrite(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", ["one", "two"])
    preprocess([src], str(tmp_path / "o"), shard_size=3, quiet=True)
    with pytest.raises(FileExistsError, match="--overwrite"):
        preprocess([src], str(tmp_path / "o"), quiet=True)
    preprocess([src], str(tmp_path / "o"), overwrite=True, quiet=True)  # single file replaces the shards
    assert shard_prefixes(str(tmp_path / "o")) == [str(tmp_path / "o")]
    assert not glob.glob(str(tmp_path / "o-*"))


def test_cli(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", ["cli text"])
    assert main(["--input", src, "--output-prefix", str(tmp_path / "c"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "1 documents" in err and "tokens/s" in err and "manifest" in err
    assert main(["--input", src, "--output-prefix", str(tmp_path / "c")]) == 1
    assert "--overwrite" in capsys.readouterr().err
    bad = tmp_path / "b.jsonl"
    bad.write_text("{nope}\n")
    assert main(["--input", str(bad), "--output-prefix", str(tmp_path / "d"), "--quiet"]) == 1
    assert "b.jsonl:1: invalid JSON" in capsys.readouterr().err


def _mistral_model():
    mc = pytest.importorskip("mistral_common")
    pytest.importorskip("sentencepiece")
    path = os.path.join(os.path.dirname(mc.__file__), "data", "tokenizer.model.v1")
    if not os.path.exists(path):
        pytest.skip("mistral-common ships no tokenizer.model.v1")
    return path


def test_sentencepiece_mistral(tmp_path):
    model = _mistral_model()
    tok = load_tokenizer(model)
    assert tok.vocab_size == 32000 and tok.eos_id == 2 and tok.name.startswith("sentencepiece:")
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    m = preprocess([src], str(tmp_path / "sp"), tokenizer=model, workers=2, quiet=True)
    assert m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 32000
    r = IndexedReader(str(tmp_path / "sp"))
    assert [tok.decode(r.document(i)[:-1]) for i in range(r.num_docs)] == [t for t in TEXTS if t]
    assert all(r.document(i)[-1] == 2 for i in range(r.num_docs))


def test_parquet_pieces_cut_inside_row_groups_for_slow_tokenizers(tmp_path, monkeypatch):
    """With workers, pieces keep Parquet row groups whole for byte-level tokens only: a SentencePiece run cuts
    them at the piece size (the workers stay even on a file of few row groups) and gives the bytes of one
    worker."""
    model = _mistral_model()
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "TASK_DOCS", 4)
    texts = [f"row {i}: " + "words and more words " * (i % 5 + 1) for i in range(60)]
    src = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"text": texts}), src, row_group_size=30)  # 2 row groups
    monkeypatch.setattr(preprocess_mod, "PIECE_BYTES", 200)
    seen = []
    real = preprocess_mod.runs_of_tasks

    def spy(tasks, min_bytes, whole_row_groups=True):
        runs = list(real(tasks, min_bytes, whole_row_groups=whole_row_groups))
        seen.append((whole_row_groups, min_bytes, runs))
        return iter(runs)

    def early_cuts(min_bytes, runs):  # runs ended inside a row group before reaching 2 x min_bytes
        return [a for a, b in zip(runs, runs[1:])
                if a[-1].group == b[0].group and sum(t.nbytes for t in a) < 2 * min_bytes]

    monkeypatch.setattr(preprocess_mod, "runs_of_tasks", spy)
    sp1 = preprocess([src], str(tmp_path / "sp1"), tokenizer=model, workers=1, quiet=True)
    sp2 = preprocess([src], str(tmp_path / "sp2"), tokenizer=model, workers=2, quiet=True)
    assert sp1["shards"][0]["bin"]["sha256"] == sp2["shards"][0]["bin"]["sha256"]
    (whole, min_bytes, runs), = seen
    assert not whole and early_cuts(min_bytes, runs)
    seen.clear()
    preprocess([src], str(tmp_path / "b2"), workers=2, quiet=True)
    (whole, min_bytes, runs), = seen
    assert whole and not early_cuts(min_bytes, runs)


def test_hf_tokenizer_json(tmp_path):
    tk = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    t = tk.Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = __import__("tokenizers.decoders", fromlist=["ByteLevel"]).ByteLevel()
    t.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = str(tmp_path / "tokenizer.json")
    t.save(path)
    tok = load_tokenizer(path)
    assert tok.eos_id == 1 and tok.name == "hf:tokenizer.json"
    src = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    preprocess([src], str(tmp_path / "hf"), tokenizer=path, quiet=True)
    r = IndexedReader(str(tmp_path / "hf"))
    assert [tok.decode(r.document(i)[:-1]) for i in range(r.num_docs)] == [t for t in TEXTS if t]


def test_builtin_corpus_is_cached_and_atomic(tmp_path):
    import sysconfig

    files = stdlib_files()
    rel = [os.path.relpath(p, sysconfig.get_paths()["stdlib"]) for p, _ in files]
    assert rel == sorted(rel) and len(files) > 100 and sum(s for _, s in files) <= 16_000_000
    assert not any(os.sep + "site-packages" + os.sep in p or os.sep + "test" + os.sep in p for p, _ in files)
    p1 = ensure_builtin_corpus(cache_dir=str(tmp_path))
    mtime = os.path.getmtime(p1 + ".bin")
    p2 = ensure_builtin_corpus(cache_dir=str(tmp_path))
    assert p1 == p2 and os.path.getmtime(p2 + ".bin") == mtime
    m = json.load(open(p1 + ".manifest.json"))
    assert m["tokenizer"]["name"] == "byte" and m["num_documents"] > 500
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == [os.path.basename(os.path.dirname(p1))]
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


def test_corrupt_compressed_input_names_file(tmp_path):
    good = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
    (tmp_path / "t.jsonl.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(DataInputError, match=r"t\.jsonl\.gz:\d+: cannot decompress"):
        preprocess([str(tmp_path / "t.jsonl.gz")], str(tmp_path / "o"), quiet=True)
    assert sorted(os.listdir(tmp_path)) == ["t.jsonl.gz"]


@pytest.mark.parametrize("string_type", ["string", "large_string"])
@pytest.mark.parametrize("eos", [True, False])
def test_byte_parquet_from_arrow_buffers_matches_the_general_path(tmp_path, monkeypatch, string_type, eos):
    """Byte-level Parquet tokens come straight from the Arrow buffers (no Python string per document): the
    same bytes and counters as the JSONL path, empty documents skipped, several row groups and slices."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megassm.data_tools import encode

    monkeypatch.setattr(sources, "TASK_DOCS", 3)  # slices that start inside row groups
    texts = [f"doc {i} ünï ☃ " * (i % 4) for i in range(40)]  # every 4th is empty
    pq.write_table(pa.table({"text": pa.array(texts, type=getattr(pa, string_type)())}), tmp_path / "t.parquet",
                   row_group_size=7)
    ref = preprocess([write_jsonl(tmp_path / "t.jsonl", texts)], str(tmp_path / "ref"), append_eos=eos, quiet=True)

    def no_python_strings(*a, **k):
        raise AssertionError("the byte-level Parquet path made Python strings")

    monkeypatch.setattr(encode, "arrow_texts", no_python_strings)
    for w in (1, 2):
        m = preprocess([str(tmp_path / "t.parquet")], str(tmp_path / f"pq{w}"), append_eos=eos, workers=w, quiet=True)
        assert m["shards"][0]["bin"]["sha256"] == ref["shards"][0]["bin"]["sha256"]
        assert m["shards"][0]["idx"]["sha256"] == ref["shards"][0]["idx"]["sha256"]
        assert m["stats"] == ref["stats"] and m["stats"]["empty_skipped"] == 10


def test_arrow_text_with_nulls_or_invalid_utf8(tmp_path):
    """Nulls are empty documents; invalid UTF-8 in a Parquet or Arrow column (writers need not check) is
    replaced and counted, as in JSONL, by both tokenizer paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"okbad\xffend"
    bad = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(np.array([0, 2, 9, 9], np.int32).tobytes()),
                                                 pa.py_buffer(data)])
    pq.write_table(pa.table({"text": bad}), tmp_path / "bad.parquet")
    with pa.OSFile(str(tmp_path / "bad.arrow"), "wb") as f, pa.ipc.new_file(f, pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": bad}))
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "nulls.parquet")
    for name in ("bad.parquet", "bad.arrow"):
        m = preprocess([str(tmp_path / name)], str(tmp_path / name.replace(".", "_")), quiet=True)
        assert m["stats"]["invalid_utf8_replaced"] == 1 and m["stats"]["empty_skipped"] == 1, name
        assert docs_of(str(tmp_path / name.replace(".", "_"))) == ["ok", "bad\ufffdend"]
    m = preprocess([str(tmp_path / "nulls.parquet")], str(tmp_path / "nulls"), quiet=True)
    assert docs_of(str(tmp_path / "nulls")) == ["a", "b"] and m["stats"]["empty_skipped"] == 1


def test_runs_of_tasks_end_between_parquet_row_groups(tmp_path, monkeypatch):
    """A worker decodes a whole row group for any slice of it: groups and pieces end between row groups
    (JSONL ranges anywhere) unless a row group holds more than two runs, and 1 or 2 workers still give the
    same bytes in both output modes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(sources, "TASK_DOCS", 4)  # several tasks per row group of 10 rows
    texts = [f"row {i} " + "p" * (i % 9) for i in range(70)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=10)
    tasks = list(sources.iter_tasks(sources.expand_inputs([str(tmp_path / "t.parquet")]), "text", False))
    assert len(tasks) > 7 and len({t.group for t in tasks}) == 7
    per_group = sum(t.nbytes for t in tasks if t.group == 0)  # 3 tasks of ~100 bytes
    runs = list(sources.runs_of_tasks(tasks, per_group // 2 + 1))
    assert [r for run in runs for r in run] == tasks
    for a, b in zip(runs, runs[1:]):
        assert a[-1].group != b[0].group  # cut only where a row group ends
    assert len(runs) == 7  # one row group per run: a run may grow to 2 x its minimum to reach the end
    big = list(sources.runs_of_tasks(tasks, per_group // 3))  # a row group is > 2 runs: it is split
    assert [r for run in big for r in run] == tasks
    assert len(big) == 14 and all(len(r) <= 2 for r in big)
    lines = [sources.Task("json", "x", 0, nbytes=10, offset=10 * i, length=10) for i in range(5)]
    assert [len(r) for r in sources.runs_of_tasks(lines, 20)] == [2, 2, 1]  # line ranges cut anywhere
    # without whole_row_groups a run ends as soon as it holds min_bytes, inside a row group too
    free = list(sources.runs_of_tasks(tasks, per_group // 2 + 1, whole_row_groups=False))
    assert [r for run in free for r in run] == tasks
    assert all(sum(t.nbytes for t in r) >= per_group // 2 + 1 for r in free[:-1])
    assert all(sum(t.nbytes for t in r[:-1]) < per_group // 2 + 1 for r in free)
    assert any(a[-1].group == b[0].group for a, b in zip(free, free[1:])) and len(free) > len(runs)

    monkeypatch.setattr(preprocess_mod, "PIECE_BYTES", per_group // 2 + 1)
    src = str(tmp_path / "t.parquet")
    one = preprocess([src], str(tmp_path / "g1"), shard_input_size=per_group // 2 + 1, workers=1, quiet=True)
    two = preprocess([src], str(tmp_path / "g2"), shard_input_size=per_group // 2 + 1, workers=2, quiet=True)
    assert len(one["shards"]) == 7 and [s["bin"]["sha256"] for s in one["shards"]] == [
        s["bin"]["sha256"] for s in two["shards"]]
    single1 = preprocess([src], str(tmp_path / "s1"), workers=1, quiet=True)
    single2 = preprocess([src], str(tmp_path / "s2"), workers=2, quiet=True)
    assert single1["shards"][0]["bin"]["sha256"] == single2["shards"][0]["bin"]["sha256"]
    assert docs_of(str(tmp_path / "g2")) == texts == docs_of(str(tmp_path / "s2"))


# --shard-input-size: one shard per group of input tasks, written and hashed by the worker (group_shards.py)
def _group_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "TASK_DOCS", 5)
    monkeypatch.setattr(sources, "TASK_BYTES", 200)  # many small range tasks
    texts = [f"grouped document {i} " + "x" * (i % 7) for i in range(80)] + [""]
    a = write_jsonl(tmp_path / "a.jsonl", texts[:50])
    b = write_jsonl(tmp_path / "b.jsonl.gz", texts[50:], opener=gzip.open)  # a raw-content task too
    return [a, b], [t for t in texts if t]


def test_shard_input_size_same_documents_and_bytes_for_any_worker_count(tmp_path, monkeypatch):
    srcs, texts = _group_corpus(tmp_path, monkeypatch)
    one = preprocess(srcs, str(tmp_path / "one"), shard_input_size=600, workers=1, quiet=True)
    two = preprocess(srcs, str(tmp_path / "two"), shard_input_size=600, workers=2, quiet=True)
    single = preprocess(srcs, str(tmp_path / "single"), quiet=True)
    assert len(one["shards"]) > 3 and one["numbered_shards"] and one["shard_input_size"] == 600
    assert docs_of(str(tmp_path / "one")) == texts == docs_of(str(tmp_path / "two"))
    assert [s["bin"]["sha256"] for s in one["shards"]] == [s["bin"]["sha256"] for s in two["shards"]]
    for s in one["shards"]:  # the manifest's digests are the files'
        for kind in ("bin", "idx"):
            assert sha(str(tmp_path / s[kind]["file"])) == s[kind]["sha256"]
            assert os.path.getsize(tmp_path / s[kind]["file"]) == s[kind]["bytes"]
    for k in ("num_documents", "num_tokens", "stats"):
        assert one[k] == single[k] == two[k], k
    assert one["stats"]["empty_skipped"] == 1
    assert not os.path.exists(tmp_path / "one.partial")


def test_shard_input_size_resume_and_refusals(tmp_path, monkeypatch, capsys):
    srcs, texts = _group_corpus(tmp_path, monkeypatch)
    ref = preprocess(srcs, str(tmp_path / "ref"), shard_input_size=600, quiet=True)
    with pytest.raises(KeyboardInterrupt):
        preprocess(srcs, str(tmp_path / "o"), shard_input_size=600, workers=2, quiet=True, _stop_after_tasks=2)
    assert not [p for p in glob.glob(str(tmp_path / "o[.-]*")) if not p.endswith(".partial")]  # nothing final
    with open(tmp_path / "o.partial" / "progress.json") as f:  # the groups finished before the stop are recorded
        recorded = json.load(f)["groups"]
    assert len(recorded) >= 2 and all(os.path.exists(tmp_path / "o.partial" / f"group-{int(g):05d}.bin")
                                      for g, r in recorded.items() if not r["empty"])
    open(tmp_path / "o.partial" / "group-00099.bin.tmp-1", "wb").write(b"half-written")  # a killed worker's file
    # a machine crash before writeback: one recorded shard lost its tail, another kept its size but not its pages
    lost = sorted(int(g) for g, r in recorded.items() if not r["empty"])[:2]
    with open(tmp_path / "o.partial" / f"group-{lost[0]:05d}.bin", "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)
    with open(tmp_path / "o.partial" / f"group-{lost[1]:05d}.idx", "r+b") as f:
        f.write(b"\0" * 8)  # its first page reads back as zeros
    with pytest.raises(FileExistsError, match="--resume"):
        preprocess(srcs, str(tmp_path / "o"), shard_input_size=600, quiet=True)
    with pytest.raises(ValueError, match="differ"):
        preprocess(srcs, str(tmp_path / "o"), shard_input_size=700, resume=True, quiet=True)
    m = preprocess(srcs, str(tmp_path / "o"), shard_input_size=600, resume=True, quiet=False)
    err = capsys.readouterr().err
    assert f"2 recorded groups no longer match their sha256 (lost in a crash?) and are redone: {lost[0]}, {lost[1]}" in err
    assert docs_of(str(tmp_path / "o")) == texts
    assert [s["bin"]["sha256"] for s in m["shards"]] == [s["bin"]["sha256"] for s in ref["shards"]]
    with pytest.raises(ValueError, match="exclude each other"):
        preprocess(srcs, str(tmp_path / "x"), shard_input_size=600, shard_size=100, quiet=True)
    assert main(["--input", *srcs, "--output-prefix", str(tmp_path / "cli"), "--shard-input-size", "1K",
                 "--workers", "2", "--quiet"]) == 0
    assert docs_of(str(tmp_path / "cli")) == texts


def test_progress_recorder_records_a_group_only_when_its_files_exist(tmp_path):
    from megassm.data_tools import group_shards as gs

    done = {}
    rec = gs.ProgressRecorder(str(tmp_path), {"fp": 1}, done)
    for ext in ("bin", "idx"):
        open(tmp_path / f"group-00000.{ext}", "wb").write(b"x")
    rec.add({"group": 0, "empty": False})
    rec.add({"group": 1, "empty": True})  # an all-empty group has no files
    rec.add({"group": 2, "empty": False})  # its files are missing: it is never recorded
    with pytest.raises(FileNotFoundError, match="group-00002"):
        rec.close()
    with open(tmp_path / gs.PROGRESS) as f:
        assert sorted(json.load(f)["groups"]) == ["0", "1"]


def test_progress_bar_starts_no_thread_so_workers_fork():
    """A live tqdm monitor thread made preprocess spawn its workers (re-importing everything) instead of
    forking them."""
    import threading

    from megassm.data_tools import preprocess as pp

    before = threading.active_count()
    bar = pp._progress_bar(100, 0, enabled=True)
    bar.update(10)
    assert threading.active_count() == before
    bar.close()
    if before == 1 and "fork" in __import__("multiprocessing").get_all_start_methods():
        assert pp._start_method() == "fork"
