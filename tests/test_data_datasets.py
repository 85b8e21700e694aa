"""megassm-preprocess reads Hugging Face datasets (data_tools/core/sources.py open_dataset, docs/data.md): a
save_to_disk folder (load_from_disk) and a local folder through load_dataset, streamed, give the same shards as the
same rows in JSONL; the manifest records the source; a wrong split or column is refused naming the choices; a
missing datasets or pyarrow package is a one-line error naming the extra. No network: the datasets are built here."""
import json
import os
import sys

import pytest

from megassm.data_tools.preprocess import main, preprocess
from megassm.data_tools.sources import DataInputError

TEXTS = [f"doc {i} " + "é" * (i % 7) + "x" * (3 * i) for i in range(40)] + [None, "", "last \ud7ff"]


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """datasets with its caches in tmp_path and the Hub off: nothing read from or written to the user's cache."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets.disable_progress_bars()
    yield datasets
    datasets.enable_progress_bars()


def _bytes(prefix):
    return open(f"{prefix}.bin", "rb").read(), open(f"{prefix}.idx", "rb").read()


def test_saved_and_streamed_datasets_match_jsonl(tmp_path, hf):
    saved = tmp_path / "saved"
    hf.DatasetDict({"train": hf.Dataset.from_dict({"text": TEXTS, "n": list(range(len(TEXTS)))}),
                    "validation": hf.Dataset.from_dict({"text": ["v1", "v2 ü"], "n": [1, 2]})}).save_to_disk(str(saved))
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "data.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t, "n": 1}) + "\n" for t in TEXTS)
    ref = preprocess([str(raw / "data.jsonl")], str(tmp_path / "ref"), quiet=True)

    # a save_to_disk folder is recognised by itself; its 'train' split is the default
    m = preprocess([str(saved)], str(tmp_path / "saved_out"), workers=2, quiet=True)
    assert _bytes(tmp_path / "saved_out") == _bytes(tmp_path / "ref")
    assert m["num_documents"] == ref["num_documents"] == len(TEXTS) - 2  # None and "" are empty documents
    rec = m["inputs"][0]
    assert (rec["path"], rec["format"], rec["loader"], rec["split"], rec["rows"]) == (
        str(saved), "datasets", "load_from_disk", "train", len(TEXTS))
    assert rec["fingerprint"] == hf.load_from_disk(str(saved))["train"]._fingerprint and rec["bytes"] > 0

    # load_dataset on a local folder of data files, streamed, through the CLI
    assert main(["--input", str(raw), "--format", "datasets", "--streaming", "--output-prefix",
                 str(tmp_path / "streamed"), "--quiet"]) == 0
    assert _bytes(tmp_path / "streamed") == _bytes(tmp_path / "ref")
    rec = json.load(open(tmp_path / "streamed.manifest.json"))["inputs"][0]
    assert (rec["loader"], rec["split"], rec["streaming"], rec["fingerprint"]) == ("load_dataset", "train", True, None)

    m = preprocess([str(saved)], str(tmp_path / "val"), split="validation", quiet=True)
    assert (m["num_documents"], m["inputs"][0]["split"]) == (2, "validation")

    for kwargs, message in [({"split": "test"}, "no split 'test' (splits: train, validation); choose one with --split"),
                            ({"text_key": "body"}, "no column 'body' (columns: text, n); choose one with --text-key"),
                            ({"text_key": "n"}, "column 'n' is Value('int64'), expected a string column")]:
        with pytest.raises(DataInputError, match=f"^{str(saved)}: " + message.replace("(", r"\(").replace(")", r"\)")):
            preprocess([str(saved)], str(tmp_path / "bad"), quiet=True, **kwargs)
    assert not os.path.exists(tmp_path / "bad.bin") and not os.path.exists(tmp_path / "bad.partial")


def test_missing_optional_packages_are_one_line_errors(tmp_path, monkeypatch, capsys):
    """No datasets / no pyarrow: the CLI exits 1 before any work with one line naming the extra to install."""
    (tmp_path / "a.parquet").write_bytes(b"PAR1")
    (tmp_path / "folder").mkdir()
    for module, args, extra in [("datasets", ["--input", str(tmp_path / "folder"), "--format", "datasets"], "datasets"),
                                ("pyarrow", ["--input", str(tmp_path / "a.parquet")], "parquet")]:
        with monkeypatch.context() as mp:
            mp.setitem(sys.modules, module, None)  # `import module` raises ImportError
            assert main([*args, "--output-prefix", str(tmp_path / "out"), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and f"pip install 'megassm[{extra}]'" in err, err
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "folder"]  # nothing written
