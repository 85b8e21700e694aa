"""Config: YAML -> dataclasses, dotted overrides, errors that name key/file/closest key, cross-checks."""
import glob
import os

import pytest
import yaml

from megassm.config import ConfigError, dump_config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["data.builtin=stdlib"]


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_yaml_and_overrides_typed(tmp_path):
    path = write(tmp_path, "model:\n  d_model: 64\n  mamba:\n    d_state: 16\ntrain:\n  steps: 5\ndata:\n  builtin: stdlib\n")
    cfg = load_config(path, ["model.d_model=96", "optim.lr=1e-3", "run.dir=runs/x", "data.split=90,5,5",
                             "model.mamba.dt_limit=[0.001, 0.5]", "run.tensorboard=false"])
    assert cfg.model.d_model == 96 and isinstance(cfg.model.d_model, int)
    assert cfg.model.mamba.d_state == 16
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.data.split == [90.0, 5.0, 5.0]
    assert cfg.model.mamba.dt_limit == [0.001, 0.5]
    assert cfg.run.tensorboard is False and cfg.run.dir == "runs/x"


def test_unknown_key_in_file_names_file_and_closest(tmp_path):
    path = write(tmp_path, "model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, BASE)
    msg = str(e.value)
    assert path in msg and "model.d_modle" in msg and "model.d_model" in msg


def test_unknown_key_on_command_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, BASE + ["train.stpes=3"])
    assert "command line" in str(e.value) and "train.steps" in str(e.value)


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown key 'modle.d_model'.*model.d_model"):
        load_config(None, BASE + ["modle.d_model=3"])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["train.global_batch=6"], "batch triad"),
        (["model.pattern=MXM"], "unknown letter 'X'"),
        (["model.pattern=-", "train.steps=0"], "train.steps must be positive"),
        (["model.mamba.ngroups=3"], "model.mamba.ngroups=3 must divide"),
        (["model.mamba.headdim=48", "model.d_model=100"], "model.mamba.headdim=48 must divide"),
        (["model.pattern=*", "model.attn.n_heads=8", "model.attn.n_kv_heads=3"], "n_kv_heads=3"),
        (["train.steps=abc"], "train.steps: expected an integer"),
        (["optim.min_lr=1.0", "optim.lr=0.1"], "optim.min_lr"),
        (["train.precision=fp16"], "train.precision"),
        (["parallel.engine=horovod"], "parallel.engine"),
        (["data.weights=[1.0]"], "data.weights"),
    ],
)
def test_cross_checks(overrides, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, BASE + overrides)
    assert fragment in str(e.value)


def test_missing_data_source():
    with pytest.raises(ConfigError, match="data.paths"):
        load_config(None, [])


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    path = write(tmp_path, "model: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path)


def test_dump_round_trip(tmp_path):
    cfg = load_config(None, BASE + ["model.d_model=64", "model.attn.n_kv_heads=2"])
    path = write(tmp_path, dump_config(cfg))
    again = load_config(path)
    assert again == cfg


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_shipped_configs_load(path):
    data = yaml.safe_load(open(path)) or {}
    extra = [] if "data" in data else BASE
    load_config(path, extra)


def test_every_key_documented():
    from megassm.config import Config, all_keys

    doc = open(os.path.join(ROOT, "docs", "config.md")).read()
    missing = [k for k in all_keys(Config) if f"`{k}`" not in doc]
    assert not missing, f"keys missing from docs/config.md: {missing}"


@pytest.mark.parametrize("over,match", [
    (["train.activation_checkpointing_blocks=4"], "needs train.activation_checkpointing=true"),
    (["train.activation_checkpointing=true", "train.activation_checkpointing_blocks=-1"], "must be >= 0"),
    (["train.activation_checkpointing=true", "train.activation_checkpointing_blocks=5"], "more than the model's 4 blocks"),
    (["train.activation_checkpointing_keep=sum"], "train.activation_checkpointing_keep=sum needs "
                                                  "train.activation_checkpointing=true"),
    (["train.activation_checkpointing=true", "train.activation_checkpointing_keep=both"],
     "train.activation_checkpointing_keep must be pair or sum, got 'both'"),
])
def test_activation_checkpointing_blocks_is_checked(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/tiny.yaml", over)
    load_config("configs/tiny.yaml", ["train.activation_checkpointing=true", "train.activation_checkpointing_blocks=4"])
