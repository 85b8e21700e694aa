"""Choosing the data source: the built-in corpus or one's own shards (data.builtin / data.paths)."""
import pytest
import yaml

from megassm.config import ConfigError, load_config


def test_command_line_paths_replace_the_files_builtin():
    # configs/tiny.yaml sets data.builtin=stdlib; one's own shards on the command line take over
    cfg = load_config("configs/tiny.yaml", ["data.paths=[/data/mycorpus]"])
    assert cfg.data.paths == ["/data/mycorpus"] and cfg.data.builtin is None


def test_builtin_none_still_accepted():
    cfg = load_config("configs/tiny.yaml", ["data.builtin=none", "data.paths=[/data/mycorpus]"])
    assert cfg.data.paths == ["/data/mycorpus"] and cfg.data.builtin is None


def test_both_on_the_command_line_says_how_to_fix():
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["data.builtin=stdlib", "data.paths=[/data/mycorpus]"])
    msg = str(e.value)
    assert "data.builtin=none" in msg and "data: data:" not in msg


def test_both_in_one_file_says_how_to_fix(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"data": {"builtin": "stdlib", "paths": ["/data/mycorpus"]}}))
    with pytest.raises(ConfigError, match="data.builtin=none"):
        load_config(str(p))


def test_trainer_message_not_doubled():
    from megassm.data_tools.loader import resolve_paths

    class D:
        builtin, paths, tokenizer, cache_dir = "stdlib", ["/x"], "byte", None

    with pytest.raises(ValueError) as e:
        resolve_paths(D())
    assert not str(e.value).startswith("data:") and "data.builtin=none" in str(e.value)
